package coordinator

import (
	"encoding/json"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

func TestJudgeReader(t *testing.T) {
	alive := rankSeen{Seen: true, AliveInc: 5, NewestInc: 5, NewestState: cluster.StateAlive}
	dead := rankSeen{Seen: true, NewestInc: 5, NewestState: cluster.StateDead}
	left := rankSeen{Seen: true, NewestInc: 5, NewestState: cluster.StateLeft}
	for _, tc := range []struct {
		name   string
		v      readerView
		absent bool // absence inference on (grace passed)
		want   string
	}{
		{"alive member", readerView{Seen: alive, Known: true, Inc: 5}, true, ""},
		{"alive member, index fenced (false death healed)", readerView{Seen: alive, Known: true, Inc: 5, Fenced: true}, true, ""},
		{"alive newer member, index has the older fenced", readerView{Seen: rankSeen{Seen: true, AliveInc: 7, NewestInc: 7, NewestState: cluster.StateAlive}, Known: true, Inc: 5, Fenced: true}, true, ""},
		{"alive older member, index newer", readerView{Seen: alive, Known: true, Inc: 9}, true, ""},
		{"dead", readerView{Seen: dead, Known: true, Inc: 5, Fenced: true}, false, causeDead},
		{"dead, fence not committed yet", readerView{Seen: dead, Known: true, Inc: 5}, false, causeDead},
		{"dead, unknown to the index", readerView{Seen: dead}, false, causeDead},
		{"left", readerView{Seen: left, Known: true, Inc: 5}, false, causeLeft},
		{"dead older incarnation, index newer, in grace", readerView{Seen: dead, Known: true, Inc: 6}, false, ""},
		{"dead older incarnation, index newer, grace passed", readerView{Seen: dead, Known: true, Inc: 6}, true, causeAbsent},
		{"dead older incarnation, index newer fenced", readerView{Seen: dead, Known: true, Inc: 6, Fenced: true}, false, causeFenced},
		{"never seen, unknown (reads others' L2 only)", readerView{}, true, ""},
		{"never seen, known, in grace or inference off", readerView{Known: true, Inc: 1}, false, ""},
		{"never seen, known, grace passed", readerView{Known: true, Inc: 1}, true, causeAbsent},
		{"never seen, fenced", readerView{Known: true, Inc: 1, Fenced: true}, false, causeFenced},
	} {
		if got := judgeReader(tc.v, tc.absent); got != tc.want {
			t.Errorf("%s: judgeReader(%+v, %v) = %q, want %q", tc.name, tc.v, tc.absent, got, tc.want)
		}
	}
}

func TestLiveTableKeepsAliveAndNewest(t *testing.T) {
	lt := newLiveTable()
	r := wire.Rank{Instance: "eng", TPRank: 1}
	mb := func(inc uint64, st cluster.MemberState) cluster.Member {
		return cluster.Member{ID: "x", State: st, Meta: cluster.Meta{Role: cluster.RoleRankd, Engine: "eng", TPRank: 1, Incarnation: inc}}
	}
	if s := lt.seen(r); s.Seen {
		t.Fatalf("empty table: %+v", s)
	}
	lt.observe(mb(5, cluster.StateAlive))
	lt.observe(mb(7, cluster.StateAlive)) // restarted before 5 was declared dead
	if s := lt.seen(r); s.AliveInc != 7 || s.NewestInc != 7 {
		t.Fatalf("two alive: %+v", s)
	}
	// A gossip death alone records nothing (deaths.go confirms it first).
	lt.observe(mb(7, cluster.StateDead))
	if s := lt.seen(r); s.AliveInc != 7 {
		t.Fatalf("unconfirmed gossip death recorded: %+v", s)
	}
	lt.markGone(r, 7, cluster.StateDead)
	if s := lt.seen(r); s.AliveInc != 5 || s.NewestState != cluster.StateDead {
		t.Fatalf("newest dead, older alive: %+v", s)
	}
	lt.markGone(r, 5, cluster.StateDead)
	if s := lt.seen(r); s.AliveInc != 0 || s.NewestInc != 7 || s.NewestState != cluster.StateDead || len(lt.ranks[r]) != 1 {
		t.Fatalf("all dead: %+v (%d entries, want the newest only)", s, len(lt.ranks[r]))
	}
	lt.observe(mb(7, cluster.StateAlive)) // false death refuted
	if s := lt.seen(r); s.AliveInc != 7 {
		t.Fatalf("refuted: %+v", s)
	}
	// Coordinators and the local member are not ranks.
	lt.observe(cluster.Member{State: cluster.StateAlive, Meta: cluster.Meta{Role: cluster.RoleCoordinator, Incarnation: 1}})
	if len(lt.ranks) != 1 {
		t.Fatalf("table %+v", lt.ranks)
	}
}

// memberFixture is a coordinator with a TP-2 namespace whose n chunks are
// stored in tier by both ranks of instance "eng", each a real memberlist
// member the coordinator sees alive.
type memberFixture struct {
	*restoreFixture
	members [2]*cluster.Cluster
}

func newMemberFixture(t *testing.T, n int, tier wire.Tier, mod func(*Config)) *memberFixture {
	c := startCoord(t, mod)
	nc := connect(t, c)
	f := &memberFixture{restoreFixture: &restoreFixture{c: c, nc: nc, ns: register(t, nc, c.subj, testSpec(2))}}
	f.chunks = chain(f.ns, n, 7)
	for tp := range 2 {
		r := wire.Rank{Instance: "eng", TPRank: tp}
		f.members[tp] = startRankMember(t, c, r, 2)
		inc := f.members[tp].LocalMember().Meta.Incarnation
		if _, werr := sendBatch(t, nc, c.subj, storeBatch(r, inc, 0, f.ns, f.chunks, tier)); werr != nil {
			t.Fatal(werr)
		}
		f.waitAlive(t, r, inc)
	}
	return f
}

// waitAlive waits until the coordinator's liveness table has incarnation
// inc of r alive.
func (f *memberFixture) waitAlive(t *testing.T, r wire.Rank, inc uint64) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, "the coordinator to see "+r.String()+" alive", func() bool {
		return f.c.live.seen(r).AliveInc == inc
	})
}

