package coordinator

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// heldFSM holds a raft node's state machine (Config.raftBeforeApply)
// while held is set, until release.
type heldFSM struct {
	held    atomic.Bool
	entered atomic.Int64 // batches that reached the hook while held
	gate    chan struct{}
	once    sync.Once
}

func newHeldFSM(t *testing.T) *heldFSM {
	h := &heldFSM{gate: make(chan struct{})}
	t.Cleanup(h.release)
	return h
}

func (h *heldFSM) hook() {
	if h.held.Load() {
		h.entered.Add(1)
		<-h.gate
	}
}

func (h *heldFSM) release() { h.once.Do(func() { close(h.gate) }) }

// TestRaftShutdownAnswersQueuedProposals holds a one-node cluster's raft
// state machine while fences are proposed one after another, so that
// their committed entries queue in raft's channel to the state machine,
// then shuts the coordinator down and releases the state machine. Raft
// drops what is still queued at its shutdown without answering the
// futures; every fence must still return (an error is fine: the entry may
// or may not have been applied), and Shutdown too. Seen red without
// Node.await: fences waited forever on futures raft never answered (CI's
// 20-minute hang of stop 52 was the leadership loop's barrier, Shutdown
// waiting for that loop).
func TestRaftShutdownAnswersQueuedProposals(t *testing.T) {
	h := newHeldFSM(t)
	rc := newRaftCluster(t, 1, func(c *Config) { c.raftBeforeApply = h.hook })
	L := rc.nodes[rc.leader()]
	h.held.Store(true)

	const fences = 24
	done := make(chan error, fences)
	for i := range fences {
		go func() {
			_, err := node(L).FenceRank(tctx(t), wire.Rank{Instance: "eng", TPRank: i}, 1)
			done <- err
		}()
		if i == 0 {
			testutil.Eventually(t, 10*time.Second, "the state machine to hold the first fence", func() bool { return h.entered.Load() > 0 })
		} else {
			// Each its own commit, so that several batches queue.
			time.Sleep(10 * time.Millisecond)
		}
	}
	time.Sleep(100 * time.Millisecond)

	shut := make(chan struct{})
	go func() {
		rc.stop(rc.leader())
		close(shut)
	}()
	time.Sleep(200 * time.Millisecond) // raft's shutdown begins and waits for its state machine
	h.release()

	deadline := time.After(30 * time.Second)
	applied := 0
	for range fences {
		select {
		case err := <-done:
			if err == nil {
				applied++
			}
		case <-deadline:
			t.Fatalf("fences still waiting 30 s after the shutdown (%d of %d returned): a future raft dropped is waited on forever", applied, fences)
		}
	}
	select {
	case <-shut:
	case <-deadline:
		t.Fatal("Shutdown did not return in 30 s")
	}
	t.Logf("%d of %d fences applied before the shutdown", applied, fences)
}

// TestRaftShutdownWhileTheLeaderBarrierWaits restarts a one-node cluster
// whose log holds many entries with its state machine held: raft replays
// them in batches that queue ahead of the barrier the new leadership's
// loop waits on, and the coordinator is shut down meanwhile. Raft drops
// what is still queued, the barrier with it; Shutdown waits for that loop
// and must return all the same. Seen red without Node.await (the
// barrier waited on alone): Shutdown hung, the loop parked in
// gainLeadership's barrier (CI's 20-minute hang of stop 52).
func TestRaftShutdownWhileTheLeaderBarrierWaits(t *testing.T) {
	h := newHeldFSM(t)
	rc := newRaftCluster(t, 1, func(c *Config) {
		// Small batches: the replay queues many, each a chance for raft's
		// shutdown to drop the ones behind it, the barrier's included.
		c.Raft.MaxAppendEntries = 4
		c.raftBeforeApply = h.hook
	})
	L := rc.nodes[rc.leader()]
	// Entries one at a time, so that the replay has many to apply.
	for i := range 200 {
		if _, err := node(L).FenceRank(tctx(t), wire.Rank{Instance: "eng", TPRank: i % 64}, uint64(i+1)); err != nil {
			t.Fatalf("fence %d: %v", i, err)
		}
	}
	rc.stop(0)
	h.held.Store(true)
	c := rc.start(0)
	testutil.Eventually(t, 20*time.Second, "the replay to reach the held state machine", func() bool { return h.entered.Load() > 0 })
	time.Sleep(300 * time.Millisecond) // the leadership loop's barrier queues behind the replay

	shut := make(chan struct{})
	go func() {
		c.Shutdown()
		close(shut)
	}()
	time.Sleep(200 * time.Millisecond) // raft's shutdown begins and waits for its state machine
	h.release()
	select {
	case <-shut:
	case <-time.After(30 * time.Second):
		t.Fatal("Shutdown did not return in 30 s: the leadership loop waits on a barrier raft dropped")
	}
	t.Logf("state machine batches: %d", h.entered.Load())
	rc.nodes[0] = nil
}
