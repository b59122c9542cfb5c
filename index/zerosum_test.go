package index_test

import (
	"errors"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// TestZeroSumRefused (STYLE 31, issue 11.8): the index refuses a Stored
// event and an inventory object of sum 0 with ErrZeroSum (an ErrInvalid),
// naming the event or object, at every entry point that writes
// placements, and nothing of the batch or inventory is applied. A Removed
// event carries no sum and passes.
func TestZeroSumRefused(t *testing.T) {
	ix := openTest(t, "", nil)
	r := wire.Rank{Instance: "eng", TPRank: 1}
	mustApply(t, ix.Index, wire.Batch{Rank: r, Incarnation: 2, Events: []wire.Event{stored(1, wire.L1, key(1, 0, 0), 1, 11)}})
	before, placed := ix.Stats(), ix.Get(key(1, 0, 0))

	b := wire.Batch{Rank: r, Incarnation: 2, Events: []wire.Event{stored(2, wire.L2, key(1, 0, 0), 1, 11),
		removed(3, wire.L1, key(1, 0, 0)), stored(4, wire.L1, key(2, 0, 0), 1, 0), stored(5, wire.L1, key(3, 0, 0), 1, 33)}}
	wantBatch := "batch from eng/1 incarnation 2: event 2 (seq 4) stores " + key(2, 0, 0).String() +
		" in L1 with sum 0: every stored object has a nonzero kvsum64"
	inv := wire.Inventory{Rank: r, Incarnation: 2, Seq: 9, Objects: []wire.Placement{{Key: key(5, 0, 0), Tier: wire.L2, Size: 1, Sum: 55},
		{Key: key(4, 0, 0), Tier: wire.L1, Size: 1}}}
	wantInv := "inventory of eng/1 incarnation 2: object 1 (" + key(4, 0, 0).String() +
		", L1) has sum 0: every stored object has a nonzero kvsum64"
	check := func(what string, err error, want string) {
		t.Helper()
		if !errors.Is(err, index.ErrZeroSum) || !errors.Is(err, index.ErrInvalid) || err.Error() != want {
			t.Fatalf("%s: err %v\nwant %q (ErrZeroSum, ErrInvalid)", what, err, want)
		}
	}

	_, err := ix.Apply(ctx, b)
	check("Apply", err, wantBatch)
	_, err = ix.ApplyAsync(ctx, b)
	check("ApplyAsync", err, wantBatch)
	check("ValidateBatch", index.ValidateBatch(&b), wantBatch)
	p, err := ix.ApplyReplicated(ctx, index.Op{RaftIndex: 1, Batch: &b})
	if err != nil {
		t.Fatal(err)
	}
	check("ApplyReplicated batch", p.Result(ix.Index).Err, wantBatch)

	_, err = ix.ApplyInventory(ctx, inv)
	check("ApplyInventory", err, wantInv)
	_, err = ix.ApplyInventoryAt(ctx, inv, 0)
	check("ApplyInventoryAt", err, wantInv)
	check("ValidateInventory", index.ValidateInventory(&inv), wantInv)
	p, err = ix.ApplyReplicated(ctx, index.Op{RaftIndex: 2, Inventory: &inv})
	if err != nil {
		t.Fatal(err)
	}
	check("ApplyReplicated inventory", p.Result(ix.Index).Err, wantInv)

	if after := ix.Stats(); after != before {
		t.Fatalf("refused input changed the index: %+v -> %+v", before, after)
	}
	if info, _ := ix.ListRank(r); info.LastSeq != 1 || info.Incarnation != 2 || len(info.Placements) != 1 {
		t.Fatalf("refused input changed the rank: %+v", info)
	}
	if got := ix.Get(key(1, 0, 0)); len(got) != 1 || got[0] != placed[0] {
		t.Fatalf("key 1 after refused input: %+v, want %+v", got, placed)
	}
	mustVerify(t, ix.Index)

	// The same batch with the sum set is applied, its Removed event of sum
	// 0 included.
	b.Events[2].Sum = 22
	if o := mustApply(t, ix.Index, b); o.Applied != 4 || o.LastSeq != 5 {
		t.Fatalf("batch with its sum set: %+v", o)
	}
	mustVerify(t, ix.Index)
}

// TestZeroSumLegacyRows: a placement of sum 0 written before the rule
// (ApplyLegacyBatchForTest, as a coordinator older than issue 11.8 wrote
// one) is kept, read back at Open and passes Verify: the rule refuses new
// input, it does not make an older file unreadable.
func TestZeroSumLegacyRows(t *testing.T) {
	dir := t.TempDir()
	ix := openTest(t, dir, nil)
	r := wire.Rank{Instance: "old", TPRank: 0}
	b := wire.Batch{Rank: r, Incarnation: 1, Events: []wire.Event{stored(1, wire.L1, key(1, 0, 0), 1, 0), stored(2, wire.L2, key(1, 0, 0), 1, 0)}}
	if _, err := index.ApplyLegacyBatchForTest(ctx, ix.Index, b); err != nil {
		t.Fatal(err)
	}
	mustVerify(t, ix.Index)
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	ix2 := openTest(t, dir, nil)
	got := ix2.Get(key(1, 0, 0))
	if len(got) != 2 || got[0].Sum != 0 || got[1].Sum != 0 {
		t.Fatalf("legacy placements after reopen: %+v, want two of sum 0", got)
	}
	mustVerify(t, ix2.Index)
	// The seam skips only the sum rule.
	bad := wire.Batch{Rank: r, Incarnation: 1, Events: []wire.Event{stored(0, wire.L1, key(2, 0, 0), 1, 0)}}
	if _, err := index.ApplyLegacyBatchForTest(ctx, ix2.Index, bad); !errors.Is(err, index.ErrInvalid) || errors.Is(err, index.ErrZeroSum) {
		t.Fatalf("legacy batch with seq 0: %v, want ErrInvalid for the sequence", err)
	}
}
