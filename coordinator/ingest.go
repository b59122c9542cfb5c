package coordinator

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/kvtier/kvtier/bus"
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

// startResync starts the resync worker of rank r unless one is running.
func (c *Coordinator) startResync(r wire.Rank) {
	c.drainMu.Lock()
	defer c.drainMu.Unlock()
	if c.draining || c.ctx.Err() != nil || !c.repl.decides() || c.resetting(r) {
		return // a rank being reset resyncs on its first batch after it
	}
	if _, running := c.resyncing[r]; running {
		// Events that raced past the running worker's inventory would be
		// lost until the rank's next batch: run once more after it.
		c.resyncing[r] = true
		return
	}
	if len(c.resyncing) >= c.cfg.MaxConcurrentResyncs {
		c.met.refused.WithLabelValues("resync_cap").Inc()
		c.log.Warn("resync not started: too many running; the rank's next batch or heartbeat asks again",
			zap.Stringer("rank", r), zap.Int("running", len(c.resyncing)), zap.Int("limit", c.cfg.MaxConcurrentResyncs))
		return
	}
	if !c.resyncLimit.Allow() {
		c.met.refused.WithLabelValues("resync_rate").Inc()
		c.log.Warn("resync not started: resync rate limit; the rank's next batch or heartbeat asks again",
			zap.Stringer("rank", r), zap.Float64("per_second", c.cfg.ResyncRate), zap.Int("burst", c.cfg.ResyncBurst))
		return
	}
	c.resyncing[r] = false
	if !c.goroutines.Go("resync", func() { c.resync(r) }) {
		// Shutdown closes the group right after it sets draining (checked
		// above, under the same lock), so this is not expected; if it
		// happens the resync is dropped as a draining one is: the rank's
		// next coordinator asks again.
		delete(c.resyncing, r)
	}
}

// resync asks rank r for its inventory and applies it, retrying up to
// ResyncAttempts times, spaced by the one backoff with jitter (bus.Backoff
// from ResyncBackoff up to ResyncMaxBackoff; STYLE 30). It gives up early when
// the coordinator stops, when it stops deciding (raft leadership lost:
// the new leader resyncs what it needs), or when the index says the
// inventory is from a superseded incarnation or was requested before a
// fence (fenced_since).
func (c *Coordinator) resync(r wire.Rank) {
	for {
		term := c.repl.term()
		c.resyncRank(term, r)
		c.drainMu.Lock()
		again := c.resyncing[r] && !c.draining && term.Err() == nil
		if !again {
			delete(c.resyncing, r)
			c.drainMu.Unlock()
			return
		}
		c.resyncing[r] = false
		c.drainMu.Unlock()
	}
}

// resyncRank is one resync of rank r, with its retries, within term (the
// replicator's term: it ends when the coordinator stops or loses raft
// leadership, and so does the resync, its inventory request included).
func (c *Coordinator) resyncRank(term context.Context, r wire.Rank) {
	log := c.log.With(zap.Stringer("rank", r))
	t0 := time.Now()
	bo := bus.Backoff{Initial: c.cfg.ResyncBackoff, Max: c.cfg.ResyncMaxBackoff}
	var wait time.Duration // before the next attempt: drawn when one fails
	var last error
	for attempt := 1; attempt <= c.cfg.ResyncAttempts; attempt++ {
		if term.Err() != nil {
			c.resyncEnded(log)
			return
		}
		if attempt > 1 {
			t := time.NewTimer(wait)
			select {
			case <-term.Done():
				t.Stop()
				c.resyncEnded(log)
				return
			case <-t.C:
			}
		}
		c.met.resyncAttempts.Inc()
		done, err := c.resyncOnce(term, r)
		if done {
			if errors.Is(err, errFencedSince) {
				log.Warn("inventory dropped: the rank was fenced after it was requested", zap.Error(err))
				return
			}
			if err != nil {
				c.met.resyncs.WithLabelValues("failed").Inc()
				log.Warn("resync ended without applying the inventory", zap.Error(err))
				return
			}
			c.met.resyncs.WithLabelValues("ok").Inc()
			log.Info("rank resynced", zap.Int("attempts", attempt), zap.Duration("took", time.Since(t0)))
			return
		}
		if term.Err() != nil {
			c.resyncEnded(log)
			return
		}
		last = err
		wait = bo.Delay(attempt - 1)
		log.Warn("inventory request failed", zap.Int("attempt", attempt), zap.Duration("next_in", wait), zap.Error(err))
	}
	c.met.resyncs.WithLabelValues("failed").Inc()
	log.Error("resync failed; the rank's next batch starts another", zap.Int("attempts", c.cfg.ResyncAttempts),
		zap.Duration("took", time.Since(t0)), zap.Error(last))
}

