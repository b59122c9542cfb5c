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
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

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
// group while the next ones travel). It pulls (STYLE 30): it takes the next
// batch from the engine (transfer.EventSource) only when its window has
// room, keeps the batches it took until the coordinator acknowledged them
// as durable (or rejected them for good), and then acknowledges them to the
// engine, which releases them. The engine's event buffer is the only queue
// and its bound (transfer.Config.EventBuffer) counts the batches taken and
// not yet acknowledged; nothing here queues or retries in-process.
// Acknowledgements are taken from the head of the window, in order. When
// the head times out or gets a transient error, everything sent after it is
// forgotten and sent again from the head (go-back-N, spaced by
// bus.Backoff): the coordinator ignores the duplicates among them, and one
// that arrived past a batch the coordinator never applied was answered with
// a resync, never applied out of order (C7).
//
// Every batch is published by the run goroutine, so the batches of one
// rank leave in sequence order on one connection. Each carries its own
// reply subject (<inbox>.<round>.<ticket>), so an acknowledgement is
// matched to its batch, and one from an abandoned round (before a resend
// or a connection change) is recognized and ignored.
//
// Locks: publisher.mu, then the engine's (NextEvents and AckEvents are
// called under publisher.mu, so taking a batch and recording it are one
// step); the engine never calls the publisher.
type publisher struct {
	subject string
	timeout time.Duration
	window  int
	log     *zap.Logger
	met     *metrics

	mu      sync.Mutex // guards the following
	src     transfer.EventSource
	taken   []wire.Batch // taken from src, not yet done; at most window
	conn    eventConn
	kick    chan struct{} // closed and replaced when taken, src or conn changes
	applied uint64        // highest AppliedThrough seen
}

// newEventPublisher returns a publisher with no source and no connection
// yet (setSource, setConn).
func newEventPublisher(subject string, timeout time.Duration, window int, log *zap.Logger, met *metrics) *publisher {
	return &publisher{subject: subject, timeout: timeout, window: window, log: log, met: met,
		kick: make(chan struct{})}
}

func (p *publisher) wakeLocked() {
	close(p.kick)
	p.kick = make(chan struct{})
}

// setSource gives the publisher the engine whose events it sends.
func (p *publisher) setSource(src transfer.EventSource) {
	p.mu.Lock()
	p.src = src
	p.wakeLocked()
	p.mu.Unlock()
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

// backlogLocked returns the event batches held for the coordinator: those
// taken and not done, and those waiting in the engine's buffer (as the
// engine will hand them out), and the events the engine holds.
func (p *publisher) backlogLocked() (batches, events int) {
	if p.src == nil {
		return len(p.taken), 0
	}
	held, waiting := p.src.EventBacklog()
	return len(p.taken) + waiting, held
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
// the t-th batch taken from the engine since the publisher started; the
// head of the window (taken[0]) has ticket head.
type window struct {
	head     uint64             // ticket of taken[0]
	sent     int                // taken[:sent] are in flight
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
		for failed == nil && conn != nil && !moving && w.sent < p.window {
			if w.sent == len(p.taken) {
				// The window has room and everything taken is in flight:
				// pull the next batch. Nothing waits: Ready wakes us.
				b, ok := p.nextLocked()
				if !ok {
					break
				}
				p.taken = append(p.taken, b)
			}
			t := w.head + uint64(w.sent)
			sent, err := p.sendOne(conn, inbox, w.round, t, &p.taken[w.sent])
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
		// Wait for the engine's next events only with room to send them.
		var ready <-chan struct{}
		if p.src != nil && conn != nil && !moving && len(p.taken) < p.window {
			ready = p.src.Ready()
		}
		p.setGaugeLocked()
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
		case <-ready:
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
	b := &p.taken[r.ticket-w.head]
	p.mu.Unlock()
	if r.noResponders {
		w.got[r.ticket] = outcome{err: fmt.Errorf("request %s: %w", p.subject, nats.ErrNoResponders)}
		return
	}
	done, err := p.settle(b, r.data)
	w.got[r.ticket] = outcome{done: done, err: err}
}

// advance takes the outcomes of the head and of the batches after it, in
// order: done ones leave the window (popped of them) and are acknowledged
// to the engine, which releases their events. It returns the error
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
		b := p.taken[0]
		p.src.AckEvents(b.Events[len(b.Events)-1].Seq)
		p.taken[0] = wire.Batch{}
		p.taken = p.taken[1:]
		p.setGaugeLocked()
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
// the window (acknowledged, or rejected for good); err: send it again.
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

// flush waits until the coordinator acknowledged every event the engine
// holds (the engine is closed: no new ones come) or ctx ends. It returns
// the event batches left (taken and not acknowledged, or never taken),
// counted in event_batches_refused_total: the coordinator resyncs this
// rank's next incarnation from its inventory.
func (p *publisher) flush(ctx context.Context) int {
	for {
		p.mu.Lock()
		batches, events := p.backlogLocked()
		kick := p.kick
		p.mu.Unlock()
		if events == 0 && batches == 0 {
			return 0
		}
		if ctx.Err() != nil {
			p.met.eventsRefused.Add(float64(batches))
			p.log.Error("event batches not acknowledged when the shutdown flush ended", zap.Int("batches", batches),
				zap.Int("events", events), zap.Error(ctx.Err()))
			return batches
		}
		select {
		case <-ctx.Done():
		case <-kick:
		}
	}
}

// status is the event part of the daemon's status.
func (p *publisher) status() EventStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	batches, _ := p.backlogLocked()
	return EventStatus{QueuedBatches: batches, AppliedThrough: p.applied}
}

// nextLocked takes the engine's next batch. Called with p.mu held.
func (p *publisher) nextLocked() (wire.Batch, bool) {
	if p.src == nil {
		return wire.Batch{}, false
	}
	return p.src.NextEvents()
}

// setGaugeLocked sets the event queue gauge. Called with p.mu held.
func (p *publisher) setGaugeLocked() {
	batches, _ := p.backlogLocked()
	p.met.eventQueue.Set(float64(batches))
}
