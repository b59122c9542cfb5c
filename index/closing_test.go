package index_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
)

// TestHandOffWhileClosing: once the index's goroutine group is closed (the
// first thing Close does), the work the committer hands off (a fold's
// sort, chunk-list compactions, Verify, Dump) runs on the committer
// instead of being dropped: every call is answered, the state stays
// exact, and Close and a reopen find it whole. The committer drains its
// queue after Close in the same state; here the group alone is closed so
// that calls can still come in.
func TestHandOffWhileClosing(t *testing.T) {
	old := index.SetCompactSlack(4)
	t.Cleanup(func() { index.SetCompactSlack(old) })
	var compactions, sorts atomic.Int32
	index.SetCompactHook(func(wire.Rank) { compactions.Add(1) })
	t.Cleanup(func() { index.SetCompactHook(nil) })
	index.SetFoldSortHook(func() { sorts.Add(1) })
	t.Cleanup(func() { index.SetFoldSortHook(nil) })
	dir := t.TempDir()
	ix := openTest(t, dir, func(c *index.Config) { c.CheckpointBytes = 4 << 10 })
	var sims []*indextest.Rank
	for tp := range 2 {
		sims = append(sims, indextest.NewRank(wire.Rank{Instance: "closing", TPRank: tp}, 1, indextest.Keys(testNS, 12, 200, 1, 1), uint64(60+tp)))
	}
	if n := index.Goroutines(ix.Index); n != 2 {
		t.Fatalf("%d goroutines in the group of an idle index, want 2 (committer, writer)", n)
	}
	index.CloseGoroutines(ix.Index)
	// A hand-off dropped would leave its call unanswered: fail loudly
	// rather than wait for the test binary's timeout.
	watchdog := time.AfterFunc(30*time.Second, func() {
		panic("TestHandOffWhileClosing: a call went unanswered with the group closed")
	})
	defer watchdog.Stop()
	for i := range 200 {
		mustApply(t, ix.Index, sims[i%2].Next(20))
	}
	if compactions.Load() == 0 || sorts.Load() == 0 {
		t.Fatalf("%d compactions and %d fold sorts ran; the test needs both", compactions.Load(), sorts.Load())
	}
	agree(t, ix.Index, sims...) // Verify
	if _, err := ix.Dump(ctx); err != nil {
		t.Fatal(err)
	}
	if p := index.RankChunkProblems(ix.Index); len(p) > 0 {
		t.Fatalf("rank chunk lists: %v", p)
	}
	if n := index.Goroutines(ix.Index); n != 2 {
		t.Fatalf("%d goroutines in the closed group, want the committer and the writer alone", n)
	}
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	agree(t, openTest(t, dir, nil).Index, sims...)
}