// resyncEnded logs a resync that ended with its term.
func (c *Coordinator) resyncEnded(log *zap.Logger) {
	if c.ctx.Err() != nil {
		log.Info("resync abandoned: coordinator stopping")
		return
	}
	c.met.resyncs.WithLabelValues("abandoned").Inc()
	log.Warn("resync abandoned: raft leadership lost (the leader resyncs the rank if it needs to)")
}

// resyncOnce fetches and applies the rank's inventory once, within term.
// done reports that retrying is pointless (applied, or dropped for a
// reason a retry cannot fix).
//
// Fence generations (C7, issues 11.2 and 29.1). Fetching an inventory
// takes time; memberlist may declare the rank dead meanwhile, and the
// fence may be committed by this coordinator or, under raft, by another
// leader while this one was deposed. The inventory was taken before the
// death, so applying it would bring back the L1 placements the fence
// dropped, and clear the fence. So the rank's fence generation (durable
// index state, moved by every fence and reset) is read before the request
// and travels with the inventory; the index drops it at apply time if the
// generation moved (fenced_since), on every replica alike, unless it comes
// from a newer incarnation than the index knows (a restarted rankd: its
// inventory is the truth). Reading a generation the index has not yet
// caught up to (a fence queued, not applied) only drops the inventory.
func (c *Coordinator) resyncOnce(term context.Context, r wire.Rank) (done bool, err error) {
	// The inventory comes in binary pages of one snapshot
	// (wire.InventoryRequest; JSON from an older rankd), ResyncWindow of
	// them in flight; ResyncTimeout bounds each page. Any failed page
	// fails the attempt.
	var gen uint64
	if ri, ok := c.idx.Rank(r); ok {
		gen = ri.FenceGen
	}
	// The rank's budget bounds its inventory too (issue 28.3): the fetch
	// stops at the first page past it, so an inventory never costs more
	// memory than the placements the rank may hold.
	budget, from := c.rankBudget(r)
	maxObjects := min(int64(c.cfg.MaxInventoryObjects), budget)
	inv, err := bus.FetchInventoryWith(term, c.nc, c.subj.Inventory(r), bus.InventoryFetch{PerPage: c.cfg.ResyncTimeout,
		MaxPages: c.cfg.MaxInventoryPages, MaxObjects: int(maxObjects), Window: c.cfg.ResyncWindow})
	if err != nil {
		if errors.Is(err, bus.ErrInventoryTooLarge) {
			rule := "inventory_pages"
			if budget < int64(c.cfg.MaxInventoryObjects) {
				rule = "inventory_budget"
				err = fmt.Errorf("inventory of %s over the rank's budget of %d placements (%s): %w", r, budget, from, err)
			}
			c.met.refused.WithLabelValues(rule).Inc()
			return true, err // the rank's next batch asks again
		}
		return false, err
	}
	if err := c.checkInventoryLimits(inv, time.Now()); err != nil {
		return true, err
	}
	if c.resetting(r) {
		// Applied now, it would make the index drop the rest of the
		// reset in one piece; the rank's first batch after the reset asks
		// again.
		return true, fmt.Errorf("inventory of %s dropped: an operator is resetting the rank", r)
	}
	if inv.Rank != r {
		return false, fmt.Errorf("inventory from %s names rank %s: %w", c.subj.Inventory(r), inv.Rank, wire.ErrMalformed)
	}
	prev, known := c.rankIncarnation(r)
	out, err := c.repl.applyInventory(term, *inv, gen)
	if err != nil {
		return errors.Is(err, index.ErrClosed) || errors.Is(err, errNotLeader), rankMalformed(err)
	}
	switch {
	case out.Reason == index.DropFencedSince:
		c.met.resyncs.WithLabelValues("fenced").Inc()
		// Done: the rank's next batch (refused as fenced) or its rejoin
		// starts a resync under the new generation.
		return true, fmt.Errorf("inventory of incarnation %d requested at fence generation %d, rank fenced since (generation %d): %w",
			inv.Incarnation, gen, out.FenceGen, errFencedSince)
	case out.Applied:
		c.kvRankChanged(r, inv)
		if known && inv.Incarnation > prev {
			// A restarted rank answered: the incarnation restores expect
			// is gone.
			c.rs.failRank(r, inv.Incarnation-1, "superseded", fmt.Sprintf("rank %s superseded", r))
		}
		return true, nil
	case out.Reason == index.DropStaleIncarnation:
		// The rank restarted since; the new incarnation syncs itself.
		return true, fmt.Errorf("inventory of incarnation %d superseded by %d", inv.Incarnation, out.Incarnation)
	default:
		// stale_inventory: events raced past the inventory; ask again.
		return false, fmt.Errorf("inventory at seq %d behind applied seq %d (%s)", inv.Seq, out.LastSeq, out.Reason)
	}
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

// errFencedSince: an inventory was requested before the rank's latest
// fence and is not applied.
var errFencedSince = errors.New("rank fenced after the inventory was requested")

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
