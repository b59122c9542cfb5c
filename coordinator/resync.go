package coordinator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// Resyncs: a rank whose events the index cannot apply (a gap, a new
// incarnation, a fence, an index that lost its data) is asked for its
// inventory, which replaces what the index holds of it.

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
//
// Streaming (issue 28.3). The inventory comes in binary pages of one
// snapshot (wire.InventoryRequest; JSON from an older rankd), ResyncWindow
// of them in flight, ResyncTimeout bounding each; each page is applied to
// the index as it arrives (index.ApplyInventoryStep: Begin on page 0, a
// Page step per page, End after the last), so the coordinator never holds
// more than the pages in flight, and under raft each page is one entry.
// Any failed page fails the attempt; pages applied before it stay hidden
// in the index (the rank partial, its batches refused) until the next
// attempt's Begin replaces them.
func (c *Coordinator) resyncOnce(term context.Context, r wire.Rank) (done bool, err error) {
	var gen uint64
	if ri, ok := c.idx.Rank(r); ok {
		gen = ri.FenceGen
	}
	// The rank's budget bounds its inventory too (issue 28.3): the fetch
	// stops at the first page past it, so an inventory never puts more
	// placements in the index than the rank may hold.
	budget, from := c.rankBudget(r)
	s := &invStream{c: c, term: term, r: r, gen: gen, max: min(int64(c.cfg.MaxInventoryObjects), budget)}
	err = bus.StreamInventory(term, c.nc, c.subj.Inventory(r), bus.InventoryFetch{PerPage: c.cfg.ResyncTimeout, Index: c.idx.ID(),
		MaxPages: c.cfg.MaxInventoryPages, MaxObjects: int(s.max), Window: c.cfg.ResyncWindow}, s.page)
	s.drain()
	if errors.Is(err, errBeginDropped) {
		err = nil // s.out says why
	}
	if err != nil {
		if s.begun && !s.ended {
			c.log.Warn("streamed inventory abandoned: the rank's placements stay hidden, its batches refused, until an inventory is applied whole",
				zap.Stringer("rank", r), zap.Int("pages_applied", s.pages), zap.Int("objects_applied", s.objects), zap.Error(err))
		}
		if errors.Is(err, bus.ErrInventoryTooLarge) {
			rule := "inventory_pages"
			if s.max < int64(c.cfg.MaxInventoryObjects) {
				rule = "inventory_budget"
				err = fmt.Errorf("inventory of %s over the rank's budget of %d placements (%s): %w", r, budget, from, err)
			}
			c.met.refused.WithLabelValues(rule).Inc()
			return true, err // the rank's next batch asks again
		}
		return s.done, err
	}
	out := s.out
	switch {
	case out.Reason == index.DropFencedSince:
		c.met.resyncs.WithLabelValues("fenced").Inc()
		// Done: the rank's next batch (refused as fenced) or its rejoin
		// starts a resync under the new generation.
		return true, fmt.Errorf("inventory of incarnation %d requested at fence generation %d, rank fenced since (generation %d): %w",
			s.inc, gen, out.FenceGen, errFencedSince)
	case out.Applied:
		c.kvInventoryApplied(r, s)
		if s.known && s.inc > s.prev {
			// A restarted rank answered: the incarnation restores expect
			// is gone.
			c.rs.failRank(r, s.inc-1, "superseded", fmt.Sprintf("rank %s superseded", r))
		}
		return true, nil
	case out.Reason == index.DropStaleIncarnation:
		// The rank restarted since; the new incarnation syncs itself.
		return true, fmt.Errorf("inventory of incarnation %d superseded by %d", s.inc, out.Incarnation)
	default:
		// stale_inventory: events raced past the inventory; ask again.
		return false, fmt.Errorf("inventory at seq %d behind applied seq %d (%s)", s.seq, out.LastSeq, out.Reason)
	}
}

