package rankd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// errQueueFull is returned by Publish when the queue is at its bound.
var errQueueFull = fmt.Errorf("event queue full: %w", ErrUnavailable)

// eventConn is the part of *nats.Conn the publisher uses (a seam for tests).
type eventConn interface {
	PublishRequest(subj, reply string, data []byte) error
	Subscribe(subj string, cb nats.MsgHandler) (*nats.Subscription, error)
	NewRespInbox() string
	// IsConnected and Stats().Reconnects tell the publisher its
	// connection is moving to another server (or moved).
	IsConnected() bool
	Stats() nats.Statistics
}

// publisher sends the transfer engine's event batches to the coordinator as
// NATS requests, in order, with up to window batches sent and not yet
// acknowledged (a pipeline: the coordinator commits several of them in one
// group while the next ones travel). A batch leaves the queue only when
// the coordinator acknowledged it as durable (or rejected it for good), and
// only in queue order: acknowledgements are taken from the head. When the
// head times out or gets a transient error, everything sent after it is
// forgotten and sent again from the head (go-back-N): the coordinator
// ignores the duplicates among them, and one that arrived past a batch the
// coordinator never applied was answered with a resync, never applied out
// of order (C7).
//
// Every batch is published by the run goroutine, so the batches of one
// rank leave in sequence order on one connection. Each carries its own
// reply subject (<inbox>.<round>.<ticket>), so an acknowledgement is
// matched to its batch, and one from an abandoned round (before a resend
// or a connection change) is recognized and ignored.
type publisher struct {
	subject string
	timeout time.Duration
	limit   int
	window  int
	log     *zap.Logger
	met     *metrics

	mu      sync.Mutex // guards the following
	queue   []wire.Batch
	closed  bool
	conn    eventConn
	kick    chan struct{} // closed and replaced when the queue or conn changes
	applied uint64        // highest AppliedThrough seen
}

func newPublisher(subject string, timeout time.Duration, limit, window int, log *zap.Logger, met *metrics) *publisher {
	return &publisher{subject: subject, timeout: timeout, limit: limit, window: window, log: log, met: met,
		kick: make(chan struct{})}
}

// Publish implements transfer.Publisher: it queues b and returns. A full
// queue or a closed publisher is an error; the engine retries, then drops
// the batch (the sequence gap makes the coordinator resync).
func (p *publisher) Publish(b wire.Batch) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.met.eventsRefused.Inc()
		return fmt.Errorf("publish %d events: publisher closed: %w", len(b.Events), ErrClosed)
	}
	if len(p.queue) >= p.limit {
		p.met.eventsRefused.Inc()
		p.log.Warn("event queue full; batch refused", zap.Int("queued", len(p.queue)), zap.Int("events", len(b.Events)))
		return errQueueFull
	}
	p.queue = append(p.queue, b)
	p.met.eventQueue.Set(float64(len(p.queue)))
	p.wakeLocked()
	return nil
}

func (p *publisher) wakeLocked() {
	close(p.kick)
	p.kick = make(chan struct{})
}

// setConn gives the publisher its NATS connection.
func (p *publisher) setConn(c eventConn) {
	p.mu.Lock()
	p.conn = c
	p.wakeLocked()
	p.mu.Unlock()
}

// reconnected wakes the publisher after its connection moved to another
// server (nats.Conn's reconnect handler): it sends the batches in flight
// again at once, from the head, instead of waiting for their timeout.
func (p *publisher) reconnected() {
	p.mu.Lock()
	p.wakeLocked()
	p.mu.Unlock()
}

// pending returns the batches queued or being sent.
func (p *publisher) pending() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.queue)
}

// outcome is what became of one sent batch: done (it leaves the queue) or
// err (send again from it).
type outcome struct {
	done bool
	err  error
}

// reply is an acknowledgement delivered to the reply subscription.
type reply struct {
	round, ticket uint64
	data          []byte
	// noResponders: the server answered for the coordinator that nobody
	// subscribes to the events subject (it, or this rank, is moving to
	// another NATS server, or it is down); send again.
	noResponders bool
}

// window is the run goroutine's view of the batches in flight. Ticket t is
// the t-th batch taken from the queue since the publisher started; the
// head of the queue has ticket head.
type window struct {
	head     uint64             // ticket of queue[0]
	sent     int                // queue[:sent] are in flight
	round    uint64             // bumped on every resend from the head
	deadline []time.Time        // per in-flight batch, from the head
	got      map[uint64]outcome // outcomes that arrived, by ticket
}

