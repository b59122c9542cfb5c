package coordinator

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
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
	n := 2_000_000
	if v := os.Getenv("KVTIER_BENCH_INVENTORY"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			b.Fatalf("KVTIER_BENCH_INVENTORY=%q", v)
		}
	}
	const batch = 8192
	for b.Loop() {
		c := startCoord(b, func(cfg *Config) {
			cfg.Logger, cfg.Cluster.Logger = zap.NewNop(), zap.NewNop()
			cfg.MaxPlacementsPerRank = n + batch
		})
		nc := connect(b, c)
		ns := register(b, nc, c.subj, testSpec(1))
		r := wire.Rank{Instance: "big", TPRank: 0}
		keyOf := func(seed uint64, i int) dcp.Key { return dcp.Key{NS: ns, Chunk: indextest.Chunk(seed, uint64(i))} }
		const size = 2048 // testSpec's object (checkEventGeometry)
		for lo := 0; lo < n; lo += batch {
			bt := &wire.Batch{Rank: r, Incarnation: 1}
			for i := lo; i < min(lo+batch, n); i++ {
				bt.Events = append(bt.Events, wire.Event{Seq: uint64(i) + 1, Kind: wire.Stored, Tier: wire.L2, Key: keyOf(1, i),
					Size: size, Sum: uint64(i) + 1})
			}
			if ack, werr := sendBatch(b, nc, c.subj, bt); werr != nil || ack.AppliedThrough != uint64(min(lo+batch, n)) {
				b.Fatalf("fill: %+v %v", ack, werr)
			}
		}
		seq := uint64(n) + 10
		inv := wire.Inventory{Rank: r, Incarnation: 1, Seq: seq, Objects: make([]wire.Placement, n)}
		for i := range inv.Objects {
			inv.Objects[i] = wire.Placement{Key: keyOf(2, i), Tier: wire.L2, Size: size, Sum: uint64(i) + 1}
		}
		srv := newInventoryServer(wire.DefaultInventoryPageSize)
		sub, err := connect(b, c).Subscribe(c.subj.Inventory(r), func(m *nats.Msg) {
			srv.serve(m, func() wire.Inventory { return inv })
		})
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		t0 := time.Now()
		apply, applyKept := testutil.PeakHeap(func() {
			gap := &wire.Batch{Rank: r, Incarnation: 1, Events: []wire.Event{{Seq: seq - 2, Kind: wire.Stored, Tier: wire.L2,
				Key: keyOf(3, 0), Size: size, Sum: 1}}}
			if ack, werr := sendBatch(b, nc, c.subj, gap); werr != nil || !ack.Resync {
				b.Fatalf("gap batch: %+v %v", ack, werr)
			}
			for {
				if ri, ok := c.idx.Rank(r); ok && ri.LastSeq == seq && !ri.Partial {
					break
				}
				if ctx.Err() != nil {
					b.Fatal("the resync never landed")
				}
				time.Sleep(time.Millisecond)
			}
		})
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
