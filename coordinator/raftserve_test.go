package coordinator

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestRaftNewLeaderServesAfterItsIndexCommitted (issue 29.5): raft's
// barrier returns once a new leader's state machine has queued every entry
// into its index, not once the index committed them. A follower whose
// committer is held back has queued a fence it has not committed when it
// becomes leader; it must not serve lookups (or restores) until its index
// holds the fence, or its first plans name the fenced rank's L1 copies.
// Seen red with the node's index sync after the barrier removed: the new
// leader served with the fence still queued and its lookup covered all 6
// chunks through the fenced rank.
func TestRaftNewLeaderServesAfterItsIndexCommitted(t *testing.T) {
	var held sync.Map // raft id -> *atomic.Bool: commits held back
	gate := make(chan struct{})
	rc := newRaftCluster(t, 3, func(c *Config) {
		h := new(atomic.Bool)
		held.Store(c.Raft.ID, h)
		c.indexAfterCommit = func() {
			if h.Load() {
				<-gate
			}
		}
	})
	opened := false
	open := func() {
		if !opened {
			opened = true
			close(gate)
		}
	}
	t.Cleanup(open)
	l := rc.leader()
	b := (l + 1) % 3
	ns, chunks := rc.storeFixture(6)
	rc.converged()
	L, B := rc.nodes[l], rc.nodes[b]
	hb, _ := held.Load(rc.peers[b].ID)
	hb.(*atomic.Bool).Store(true)

	r := wire.Rank{Instance: "eng", TPRank: 0}
	if n, err := L.repl.fenceRank(tctx(t), r, 1); err != nil || n != 6 {
		t.Fatalf("fence: %d %v", n, err)
	}
	want := node(L).FSMLast()
	testutil.Eventually(t, 10*time.Second, "B's state machine to queue the fence", func() bool {
		return node(B).FSMLast() >= want
	})
	if ri, _ := B.idx.Rank(r); ri.Fenced {
		t.Fatal("B's index committed the fence although its commits are held back: the test sees no window")
	}

	if err := node(L).TransferLeadership(rc.peers[b].ID, rc.peers[b].Addr); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "raft to make B leader", func() bool { return node(B).IsLeader() })
	// Held back, B's index cannot commit the fence: B must not serve.
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if serving(B) {
			p, _ := B.lookup("eng", ns, chunks)
			ri, _ := B.idx.Rank(r)
			t.Fatalf("B serves with the fence only queued in its index: rank %s fenced %v, lookup prefix %d of %d",
				r, ri.Fenced, p.Prefix, len(chunks))
		}
	}
	open()
	if got := rc.leader(); got != b {
		t.Fatalf("leader %s once B's index committed, want %s", rc.peers[got].ID, rc.peers[b].ID)
	}
	if ri, _ := B.idx.Rank(r); !ri.Fenced || ri.L1Placements != 0 {
		t.Fatalf("B serving: rank %s fenced %v with %d L1 placements; want fenced, 0", r, ri.Fenced, ri.L1Placements)
	}
	if p, _ := B.lookup("eng", ns, chunks); p.Prefix != 0 {
		t.Fatalf("B serving: lookup prefix %d, want 0 (the fenced rank's copies)", p.Prefix)
	}
	rc.converged()
}
