package coordinator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// Membership: a rankd that memberlist declares dead has its L1 placements
// fenced at once (C7); one that leaves gracefully too (its L1 is gone with
// it). L2 placements stay: the files survive the process. Every active
// restore that expects the rank (that incarnation or an older one) has the
// rank's unreported chunks failed at once, before the fence is committed:
// the rank will never report them (restores.failRank). Every rankd state
// change also feeds the liveness table restore.begin and lookup consult.

// membershipLoop consumes the member's events until its subscription is
// closed (cluster Shutdown).
func (c *Coordinator) membershipLoop() {
	defer c.wg.Done()
	var seq uint64
	for ev := range c.msub.C() {
		if ev.Seq != seq+1 && seq != 0 {
			// Events were dropped: reconcile from the member table.
			c.log.Warn("membership events dropped; reconciling from the member table",
				zap.Uint64("expected_seq", seq+1), zap.Uint64("got_seq", ev.Seq))
			c.reconcileMembers()
		}
		seq = ev.Seq
		c.live.observe(ev.Member)
		switch ev.Type {
		case cluster.EventJoin:
			c.noteDuplicate(ev.Member)
			c.resyncRejoined(ev.Member)
			if c.rebuilding && ev.Member.Meta.Role == cluster.RoleRankd {
				c.startResync(memberRank(ev.Member)) // refill the rebuilt index
			}
		case cluster.EventDead:
			c.fenceMember(ev.Member, "dead", ev.At)
		case cluster.EventLeave:
			c.fenceMember(ev.Member, "left", ev.At)
		}
	}
}

// noteDuplicate counts and logs a rankd member that joins while another
// incarnation of its rank is alive (issue 18.3): a second rankd for a live
// rank, which refuses to start after rankd's DuplicateWait, or a restart
// whose predecessor is not declared dead yet. Neither changes the index:
// only batches do, and a death or leave of an incarnation the index does
// not know fences nothing.
func (c *Coordinator) noteDuplicate(m cluster.Member) {
	if m.Meta.Role != cluster.RoleRankd || m.Local {
		return
	}
	r := memberRank(m)
	for _, s := range c.live.alive(r) {
		if s != m.Meta.Incarnation {
			c.met.duplicates.Inc()
			c.log.Warn("a second rankd member claims a live rank", zap.Stringer("rank", r), zap.String("member", m.ID),
				zap.Uint64("incarnation", m.Meta.Incarnation), zap.Uint64("live_incarnation", s))
			return
		}
	}
}

// reconcileMembers fences every rankd the member table says is dead or
// left.
func (c *Coordinator) reconcileMembers() {
	ms := c.member.Members()
	for _, m := range ms {
		c.live.observe(m)
	}
	for _, m := range ms {
		switch m.State {
		case cluster.StateDead:
			c.fenceMember(m, "dead", m.Since)
		case cluster.StateLeft:
			c.fenceMember(m, "left", m.Since)
		}
	}
}

// memberRank is the rank a rankd member serves.
func memberRank(m cluster.Member) wire.Rank {
	return wire.Rank{Instance: m.Meta.Engine, TPRank: m.Meta.TPRank}
}

// fenceMember fails the unreported chunks of that incarnation of the rank
// in every active restore, then fences the L1 placements of a rankd that
// died or left, unless the index already knows a newer incarnation of its
// rank (a restarted rankd that reported before the old one was declared
// dead).
func (c *Coordinator) fenceMember(m cluster.Member, cause string, at time.Time) {
	if m.Meta.Role != cluster.RoleRankd || m.Local {
		if m.Meta.Role == cluster.RoleCoordinator && !m.Local {
			c.log.Warn("another coordinator "+cause, zap.String("id", m.ID), zap.String("addr", m.Addr))
		}
		return
	}
	r := memberRank(m)
	if !c.repl.decides() {
		return // replicated: the leader fences (and a new leader sweeps)
	}
	// Only restores that expect this very incarnation: one that expects
	// another is not read by the member that died.
	c.rs.failRankRange(r, m.Meta.Incarnation, m.Meta.Incarnation, cause, fmt.Sprintf("rank %s %s", r, cause))
	log := c.log.With(zap.Stringer("rank", r), zap.String("member", m.ID), zap.String("cause", cause),
		zap.Uint64("incarnation", m.Meta.Incarnation))
	// Only the incarnation the index knows is fenced (issue 10.3): a notice
	// for an older one is stale; one for a newer incarnation that never
	// reported is unverified (a forged or confused member claiming the
	// rank). A real restart's new incarnation fences the old one with its
	// first batch, and reader liveness refuses restores from a rank whose
	// newest member is dead meanwhile.
	inc, ok := c.rankIncarnation(r)
	switch {
	case !ok:
		log.Debug("rank member gone; the index does not know the rank")
		return
	case inc > m.Meta.Incarnation:
		c.met.fenceSkips.Inc()
		log.Info("rank member gone, but a newer incarnation already reports; not fencing",
			zap.Uint64("current_incarnation", inc))
		return
	case inc < m.Meta.Incarnation:
		c.met.fenceSkips.Inc()
		log.Warn("death notice for an incarnation that never reported; not fencing the one the index knows",
			zap.Uint64("current_incarnation", inc))
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, 30*time.Second)
	defer cancel()
	n, err := c.repl.fenceRank(ctx, r, m.Meta.Incarnation)
	if err != nil {
		if errors.Is(err, errNotLeader) {
			log.Warn("rank not fenced: leadership lost; the new leader's sweep fences it", zap.Error(err))
			return
		}
		if errors.Is(err, index.ErrClosed) || errors.Is(err, context.Canceled) {
			log.Warn("rank not fenced: coordinator stopping", zap.Error(err))
			return
		}
		c.met.internal.Inc()
		log.Error("fence rank failed; its L1 placements may still be served", zap.Error(err))
		return
	}
	took := time.Since(at)
	c.met.fences.WithLabelValues(cause).Inc()
	c.met.fenced.Add(float64(n))
	c.met.fenceSeconds.Observe(took.Seconds())
	msg := "dead rank fenced"
	if cause == "left" {
		msg = "rank left; its L1 placements fenced"
	}
	log.Warn(msg, zap.Int("l1_placements", n), zap.Duration("since_notification", took))
}

