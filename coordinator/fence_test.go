package coordinator

import (
	"testing"
	"time"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// deadMember is the memberlist record of a rankd incarnation that was
// declared dead.
func deadMember(r wire.Rank, inc uint64) cluster.Member {
	return cluster.Member{Name: "rankd-" + r.String(), ID: "test-" + r.String(), State: cluster.StateDead,
		Meta: cluster.Meta{Role: cluster.RoleRankd, Engine: r.Instance, TPRank: r.TPRank, TPSize: 1, DCPSize: 1,
			Incarnation: inc}}
}

// fenceMember acts on a confirmed death of member m (what the death check
// does once NATS confirmed a gossip notice), for tests of what follows.
func (c *Coordinator) fenceMember(m cluster.Member, cause string, at time.Time) {
	c.confirmDeath(suspect{rank: memberRank(m), inc: m.Meta.Incarnation, cause: cause, member: m.ID, state: m.State, since: at},
		byNATS, time.Now())
}

// TestLateInventoryDoesNotUndoFence (issue 11.2): a resync's inventory
// requested before the rank was declared dead arrives after the fence. It
// must not bring the fenced L1 placements back. On f044f94 the rank ended
// fenced=false with its 4 L1 placements and lookup prefix 4.
func TestLateInventoryDoesNotUndoFence(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	const inc = 7
	l1 := chain(ns, 4, 1)
	b := storeBatch(r, inc, 0, ns, l1, wire.L1)
	if _, werr := sendBatch(t, nc, c.subj, b); werr != nil {
		t.Fatal(werr)
	}

	// The rank's inventory server holds its first reply until released.
	asked := make(chan struct{}, 1)
	release := make(chan struct{})
	srv := newInventoryServer(16)
	inv := inventoryOf(r, inc, 5, b.Events)
	sub, err := connect(t, c).Subscribe(c.subj.Inventory(r), func(m *nats.Msg) {
		if srv.fresh(m) {
			select {
			case asked <- struct{}{}:
			default:
			}
			<-release
		}
		srv.serve(m, func() wire.Inventory { return inv })
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	// A batch past a gap starts a resync; its inventory request is held.
	gap := &wire.Batch{Rank: r, Incarnation: inc, Events: []wire.Event{{Seq: 6, Kind: wire.Stored, Tier: wire.L2,
		Key: b.Events[0].Key, Size: 2048, Sum: b.Events[0].Sum}}}
	if ack, werr := sendBatch(t, nc, c.subj, gap); werr != nil || !ack.Resync {
		t.Fatalf("gap batch: %+v %v", ack, werr)
	}
	select {
	case <-asked:
	case <-time.After(10 * time.Second):
		t.Fatal("no inventory request")
	}

	// Memberlist declares that incarnation dead: fenced, 0 L1 placements.
	c.fenceMember(deadMember(r, inc), "dead", time.Now())
	ri, ok := c.idx.Rank(r)
	if !ok || !ri.Fenced || ri.L1Placements != 0 {
		t.Fatalf("after the death: %+v", ri)
	}

	// Now the held inventory arrives.
	close(release)
	testutil.Eventually(t, 10*time.Second, "the resync to end", func() bool {
		c.drainMu.Lock()
		_, running := c.resyncing[r]
		c.drainMu.Unlock()
		return !running
	})
	ri, _ = c.idx.Rank(r)
	if !ri.Fenced || ri.L1Placements != 0 || ri.Incarnation != inc {
		t.Fatalf("after the late inventory: fenced=%v L1=%d incarnation=%d, want fenced=true L1=0 incarnation %d",
			ri.Fenced, ri.L1Placements, ri.Incarnation, inc)
	}
	if p, _ := c.lookup("eng", ns, l1); p.Prefix != 0 {
		t.Fatalf("lookup prefix %d after the late inventory, want 0", p.Prefix)
	}
	if got := testutil.Metric(t, c.reg, "kvtier_coord_resyncs_total", "outcome", "fenced"); got != 1 {
		t.Fatalf("resyncs_total{fenced} = %v, want 1", got)
	}
	// A resync asked for after the fence (the rank came back) applies.
	c.startResync(r)
	testutil.Eventually(t, 10*time.Second, "the second resync to apply", func() bool {
		ri, _ := c.idx.Rank(r)
		return !ri.Fenced && !ri.Partial && ri.L1Placements == 4
	})
	mustVerify(t, c)
}

// TestDeathNoticeFencesOnlyKnownIncarnation (issue 10.3): a death notice
// fences the rank only when it names the incarnation the index knows; a
// notice for an older one (stale) or a newer one never seen reporting
// (forged or not yet reported) fences nothing. On f044f94 the newer one
// fenced the live rank.
func TestDeathNoticeFencesOnlyKnownIncarnation(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	const inc = 100
	l1 := chain(ns, 4, 1)
	if _, werr := sendBatch(t, nc, c.subj, storeBatch(r, inc, 0, ns, l1, wire.L1)); werr != nil {
		t.Fatal(werr)
	}
	// A restore reading the rank is in flight.
	plan := call[wire.RestorePlan](t, nc, c.subj.Coord(wire.CoordRestoreBegin), wire.RestoreBegin{Namespace: ns, Chunks: l1})
	if plan.Prefix != 4 {
		t.Fatalf("plan prefix %d, reason %q", plan.Prefix, plan.Reason)
	}
	for _, bad := range []uint64{inc - 1, inc + 1, 1<<64 - 1} {
		c.fenceMember(deadMember(r, bad), "dead", time.Now())
		ri, _ := c.idx.Rank(r)
		if ri.Fenced || ri.L1Placements != 4 {
			t.Fatalf("death notice for incarnation %d (index knows %d) fenced: %+v", bad, inc, ri)
		}
		c.rs.mu.Lock()
		_, active := c.rs.active[plan.RestoreID]
		c.rs.mu.Unlock()
		if !active {
			t.Fatalf("death notice for incarnation %d (index knows %d) decided the restore", bad, inc)
		}
	}
	if got := testutil.Metric(t, c.reg, "kvtier_coord_rank_fences_skipped_total"); got != 3 {
		t.Fatalf("fences skipped = %v, want 3", got)
	}
	// The rank still ingests.
	if ack, werr := sendBatch(t, nc, c.subj, storeBatch(r, inc, 4, ns, chain(ns, 1, 9), wire.L1)); werr != nil ||
		ack.Resync || ack.AppliedThrough != 5 {
		t.Fatalf("batch after the notices: %+v %v", ack, werr)
	}
	c.fenceMember(deadMember(r, inc), "dead", time.Now())
	if ri, _ := c.idx.Rank(r); !ri.Fenced || ri.L1Placements != 0 {
		t.Fatalf("death notice for the known incarnation did not fence: %+v", ri)
	}
	v := call[wire.RestoreVerdict](t, nc, c.subj.Coord(wire.CoordRestoreWait), wire.RestoreWait{RestoreID: plan.RestoreID})
	if v.State != wire.VerdictFailed || len(v.Failed) != 4 {
		t.Fatalf("verdict after the real death: %+v", v)
	}
	mustVerify(t, c)
}
