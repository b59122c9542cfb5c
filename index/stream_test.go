package index_test

import (
	"bytes"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// streamOf is a streamed inventory of rank "a"/0 of newSlicedFence's index
// at incarnation 3, sequence 45 (its last): chunk 0 in L1 with a new sum
// and chunks 10..39 in L2, cut into pages of 10 objects (the last one
// shorter).
func streamOf(f *slicedFence) (head index.InventoryStep, pages [][]wire.Placement, all []wire.Placement) {
	r0 := wire.Rank{Instance: "a", TPRank: 0}
	all = append(all, wire.Placement{Key: dcp.Key{NS: f.ns, Chunk: f.chain[0]}, Tier: wire.L1, Size: 100, Sum: 777})
	for i, c := range f.chain[10:] {
		all = append(all, wire.Placement{Key: dcp.Key{NS: f.ns, Chunk: c}, Tier: wire.L2, Size: 200, Sum: uint64(1000 + i)})
	}
	for lo := 0; lo < len(all); lo += 10 {
		pages = append(pages, slices.Clone(all[lo:min(lo+10, len(all))]))
	}
	return index.InventoryStep{Rank: r0, Incarnation: 3, Seq: 45}, pages, sorted(all)
}

func mustStep(t *testing.T, ix *index.Index, s index.InventoryStep) index.InventoryOutcome {
	t.Helper()
	o, err := ix.ApplyInventoryStep(ctx, s)
	if err != nil {
		t.Fatalf("step %d of %s: %v", s.Kind, s.Rank, err)
	}
	return o
}

// hiddenWhole checks that nothing of rank "a"/0 is visible to Get or
// ListRank and that it is partial.
func hiddenWhole(t *testing.T, f *slicedFence, when string) {
	t.Helper()
	r0 := wire.Rank{Instance: "a", TPRank: 0}
	if ps := placementsOf(t, f.ix.Index, r0); len(ps) != 0 {
		t.Fatalf("%s: ListRank shows %d placements of the rank, want none (hidden)", when, len(ps))
	}
	for _, c := range f.chain {
		for _, h := range f.ix.Get(dcp.Key{NS: f.ns, Chunk: c, Shard: 0}) {
			if h.Rank == r0 {
				t.Fatalf("%s: Get shows %+v", when, h)
			}
		}
	}
	if ri, _ := f.ix.Rank(r0); !ri.Partial {
		t.Fatalf("%s: %+v, want partial", when, ri)
	}
}

// TestStreamedInventoryExact: Begin, three pages and End leave rank "a"/0
// with exactly the pages' placements (its old ones gone, whether listed
// again or not), hidden whole in between, its batches refused meanwhile;
// the other rank is untouched; it survives a reopen and Verify. Run with
// Begin's drop sliced (4 chunks a commit of the rank's 40) and in one
// piece. Seen red with Begin's drop removed (the old L1 placements of
// chunks 1..9 stayed: "rank has extra") and with one page's puts skipped
// (the index lacked its 10 objects).
func TestStreamedInventoryExact(t *testing.T) {
	for _, tc := range []struct {
		name  string
		slice int
	}{{"sliced", 4}, {"one_piece", 1000}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			f := newSlicedFence(t, dir, func(c *index.Config) { c.InventorySlice = tc.slice })
			r0, r1 := wire.Rank{Instance: "a", TPRank: 0}, wire.Rank{Instance: "a", TPRank: 1}
			other := placementsOf(t, f.ix.Index, r1)
			commits := f.commits.Load()
			head, pages, want := streamOf(f)
			gen := head
			gen.Kind, gen.Checked = index.StepBegin, true
			o := mustStep(t, f.ix.Index, gen)
			if o.Applied || o.Reason != "" || o.Replaced != 45 || o.Fenced != 0 {
				t.Fatalf("begin: %+v, want 45 replaced", o)
			}
			if n := f.commits.Load() - commits; tc.slice == 4 && n < 10 {
				t.Fatalf("begin took %d commits, want >= 10 (40 chunks, 4 a slice)", n)
			}
			hiddenWhole(t, f, "after begin")
			b := wire.Batch{Rank: r0, Incarnation: 3, Events: []wire.Event{stored(46, wire.L1, dcp.Key{NS: f.ns, Chunk: f.chain[3]}, 100, 5)}}
			if out := mustApply(t, f.ix.Index, b); out.Applied != 0 || out.Reason != index.DropPartialRank || !out.Resync {
				t.Fatalf("the rank's batch mid-stream: %+v, want refused partial_rank with a resync", out)
			}
			n := 0
			for i, p := range pages {
				s := head
				s.Kind, s.FenceGen, s.Objects = index.StepPage, o.FenceGen, p
				if po := mustStep(t, f.ix.Index, s); po.Reason != "" || po.Placements != len(p) {
					t.Fatalf("page %d: %+v", i, po)
				}
				n += len(p)
				hiddenWhole(t, f, "after a page")
			}
			end := head
			end.Kind, end.FenceGen, end.Placements = index.StepEnd, o.FenceGen, n
			if eo := mustStep(t, f.ix.Index, end); !eo.Applied || eo.Placements != len(want) || eo.LastSeq != 45 {
				t.Fatalf("end: %+v", eo)
			}
			check := func(ix *index.Index, when string) {
				t.Helper()
				if got := placementsOf(t, ix, r0); !slices.Equal(got, want) {
					t.Fatalf("%s: the rank holds %d placements, want the pages' %d: %s", when, len(got), len(want), firstDiff(want, got))
				}
				if got := placementsOf(t, ix, r1); !slices.Equal(got, other) {
					t.Fatalf("%s: the other rank changed: %s", when, firstDiff(other, got))
				}
				if ri, _ := ix.Rank(r0); ri.Partial || ri.Fenced || ri.LastSeq != 45 || ri.Incarnation != 3 {
					t.Fatalf("%s: %+v", when, ri)
				}
				if hs := ix.Get(dcp.Key{NS: f.ns, Chunk: f.chain[0]}); !slices.ContainsFunc(hs, func(h index.Holder) bool { return h.Rank == r0 && h.Sum == 777 }) {
					t.Fatalf("%s: Get of chunk 0 shows %+v, want rank 0's new L1 copy", when, hs)
				}
				mustVerify(t, ix)
			}
			check(f.ix.Index, "after end")
			if err := f.ix.Close(); err != nil {
				t.Fatal(err)
			}
			check(openTest(t, dir, nil).Index, "reopened")
		})
	}
}

