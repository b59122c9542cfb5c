package coordinator

import (
	"context"
	"errors"
	"time"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// Membership: a rankd that memberlist declares dead has its L1 placements
// fenced at once (C7); one that leaves gracefully too (its L1 is gone with
// it). L2 placements stay: the files survive the process.

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
		switch ev.Type {
		case cluster.EventDead:
			c.fenceMember(ev.Member, "dead", ev.At)
		case cluster.EventLeave:
			c.fenceMember(ev.Member, "left", ev.At)
		}
	}
}

// reconcileMembers fences every rankd the member table says is dead or
// left.
func (c *Coordinator) reconcileMembers() {
	for _, m := range c.member.Members() {
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

// fenceMember fences the L1 placements of a rankd that died or left, unless
// the index already knows a newer incarnation of its rank (a restarted
// rankd that reported before the old one was declared dead).
func (c *Coordinator) fenceMember(m cluster.Member, cause string, at time.Time) {
	if m.Meta.Role != cluster.RoleRankd || m.Local {
		if m.Meta.Role == cluster.RoleCoordinator && !m.Local {
			c.log.Warn("another coordinator "+cause, zap.String("id", m.ID), zap.String("addr", m.Addr))
		}
		return
	}
	r := memberRank(m)
	log := c.log.With(zap.Stringer("rank", r), zap.String("member", m.ID), zap.String("cause", cause),
		zap.Uint64("incarnation", m.Meta.Incarnation))
	if inc, ok := c.rankIncarnation(r); ok && inc > m.Meta.Incarnation {
		c.met.fenceSkips.Inc()
		log.Info("rank member gone, but a newer incarnation already reports; not fencing",
			zap.Uint64("current_incarnation", inc))
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, 30*time.Second)
	defer cancel()
	n, err := c.idx.FenceRank(ctx, r)
	if err != nil {
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
