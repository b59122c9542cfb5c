package coordinator

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// Reader liveness: whether the ranks that would read a restore are there to
// read it. Lookup reports the ones that are not (LookupReply.NotAlive);
// restore.begin plans nothing while any is not (see restore.go for the
// rule). The inputs are the coordinator's memberlist view (liveTable) and
// the index's rank records; the rule itself is judgeReader, a pure
// function.

// Causes of a reader not being alive, also the label values of
// kvtier_coord_restores_not_planned_total.
const (
	causeDead   = "dead"   // its newest incarnation is dead: gossip said so and NATS confirmed it (deaths.go)
	causeLeft   = "left"   // its newest incarnation left gracefully (confirmed likewise)
	causeFenced = "fenced" // the index has it fenced and memberlist never showed it alive since
	causeAbsent = "absent" // known to the index, never seen in memberlist, startup grace passed
)

// liveTable is every rankd incarnation this coordinator has seen in
// memberlist since it started, with its last state: alive as gossip says,
// dead or left only once confirmed over NATS (markGone; a gossip notice
// alone is a suspicion, deaths.go). Unlike the member
// table (cluster.Members), which forgets dead members after
// GossipToTheDeadTime, it keeps the newest incarnation of each rank for the
// life of the process, so a rank dead for long is still known dead rather
// than never seen. Per rank it keeps the alive incarnations and the newest
// one: a handful of entries.
type liveTable struct {
	mu    sync.RWMutex // guards ranks
	ranks map[wire.Rank][]seenInc
}

type seenInc struct {
	inc   uint64
	state cluster.MemberState
}

func newLiveTable() *liveTable {
	return &liveTable{ranks: make(map[wire.Rank][]seenInc)}
}

// observe records a rankd member gossip shows alive; other states are
// recorded by markGone once confirmed.
func (t *liveTable) observe(m cluster.Member) {
	if m.Meta.Role != cluster.RoleRankd || m.Local || m.State != cluster.StateAlive {
		return
	}
	t.set(memberRank(m), m.Meta.Incarnation, cluster.StateAlive)
}

// markGone records that incarnation inc of rank r is confirmed dead or
// left (state).
func (t *liveTable) markGone(r wire.Rank, inc uint64, state cluster.MemberState) {
	if state == cluster.StateAlive {
		state = cluster.StateDead
	}
	t.set(r, inc, state)
}

func (t *liveTable) set(r wire.Rank, inc uint64, state cluster.MemberState) {
	t.mu.Lock()
	defer t.mu.Unlock()
	incs := t.ranks[r]
	i := slices.IndexFunc(incs, func(s seenInc) bool { return s.inc == inc })
	if i < 0 {
		incs = append(incs, seenInc{inc: inc})
		i = len(incs) - 1
	}
	incs[i].state = state
	// Keep the alive incarnations and the newest one.
	newest := uint64(0)
	for _, s := range incs {
		newest = max(newest, s.inc)
	}
	incs = slices.DeleteFunc(incs, func(s seenInc) bool { return s.state != cluster.StateAlive && s.inc != newest })
	t.ranks[r] = incs
}

// alive returns the alive incarnations of rank r.
func (t *liveTable) alive(r wire.Rank) []uint64 {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var out []uint64
	for _, s := range t.ranks[r] {
		if s.state == cluster.StateAlive {
			out = append(out, s.inc)
		}
	}
	return out
}

// aliveInc reports whether incarnation inc of rank r is alive.
func (t *liveTable) aliveInc(r wire.Rank, inc uint64) bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	for _, s := range t.ranks[r] {
		if s.inc == inc && s.state == cluster.StateAlive {
			return true
		}
	}
	return false
}

// seen returns what the table knows of rank r.
func (t *liveTable) seen(r wire.Rank) rankSeen {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var out rankSeen
	for _, s := range t.ranks[r] {
		out.Seen = true
		if s.state == cluster.StateAlive {
			out.AliveInc = max(out.AliveInc, s.inc)
		}
		if s.inc >= out.NewestInc {
			out.NewestInc, out.NewestState = s.inc, s.state
		}
	}
	return out
}