func (f *memberFixture) beginDeadline(t *testing.T, d time.Duration) *wire.RestorePlan {
	t.Helper()
	return call[wire.RestorePlan](t, f.nc, f.c.subj.Coord(wire.CoordRestoreBegin),
		wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks, DeadlineMS: int(d / time.Millisecond)})
}

func (f *memberFixture) lookup(t *testing.T) *wire.LookupReply {
	t.Helper()
	return call[wire.LookupReply](t, f.nc, f.c.subj.Coord(wire.CoordLookup),
		wire.LookupRequest{Namespace: f.ns, Chunks: f.chunks, Instance: "eng"})
}

// TestRestoreFailsEarlyWhenReaderFenced: a reader rank that dies (killed:
// its member shut down without Leave), leaves, or is superseded by a new
// incarnation mid-restore has its unreported chunks failed as soon as the
// coordinator fences it, long before the restore's deadline; the chunks it
// confirmed stay confirmed.
func TestRestoreFailsEarlyWhenReaderFenced(t *testing.T) {
	const deadline = 20 * time.Second
	for _, tc := range []struct {
		cause string
		fence func(t *testing.T, f *memberFixture)
	}{
		{"dead", func(t *testing.T, f *memberFixture) { _ = f.members[1].Shutdown() }},
		{"left", func(t *testing.T, f *memberFixture) {
			if err := f.members[1].Leave(2 * time.Second); err != nil {
				t.Fatal(err)
			}
			_ = f.members[1].Shutdown()
		}},
		{"superseded", func(t *testing.T, f *memberFixture) {
			// The restarted rankd's first batch arrives.
			r := wire.Rank{Instance: "eng", TPRank: 1}
			if _, werr := sendBatch(t, f.nc, f.c.subj, storeBatch(r, cluster.NewIncarnation(), 0, f.ns, f.chunks[:1], wire.L2)); werr != nil {
				t.Fatal(werr)
			}
		}},
	} {
		t.Run(tc.cause, func(t *testing.T) {
			f := newMemberFixture(t, 4, wire.L1, nil)
			plan := f.beginDeadline(t, deadline)
			if plan.Prefix != 4 || plan.Reason != "" {
				t.Fatalf("plan = %+v", plan)
			}
			w := f.waitAsync(t, plan.RestoreID)
			t0 := time.Now()
			f.report(t, plan.RestoreID, 0, results(plan.Ranks["eng/0"]))
			// Rank 1 confirms chunk 0, then goes away.
			f.report(t, plan.RestoreID, 1, results(plan.Ranks["eng/1"][:1]))
			tc.fence(t, f)
			v := recv(t, w)
			took := time.Since(t0)
			if v.State != wire.VerdictFailed || !slices.Equal(v.Failed, []int{1, 2, 3}) {
				t.Fatalf("verdict = %+v, want failed [1 2 3] (rank 1's unreported chunks)", v)
			}
			for _, r := range v.Reasons {
				if !strings.Contains(r, "rank eng/1 "+tc.cause) {
					t.Errorf("reason %q does not say rank eng/1 %s", r, tc.cause)
				}
			}
			if took >= deadline/2 {
				t.Fatalf("verdict after %v: not well before the %v deadline", took, deadline)
			}
			t.Logf("rank 1 %s mid-restore: verdict failed %v after %v (deadline %v)", tc.cause, v.Failed, took, deadline)
			if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restore_rank_failures_total", "cause", tc.cause); got != 1 {
				t.Errorf("restores failed early (%s) = %v, want 1", tc.cause, got)
			}
			if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restores_total", "outcome", wire.VerdictFailed, "cause", "rank_"+tc.cause); got != 1 {
				t.Errorf("failed restores (rank_%s) = %v, want 1", tc.cause, got)
			}
			// Rank 1's own late report changes nothing.
			if ack := f.report(t, plan.RestoreID, 1, results(plan.Ranks["eng/1"])); ack.State != wire.VerdictFailed {
				t.Fatalf("late report ack = %+v", ack)
			}
		})
	}
}

