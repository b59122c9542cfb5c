package index_test

import (
	"sync"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
)

// Verify compares a copy taken at a barrier on its own goroutine while the
// committer goes on: Verifys running during ingest, fences, inventories and
// checkpoints all pass, and under -race nothing of the copy is shared with
// what the committer changes (a copy sharing the chunk maps was seen
// failing with data races).
func TestVerifyDuringIngest(t *testing.T) {
	// Verify's copies span slab compactions.
	defer index.SetSlabCompactMin(index.SetSlabCompactMin(1))
	ix := openTest(t, "", func(c *index.Config) { c.CheckpointBytes = 64 << 10 }) // folds during the test
	res, err := ix.RegisterNamespace(ctx, benchGQA(4))
	if err != nil {
		t.Fatal(err)
	}
	ns := res.Namespace
	const batches, per = 40, 64
	var wg sync.WaitGroup
	for tp := range 4 {
		wg.Go(func() {
			r := wire.Rank{Instance: "eng", TPRank: tp}
			var seq uint64
			for bi := range batches {
				b := wire.Batch{Rank: r, Incarnation: 1}
				for c := range per {
					seq++
					k := dcp.Key{NS: ns, Chunk: indextest.Chunk(5, uint64(bi*per+c)), Shard: uint16(tp)}
					b.Events = append(b.Events, wire.Event{Seq: seq, Kind: wire.Stored, Tier: wire.Tier(1 + c%2), Key: k, Size: 10, Sum: seq})
				}
				if _, err := ix.Apply(ctx, b); err != nil {
					t.Error(err)
					return
				}
				if tp == 3 && bi%10 == 9 {
					if _, err := ix.FenceRank(ctx, r, 1); err != nil {
						t.Error(err)
						return
					}
					if _, err := ix.ApplyInventory(ctx, wire.Inventory{Rank: r, Incarnation: 1, Seq: seq}); err != nil {
						t.Error(err)
						return
					}
				}
			}
		})
	}
	wg.Go(func() {
		for range 15 {
			rep, err := ix.Verify(ctx)
			if err != nil {
				t.Errorf("verify during ingest: %v %v", err, rep.Problems)
				return
			}
		}
	})
	wg.Wait()
	rep := mustVerify(t, ix.Index)
	if rep.Placements == 0 {
		t.Fatalf("final verify saw no placements: %+v", rep)
	}
}
