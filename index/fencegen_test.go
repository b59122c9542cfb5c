package index_test

import (
	"math"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestInventoryFencedSince (issue 29.1): an inventory requested before a
// fence and applied after it is dropped (fenced_since): the dead rank
// stays fenced, its L1 copies stay gone. The fence generation survives a
// reopen, moves with every fence (sliced or not, of a fenced rank too)
// and never with an inventory or a new incarnation; an inventory of a newer
// incarnation supersedes the fence whatever the generation. Each slicing
// (one-shot, sliced fence, sliced inventory) is checked.
func TestInventoryFencedSince(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*index.Config)
	}{
		{"one-shot", nil},
		{"sliced fence", func(c *index.Config) { c.FenceSliceChunks = 2 }},
		{"sliced inventory", func(c *index.Config) { c.InventorySlice = 2 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			ix := openTest(t, dir, tc.mod)
			r := wire.Rank{Instance: "eng-a", TPRank: 0}
			const chunks = 8
			var evs []wire.Event
			var objs []wire.Placement
			for c := range chunks {
				k := key(uint64(c), 0, 0)
				evs = append(evs, stored(uint64(2*c+1), wire.L1, k, 100, 7), stored(uint64(2*c+2), wire.L2, k, 100, 7))
				objs = append(objs, wire.Placement{Key: k, Tier: wire.L1, Size: 100, Sum: 7},
					wire.Placement{Key: k, Tier: wire.L2, Size: 100, Sum: 7})
			}
			mustApply(t, ix.Index, wire.Batch{Rank: r, Incarnation: 3, Events: evs})
			inv := wire.Inventory{Rank: r, Incarnation: 3, Seq: 2 * chunks, Objects: objs}
			info := func() index.RankInfo {
				t.Helper()
				ri, ok := ix.Rank(r)
				if !ok {
					t.Fatalf("rank %s unknown", r)
				}
				return ri
			}

			// The resync reads the generation, then asks for the inventory;
			// the rank is declared dead and fenced before it is applied.
			gen := info().FenceGen
			if n, err := ix.FenceRank(ctx, r, math.MaxUint64); err != nil || n != chunks {
				t.Fatalf("fence: %d %v", n, err)
			}
			o, err := ix.ApplyInventoryAt(ctx, inv, gen)
			if err != nil {
				t.Fatal(err)
			}
			if o.Applied || o.Reason != index.DropFencedSince || o.FenceGen != gen+1 {
				t.Fatalf("inventory requested at generation %d after a fence: %+v, want dropped fenced_since at %d", gen, o, gen+1)
			}
			ri := info()
			if !ri.Fenced || ri.L1Placements != 0 || ri.FenceGen != gen+1 {
				t.Fatalf("after the late inventory: fenced %v, %d L1 placements, generation %d; want fenced, 0, %d",
					ri.Fenced, ri.L1Placements, ri.FenceGen, gen+1)
			}
			mustVerify(t, ix.Index)

			// A second fence of the fenced rank moves it again.
			if _, err := ix.FenceRank(ctx, r, math.MaxUint64); err != nil {
				t.Fatal(err)
			}
			if g := info().FenceGen; g != gen+2 {
				t.Fatalf("generation %d after a second fence, want %d", g, gen+2)
			}
			if o, err := ix.ApplyInventoryAt(ctx, inv, gen+1); err != nil || o.Reason != index.DropFencedSince {
				t.Fatalf("inventory at generation %d after the second fence: %+v %v", gen+1, o, err)
			}

			// Durable: a reopen has the same generation and still drops it.
			if err := ix.Close(); err != nil {
				t.Fatal(err)
			}
			ix = openTest(t, dir, tc.mod)
			if ri := info(); ri.FenceGen != gen+2 || !ri.Fenced {
				t.Fatalf("after reopen: generation %d fenced %v, want %d fenced", ri.FenceGen, ri.Fenced, gen+2)
			}
			if o, err := ix.ApplyInventoryAt(ctx, inv, gen); err != nil || o.Reason != index.DropFencedSince {
				t.Fatalf("late inventory after reopen: %+v %v", o, err)
			}
			if ri := info(); !ri.Fenced || ri.L1Placements != 0 {
				t.Fatalf("after reopen and the late inventory: fenced %v, %d L1", ri.Fenced, ri.L1Placements)
			}

			// An inventory requested under the current generation applies
			// and clears the fence, keeping the generation.
			if o, err := ix.ApplyInventoryAt(ctx, inv, gen+2); err != nil || !o.Applied || o.FenceGen != gen+2 {
				t.Fatalf("inventory at the current generation: %+v %v", o, err)
			}
			if ri := info(); ri.Fenced || ri.L1Placements != chunks || ri.FenceGen != gen+2 {
				t.Fatalf("after the resync: %+v", ri)
			}
			mustVerify(t, ix.Index)

			// A newer incarnation's inventory is the truth, whatever the
			// generation it was requested under; so is its first batch,
			// which keeps the generation.
			if _, err := ix.FenceRank(ctx, r, math.MaxUint64); err != nil {
				t.Fatal(err)
			}
			newer := inv
			newer.Incarnation, newer.Seq = 4, 0
			if o, err := ix.ApplyInventoryAt(ctx, newer, gen); err != nil || !o.Applied {
				t.Fatalf("newer incarnation's inventory: %+v %v", o, err)
			}
			if ri := info(); ri.Fenced || ri.Incarnation != 4 || ri.FenceGen != gen+3 {
				t.Fatalf("after the newer incarnation: %+v", ri)
			}
			mustApply(t, ix.Index, wire.Batch{Rank: r, Incarnation: 5, Events: []wire.Event{stored(1, wire.L1, key(99, 0, 0), 1, 1)}})
			if ri := info(); ri.FenceGen != gen+3 {
				t.Fatalf("a new incarnation's batch moved the generation to %d", ri.FenceGen)
			}
			if got := testutil.Metric(t, ix.reg, "kvtier_index_dropped_total", "reason", string(index.DropFencedSince)); got != 1 {
				t.Fatalf("fenced_since counted %v since the reopen, want 1", got)
			}
			mustVerify(t, ix.Index)
		})
	}
}