// invStream is one streamed inventory of a resync: what page 0 said, and
// how far its steps got.
type invStream struct {
	c    *Coordinator
	term context.Context
	r    wire.Rank
	gen  uint64 // read before the request; after Begin, the one Begin returned
	max  int64  // objects at most (the fetch's MaxObjects)

	inc, seq       uint64 // page 0's header
	prev           uint64 // the index's incarnation of r before, if known
	known          bool
	begun, ended   bool
	pages, objects int // applied so far
	// kvChunks: the chunks of the pages applied, for the KV events
	// recheck, up to kvInventoryChunks; kvAll when there were more.
	kvChunks []wire.Placement
	kvAll    bool
	inflight []queuedPage // page steps queued, oldest first
	out      index.InventoryOutcome
	// done: the attempt ended for a reason a retry cannot fix.
	done bool
}

// stepsInFlight is the page steps a resync keeps queued in the index at
// once: the committer stages the next page while one commits, and the
// coordinator holds at most these pages besides the fetch window's.
const stepsInFlight = 2

// stepWait waits for a queued step's outcome (replicator.queueInventoryStep).
type stepWait func() (index.InventoryOutcome, error)

// page is bus.StreamInventory's callback: it queues one page's step, and
// after the last page waits for them all and applies End.
func (s *invStream) page(p *wire.InventoryPage) error {
	c := s.c
	if p.Page == 0 {
		if err := s.begin(p); err != nil || s.out.Reason != "" {
			return err
		}
	}
	if c.testInvStep != nil {
		c.testInvStep(len(p.Objects))
	}
	w, err := c.repl.queueInventoryStep(s.term, index.InventoryStep{Kind: index.StepPage, Rank: p.Rank,
		Incarnation: p.Incarnation, Seq: p.Seq, FenceGen: s.gen, Objects: p.Objects})
	if err != nil {
		return s.failed(err)
	}
	s.inflight = append(s.inflight, queuedPage{w, p.Page, p.Pages})
	if s.c.kv != nil && !s.kvAll {
		if len(s.kvChunks)+len(p.Objects) > kvInventoryChunks {
			s.kvAll, s.kvChunks = true, nil
		} else {
			s.kvChunks = append(s.kvChunks, p.Objects...)
		}
	}
	for len(s.inflight) > stepsInFlight || (p.Page == p.Pages-1 && len(s.inflight) > 0) {
		if err := s.settle(); err != nil {
			return err
		}
	}
	if p.Page < p.Pages-1 {
		return nil
	}
	out, err := s.apply(index.InventoryStep{Kind: index.StepEnd, Rank: p.Rank,
		Incarnation: p.Incarnation, Seq: p.Seq, FenceGen: s.gen, Placements: s.objects})
	if err != nil {
		return err
	}
	if out.Reason != "" {
		return s.gone(fmt.Sprintf("at its end (%s)", out.Reason))
	}
	s.ended, s.out = true, out
	return nil
}

// queuedPage is a page step queued in the index.
type queuedPage struct {
	wait        stepWait
	page, pages int
}

// settle waits for the oldest queued page step.
func (s *invStream) settle() error {
	q := s.inflight[0]
	s.inflight = s.inflight[1:]
	out, err := q.wait()
	if err != nil {
		return s.failed(err)
	}
	if out.Reason != "" {
		return s.gone(fmt.Sprintf("page %d of %d (%s)", q.page, q.pages, out.Reason))
	}
	s.pages++
	s.objects += out.Placements
	return nil
}

// gone ends a stream whose step the index dropped (inventory_gone): a
// fence or reset of the rank since Begin moved its generation, as
// fenced_since does before Begin; the rank's next batch or rejoin asks
// again.
func (s *invStream) gone(what string) error {
	s.done = true
	s.c.met.resyncs.WithLabelValues("fenced").Inc()
	return fmt.Errorf("inventory of %s dropped %s: %w", s.r, what, errFencedSince)
}

// drain waits for the page steps still queued when the stream stopped.
func (s *invStream) drain() {
	for len(s.inflight) > 0 {
		_ = s.settle()
	}
}

