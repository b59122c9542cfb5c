package index_test

import (
	"math"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// TestLookupSharedL2 (issue 26.1): TP4/DCP1 MLA, rank 0 of instance e1
// stores; a reader of e2 whose share group holds e1 restores e1's L2
// copies, never its L1 (even host-shared) nor its L3 copies; its own
// instance's copies come first; a fence of the holder leaves its L2 copies
// usable; a reader not given e1 finds nothing; another layout of the same
// model (another namespace, C4) never matches. Seen failing first with
// sharedL2 returning 0 (prefix 0 for e2).
func TestLookupSharedL2(t *testing.T) {
	ix := openTest(t, "", func(c *index.Config) { c.HostSharedL1 = true })
	w, _ := newWorld(t, ix.Index, mlaSpec(4, 1))
	for c := range 4 {
		w.store(rk("e1", 0), wire.L1, c, 0, 0)
	}
	for c := range 3 {
		w.store(rk("e1", 0), wire.L2, c, 0, 0)
	}
	w.store(rk("e1", 0), wire.L3, 3, 0, 0) // chunk 3: L1 and L3 only

	shared := []string{"e1"}
	look := func(inst string, shared []string) index.LookupResult {
		t.Helper()
		var res index.LookupResult
		if err := ix.LookupSharedInto(&res, inst, shared, w.ns, chunks(4)); err != nil {
			t.Fatal(err)
		}
		if len(res.Sources) != res.Prefix*len(res.Expectations) {
			t.Fatalf("%d sources for prefix %d", len(res.Sources), res.Prefix)
		}
		return res
	}
	// e2 has never stored anything: the index does not know it.
	got := look("e2", shared)
	if got.Prefix != 3 {
		t.Fatalf("e2 sharing e1: prefix %d, want 3 (e1's L1 and L3 copies are not readable from e2)", got.Prefix)
	}
	for i := range 3 {
		for j, e := range got.Expectations {
			s, h := got.Source(i, j), got.Holder(i, j)
			if s.Tier != wire.L2 || h != rk("e1", 0) || !got.FromShared(i, j) || s.Sum != sumFor(i, 0, 0, 1) {
				t.Fatalf("chunk %d reader %d: source %+v holder %s, want e1/0's L2", i, e.Rank, s, h)
			}
		}
	}
	if n := got.SharedSources(3, false); n != 3*4 {
		t.Fatalf("shared sources %d, want 12", n)
	}
	if got := look("e2", nil); got.Prefix != 0 {
		t.Fatalf("e2 not sharing: prefix %d, want 0", got.Prefix)
	}
	if got := look("e3", []string{"e4", "nobody"}); got.Prefix != 0 {
		t.Fatalf("e3 sharing other instances: prefix %d, want 0", got.Prefix)
	}
	// The reader's own instance first: e2 rank 2's own L2 copy of chunk
	// 1, and rank 1's L2 copy of chunk 2 (another rank of e2) beat e1's.
	w.store(rk("e2", 2), wire.L2, 1, 0, 0)
	w.store(rk("e2", 1), wire.L2, 2, 0, 0)
	got = look("e2", []string{"e2", "e1"}) // its own name in the list is ignored
	if got.Prefix != 3 {
		t.Fatalf("prefix %d, want 3", got.Prefix)
	}
	for i := range 3 {
		for j, e := range got.Expectations {
			want := rk("e1", 0)
			switch {
			case i == 1:
				want = rk("e2", 2)
			case i == 2:
				want = rk("e2", 1)
			}
			if h := got.Holder(i, j); h != want || got.Source(i, j).Tier != wire.L2 {
				t.Fatalf("chunk %d reader %d: holder %s %+v, want %s's L2", i, e.Rank, h, got.Source(i, j), want)
			}
		}
	}
	// The holder dies: its L1 is fenced for every reader, its L2 files
	// outlive it.
	if _, err := ix.FenceRank(ctx, rk("e1", 0), math.MaxUint64); err != nil {
		t.Fatal(err)
	}
	if got := look("e2", shared); got.Prefix != 3 || got.Holder(0, 0) != rk("e1", 0) {
		t.Fatalf("after fencing e1/0: %+v", got)
	}
	if got := lookup(t, ix.Index, "e1", w.ns, 4); got.Prefix != 4 || got.Source(3, 0).Tier != wire.L3 {
		t.Fatalf("e1 itself after its fence: %+v, want prefix 4 (L2, and its own L3 for chunk 3)", got)
	}

	// Another layout of the same model is another namespace (C4): nothing
	// e1 stored matches there, whatever the group.
	res2, err := ix.RegisterNamespace(ctx, mlaSpec(4, 2))
	if err != nil {
		t.Fatal(err)
	}
	if res2.Namespace == w.ns {
		t.Fatal("two layouts, one namespace")
	}
	var r2 index.LookupResult
	if err := ix.LookupSharedInto(&r2, "e2", shared, res2.Namespace, chunks(4)); err != nil || r2.Prefix != 0 {
		t.Fatalf("other layout: prefix %d, %v; want 0", r2.Prefix, err)
	}
	if err := ix.LookupSharedInto(&r2, "e2", make([]string, index.MaxShared+1), w.ns, chunks(4)); err == nil {
		t.Fatalf("%d shared instances accepted", index.MaxShared+1)
	}
	mustVerify(t, ix.Index)
}

// TestLookupSharedL3 (issue 26.1): with Config.SharedL3, a reader of e2
// sharing with e1 may read e1's L3 copies, after every L2 copy it could
// read (its own instance's and e1's) and after its own instance's L3
// copies; e1's L3 copies outlive a fence of their holder; without
// SharedL3 they are never planned; an instance not given e1 finds nothing.
// Seen failing first with sharedCopy ignoring l3 (prefix 1, want 4).
func TestLookupSharedL3(t *testing.T) {
	for _, on := range []bool{false, true} {
		ix := openTest(t, "", func(c *index.Config) { c.SharedL3 = on })
		w, _ := newWorld(t, ix.Index, mlaSpec(4, 1))
		for c := range 4 {
			w.store(rk("e1", 0), wire.L3, c, 0, 0)
		}
		w.store(rk("e1", 0), wire.L2, 0, 0, 0) // chunk 0: e1's L2 beats e1's L3
		w.store(rk("e2", 3), wire.L3, 2, 0, 0) // chunk 2: e2's own L3 beats e1's
		if _, err := ix.FenceRank(ctx, rk("e1", 0), math.MaxUint64); err != nil {
			t.Fatal(err)
		}
		var got index.LookupResult
		if err := ix.LookupSharedInto(&got, "e2", []string{"e1"}, w.ns, chunks(4)); err != nil {
			t.Fatal(err)
		}
		if !on {
			if got.Prefix != 1 {
				t.Fatalf("without SharedL3: prefix %d, want 1 (e1's L2 copy only)", got.Prefix)
			}
			continue
		}
		if got.Prefix != 4 {
			t.Fatalf("with SharedL3: prefix %d, want 4", got.Prefix)
		}
		for i := range 4 {
			for j, e := range got.Expectations {
				want, tier, shared := rk("e1", 0), wire.L3, true
				switch i {
				case 0:
					tier = wire.L2
				case 2:
					want, shared = rk("e2", 3), false
				}
				if s, h := got.Source(i, j), got.Holder(i, j); h != want || s.Tier != tier || got.FromShared(i, j) != shared ||
					s.Sum != sumFor(i, 0, 0, 1) {
					t.Fatalf("chunk %d reader %d: source %+v holder %s shared %v, want %s's %s", i, e.Rank, s, h,
						got.FromShared(i, j), want, tier)
				}
			}
		}
		if err := ix.LookupSharedInto(&got, "e3", []string{"e4"}, w.ns, chunks(4)); err != nil || got.Prefix != 0 {
			t.Fatalf("e3 sharing with e4: prefix %d, %v; want 0", got.Prefix, err)
		}
		mustVerify(t, ix.Index)
	}
}

// TestLookupSharedL1 (issue 26.1): with HostSharedL1 and SharedL1, a
// reader of e2 sharing with e1 may read e1's L1 copies after the L1
// copies of its own instance and before any L2 copy (its own included);
// a fence of the holder removes them (its L2 copies stay); without
// SharedL1 they are never planned. Seen failing first with sharedCopy
// ignoring l1 (chunk 1 read from e2's L2).
func TestLookupSharedL1(t *testing.T) {
	for _, on := range []bool{false, true} {
		ix := openTest(t, "", func(c *index.Config) { c.HostSharedL1, c.SharedL1 = true, on })
		w, _ := newWorld(t, ix.Index, mlaSpec(4, 1))
		for c := range 4 {
			w.store(rk("e1", 0), wire.L1, c, 0, 0)
		}
		w.store(rk("e1", 0), wire.L2, 0, 0, 0)
		w.store(rk("e1", 0), wire.L2, 3, 0, 0)
		w.store(rk("e2", 1), wire.L2, 1, 0, 0) // e2's own L2 of chunk 1
		w.store(rk("e2", 2), wire.L1, 2, 0, 0) // e2's own L1 of chunk 2
		look := func(what string, want func(i int) (wire.Rank, wire.Tier)) {
			t.Helper()
			var got index.LookupResult
			if err := ix.LookupSharedInto(&got, "e2", []string{"e1"}, w.ns, chunks(4)); err != nil {
				t.Fatal(err)
			}
			if got.Prefix != 4 {
				t.Fatalf("SharedL1 %v, %s: prefix %d, want 4", on, what, got.Prefix)
			}
			for i := range 4 {
				for j, e := range got.Expectations {
					r, tier := want(i)
					if h, s := got.Holder(i, j), got.Source(i, j); h != r || s.Tier != tier {
						t.Fatalf("SharedL1 %v, %s: chunk %d reader %d: %s's %s, want %s's %s", on, what, i, e.Rank, h, s.Tier, r, tier)
					}
				}
			}
		}
		withoutL1 := func(i int) (wire.Rank, wire.Tier) {
			switch i {
			case 1:
				return rk("e2", 1), wire.L2
			case 2:
				return rk("e2", 2), wire.L1
			}
			return rk("e1", 0), wire.L2
		}
		if !on {
			look("e1's L1 never planned", withoutL1)
			continue
		}
		look("e1's L1 before every L2", func(i int) (wire.Rank, wire.Tier) {
			if i == 2 {
				return rk("e2", 2), wire.L1
			}
			return rk("e1", 0), wire.L1
		})
		if _, err := ix.FenceRank(ctx, rk("e1", 0), math.MaxUint64); err != nil {
			t.Fatal(err)
		}
		look("e1/0 fenced", withoutL1)
		mustVerify(t, ix.Index)
	}
}
