package index_test

import (
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// TestLookupHostSharedL1 (issue 15.1): TP4/DCP1 MLA with HostSharedL1.
// Rank 0's L1 copy now serves ranks 1..3 too, preferred over any L2
// copy; a reader's own L1 still comes first; another instance never reads
// it, and a fenced holder's L1 serves no one (the other ranks' copies do). Seen failing first with the
// peer L1 score off (prefix 1: ranks 1..3 had only chunk 0's L2 copy).
func TestLookupHostSharedL1(t *testing.T) {
	ix := openTest(t, "", func(c *index.Config) { c.HostSharedL1 = true })
	w, _ := newWorld(t, ix.Index, mlaSpec(4, 1))
	for c := range 3 {
		w.store(rk("e1", 0), wire.L1, c, 0, 0)
	}
	w.store(rk("e1", 0), wire.L2, 0, 0, 0) // chunk 0 also in L2
	w.store(rk("e1", 2), wire.L1, 1, 0, 0) // rank 2 holds chunk 1 itself
	w.store(rk("e1", 3), wire.L1, 2, 0, 0) // and rank 3 chunk 2: rank 1 prefers rank 0's
	got := lookup(t, ix.Index, "e1", w.ns, 3)
	if got.Prefix != 3 {
		t.Fatalf("prefix %d, want 3 (ranks 1..3 read rank 0's L1)", got.Prefix)
	}
	for i := range 3 {
		for j, e := range got.Expectations {
			s, h := got.Source(i, j), got.Holder(i, j)
			want := rk("e1", 0)
			if (i == 1 && e.Rank == 2) || (i == 2 && e.Rank == 3) {
				want = rk("e1", e.Rank) // its own L1 first
			}
			if s.Tier != wire.L1 || h != want || s.Sum != sumFor(i, 0, 0, wire.L1) {
				t.Fatalf("chunk %d reader %d: source %+v holder %s, want L1 of %s", i, e.Rank, s, h, want)
			}
		}
	}
	if got := lookup(t, ix.Index, "e2", w.ns, 3); got.Prefix != 0 {
		t.Fatalf("another instance: prefix %d, want 0", got.Prefix)
	}
	if _, err := ix.FenceRank(ctx, rk("e1", 0), math.MaxUint64); err != nil {
		t.Fatal(err)
	}
	got = lookup(t, ix.Index, "e1", w.ns, 3)
	// Chunk 0: its L2 copy; chunks 1 and 2: the L1 of ranks 2 and 3.
	if got.Prefix != 3 || got.Source(0, 1).Tier != wire.L2 || got.Source(1, 1).Tier != wire.L1 || got.Holder(1, 1) != rk("e1", 2) ||
		got.Holder(2, 0) != rk("e1", 3) || got.Source(2, 0).Tier != wire.L1 {
		t.Fatalf("after fencing rank 0: %+v", got)
	}
	mustVerify(t, ix.Index)
}

// TestLookupHostSharedL1NeverPlansAFencedHolder (tiers4.4): a rank killed
// -9 leaves its host-shared L1 segment behind; once it is fenced, no
// lookup may send a peer to it. With HostSharedL1, TP2 MLA, rank 0
// holding 12 chunks in L1 (the first 3 also in L2): while its sliced
// fence is half done (the first slice committed, the rest held), and after
// it, rank 1 is never planned to read rank 0's L1; only the L2 copies
// serve (prefix 3). Seen failing with the lookup's conservative switch off
// (hostL1 left on while a reader is being fenced): mid-fence, rank 1 was
// planned from rank 0's L1 (chunk 2 first).
func TestLookupHostSharedL1NeverPlansAFencedHolder(t *testing.T) {
	var hold atomic.Bool
	commit, proceed, stop := make(chan struct{}), make(chan struct{}), make(chan struct{})
	ix := openTest(t, "", func(c *index.Config) {
		c.HostSharedL1, c.FenceSliceChunks = true, 2
		c.AfterCommit = func() {
			if !hold.Load() {
				return
			}
			select {
			case commit <- struct{}{}:
			case <-stop:
				return
			}
			select {
			case <-proceed:
			case <-stop:
			}
		}
	})
	t.Cleanup(func() { close(stop) })
	w, _ := newWorld(t, ix.Index, mlaSpec(2, 1))
	const n = 12
	for c := range n {
		w.store(rk("e1", 0), wire.L1, c, 0, 0)
	}
	for c := range 3 {
		w.store(rk("e1", 0), wire.L2, c, 0, 0)
	}
	if got := lookup(t, ix.Index, "e1", w.ns, n); got.Prefix != n || got.Holder(n-1, 1) != rk("e1", 0) || got.Source(n-1, 1).Tier != wire.L1 {
		t.Fatalf("before the fence: %+v, want rank 1 reading rank 0's L1 for %d chunks", got, n)
	}
	noPeerL1 := func(what string) {
		t.Helper()
		got := lookup(t, ix.Index, "e1", w.ns, n)
		if got.Prefix != 3 {
			t.Fatalf("%s: prefix %d, want 3 (the L2 copies only)", what, got.Prefix)
		}
		for i := range got.Prefix {
			for j := range got.Expectations {
				if s := got.Source(i, j); s.Tier == wire.L1 {
					t.Fatalf("%s: chunk %d reader %d planned from the L1 of %s", what, i, got.Expectations[j].Rank, got.Holder(i, j))
				}
			}
		}
	}
	hold.Store(true)
	fenced := make(chan error, 1)
	go func() {
		_, err := ix.FenceRank(ctx, rk("e1", 0), math.MaxUint64)
		fenced <- err
	}()
	for i := range 2 { // the second slice is committed once the first is published
		select {
		case <-commit:
		case <-time.After(10 * time.Second):
			t.Fatalf("no commit of fence slice %d", i+1)
		}
		if i == 0 {
			proceed <- struct{}{}
		}
	}
	noPeerL1("mid-fence (2 of 6 slices)")
	hold.Store(false)
	close(proceed)
	if err := <-fenced; err != nil {
		t.Fatal(err)
	}
	noPeerL1("after the fence")
	mustVerify(t, ix.Index)
}