// apply queues st in the index and waits for its outcome, as Begin and
// End are applied (a page step is waited for later, by settle).
func (s *invStream) apply(st index.InventoryStep) (index.InventoryOutcome, error) {
	w, err := s.c.repl.queueInventoryStep(s.term, st)
	if err != nil {
		return index.InventoryOutcome{}, s.failed(err)
	}
	out, err := w()
	if err != nil {
		return index.InventoryOutcome{}, s.failed(err)
	}
	return out, nil
}

// failed notes an index error of a step: done when a retry cannot help.
func (s *invStream) failed(err error) error {
	s.done = s.done || errors.Is(err, index.ErrClosed) || errors.Is(err, errNotLeader)
	return rankMalformed(err)
}

// begin checks page 0's header and applies the Begin step. A dropped
// Begin leaves s.out's Reason set and stops the fetch (errBeginDropped).
func (s *invStream) begin(p *wire.InventoryPage) error {
	c, r := s.c, s.r
	if p.Rank != r {
		return fmt.Errorf("inventory from %s names rank %s: %w", c.subj.Inventory(r), p.Rank, wire.ErrMalformed)
	}
	head := wire.Inventory{Rank: p.Rank, Incarnation: p.Incarnation, Seq: p.Seq}
	if err := c.checkInventoryLimits(&head, time.Now()); err != nil {
		s.done = true
		return err
	}
	// Every page but the last is full, so page 0 tells how many objects
	// the snapshot holds at least: an honest rank over its bound is
	// refused before the index changes.
	if p.Pages > 1 && int64(p.Pages-1)*int64(len(p.Objects))+1 > s.max {
		return fmt.Errorf("inventory of %s declares %d pages of %d objects, limit %d objects: %w",
			r, p.Pages, len(p.Objects), s.max, bus.ErrInventoryTooLarge)
	}
	// Page 0 is checked before Begin, so a malformed one-page inventory
	// is refused with the rank untouched, as a whole one was; a later
	// malformed page abandons the stream.
	if err := index.ValidateInventoryStep(&index.InventoryStep{Kind: index.StepPage, Rank: p.Rank,
		Incarnation: p.Incarnation, Seq: p.Seq, Objects: p.Objects}); err != nil {
		return rankMalformed(err)
	}
	if c.resetting(r) {
		// Applied now, it would make the index drop the rest of the
		// reset in one piece; the rank's first batch after the reset asks
		// again.
		s.done = true
		return fmt.Errorf("inventory of %s dropped: an operator is resetting the rank", r)
	}
	s.inc, s.seq = p.Incarnation, p.Seq
	s.prev, s.known = c.rankIncarnation(r)
	// Waited for: a page finding Begin's sliced drop running would
	// finish it in one piece.
	out, err := s.apply(index.InventoryStep{Kind: index.StepBegin, Rank: r,
		Incarnation: p.Incarnation, Seq: p.Seq, FenceGen: s.gen, Checked: true})
	if err != nil {
		return err
	}
	if out.Reason != "" {
		s.out = out
		return errBeginDropped
	}
	s.begun, s.gen = true, out.FenceGen
	return nil
}

// errBeginDropped stops the fetch of an inventory whose Begin the index
// dropped; resyncOnce reads why from invStream.out.
var errBeginDropped = errors.New("inventory dropped at its begin")

// kvInventoryChunks bounds the objects a resync keeps for the KV events
// recheck of the chunks its inventory brought; past it, the recheck
// covers the rank's whole instance and a resnapshot (kvInventoryApplied).
const kvInventoryChunks = 1 << 16

// kvInventoryApplied asks the KV events publisher to recheck what an
// applied inventory changed: the instance and the chunks of its pages, or
// for a large inventory, whose chunks are not kept, a resnapshot.
func (c *Coordinator) kvInventoryApplied(r wire.Rank, s *invStream) {
	if c.kv == nil {
		return
	}
	if s.kvAll {
		c.kvRankChanged(r, nil)
		c.kv.overflow.Store(true) // not counted as one: nothing was lost
		c.kvWake()
		return
	}
	c.kvRankChanged(r, &wire.Inventory{Rank: r, Objects: s.kvChunks})
}

// errFencedSince: an inventory was requested before the rank's latest
// fence and is not applied.
var errFencedSince = errors.New("rank fenced after the inventory was requested")
