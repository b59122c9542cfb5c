package coordinator

import (
	"time"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// Membership: a rankd that memberlist declares dead, or that leaves, is
// a suspect (deaths.go): gossip is keyed with a key every rankd host holds,
// and starved processes miss their probes, so a gossip notice alone
// fences nothing. Once the rank's own NATS channel confirms it (a leaving
// heartbeat, its connection gone, or its heartbeats stopped for the
// confirmation window), every active restore that expects that
// incarnation has the rank's unreported chunks failed at once (it will
// never report them: restores.failRank), then its L1 placements are
// fenced (C7); L2 placements stay, the files survive the process. Every
// rankd state change also feeds the liveness table restore.begin and
// lookup consult, deaths and leaves only once confirmed.

// membershipLoop consumes the member's events until its subscription is
// closed (cluster Shutdown).
func (c *Coordinator) membershipLoop() {
	var seq uint64
	for ev := range c.msub.C() {
		if ev.Seq != seq+1 && seq != 0 {
			// Events were dropped: reconcile from the member table.
			c.log.Warn("membership events dropped; reconciling from the member table",
				zap.Uint64("expected_seq", seq+1), zap.Uint64("got_seq", ev.Seq))
			c.reconcileMembers()
		}
		seq = ev.Seq
		c.noteMember(ev.Member, ev.At)
		switch ev.Type {
		case cluster.EventJoin:
			c.noteDuplicate(ev.Member)
			c.resyncRejoined(ev.Member)
			if c.rebuilding && ev.Member.Meta.Role == cluster.RoleRankd {
				c.startResync(memberRank(ev.Member)) // refill the rebuilt index
			}
		case cluster.EventDead, cluster.EventLeave:
			if m := ev.Member; m.Meta.Role == cluster.RoleCoordinator && !m.Local {
				c.log.Warn("another coordinator "+m.State.String(), zap.String("id", m.ID), zap.String("addr", m.Addr))
			}
		}
	}
}

// noteMember records a rankd member's gossip state: alive goes to the
// liveness table at once (and ends a suspicion of that incarnation); dead
// and left make it a suspect until NATS confirms.
func (c *Coordinator) noteMember(m cluster.Member, at time.Time) {
	if m.Meta.Role != cluster.RoleRankd || m.Local {
		return
	}
	switch m.State {
	case cluster.StateAlive:
		c.live.observe(m)
		c.aliveInGossip(memberRank(m), m.Meta.Incarnation)
	case cluster.StateDead:
		c.suspectMember(m, causeGossipDead, at)
	case cluster.StateLeft:
		c.suspectMember(m, causeGossipLeft, at)
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

// reconcileMembers applies the member table after dropped events: every
// rankd it says is dead or left becomes a suspect (a known one keeps its
// first notice).
func (c *Coordinator) reconcileMembers() {
	for _, m := range c.member.Members() {
		c.noteMember(m, m.Since)
	}
}

// memberRank is the rank a rankd member serves.
func memberRank(m cluster.Member) wire.Rank {
	return wire.Rank{Instance: m.Meta.Engine, TPRank: m.Meta.TPRank}
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
// back); its L1 placements are fenced as for a death, once confirmed.
func (c *Coordinator) startupFence(grace time.Duration) {
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

// fenceAbsent makes every rank whose incarnation is not alive in the
// cluster a suspect (the startup fence; in replicated mode also a new
// leader's sweep, cause "leader"). Absence from gossip is no proof either:
// the death check fences those its NATS channel confirms dead (deaths.go).
func (c *Coordinator) fenceAbsent(cause string) {
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
	now := time.Now()
	n := 0
	for _, ri := range c.idx.Ranks() {
		if ri.L1Placements == 0 || ri.Fenced || alive[key{ri.Rank, ri.Incarnation}] {
			continue
		}
		c.addSuspect(suspect{rank: ri.Rank, inc: ri.Incarnation, cause: cause, state: cluster.StateDead, since: now, sweep: true})
		n++
	}
	c.log.Info("absent-rank check done; each is fenced once NATS confirms it gone", zap.String("cause", cause),
		zap.Int("ranks_absent", n))
}
