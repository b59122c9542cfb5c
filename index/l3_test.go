package index_test

import (
	"math"
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestLookupL3LastResort: TP2 GQA. An L3 copy (the instance's bucket)
// serves any rank of its instance, but only where neither the reader's L1
// nor an L2 copy exists (L1 > L2 > L3); it survives a fence of its writer
// and serves no other instance.
func TestLookupL3LastResort(t *testing.T) {
	ix := openTest(t, "", nil)
	w, _ := newWorld(t, ix.Index, gqaSpec(2))
	for c := range 3 {
		for r := range 2 {
			for g := range 2 {
				w.store(rk("e", r), wire.L3, c, r, g)
			}
		}
	}
	got := lookup(t, ix.Index, "e", w.ns, 3)
	if got.Prefix != 3 {
		t.Fatalf("L3 only: prefix %d, want 3", got.Prefix)
	}
	for i := range 3 {
		for j := range got.Expectations {
			if s := got.Source(i, j); s.Tier != wire.L3 {
				t.Fatalf("chunk %d exp %d: source tier %s, want L3", i, j, s.Tier)
			}
		}
	}
	if got := lookup(t, ix.Index, "other", w.ns, 3); got.Prefix != 0 {
		t.Fatalf("another instance reads e's L3: prefix %d", got.Prefix)
	}
	// Rank 0 also holds chunk 0 in L2 and chunk 1 in L1: each preferred.
	w.store(rk("e", 0), wire.L2, 0, 0, 0)
	w.store(rk("e", 0), wire.L1, 1, 0, 0)
	got = lookup(t, ix.Index, "e", w.ns, 3)
	want := map[int]wire.Tier{0: wire.L2, 1: wire.L1, 2: wire.L3}
	for i, tier := range want {
		for j, e := range got.Expectations {
			if e.Rank != 0 || e.Group != 0 {
				continue
			}
			if s := got.Source(i, j); s.Tier != tier {
				t.Fatalf("chunk %d rank 0 group 0: source %s, want %s", i, s.Tier, tier)
			}
		}
	}
	// A dead rank's L3 copies still serve (the bucket outlives the rank).
	if _, err := ix.FenceRank(ctx, rk("e", 1), math.MaxUint64); err != nil {
		t.Fatal(err)
	}
	if got := lookup(t, ix.Index, "e", w.ns, 3); got.Prefix != 3 {
		t.Fatalf("after fencing rank 1: prefix %d, want 3", got.Prefix)
	}
	// A removal of an L3 copy ends the prefix there.
	w.event(rk("e", 0), wire.Removed, wire.L3, 1, 0, 1)
	if got := lookup(t, ix.Index, "e", w.ns, 3); got.Prefix != 1 {
		t.Fatalf("after removing chunk 1's L3 copy: prefix %d, want 1", got.Prefix)
	}
	mustVerify(t, ix.Index)
}

// TestLookupL3TPReaders: TP4/DCP1 MLA. Rank 0's L3 copy serves all four
// readers, and another rank's L2 copy is preferred to the reader's own L3
// copy.
func TestLookupL3TPReaders(t *testing.T) {
	ix := openTest(t, "", nil)
	w, _ := newWorld(t, ix.Index, mlaSpec(4, 1))
	w.store(rk("e", 0), wire.L3, 0, 0, 0)
	w.store(rk("e", 0), wire.L3, 1, 0, 0)
	got := lookup(t, ix.Index, "e", w.ns, 2)
	if got.Prefix != 2 {
		t.Fatalf("prefix %d, want 2 (every TP reader reads rank 0's L3 copy)", got.Prefix)
	}
	for i := range 2 {
		for j := range got.Expectations {
			if s := got.Source(i, j); s.Tier != wire.L3 || got.Holder(i, j) != rk("e", 0) {
				t.Fatalf("chunk %d exp %d: %+v from %s, want L3 of e/0", i, j, s, got.Holder(i, j))
			}
		}
	}
	// Rank 1 holds chunk 1 in L3 too and rank 2 in L2: the L2 copy wins
	// for every reader but rank 0 ... which also takes it (its own copy is
	// only L3).
	w.store(rk("e", 1), wire.L3, 1, 0, 0)
	w.store(rk("e", 2), wire.L2, 1, 0, 0)
	got = lookup(t, ix.Index, "e", w.ns, 2)
	for j := range got.Expectations {
		if s := got.Source(1, j); s.Tier != wire.L2 || got.Holder(1, j) != rk("e", 2) {
			t.Fatalf("chunk 1 exp %d: %+v from %s, want L2 of e/2", j, s, got.Holder(1, j))
		}
	}
	mustVerify(t, ix.Index)
}