// TestStreamedInventorySuperseded: a fence between two pages ends the
// stream (its later steps are dropped as inventory_gone), leaving the rank
// hidden and refusing batches, also after a reopen (the stream is never
// ended); a new stream under the new generation applies whole. Seen red
// with the steps' generation check removed (the page after the fence was
// applied).
func TestStreamedInventorySuperseded(t *testing.T) {
	dir := t.TempDir()
	f := newSlicedFence(t, dir, nil)
	r0 := wire.Rank{Instance: "a", TPRank: 0}
	head, pages, want := streamOf(f)
	begin := head
	begin.Kind, begin.Checked = index.StepBegin, true
	o := mustStep(t, f.ix.Index, begin)
	page := func(ix *index.Index, gen uint64, p []wire.Placement) index.InventoryOutcome {
		s := head
		s.Kind, s.FenceGen, s.Objects = index.StepPage, gen, slices.Clone(p)
		return mustStep(t, ix, s)
	}
	if po := page(f.ix.Index, o.FenceGen, pages[0]); po.Reason != "" {
		t.Fatalf("page 0: %+v", po)
	}
	if _, err := f.ix.FenceRank(ctx, r0, 3); err != nil {
		t.Fatal(err)
	}
	if po := page(f.ix.Index, o.FenceGen, pages[1]); po.Reason != index.DropInventoryGone {
		t.Fatalf("page after a fence: %+v, want inventory_gone", po)
	}
	end := head
	end.Kind, end.FenceGen = index.StepEnd, o.FenceGen
	if eo := mustStep(t, f.ix.Index, end); eo.Applied || eo.Reason != index.DropInventoryGone {
		t.Fatalf("end after a fence: %+v, want inventory_gone", eo)
	}
	hiddenWhole(t, f, "after the superseded stream")
	if err := f.ix.Close(); err != nil {
		t.Fatal(err)
	}
	f.ix = openTest(t, dir, nil)
	hiddenWhole(t, f, "reopened")
	b := wire.Batch{Rank: r0, Incarnation: 3, Events: []wire.Event{stored(46, wire.L1, dcp.Key{NS: f.ns, Chunk: f.chain[3]}, 100, 5)}}
	if out := mustApply(t, f.ix.Index, b); out.Reason != index.DropPartialRank || !out.Resync {
		t.Fatalf("batch of the abandoned rank: %+v, want partial_rank", out)
	}
	// An inventory requested under the old generation is dropped; one
	// under the current one applies.
	if bo := mustStep(t, f.ix.Index, begin); bo.Reason != index.DropFencedSince {
		t.Fatalf("begin under the old generation: %+v, want fenced_since", bo)
	}
	ri, _ := f.ix.Rank(r0)
	begin.FenceGen = ri.FenceGen
	o = mustStep(t, f.ix.Index, begin)
	for _, p := range pages {
		page(f.ix.Index, o.FenceGen, p)
	}
	end.FenceGen = o.FenceGen
	if eo := mustStep(t, f.ix.Index, end); !eo.Applied {
		t.Fatalf("end: %+v", eo)
	}
	if got := placementsOf(t, f.ix.Index, r0); !slices.Equal(got, want) {
		t.Fatalf("after the second stream: %s", firstDiff(want, got))
	}
	mustVerify(t, f.ix.Index)
}