// TestRestoreFenceBeforeOtherReports: the fence fails the dead rank's
// chunks at once but the verdict waits for the live rank, whose chunks
// still count.
func TestRestoreFenceBeforeOtherReports(t *testing.T) {
	f := newMemberFixture(t, 3, wire.L1, nil)
	plan := f.beginDeadline(t, 20*time.Second)
	_ = f.members[1].Shutdown()
	testutil.Eventually(t, 10*time.Second, "rank 1's chunks to be failed", func() bool {
		return testutil.Metric(t, f.c.reg, "kvtier_coord_restore_rank_failures_total", "cause", "dead") == 1
	})
	w := f.waitAsync(t, plan.RestoreID)
	if ack := f.report(t, plan.RestoreID, 0, results(plan.Ranks["eng/0"])); ack.State != wire.VerdictFailed {
		t.Fatalf("last report ack = %+v", ack)
	}
	v := recv(t, w)
	if v.State != wire.VerdictFailed || !slices.Equal(v.Failed, []int{0, 1, 2}) {
		t.Fatalf("verdict = %+v", v)
	}
	if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restores_total", "outcome", wire.VerdictFailed, "cause", "reports"); got != 1 {
		t.Errorf("decided by the last report: %v", got)
	}
}

// TestOldIncarnationDeathSparesNewRestore: a restore begun once the new
// incarnation of a rank reports is not failed when the old incarnation is
// declared dead.
func TestOldIncarnationDeathSparesNewRestore(t *testing.T) {
	f := newMemberFixture(t, 3, wire.L1, nil)
	r := wire.Rank{Instance: "eng", TPRank: 1}
	newInc := cluster.NewIncarnation()
	if _, werr := sendBatch(t, f.nc, f.c.subj, storeBatch(r, newInc, 0, f.ns, f.chunks, wire.L1)); werr != nil {
		t.Fatal(werr)
	}
	plan := f.beginDeadline(t, 20*time.Second)
	if plan.Prefix != 3 {
		t.Fatalf("plan = %+v", plan)
	}
	_ = f.members[1].Shutdown() // the old incarnation dies
	testutil.Eventually(t, 10*time.Second, "the old incarnation's death to be handled", func() bool {
		return testutil.Metric(t, f.c.reg, "kvtier_coord_rank_fences_skipped_total") == 1
	})
	w := f.waitAsync(t, plan.RestoreID)
	f.report(t, plan.RestoreID, 0, results(plan.Ranks["eng/0"]))
	f.report(t, plan.RestoreID, 1, results(plan.Ranks["eng/1"]))
	if v := recv(t, w); v.State != wire.VerdictComplete {
		t.Fatalf("verdict = %+v", v)
	}
	if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restore_rank_failures_total", "cause", "dead"); got != 0 {
		t.Fatalf("restores failed by the old incarnation's death: %v", got)
	}
}

