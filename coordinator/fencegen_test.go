package coordinator

import (
	"slices"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// TestRaftLateInventoryAfterAnotherLeadersFence (issue 29.1): leader A
// asks a rank for its inventory; leadership moves to B, which fences the
// rank as dead; A leads again. A's resync ended with its term (its
// inventory request is cancelled, nothing is applied), and an inventory
// requested under the fence generation A read before the fence is dropped
// by every replica's index when it is applied after it (fenced_since),
// although A itself never committed that fence. The dead rank stays fenced
// with no L1 placement on all three replicas, which stay identical. Seen
// red with the index's generation check removed (the inventory applied,
// the rank unfenced with its 6 L1 placements on every replica) and, for the
// resync, with the term not ended at follow (A's resync still running).
func TestRaftLateInventoryAfterAnotherLeadersFence(t *testing.T) {
	rc := newRaftCluster(t, 3, nil)
	a := rc.leader()
	b := (a + 1) % 3
	ns, chunks := rc.storeFixture(6)
	r := wire.Rank{Instance: "eng", TPRank: 0}
	A := rc.nodes[a]
	events := storeBatch(r, 1, 0, ns, chunks, wire.L1).Events
	inv := inventoryOf(r, 1, uint64(len(chunks)), events)

	// The rank's inventory server holds its first reply until released.
	asked := make(chan struct{}, 1)
	release := make(chan struct{})
	srv := newInventoryServer(16)
	sub, err := connect(t, A).Subscribe(rc.subj.Inventory(r), func(m *nats.Msg) {
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
	released := false
	t.Cleanup(func() {
		if !released {
			close(release)
		}
	})

	// A starts a resync: the fence generation it reads is gen.
	ri, _ := A.idx.Rank(r)
	gen := ri.FenceGen
	A.startResync(r)
	select {
	case <-asked:
	case <-time.After(10 * time.Second):
		t.Fatal("no inventory request")
	}

	// B becomes leader and fences the dead rank.
	if err := node(A).TransferLeadership(rc.peers[b].ID, rc.peers[b].Addr); err != nil {
		t.Fatal(err)
	}
	if got := rc.leader(); got != b {
		t.Fatalf("leader %s after the transfer, want %s", rc.peers[got].ID, rc.peers[b].ID)
	}
	testutil.Eventually(t, 10*time.Second, "A's resync to end with its term", func() bool {
		A.drainMu.Lock()
		defer A.drainMu.Unlock()
		_, running := A.resyncing[r]
		return !running
	})
	if got := testutil.Metric(t, A.reg, "kvtier_coord_resyncs_total", "outcome", "abandoned"); got != 1 {
		t.Fatalf("A's resyncs_total{abandoned} = %v, want 1", got)
	}
	B := rc.nodes[b]
	B.fenceMember(deadMember(r, 1), "dead", time.Now())
	if ri, _ := B.idx.Rank(r); !ri.Fenced || ri.L1Placements != 0 || ri.FenceGen != gen+1 {
		t.Fatalf("after B's fence: %+v", ri)
	}

	// A leads again; the held inventory is released (A's request was
	// cancelled: nobody applies it), and A applies an inventory requested
	// under gen, as a resync that outlived its term would have.
	if err := node(B).TransferLeadership(rc.peers[a].ID, rc.peers[a].Addr); err != nil {
		t.Fatal(err)
	}
	if got := rc.leader(); got != a {
		t.Fatalf("leader %s after the transfer back, want %s", rc.peers[got].ID, rc.peers[a].ID)
	}
	close(release)
	released = true
	// A copy: the apply sorts the objects in place (index.ValidateInventory)
	// while the released server may still be encoding inv's.
	late := inv
	late.Objects = slices.Clone(inv.Objects)
	out, err := A.repl.applyInventory(tctx(t), late, gen)
	if err != nil {
		t.Fatal(err)
	}
	if out.Applied || out.Reason != "fenced_since" {
		t.Fatalf("late inventory on A: %+v, want dropped fenced_since", out)
	}
	rc.converged()
	for i, c := range rc.nodes {
		ri, _ := c.idx.Rank(r)
		if !ri.Fenced || ri.L1Placements != 0 || ri.FenceGen != gen+1 {
			t.Fatalf("%s after the late inventory: fenced %v, %d L1 placements, generation %d; want fenced, 0, %d",
				rc.peers[i].ID, ri.Fenced, ri.L1Placements, ri.FenceGen, gen+1)
		}
		if p, _ := c.lookup("eng", ns, chunks); p.Prefix != 0 {
			t.Fatalf("%s: lookup prefix %d after the late inventory, want 0", rc.peers[i].ID, p.Prefix)
		}
	}

	// A resync asked under the new generation (the rank came back) applies.
	A.startResync(r)
	testutil.Eventually(t, 20*time.Second, "the resync after the fence to apply", func() bool {
		ri, _ := A.idx.Rank(r)
		return !ri.Fenced && !ri.Partial && ri.L1Placements == int64(len(chunks))
	})
	rc.converged()
}