// TestReplicatedInventoryFencedSince: replicas applying the same
// replicated requests agree on the verdict: an inventory entry carrying the
// generation before a fence entry that precedes it in the log is dropped
// on every replica, and the replicas' dumps are equal.
func TestReplicatedInventoryFencedSince(t *testing.T) {
	r := wire.Rank{Instance: "eng-a", TPRank: 1}
	k := key(1, 0, 0)
	gen := uint64(0)
	ops := []index.Op{
		{Batch: &wire.Batch{Rank: r, Incarnation: 2, Events: []wire.Event{stored(1, wire.L1, k, 5, 9)}}},
		{Fence: &r, UpTo: math.MaxUint64},
		{Inventory: &wire.Inventory{Rank: r, Incarnation: 2, Seq: 1, Objects: []wire.Placement{{Key: k, Tier: wire.L1, Size: 5, Sum: 9}}},
			FenceGen: &gen},
	}
	var dumps [][]byte
	for range 2 {
		ix := openTest(t, "", nil)
		var last index.Result
		for i, op := range ops {
			op.RaftIndex = uint64(i + 1)
			p, err := ix.ApplyReplicated(ctx, op)
			if err != nil {
				t.Fatal(err)
			}
			last = p.Result(ix.Index)
		}
		if last.Err != nil || last.Inventory.Applied || last.Inventory.Reason != index.DropFencedSince {
			t.Fatalf("replicated late inventory: %+v", last)
		}
		if ri, _ := ix.Rank(r); !ri.Fenced || ri.L1Placements != 0 || ri.FenceGen != 1 {
			t.Fatalf("replica: %+v", ri)
		}
		mustVerify(t, ix.Index)
		d, err := ix.Dump(ctx)
		if err != nil {
			t.Fatal(err)
		}
		dumps = append(dumps, d.Bytes)
	}
	if string(dumps[0]) != string(dumps[1]) {
		t.Fatal("replicas' dumps differ")
	}
}
