package rankd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/wire"
)

// errQueueFull is returned by Publish when the queue is at its bound.
var errQueueFull = fmt.Errorf("event queue full: %w", ErrUnavailable)

// requester is the part of *nats.Conn the publisher uses (a seam for tests).
type requester interface {
	RequestWithContext(ctx context.Context, subj string, data []byte) (*nats.Msg, error)
}

// publisher sends the transfer engine's event batches to the coordinator,
// in order, one at a time, as NATS requests; a batch leaves the queue only
// when the coordinator acknowledged it as durable (or rejected it for good).
// On timeout or a transient error the same batch is sent again: the
// coordinator ignores duplicates.
type publisher struct {
	subject string
	timeout time.Duration
	limit   int
	log     *zap.Logger
	met     *metrics

	mu      sync.Mutex // guards the following
	queue   []wire.Batch
	sending bool // the head of the queue is being sent
	closed  bool
	conn    requester
	kick    chan struct{} // closed and replaced when the queue or conn changes
	applied uint64        // highest AppliedThrough seen
}

func newPublisher(subject string, timeout time.Duration, limit int, log *zap.Logger, met *metrics) *publisher {
	return &publisher{subject: subject, timeout: timeout, limit: limit, log: log, met: met, kick: make(chan struct{})}
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
func (p *publisher) setConn(c requester) {
	p.mu.Lock()
	p.conn = c
	p.wakeLocked()
	p.mu.Unlock()
}

// pending returns the batches queued or being sent.
func (p *publisher) pending() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.queue)
}

// run sends batches until stop is closed. It is the only sender.
func (p *publisher) run(stop <-chan struct{}) {
	backoff := 50 * time.Millisecond
	for {
		p.mu.Lock()
		kick := p.kick
		var b wire.Batch
		ok := len(p.queue) > 0 && p.conn != nil
		conn := p.conn
		if ok {
			b = p.queue[0]
			p.sending = true
		}
		p.mu.Unlock()
		if !ok {
			select {
			case <-stop:
				return
			case <-kick:
			}
			continue
		}
		done, err := p.send(conn, &b)
		p.mu.Lock()
		p.sending = false
		if done {
			p.queue[0] = wire.Batch{}
			p.queue = p.queue[1:]
			p.met.eventQueue.Set(float64(len(p.queue)))
			p.wakeLocked()
		}
		p.mu.Unlock()
		if err == nil {
			backoff = 50 * time.Millisecond
			continue
		}
		p.met.eventRetries.Inc()
		p.log.Warn("event batch not acknowledged; sending it again", zap.Int("events", len(b.Events)),
			zap.Duration("backoff", backoff), zap.Error(err))
		t := time.NewTimer(backoff)
		select {
		case <-stop:
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, time.Second)
	}
}

// send sends one batch and waits for its acknowledgment. done: the batch
// leaves the queue (acknowledged, or rejected for good); err: retry it.
func (p *publisher) send(conn requester, b *wire.Batch) (done bool, err error) {
	data, err := b.MarshalBinary()
	if err != nil {
		// A batch we cannot encode will never succeed: drop it, loudly.
		p.met.eventsDropped.Inc()
		p.log.Error("event batch cannot be encoded; dropped (the coordinator will resync)", zap.Error(err))
		return true, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.timeout)
	defer cancel()
	p.met.eventBatchesSent.Inc()
	msg, err := conn.RequestWithContext(ctx, p.subject, data)
	if err != nil {
		return false, fmt.Errorf("request %s: %w", p.subject, err)
	}
	var rep wire.Reply[wire.EventAck]
	if err := json.Unmarshal(msg.Data, &rep); err != nil {
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