// resyncRejoined starts a resync of a rankd that came back with the
// incarnation the index has fenced (a false death, or a healed partition):
// its L1 copies were fenced and are usable again only after an inventory.
// Without this the rank would stay fenced until its next batch.
func (c *Coordinator) resyncRejoined(m cluster.Member) {
	if m.Meta.Role != cluster.RoleRankd {
		return
	}
	r := memberRank(m)
	for _, ri := range c.idx.Ranks() {
		if ri.Rank == r && ri.Fenced && ri.Incarnation == m.Meta.Incarnation {
			c.log.Info("fenced rank rejoined; resyncing", zap.Stringer("rank", r), zap.String("member", m.ID))
			c.startResync(r)
			return
		}
	}
}

// startupFence runs once, StartupFenceGrace after Start: every rank the
// index holds L1 placements of whose incarnation is not alive in the
// cluster by then died while the coordinator was down (or never came
// back); its L1 placements are fenced as for a death.
func (c *Coordinator) startupFence(grace time.Duration) {
	defer c.wg.Done()
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-c.ctx.Done():
		return
	case <-t.C:
	}
	if !c.repl.decides() {
		c.log.Info("startup fence check skipped: not the raft leader (the leader sweeps when it gains leadership)")
		return
	}
	c.fenceAbsent("startup")
}

// fenceAbsent fences the L1 placements of every rank whose incarnation is
// not alive in the cluster (the startup fence; in replicated mode also a
// new leader's sweep, cause "leader").
func (c *Coordinator) fenceAbsent(cause string) {
	grace := c.cfg.StartupFenceGrace
	type key struct {
		r   wire.Rank
		inc uint64
	}
	alive := make(map[key]bool)
	for _, m := range c.member.Members() {
		if m.Meta.Role == cluster.RoleRankd && m.State == cluster.StateAlive {
			alive[key{memberRank(m), m.Meta.Incarnation}] = true
		}
	}
	fenced := 0
	for _, ri := range c.idx.Ranks() {
		if ri.L1Placements == 0 || ri.Fenced || alive[key{ri.Rank, ri.Incarnation}] {
			continue
		}
		if inc, ok := c.rankIncarnation(ri.Rank); !ok || inc != ri.Incarnation {
			continue // a new incarnation reported meanwhile
		}
		c.rs.failRank(ri.Rank, ri.Incarnation, cause,
			fmt.Sprintf("rank %s not in the cluster after the startup grace", ri.Rank))
		ctx, cancel := context.WithTimeout(c.ctx, 30*time.Second)
		n, err := c.repl.fenceRank(ctx, ri.Rank, ri.Incarnation)
		cancel()
		if err != nil {
			if c.ctx.Err() == nil {
				c.met.internal.Inc()
				c.log.Error("startup fence failed", zap.String("cause", cause), zap.Stringer("rank", ri.Rank), zap.Error(err))
			}
			return
		}
		fenced++
		c.met.fences.WithLabelValues(cause).Inc()
		c.met.fenced.Add(float64(n))
		c.log.Warn("rank not alive in the cluster after the startup grace; L1 placements fenced",
			zap.Stringer("rank", ri.Rank), zap.Uint64("incarnation", ri.Incarnation), zap.Int("l1_placements", n),
			zap.Duration("grace", grace))
	}
	c.log.Info("absent-rank fence check done", zap.String("cause", cause), zap.Int("ranks_fenced", fenced))
}