// run sends batches until stop is closed. It is the only sender.
func (p *publisher) run(stop <-chan struct{}) {
	replies := make(chan reply, 2*p.window)
	var (
		conn  eventConn
		sub   *nats.Subscription
		inbox string
		w     = window{got: make(map[uint64]outcome)}
		timer = time.NewTimer(time.Hour)
	)
	defer timer.Stop()
	defer func() {
		if sub != nil {
			_ = sub.Unsubscribe()
		}
	}()
	// Resends are spaced by the one backoff with jitter (STYLE 30): 25-50
	// ms after the first failure, doubling to 0.5-1 s.
	bo := bus.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}
	failures := 0
	var reconnects uint64 // conn's reconnect count when last looked at
	for {
		var failed error
		p.mu.Lock()
		kick := p.kick
		if p.conn != conn {
			// A new connection: subscribe there, and send everything in
			// flight again on it.
			if sub != nil {
				_ = sub.Unsubscribe()
				sub = nil
			}
			conn = p.conn
			w.restart()
			if conn != nil {
				reconnects = conn.Stats().Reconnects
				inbox = conn.NewRespInbox()
				var err error
				sub, err = conn.Subscribe(inbox+".*.*", func(m *nats.Msg) { deliverReply(m, inbox, replies, stop) })
				if err != nil {
					conn = nil // subscribe again after the backoff
				}
				failed = err
			}
		}
		// A connection that moved to another server lost what was in
		// flight on the old one: send it again, from the head, before
		// anything newer, so the coordinator sees no gap (a gap costs a
		// resync). While it is moving, send nothing: nats.go would buffer
		// it and deliver it on the new server ahead of those resends.
		moving := false
		if failed == nil && conn != nil {
			if n := conn.Stats().Reconnects; n != reconnects {
				reconnects = n
				if w.sent > 0 {
					p.log.Info("NATS connection moved to another server; sending the batches in flight again",
						zap.Uint64("ticket", w.head), zap.Int("in_flight", w.sent))
					w.restart()
				}
			}
			moving = !conn.IsConnected()
		}
		for failed == nil && conn != nil && !moving && w.sent < min(p.window, len(p.queue)) {
			t := w.head + uint64(w.sent)
			sent, err := p.sendOne(conn, inbox, w.round, t, &p.queue[w.sent])
			if err != nil {
				failed = err
				break
			}
			if !sent {
				w.got[t] = outcome{done: true} // dropped: it can never be sent
			}
			w.sent++
			w.deadline = append(w.deadline, time.Now().Add(p.timeout))
		}
		p.mu.Unlock()
		if failed == nil && w.sent > 0 {
			var popped int
			popped, failed = p.advance(&w)
			if popped > 0 {
				failures = 0
			}
		}
		if failed != nil {
			p.met.eventRetries.Inc()
			backoff := bo.Delay(failures)
			failures++
			p.log.Warn("event batch not acknowledged; sending again from it", zap.Uint64("ticket", w.head),
				zap.Int("in_flight", w.sent), zap.Duration("backoff", backoff), zap.Error(failed))
			w.restart()
			if !sleep(stop, backoff) {
				return
			}
			continue
		}
		var tick <-chan time.Time
		switch {
		case moving:
			timer.Reset(20 * time.Millisecond) // look again soon
			tick = timer.C
		case w.sent > 0:
			timer.Reset(time.Until(w.deadline[0]))
			tick = timer.C
		}
		select {
		case <-stop:
			return
		case <-kick:
		case r := <-replies:
			p.take(&w, r)
		case <-tick: // advance reports the timeout of the head
		}
		timer.Stop()
	}
}

// restart forgets the batches in flight: they are sent again.
func (w *window) restart() {
	w.sent = 0
	w.round++
	w.deadline = w.deadline[:0]
	clear(w.got)
}

// take records the outcome of an acknowledgement of the current round.
func (p *publisher) take(w *window, r reply) {
	if r.round != w.round || r.ticket < w.head || r.ticket >= w.head+uint64(w.sent) {
		return // for a batch already done, or of an abandoned round
	}
	if _, ok := w.got[r.ticket]; ok {
		return // a duplicate reply
	}
	p.mu.Lock()
	b := &p.queue[r.ticket-w.head]
	p.mu.Unlock()
	if r.noResponders {
		w.got[r.ticket] = outcome{err: fmt.Errorf("request %s: %w", p.subject, nats.ErrNoResponders)}
		return
	}
	done, err := p.settle(b, r.data)
	w.got[r.ticket] = outcome{done: done, err: err}
}