// TestStreamedInventoryReplicated: the steps as raft entries, with another
// rank's batch between two pages, give byte-identical indexes whether
// Begin's drop is sliced or not, and a snapshot taken mid-stream, restored
// into a fresh index that then applies the rest of the entries, gives the
// same index again: nothing of a stream lives only in memory.
func TestStreamedInventoryReplicated(t *testing.T) {
	r, r2 := wire.Rank{Instance: "i0", TPRank: 0}, wire.Rank{Instance: "i1", TPRank: 0}
	var fill wire.Batch
	fill = wire.Batch{Rank: r, Incarnation: 1}
	for i := range 30 {
		fill.Events = append(fill.Events, stored(uint64(i+1), wire.L1, key(uint64(i), 0, 0), 100, uint64(i+1)))
	}
	ops := []index.Op{{Batch: &fill}}
	step := func(kind index.StepKind, objs []wire.Placement, n int) index.Op {
		return index.Op{Step: &index.InventoryStep{Kind: kind, Rank: r, Incarnation: 2, Seq: 7, Objects: objs, Placements: n}}
	}
	ops = append(ops, step(index.StepBegin, nil, 0))
	var page1, page2 []wire.Placement
	for i := range 10 {
		page1 = append(page1, wire.Placement{Key: key(uint64(i), 0, 0), Tier: wire.L2, Size: 100, Sum: uint64(50 + i)})
		page2 = append(page2, wire.Placement{Key: key(uint64(40+i), 0, 0), Tier: wire.L1, Size: 100, Sum: uint64(90 + i)})
	}
	ops = append(ops, step(index.StepPage, page1, 0),
		index.Op{Batch: &wire.Batch{Rank: r2, Incarnation: 1, Events: []wire.Event{stored(1, wire.L1, key(3, 0, 0), 100, 3)}}},
		step(index.StepPage, page2, 0), step(index.StepEnd, nil, 20))
	const mid = 3 // entries before the snapshot: the fill, Begin, page 1

	a := openTest(t, "", func(c *index.Config) { c.InventorySlice = 4 })
	b := openTest(t, "", nil)
	for _, ix := range []*index.Index{a.Index, b.Index} {
		for i, res := range applyOps(t, ix, ops[:mid], 1) {
			if res.Err != nil || res.Inventory.Reason != "" {
				t.Fatalf("entry %d: %+v", i+1, res)
			}
		}
	}
	snap, err := a.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var stream bytes.Buffer
	if _, err := snap.WriteTo(&stream); err != nil {
		t.Fatal(err)
	}
	snap.Release()
	c := openTest(t, "", nil)
	if ok, err := c.Restore(ctx, &stream); !ok || err != nil {
		t.Fatalf("restore: %v %v", ok, err)
	}
	for _, ix := range []*index.Index{a.Index, b.Index, c.Index} {
		res := applyOps(t, ix, ops[mid:], mid+1)
		if last := res[len(res)-1]; last.Err != nil || !last.Inventory.Applied || last.Inventory.Placements != 20 {
			t.Fatalf("end: %+v", last)
		}
	}
	want := mustDump(t, a.Index)
	for name, ix := range map[string]*index.Index{"one piece": b.Index, "restored mid-stream": c.Index} {
		if got := mustDump(t, ix); !bytes.Equal(got.Bytes, want.Bytes) || got.RaftIndex != want.RaftIndex {
			t.Fatalf("%s: dump differs (%d B, raft index %d; want %d B, %d)", name, len(got.Bytes), got.RaftIndex,
				len(want.Bytes), want.RaftIndex)
		}
		mustVerify(t, ix)
	}
	if got := placementsOf(t, a.Index, r); len(got) != 20 {
		t.Fatalf("the rank holds %d placements, want the pages' 20", len(got))
	}
}