// rankSeen is the memberlist side of a reader's liveness.
type rankSeen struct {
	Seen        bool                // some incarnation was seen in memberlist since the coordinator started
	AliveInc    uint64              // newest incarnation alive now; 0: none
	NewestInc   uint64              // newest incarnation seen
	NewestState cluster.MemberState // and its state
}

// readerView is everything judgeReader decides from.
type readerView struct {
	Seen rankSeen
	// The index's record of the rank.
	Known  bool
	Inc    uint64
	Fenced bool
}

// judgeReader is the liveness rule (restore.go explains it); it returns ""
// for alive, or the cause. absentIsDead is true once the coordinator
// infers death from absence: StartupFenceGrace > 0 and passed since Start.
func judgeReader(v readerView, absentIsDead bool) string {
	s := v.Seen
	switch {
	case s.AliveInc != 0:
		return ""
	case s.Seen && (!v.Known || v.Inc <= s.NewestInc):
		if s.NewestState == cluster.StateLeft {
			return causeLeft
		}
		return causeDead
	// Never seen (or only older incarnations than the index's were).
	case !v.Known:
		return ""
	case v.Fenced:
		return causeFenced
	case absentIsDead:
		return causeAbsent
	}
	return ""
}

// readerStatus is one reader rank of a restore or lookup.
type readerStatus struct {
	tp int
	// inc is the incarnation a restore begun now expects to read: the
	// newest one alive in memberlist or known to the index. A fence of
	// this incarnation or an older one fails the restore's unreported
	// chunks of this rank; a fence of an older one alone does not.
	inc   uint64
	cause string // "" when alive
}

// readerStatuses judges every distinct reader rank of exps for instance.
func (c *Coordinator) readerStatuses(instance string, exps []dcp.Expectation) []readerStatus {
	out := make([]readerStatus, 0, 8)
	for _, e := range exps {
		if !slices.ContainsFunc(out, func(s readerStatus) bool { return s.tp == e.Rank }) {
			out = append(out, readerStatus{tp: e.Rank})
		}
	}
	absentIsDead := c.cfg.StartupFenceGrace > 0 && time.Since(c.startedAt) >= c.cfg.StartupFenceGrace
	for i := range out {
		r := wire.Rank{Instance: instance, TPRank: out[i].tp}
		v := readerView{Seen: c.live.seen(r)}
		// Lock-free (the lookup view): lookups call this per reader and
		// must not wait for the committer's publish.
		if inc, fenced, ok := c.idx.RankFence(r); ok {
			v.Known, v.Inc, v.Fenced = true, inc, fenced
		}
		out[i].inc = max(v.Inc, v.Seen.AliveInc)
		out[i].cause = judgeReader(v, absentIsDead)
	}
	return out
}

// notAlive returns the reader ranks that are not alive, and one line
// saying why ("" when every reader is alive).
func notAlive(instance string, st []readerStatus) (ranks []string, reason string) {
	var why []string
	for _, s := range st {
		if s.cause == "" {
			continue
		}
		r := wire.Rank{Instance: instance, TPRank: s.tp}.String()
		ranks = append(ranks, r)
		why = append(why, r+" "+causeText(s.cause))
	}
	if len(ranks) == 0 {
		return nil, ""
	}
	return ranks, fmt.Sprintf("reader ranks not alive: %s", strings.Join(why, "; "))
}

func causeText(cause string) string {
	switch cause {
	case causeDead:
		return "declared dead (gossip's notice confirmed over NATS)"
	case causeLeft:
		return "left the cluster"
	case causeFenced:
		return "fenced in the index and not seen alive since"
	case causeAbsent:
		return "never joined the cluster since the coordinator started (startup grace passed)"
	}
	return cause
}
