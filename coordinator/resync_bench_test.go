package coordinator

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// BenchmarkInventoryReplaceHeap measures the heap of a coordinator (in
// process, fsync on, embedded NATS; the fake rank and the test's clients
// share the process) while one rank holding KVTIER_BENCH_INVENTORY
// placements (default 2,000,000; the rank's budget raised to fit) is
// resynced from an inventory of as many other objects (issue 28.3: an
// inventory replaces the rank's shard), and then while `coordinator rank
// reset` drops them (admin.rank.reset through NATS). The inventory is
// served in pages of wire.DefaultInventoryPageSize from an array built
// before the baseline. Reported: the peak of runtime.MemStats.HeapInuse
// sampled every millisecond during each, above HeapInuse right before it
// (after a GC), what it kept (HeapInuse after a GC, above the same
// baseline: the new placements, less the old ones), and how long each
// took:
//
//	KVTIER_BENCH_INVENTORY=2000000 go test -run '^$' -bench InventoryReplaceHeap -benchtime 1x ./coordinator/
func BenchmarkInventoryReplaceHeap(b *testing.B) {
	n := benchCount(b, "KVTIER_BENCH_INVENTORY", 2_000_000)
	for b.Loop() {
		c := benchCoord(b, func(cfg *Config) { cfg.MaxPlacementsPerRank = n + fillBatch })
		nc := connect(b, c)
		ns := register(b, nc, c.subj, testSpec(1))
		r := wire.Rank{Instance: "big", TPRank: 0}
		keyOf := func(seed uint64, i int) dcp.Key { return dcp.Key{NS: ns, Chunk: indextest.Chunk(seed, uint64(i))} }
		fillRank(b, nc, c.subj, r, n, func(i int) dcp.Key { return keyOf(1, i) })
		seq := uint64(n) + 10
		inv := wire.Inventory{Rank: r, Incarnation: 1, Seq: seq, Objects: make([]wire.Placement, n)}
		for i := range inv.Objects {
			inv.Objects[i] = wire.Placement{Key: keyOf(2, i), Tier: wire.L2, Size: benchObject, Sum: uint64(i) + 1}
		}
		sub := serveBenchInventory(b, c, &inv)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		t0 := time.Now()
		apply, applyKept := testutil.PeakHeap(func() { resyncAfterGap(b, ctx, c, nc, &inv, keyOf(3, 0)) })
		applyTook := time.Since(t0)
		if ri, _ := c.idx.Rank(r); ri.L2Placements != int64(n) {
			b.Fatalf("after the resync: %+v, want %d L2 placements", ri, n)
		}
		_ = sub.Unsubscribe()
		inv.Objects = nil
		t0 = time.Now()
		reset, resetKept := testutil.PeakHeap(func() {
			rep, err := bus.Call[wire.AdminRankResetReply](ctx, nc, c.subj.Admin(wire.AdminRankReset), wire.AdminRankResetRequest{Rank: r.String()})
			if err != nil || rep.Placements != n {
				b.Fatalf("reset: %+v %v", rep, err)
			}
		})
		resetTook := time.Since(t0)
		cancel()
		runtime.KeepAlive(inv)
		mib := func(v uint64) float64 { return float64(v) / (1 << 20) }
		b.Logf("%d placements: inventory replacing them peak +%.1f MiB (%.0f B each), kept %+.1f MiB, in %v; reset peak +%.1f MiB (%.0f B each), kept %+.1f MiB, in %v",
			n, mib(apply), float64(apply)/float64(n), float64(applyKept)/(1<<20), applyTook.Round(time.Millisecond),
			mib(reset), float64(reset)/float64(n), float64(resetKept)/(1<<20), resetTook.Round(time.Millisecond))
		b.ReportMetric(mib(apply), "MiB-inventory-peak")
		b.ReportMetric(mib(reset), "MiB-reset-peak")
	}
}
