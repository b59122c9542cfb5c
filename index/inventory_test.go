package index_test

import (
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// slicedInventory is the sliced-fence harness (rank a/0: 40 chunks in L1,
// the first 5 in L2; a/1 the same chunks in L1) with inventories applied
// 4 units a slice, and an inventory of a/0 at seq 100: the L2 copies of
// chunks 10..39 with new sums.
func slicedInventory(t *testing.T, mod func(*index.Config)) (*slicedFence, wire.Inventory) {
	f := newSlicedFence(t, "", func(c *index.Config) {
		c.InventorySlice = 4
		if mod != nil {
			mod(c)
		}
	})
	inv := wire.Inventory{Rank: wire.Rank{Instance: "a", TPRank: 0}, Incarnation: 3, Seq: 100}
	for i, c := range f.chain[10:] {
		inv.Objects = append(inv.Objects, wire.Placement{Key: dcp.Key{NS: f.ns, Chunk: c, Shard: 0}, Tier: wire.L2, Size: 200, Sum: uint64(1000 + i)})
	}
	return f, inv
}

func placementsOf(t *testing.T, ix *index.Index, r wire.Rank) []wire.Placement {
	t.Helper()
	ri, err := ix.ListRank(r)
	if err != nil {
		t.Fatal(err)
	}
	return ri.Placements
}

func sorted(ps []wire.Placement) []wire.Placement {
	ps = append([]wire.Placement(nil), ps...)
	index.SortPlacements(ps)
	return ps
}

// TestSlicedInventoryAtomicForLookups steps a sliced inventory commit by
// commit, with a batch of the rank itself (a store and a removal) and one
// of another rank arriving after the second slice: at every step the
// rank's placements as ListRank, Get and Lookup see them are its old ones,
// none (hidden), or the final ones, never a mix; the other rank's batch is
// acknowledged before the inventory finishes; the rank's batch lands on
// top of the inventory. Then a second inventory is ended by a FenceRank
// after its first slice: both return, the fence applies to the whole
// inventory. Seen failing first: with the hiding removed, ListRank showed
// a partly dropped rank after the first slice.
func TestSlicedInventoryAtomicForLookups(t *testing.T) {
	f, inv := slicedInventory(t, nil)
	r0, r1 := wire.Rank{Instance: "a", TPRank: 0}, wire.Rank{Instance: "a", TPRank: 1}
	old := placementsOf(t, f.ix.Index, r0)
	ev := wire.Batch{Rank: r0, Incarnation: 3, Events: []wire.Event{
		stored(101, wire.L1, dcp.Key{NS: f.ns, Chunk: f.chain[0], Shard: 0}, 100, 77),
		removed(102, wire.L2, dcp.Key{NS: f.ns, Chunk: f.chain[12], Shard: 0})}}
	var final []wire.Placement
	for _, p := range inv.Objects {
		if p.Key.Chunk != f.chain[12] {
			final = append(final, p)
		}
	}
	final = sorted(append(final, wire.Placement{Key: dcp.Key{NS: f.ns, Chunk: f.chain[0], Shard: 0}, Tier: wire.L1, Size: 100, Sum: 77}))
	check := func(step string, allowed ...[]wire.Placement) {
		t.Helper()
		got := placementsOf(t, f.ix.Index, r0)
		var gets []index.Holder
		for _, c := range f.chain {
			for _, h := range f.ix.Get(dcp.Key{NS: f.ns, Chunk: c, Shard: 0}) {
				if h.Rank == r0 {
					gets = append(gets, h)
				}
			}
		}
		for _, a := range allowed {
			if reflect.DeepEqual(got, a) || (len(got) == 0 && len(a) == 0) {
				if len(gets) != len(got) {
					t.Fatalf("%s: Get shows %d copies of %s, ListRank %d", step, len(gets), r0, len(got))
				}
				return
			}
		}
		t.Fatalf("%s: %s shows %d placements, neither its old %d, none, nor the final %d: a half-applied inventory",
			step, r0, len(got), len(old), len(final))
	}

	f.hold.Store(true)
	applied := make(chan index.InventoryOutcome, 1)
	go func() { applied <- mustInventory(t, f.ix.Index, inv) }()
	f.waitCommit(t, "of the first slice")
	check("first slice committed, not published", old)
	f.proceed <- struct{}{}
	f.waitCommit(t, "of the second slice")
	check("second slice committed", nil)
	if res, err := f.ix.Lookup("a", f.ns, f.chain[:5]); err != nil || res.Prefix != 0 {
		t.Fatalf("lookup during the sliced inventory: prefix %d, %v; want 0 (a/0 hidden)", res.Prefix, err)
	}
	own := make(chan index.Outcome, 1)
	other := make(chan index.Outcome, 1)
	go func() { own <- mustApply(t, f.ix.Index, ev) }()
	go func() {
		other <- mustApply(t, f.ix.Index, wire.Batch{Rank: r1, Incarnation: 3, Events: []wire.Event{
			stored(sfChunks+1, wire.L2, dcp.Key{NS: f.ns, Chunk: f.chain[0], Shard: 1}, 100, 5)}})
	}()
	f.proceed <- struct{}{}
	var out index.InventoryOutcome
	otherDone := false
	for step := 3; ; step++ {
		select {
		case <-f.commit:
			check("a later slice committed", nil, final)
			f.proceed <- struct{}{}
			continue
		case o := <-other:
			if o.Applied != 1 {
				t.Fatalf("other rank's batch: %+v", o)
			}
			otherDone = true
			continue
		case out = <-applied:
		case <-time.After(10 * time.Second):
			t.Fatal("the sliced inventory never finished")
		}
		break
	}
	if !otherDone {
		t.Fatal("the other rank's batch was acknowledged only after the whole inventory")
	}
	f.hold.Store(false)
	select {
	case f.proceed <- struct{}{}:
	default:
	}
	if o := <-own; o.Applied != 2 || o.LastSeq != 102 {
		t.Fatalf("the rank's own batch during its inventory: %+v", o)
	}
	if !out.Applied || out.Placements != 30 || out.Replaced+out.Fenced != 45 || out.LastSeq != 100 {
		t.Fatalf("inventory outcome %+v; want applied, 30 placements, 45 replaced", out)
	}
	if got := placementsOf(t, f.ix.Index, r0); !reflect.DeepEqual(got, final) {
		t.Fatalf("after the inventory and the batch: %d placements %+v\nwant %d %+v", len(got), got, len(final), final)
	}
	if ri, _ := f.ix.Rank(r0); ri.Partial || ri.LastSeq != 102 || ri.Fenced {
		t.Fatalf("rank after: %+v", ri)
	}
	mustVerify(t, f.ix.Index)

	// A second inventory, ended by a fence after its first slice.
	inv2 := inv
	inv2.Seq = 200
	f.hold.Store(true)
	go func() { applied <- mustInventory(t, f.ix.Index, inv2) }()
	f.waitCommit(t, "of the second inventory's first slice")
	fenced := make(chan int, 1)
	go func() {
		n, err := f.ix.FenceRank(ctx, r0, 3)
		if err != nil {
			t.Error(err)
		}
		fenced <- n
	}()
	f.hold.Store(false)
	f.proceed <- struct{}{}
	for range 2 {
		select {
		case out = <-applied:
			if !out.Applied {
				t.Fatalf("second inventory: %+v", out)
			}
		case n := <-fenced:
			if n != 0 {
				t.Fatalf("fence after an all-L2 inventory fenced %d", n)
			}
		case <-f.commit:
			f.proceed <- struct{}{}
		case <-time.After(10 * time.Second):
			t.Fatal("inventory or fence never returned")
		}
	}
	ri, _ := f.ix.Rank(r0)
	if !ri.Fenced || ri.Partial || ri.L2Placements != 30 || ri.L1Placements != 0 {
		t.Fatalf("after inventory then fence: %+v; want fenced, 30 L2", ri)
	}
	mustVerify(t, f.ix.Index)
}

// TestSlicedInventoryCrash: the file as it was after the second slice of a
// sliced inventory (the writer held, a copy taken; folds due after every
// commit) reopens with the rank partial: none of its placements usable,
// its batches refused with partial_rank and a resync asked, Verify clean;
// an inventory applied whole then makes it exactly that inventory, also
// after another reopen. Seen failing first: without the durable partial
// flag the copy reopened with a half-applied rank usable.
func TestSlicedInventoryCrash(t *testing.T) {
	// Slices of 30: the first drops 30 of the 40 chunks, the second the
	// rest and puts 20 of the 30 objects.
	f, inv := slicedInventory(t, func(c *index.Config) { c.CheckpointBytes = 1; c.InventorySlice = 30 })
	r0 := wire.Rank{Instance: "a", TPRank: 0}
	f.hold.Store(true)
	done := make(chan index.InventoryOutcome, 1)
	go func() { done <- mustInventory(t, f.ix.Index, inv) }()
	f.waitCommit(t, "of the first slice")
	f.proceed <- struct{}{}
	f.waitCommit(t, "of the second slice")
	crash := filepath.Join(t.TempDir(), "index.db")
	copyFile(t, f.ix.path, crash)
	f.hold.Store(false)
	f.proceed <- struct{}{}
	if out := <-done; !out.Applied {
		t.Fatalf("inventory: %+v", out)
	}

	ix2 := openTest(t, filepath.Dir(crash), nil)
	ri, ok := ix2.Rank(r0)
	if !ok || !ri.Partial || ri.L2Placements != 20 || ri.L1Placements != 0 || ri.LastSeq != 100 {
		t.Fatalf("crash copy: %+v; want the rank partial at seq 100 with 20 of the 30 L2 placements", ri)
	}
	if ps := placementsOf(t, ix2.Index, r0); len(ps) != 0 {
		t.Fatalf("crash copy shows %d placements of a half-applied inventory", len(ps))
	}
	if res, err := ix2.Lookup("a", f.ns, f.chain); err != nil || res.Prefix != 0 {
		t.Fatalf("crash copy: lookup prefix %d, %v; want 0", res.Prefix, err)
	}
	mustVerify(t, ix2.Index)
	o := mustApply(t, ix2.Index, wire.Batch{Rank: r0, Incarnation: 3, Events: []wire.Event{
		stored(ri.LastSeq+1, wire.L1, dcp.Key{NS: f.ns, Chunk: f.chain[0], Shard: 0}, 100, 1)}})
	if o.Reason != index.DropPartialRank || !o.Resync || o.Dropped != 1 {
		t.Fatalf("batch of the partial rank: %+v; want dropped (partial_rank) with a resync", o)
	}
	inv.Seq = 150
	if out := mustInventory(t, ix2.Index, inv); !out.Applied {
		t.Fatalf("whole inventory: %+v", out)
	}
	want := sorted(inv.Objects)
	if got := placementsOf(t, ix2.Index, r0); !reflect.DeepEqual(got, want) {
		t.Fatalf("after a whole inventory: %d placements, want %d", len(got), len(want))
	}
	mustVerify(t, ix2.Index)
	if err := ix2.Close(); err != nil {
		t.Fatal(err)
	}
	ix3 := openTest(t, filepath.Dir(crash), nil)
	if ri, _ := ix3.Rank(r0); ri.Partial || ri.L2Placements != 30 {
		t.Fatalf("reopened: %+v", ri)
	}
	if got := placementsOf(t, ix3.Index, r0); !reflect.DeepEqual(got, want) {
		t.Fatalf("reopened: %d placements, want %d", len(got), len(want))
	}
}