// advance takes the outcomes of the head and of the batches after it, in
// order: done ones leave the queue (popped of them). It returns the error
// of the head (an error reply or its timeout): the caller sends again from
// it.
func (p *publisher) advance(w *window) (popped int, err error) {
	for ; w.sent > 0; popped++ {
		o, ok := w.got[w.head]
		if !ok {
			if time.Now().After(w.deadline[0]) {
				return popped, fmt.Errorf("request %s: no acknowledgement within %v: %w", p.subject, p.timeout, nats.ErrTimeout)
			}
			return popped, nil
		}
		if o.err != nil {
			return popped, o.err
		}
		delete(w.got, w.head)
		p.mu.Lock()
		p.queue[0] = wire.Batch{}
		p.queue = p.queue[1:]
		p.met.eventQueue.Set(float64(len(p.queue)))
		p.wakeLocked()
		p.mu.Unlock()
		w.head++
		w.sent--
		w.deadline = w.deadline[1:]
	}
	return popped, nil
}

// deliverReply runs on the NATS delivery goroutine of the reply
// subscription: it hands an acknowledgement to run.
func deliverReply(m *nats.Msg, inbox string, out chan<- reply, stop <-chan struct{}) {
	rest, ok := strings.CutPrefix(m.Subject, inbox+".")
	if !ok {
		return
	}
	rs, ts, ok := strings.Cut(rest, ".")
	if !ok {
		return
	}
	round, err1 := strconv.ParseUint(rs, 10, 64)
	ticket, err2 := strconv.ParseUint(ts, 10, 64)
	if err1 != nil || err2 != nil {
		return
	}
	// A status message without a body: nats-server's "no responders"
	// (503) for a request nobody is subscribed to.
	noResp := len(m.Data) == 0 && m.Header.Get("Status") == "503"
	select {
	case out <- reply{round: round, ticket: ticket, data: m.Data, noResponders: noResp}:
	case <-stop:
	}
}

// sendOne publishes one batch with its own reply subject. A batch that
// cannot be encoded will never succeed: it is not sent (sent false) and
// dropped, loudly; the sequence gap makes the coordinator resync. err: the
// publish failed, send again. Called with p.mu held.
func (p *publisher) sendOne(conn eventConn, inbox string, round, ticket uint64, b *wire.Batch) (sent bool, err error) {
	data, err := b.MarshalBinary()
	if err != nil {
		p.met.eventsDropped.Inc()
		p.log.Error("event batch cannot be encoded; dropped (the coordinator will resync)", zap.Error(err))
		return false, nil
	}
	p.met.eventBatchesSent.Inc()
	replyTo := inbox + "." + strconv.FormatUint(round, 10) + "." + strconv.FormatUint(ticket, 10)
	if err := conn.PublishRequest(p.subject, replyTo, data); err != nil {
		return false, fmt.Errorf("publish %s: %w", p.subject, err)
	}
	return true, nil
}

// settle decodes the acknowledgement of one batch. done: the batch leaves
// the queue (acknowledged, or rejected for good); err: send it again.
func (p *publisher) settle(b *wire.Batch, data []byte) (done bool, err error) {
	var rep wire.Reply[wire.EventAck]
	if err := json.Unmarshal(data, &rep); err != nil {
		return false, fmt.Errorf("decode event ack: %w", errors.Join(err, wire.ErrMalformed))
	}
	if rep.Error != nil {
		if rep.Error.Code == wire.CodeUnavailable || rep.Error.Code == wire.CodeInternal {
			return false, rep.Error
		}
		p.met.eventsDropped.Inc()
		p.log.Error("coordinator rejected an event batch; dropped (the coordinator will resync)",
			zap.String("code", rep.Error.Code), zap.String("message", rep.Error.Message), zap.Int("events", len(b.Events)))
		return true, nil
	}
	if rep.OK == nil {
		return false, fmt.Errorf("event ack has neither ok nor error: %w", wire.ErrMalformed)
	}
	ack := rep.OK
	p.met.eventBatchesAcked.Inc()
	p.mu.Lock()
	p.applied = max(p.applied, ack.AppliedThrough)
	p.mu.Unlock()
	switch {
	case ack.Fenced:
		p.met.eventsFenced.Inc()
		p.log.Error("coordinator fenced this incarnation's events; batch dropped",
			zap.Uint64("incarnation", b.Incarnation), zap.Int("events", len(b.Events)))
	case ack.Resync:
		p.log.Info("coordinator asked for a resync; it will read the inventory", zap.Uint64("applied_through", ack.AppliedThrough))
	}
	return true, nil
}

// sleep waits d or until stop is closed; false when stopped.
func sleep(stop <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-stop:
		return false
	case <-t.C:
		return true
	}
}

// flush waits until every queued batch was acknowledged or ctx ends; then
// it closes the publisher (later Publish calls fail). It returns the number
// of batches left unsent.
func (p *publisher) flush(ctx context.Context) int {
	for {
		p.mu.Lock()
		n, kick := len(p.queue), p.kick
		if n == 0 || ctx.Err() != nil {
			p.closed = true
			p.mu.Unlock()
			return n
		}
		p.mu.Unlock()
		select {
		case <-ctx.Done():
		case <-kick:
		}
	}
}
