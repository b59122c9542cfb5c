package coordinator

import (
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/wire"
)

// lookupWorkPool answers lookups and restore begins (the vLLM connector's
// lookup) on lookupWorkers goroutines fed from one queue. Until stop 66
// each had four NATS queue subscribers, and NATS hands a message to a
// member of the group at random: a begin held up in one of them (a huge
// plan, a slow host) delayed about a quarter of the requests behind it
// until it finished, while the other three idled. Now a slow request holds
// one worker and the rest go to the others.
//
// The subscription's callback only queues the message; when every worker
// is busy and the queue is full it waits, and NATS keeps what follows in
// the subscription's pending buffer, as before.
type lookupWorkPool struct {
	c    *Coordinator
	work chan lookupJob
	wg   sync.WaitGroup
	once sync.Once
	// quit closes first in close; mu (read-held by each send) then lets
	// close wait out the sends under way before it closes work, so that a
	// callback still running past the subscription's drain (Shutdown gives
	// up on one after 10 s) never sends on a closed channel.
	quit chan struct{}
	mu   sync.RWMutex
}

type lookupJob struct {
	op string
	fn nats.MsgHandler
	m  *nats.Msg
}

// lookupRetryMS is the retry hint of a lookup or begin refused because
// this coordinator stopped leading after it was queued.
const lookupRetryMS = 100

func newLookupWorkPool(c *Coordinator, workers int) *lookupWorkPool {
	p := &lookupWorkPool{c: c, work: make(chan lookupJob, workers), quit: make(chan struct{})}
	p.wg.Add(workers)
	for range workers {
		go func() {
			defer p.wg.Done()
			for j := range p.work {
				p.run(j)
			}
		}()
	}
	return p
}

// run answers one queued request. A raft coordinator that stopped leading
// since the request was queued refuses it as retryable, as NATS would
// have dropped it with the leader's subscription: the new leader answers.
func (p *lookupWorkPool) run(j lookupJob) {
	if !p.c.repl.decides() {
		p.c.sendErrorRetry(j.op, j.m, wire.CodeUnavailable, "this coordinator stopped leading; retry", lookupRetryMS, replyError)
		return
	}
	j.fn(j.m)
}

// handler is fn (the handler of op) as the pool's subscription callback.
func (p *lookupWorkPool) handler(op string, fn nats.MsgHandler) nats.MsgHandler {
	return func(m *nats.Msg) {
		p.mu.RLock()
		defer p.mu.RUnlock()
		select {
		case <-p.quit: // work may be closed: a send would panic
		default:
			select {
			case p.work <- lookupJob{op: op, fn: fn, m: m}:
				return
			case <-p.quit:
			}
		}
		p.c.sendErrorRetry(op, m, wire.CodeUnavailable, "the coordinator is shutting down; retry", lookupRetryMS, replyError)
	}
}

// close answers what is queued and stops the workers; the subscriptions
// must be drained or closed first. A request still arriving is refused as
// retryable.
func (p *lookupWorkPool) close() {
	p.once.Do(func() {
		close(p.quit)
		p.mu.Lock() // the sends under way have ended
		close(p.work)
		p.mu.Unlock()
		p.wg.Wait()
	})
}