// TestRestoreBeginWithDeadReader: while a reader rank is dead, lookup
// still reports the stored prefix (its L2 files count) and names the rank;
// restore.begin plans nothing and says why. Once a new incarnation of the
// rank is alive, restores are planned again.
func TestRestoreBeginWithDeadReader(t *testing.T) {
	f := newMemberFixture(t, 4, wire.L2, nil)
	if lr := f.lookup(t); lr.Prefix != 4 || len(lr.NotAlive) != 0 || lr.Reason != "" {
		t.Fatalf("lookup with every reader alive = %+v", lr)
	}
	_ = f.members[1].Shutdown()
	r1 := wire.Rank{Instance: "eng", TPRank: 1}
	testutil.Eventually(t, 10*time.Second, "rank 1 declared dead", func() bool {
		return !f.c.live.seen(r1).Seen || f.c.live.seen(r1).AliveInc == 0
	})

	lr := f.lookup(t)
	if lr.Prefix != 4 || !slices.Equal(lr.NotAlive, []string{"eng/1"}) || !strings.Contains(lr.Reason, "eng/1 declared dead") {
		t.Fatalf("lookup with rank 1 dead = %+v, want prefix 4 and eng/1 not alive", lr)
	}
	plan := f.begin(t, f.chunks)
	if plan.Prefix != 0 || len(plan.Ranks) != 0 || !strings.Contains(plan.Reason, "eng/1 declared dead") {
		t.Fatalf("plan with rank 1 dead = %+v, want prefix 0 and a reason naming eng/1", plan)
	}
	t.Logf("plan reason: %s", plan.Reason)
	// Refused, never complete (issue 11.4): its own state with the reason,
	// recorded and counted as such.
	v := call[wire.RestoreVerdict](t, f.nc, f.c.subj.Coord(wire.CoordRestoreWait), wire.RestoreWait{RestoreID: plan.RestoreID})
	want := wire.RestoreVerdict{RestoreID: plan.RestoreID, State: "refused", Prefix: 0, Reason: plan.Reason}
	if !reflect.DeepEqual(*v, want) {
		t.Fatalf("verdict of the unplanned restore = %+v, want %+v", *v, want)
	}
	if err := v.Validate(); err != nil {
		t.Fatal(err)
	}
	hist := call[wire.AdminRestoresReply](t, f.nc, f.c.subj.Admin(wire.AdminRestores), struct{}{})
	if len(hist.Restores) != 1 || !reflect.DeepEqual(hist.Restores[0].RestoreVerdict, want) {
		t.Fatalf("history = %+v, want one entry %+v", hist.Restores, want)
	}
	if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restores_not_planned_total", "cause", causeDead); got != 1 {
		t.Errorf("not planned (dead) = %v", got)
	}
	if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restores_total", "outcome", "refused", "cause", "readers_not_alive"); got != 1 {
		t.Errorf("restores_total{refused,readers_not_alive} = %v, want 1", got)
	}
	if got := testutil.MetricSum(t, f.c.reg, "kvtier_coord_restores_total", "outcome", wire.VerdictComplete); got != 0 {
		t.Errorf("restores_total{complete} = %v, want 0", got)
	}
	// A begin that is also the engine's lookup (RestoreBeginRequest.Lookup)
	// misses as coord.lookup does: the reason, no restore refused.
	lplan := call[wire.RestorePlan](t, f.nc, f.c.subj.Coord(wire.CoordRestoreBegin),
		wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks}, Lookup: true})
	if lplan.Prefix != 0 || !strings.Contains(lplan.Reason, "eng/1 declared dead") {
		t.Fatalf("lookup-begin with rank 1 dead = %+v", lplan)
	}
	if hist := call[wire.AdminRestoresReply](t, f.nc, f.c.subj.Admin(wire.AdminRestores), struct{}{}); len(hist.Restores) != 1 {
		t.Errorf("history after a lookup-begin's miss holds %d restores, want 1", len(hist.Restores))
	}
	if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restores_total", "outcome", "refused", "cause", "readers_not_alive"); got != 1 {
		t.Errorf("restores_total{refused,readers_not_alive} = %v after a lookup-begin, want 1", got)
	}
	// The plan reply stays backward compatible: no reason key when empty.
	if b, _ := jsonOf(wire.RestorePlan{RestoreID: "x"}); strings.Contains(b, "reason") {
		t.Errorf("empty reason encoded: %s", b)
	}

	// The rankd restarts: a new incarnation joins; its fenced L1 is gone
	// but its L2 files serve.
	m := startRankMember(t, f.c, r1, 2)
	f.waitAlive(t, r1, m.LocalMember().Meta.Incarnation)
	if plan := f.begin(t, f.chunks); plan.Prefix != 4 || plan.Reason != "" {
		t.Fatalf("plan after the restart = %+v", plan)
	}
	if lr := f.lookup(t); len(lr.NotAlive) != 0 {
		t.Fatalf("lookup after the restart = %+v", lr)
	}
}

