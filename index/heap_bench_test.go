package index_test

import (
	"path/filepath"
	"runtime"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// BenchmarkRankHeap measures, in process (fsync on), the heap a large rank
// costs the index while it is reset and while its inventory is applied
// (issue 28.3): one rank stores KVTIER_BENCH_RANK_OBJECTS placements
// (default 1 M), each its own chunk (the flood's shape: invented chunks of
// the rank's own shard), through batches of 8192 events. Then
//
//   - reset: ResetRank drops them all;
//   - inventory: a new rank's inventory of as many objects is applied
//     (the inventory's own array, 56 B an object, is built before the
//     baseline: what is reported is what applying it costs on top).
//
// For each, the peak of runtime.MemStats.HeapInuse sampled every
// millisecond during the call, minus HeapInuse right before it (after a
// GC), in MiB and in bytes per object, and what the call left behind
// (after a GC):
//
//	KVTIER_BENCH_RANK_OBJECTS=2000000 go test -run '^$' -bench RankHeap -benchtime 1x ./index/
func BenchmarkRankHeap(b *testing.B) {
	n := envInt(b, "KVTIER_BENCH_RANK_OBJECTS", 1<<20)
	const batch = 8192
	for b.Loop() {
		cfg := index.DefaultConfig()
		cfg.Path = filepath.Join(b.TempDir(), "index.db")
		cfg.Logger = zap.NewNop()
		ix, err := index.Open(cfg)
		if err != nil {
			b.Fatal(err)
		}
		r := wire.Rank{Instance: "flood", TPRank: 0}
		keyOf := func(seed uint64, i int) dcp.Key {
			return dcp.Key{NS: testNS, Chunk: indextest.Chunk(seed, uint64(i))}
		}
		for lo := 0; lo < n; lo += batch {
			bt := wire.Batch{Rank: r, Incarnation: 1}
			for i := lo; i < min(lo+batch, n); i++ {
				bt.Events = append(bt.Events, stored(uint64(i)+1, wire.L2, keyOf(1, i), 2048, uint64(i)+1))
			}
			if _, err := ix.Apply(ctx, bt); err != nil {
				b.Fatal(err)
			}
		}
		inv := wire.Inventory{Rank: wire.Rank{Instance: "inv", TPRank: 0}, Incarnation: 1, Seq: 1,
			Objects: make([]wire.Placement, n)}
		for i := range inv.Objects {
			inv.Objects[i] = wire.Placement{Key: keyOf(2, i), Tier: wire.L2, Size: 2048, Sum: uint64(i) + 1}
		}

		reset, resetKept := testutil.PeakHeap(func() {
			if got, err := ix.ResetRank(ctx, r); err != nil || got != n {
				b.Fatalf("reset: %d placements, %v; want %d", got, err, n)
			}
		})
		apply, applyKept := testutil.PeakHeap(func() {
			if o, err := ix.ApplyInventory(ctx, inv); err != nil || !o.Applied || o.Placements != n {
				b.Fatalf("inventory: %+v %v", o, err)
			}
		})
		runtime.KeepAlive(inv)
		if err := ix.Close(); err != nil {
			b.Fatal(err)
		}
		mib := func(v uint64) float64 { return float64(v) / (1 << 20) }
		b.Logf("%d objects: reset peak +%.1f MiB (%.0f B/object), kept %+.1f MiB; inventory apply peak +%.1f MiB (%.0f B/object), kept %+.1f MiB (the new rank's placements)",
			n, mib(reset), float64(reset)/float64(n), float64(resetKept)/(1<<20),
			mib(apply), float64(apply)/float64(n), float64(applyKept)/(1<<20))
		b.ReportMetric(mib(reset), "MiB-reset-peak")
		b.ReportMetric(mib(apply), "MiB-inventory-peak")
	}
}
