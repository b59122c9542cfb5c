package index_test

import (
	"math"
	"testing"

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