// TestRestoreBeginAbsentOrFencedReader: ranks that never joined
// memberlist count as alive while nothing says otherwise (a cluster of
// one driven over NATS, or a coordinator whose ranks are still rejoining),
// as not alive once fenced in the index, and, with the startup grace on,
// as not alive once the grace has passed.
func TestRestoreBeginAbsentOrFencedReader(t *testing.T) {
	storeBoth := func(t *testing.T, c *Coordinator) *restoreFixture {
		nc := connect(t, c)
		f := &restoreFixture{c: c, nc: nc, ns: register(t, nc, c.subj, testSpec(2))}
		f.chunks = chain(f.ns, 3, 5)
		for tp := range 2 {
			if _, werr := sendBatch(t, nc, c.subj, storeBatch(wire.Rank{Instance: "eng", TPRank: tp}, 1, 0, f.ns, f.chunks, wire.L2)); werr != nil {
				t.Fatal(werr)
			}
		}
		return f
	}
	t.Run("fenced", func(t *testing.T) {
		f := storeBoth(t, startCoord(t, nil)) // StartupFenceGrace 0: absence says nothing
		if p := f.begin(t, f.chunks); p.Prefix != 3 {
			t.Fatalf("plan with ranks never seen in memberlist = %+v, want prefix 3", p)
		}
		if _, err := f.c.idx.FenceRank(tctx(t), wire.Rank{Instance: "eng", TPRank: 0}, math.MaxUint64); err != nil {
			t.Fatal(err)
		}
		p := f.begin(t, f.chunks)
		if p.Prefix != 0 || !strings.Contains(p.Reason, "eng/0 fenced") {
			t.Fatalf("plan with rank 0 fenced = %+v", p)
		}
		lr := call[wire.LookupReply](t, f.nc, f.c.subj.Coord(wire.CoordLookup), wire.LookupRequest{Namespace: f.ns, Chunks: f.chunks})
		if lr.Prefix != 3 || !slices.Equal(lr.NotAlive, []string{"eng/0"}) {
			t.Fatalf("lookup with rank 0 fenced = %+v", lr)
		}
		if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restores_not_planned_total", "cause", causeFenced); got != 1 {
			t.Errorf("not planned (fenced) = %v", got)
		}
	})
	t.Run("absent after the grace", func(t *testing.T) {
		const grace = time.Second
		c := startCoord(t, func(cfg *Config) { cfg.StartupFenceGrace = grace })
		f := storeBoth(t, c)
		if p := f.begin(t, f.chunks); time.Since(c.startedAt) < grace && p.Prefix != 3 {
			t.Fatalf("plan within the startup grace = %+v, want prefix 3", p)
		}
		testutil.Eventually(t, 10*time.Second, "the startup grace to pass", func() bool { return time.Since(c.startedAt) > grace })
		p := f.begin(t, f.chunks)
		if p.Prefix != 0 || !strings.Contains(p.Reason, "eng/0 never joined") || !strings.Contains(p.Reason, "eng/1 never joined") {
			t.Fatalf("plan after the grace = %+v", p)
		}
		// A rank that joins is alive again; the other is still absent.
		m := startRankMember(t, c, wire.Rank{Instance: "eng", TPRank: 0}, 2)
		testutil.Eventually(t, 10*time.Second, "rank 0 alive", func() bool {
			return c.live.seen(wire.Rank{Instance: "eng", TPRank: 0}).AliveInc == m.LocalMember().Meta.Incarnation
		})
		p = f.begin(t, f.chunks)
		if p.Prefix != 0 || strings.Contains(p.Reason, "eng/0") || !strings.Contains(p.Reason, "eng/1") {
			t.Fatalf("plan with rank 0 joined = %+v", p)
		}
		if got := testutil.Metric(t, c.reg, "kvtier_coord_restores_not_planned_total", "cause", causeAbsent); got != 2 {
			t.Errorf("not planned (absent) = %v", got)
		}
	})
}

func jsonOf(v any) (string, error) {
	b, err := json.Marshal(v)
	return string(b), err
}
