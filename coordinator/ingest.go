package coordinator

import (
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// opEvents is the operation label of event batch replies.
const opEvents = "events"

// Event ingest: every message on <p>.events.> is a binary wire.Batch sent
// as a request. It is queued into the index, and acknowledged with a
// wire.EventAck only once the index has committed it (C7).

// dispatchBatch runs on NATS's delivery goroutine for the events
// subscription: it routes the message to the ingest worker of its subject
// (one subject per rank), so one rank's batches are applied in order.
func (c *Coordinator) dispatchBatch(m *nats.Msg) {
	h := fnv.New32a()
	_, _ = h.Write([]byte(m.Subject))
	c.ingestMu.RLock()
	defer c.ingestMu.RUnlock()
	if c.ingestClosed {
		c.replyError(opEvents, m, wire.CodeUnavailable, "coordinator shutting down")
		return
	}
	c.ingest[h.Sum32()%uint32(len(c.ingest))] <- m
}

// ingestWorker queues the batches of its ranks into the index in arrival
// order (ApplyAsync) without waiting for their commits, and hands each to
// its acker, which acknowledges them in the same order once committed. A
// rank with several batches in flight (rankd's publisher window) thus has
// them all in the index's group commit at once, never one commit per
// batch (no head-of-line blocking), and its acks still come in order.
// Start starts both (ingestGroup); the worker closes acks when ch closes,
// which ends the acker once it has acknowledged everything queued.
func (c *Coordinator) ingestWorker(ch <-chan *nats.Msg, acks chan<- ingestJob) {
	defer close(acks)
	for m := range ch {
		if j, ok := c.queueBatch(m); ok {
			acks <- j
		}
	}
}

// ingestJob is a batch queued in the index, waiting for its commit.
type ingestJob struct {
	m       *nats.Msg
	b       *wire.Batch
	pending batchResult
	t0      time.Time
}

// ingestAcker acknowledges the batches of one ingest worker, in order.
func (c *Coordinator) ingestAcker(jobs <-chan ingestJob) {
	for j := range jobs {
		out, err := j.pending.Wait()
		c.batchDone(j.b.Rank)
		if err == nil {
			c.kvBatchApplied(j.b, out)
		}
		c.finishBatch(j.m, j.b, j.t0, out, err)
	}
}

// queueBatch decodes and checks one batch and queues it in the index. When
// it cannot be queued it has answered m and returns false.
func (c *Coordinator) queueBatch(m *nats.Msg) (ingestJob, bool) {
	var b wire.Batch
	if err := b.UnmarshalBinary(m.Data); err != nil {
		c.badRequest(m, opEvents, err)
		c.met.batches.WithLabelValues("bad_request").Inc()
		return ingestJob{}, false
	}
	if err := wire.ValidInstance(b.Rank.Instance); err != nil {
		c.badRequest(m, opEvents, err)
		c.met.batches.WithLabelValues("bad_request").Inc()
		return ingestJob{}, false
	}
	if want := c.subj.Events(b.Rank); m.Subject != want {
		c.refuse(m, opEvents, fmt.Errorf("batch of rank %s arrived on %s, want %s: %w",
			b.Rank, m.Subject, want, wire.ErrMalformed))
		c.met.batches.WithLabelValues("unauthorized").Inc()
		return ingestJob{}, false
	}
	// A batch the index would refuse (it owns the rules about placements,
	// a nonzero sum included: index.ValidateBatch, STYLE 31) is refused
	// before admission: it costs the rank no rate and no budget.
	if err := index.ValidateBatch(&b); err != nil {
		c.badRequest(m, opEvents, rankMalformed(err))
		c.met.batches.WithLabelValues("bad_request").Inc()
		return ingestJob{}, false
	}
	if err := c.checkBatchLimits(&b, time.Now()); err != nil {
		c.met.batches.WithLabelValues("refused").Inc()
		if errors.Is(err, errNotMember) {
			c.log.Warn("batch refused for now", zap.Stringer("rank", b.Rank), zap.Error(err))
			c.replyError(opEvents, m, wire.CodeUnavailable, err.Error())
			return ingestJob{}, false
		}
		c.badRequest(m, opEvents, err)
		return ingestJob{}, false
	}
	t0 := time.Now()
	if retryMS, err := c.admitBatch(&b, t0); err != nil {
		c.met.batches.WithLabelValues("refused").Inc()
		if errors.Is(err, errRetryLater) {
			c.sendErrorRetry(opEvents, m, wire.CodeUnavailable, err.Error(), retryMS, replyError)
			return ingestJob{}, false
		}
		c.met.badRequests.WithLabelValues(opEvents).Inc()
		c.replyError(opEvents, m, wire.CodeBadRequest, err.Error()) // logged by admitBatch, once per interval
		return ingestJob{}, false
	}
	p, err := c.repl.applyBatch(&b)
	if err != nil {
		c.batchDone(b.Rank)
		c.finishBatch(m, &b, t0, index.Outcome{}, err)
		return ingestJob{}, false
	}
	if n := len(b.Events); n > 0 {
		c.hb.noteReceived(b.Rank, b.Incarnation, b.Events[n-1].Seq)
	}
	return ingestJob{m: m, b: &b, pending: p, t0: t0}, true
}

// finishBatch acknowledges one applied batch (or answers its error).
func (c *Coordinator) finishBatch(m *nats.Msg, bp *wire.Batch, t0 time.Time, out index.Outcome, err error) {
	b := *bp
	if err != nil {
		c.met.batches.WithLabelValues("failed").Inc()
		switch {
		case errors.Is(err, index.ErrInvalid):
			c.badRequest(m, opEvents, err)
		case errors.Is(err, index.ErrClosed):
			c.replyError(opEvents, m, wire.CodeUnavailable, "index closed: coordinator shutting down")
		case errors.Is(err, errNotLeader):
			c.replyError(opEvents, m, wire.CodeUnavailable, err.Error())
		default:
			c.internalError(m, opEvents, "apply event batch", err, zap.Stringer("rank", b.Rank),
				zap.Uint64("incarnation", b.Incarnation), zap.Int("events", len(b.Events)))
		}
		return
	}
	c.met.applySeconds.Observe(time.Since(t0).Seconds())
	c.met.events.Add(float64(out.Applied))
	ack := wire.EventAck{AppliedThrough: out.LastSeq, Resync: out.Resync}
	outcome := "applied"
	switch {
	case out.Reason == index.DropStaleIncarnation:
		// The batch's incarnation is superseded: it is dropped for good.
		ack.Fenced = true
		outcome = "fenced"
		c.log.Warn("batch from a superseded incarnation dropped", zap.Stringer("rank", b.Rank),
			zap.Uint64("incarnation", b.Incarnation), zap.Uint64("current_incarnation", out.Incarnation),
			zap.Int("events", len(b.Events)))
	case out.Resync:
		outcome = "resync"
		if out.Reason == index.DropGap {
			c.met.gaps.Inc()
		}
		c.log.Warn("rank needs a resync", zap.Stringer("rank", b.Rank), zap.Uint64("incarnation", b.Incarnation),
			zap.String("reason", string(out.Reason)), zap.Uint64("resync_from", out.ResyncFrom),
			zap.Int("dropped", out.Dropped))
		c.startResync(b.Rank)
	}
	if out.NewIncarnation {
		// The old incarnation is gone: whatever it had not reported of an
		// active restore it never will.
		c.rs.failRank(b.Rank, b.Incarnation-1, "superseded", fmt.Sprintf("rank %s superseded", b.Rank))
		// Its L2 placements stay in the index, but files may have been lost
		// or quarantined while it was down, and the new incarnation's rescan
		// announces only the files that exist: its inventory replaces all
		// of the rank's placements, dropping the stale ones.
		c.startResync(b.Rank)
	}
	if out.NewIncarnation && out.Fenced > 0 {
		c.met.fences.WithLabelValues("incarnation").Inc()
		c.met.fenced.Add(float64(out.Fenced))
	}
	c.met.batches.WithLabelValues(outcome).Inc()
	if ack.Fenced {
		// AppliedThrough is meaningless to a superseded incarnation.
		ack.AppliedThrough = 0
	}
	c.reply(opEvents, m, &ack)
}

// rankMalformed returns the index's refusal of what a rank sent, marked as
// the rank's malformed message when it breaks the rule that every stored
// object has a nonzero sum (index.ErrZeroSum, issue 11.8): the reply and
// the log read as they did when the coordinator checked that rule itself.
func rankMalformed(err error) error {
	if errors.Is(err, index.ErrZeroSum) {
		return fmt.Errorf("%w: %w", err, wire.ErrMalformed)
	}
	return err
}

// badRequest answers a malformed or invalid request with code bad_request,
// counts and logs it.
func (c *Coordinator) badRequest(m *nats.Msg, op string, err error) {
	c.met.badRequests.WithLabelValues(op).Inc()
	c.log.Warn("bad request", zap.String("op", op), zap.String("subject", m.Subject), zap.Error(err))
	if m.Reply != "" {
		c.replyError(op, m, wire.CodeBadRequest, err.Error())
	}
}

// internalError answers with code internal, counts and logs at Error: the
// request's work is lost.
func (c *Coordinator) internalError(m *nats.Msg, op, what string, err error, fields ...zap.Field) {
	c.met.internal.Inc()
	c.log.Error(what+" failed", append(fields, zap.String("op", op), zap.String("subject", m.Subject), zap.Error(err))...)
	if m.Reply != "" {
		c.replyError(op, m, wire.CodeInternal, what+": "+err.Error())
	}
}
