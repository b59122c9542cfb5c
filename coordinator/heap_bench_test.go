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
)

// BenchmarkRankResetHeap measures the heap of a coordinator (in process,
// fsync on, embedded NATS; the test's own NATS clients and fake rank share
// the process) while one rank's placements are reset and while a large
// inventory of it is applied (issue 28.3): the rank stores
// KVTIER_BENCH_RANK_OBJECTS placements (default 1 M; at most the default
// MaxPlacementsPerRank), each its own chunk of the rank's shard, through
// NATS in batches of 8,192; then
//
//   - reset: `coordinator rank reset` (admin.rank.reset through NATS)
//     drops them all;
//   - inventory: a gap batch makes the coordinator resync the rank from
//     an inventory of as many objects (served by a fake rank in this
//     process from an array built before the baseline), until the index
//     shows its sequence.
//
// Reported: the peak of runtime.MemStats.HeapInuse sampled every
// millisecond during each, above HeapInuse right before it (after a GC):
//
//	KVTIER_BENCH_RANK_OBJECTS=1000000 go test -run '^$' -bench RankResetHeap -benchtime 1x ./coordinator/
func BenchmarkRankResetHeap(b *testing.B) {
	n := benchCount(b, "KVTIER_BENCH_RANK_OBJECTS", 1<<20)
	for b.Loop() {
		c := benchCoord(b)
		nc := connect(b, c)
		ns := register(b, nc, c.subj, testSpec(1))
		r := wire.Rank{Instance: "flood", TPRank: 0}
		keyOf := func(seed uint64, i int) dcp.Key { return dcp.Key{NS: ns, Chunk: indextest.Chunk(seed, uint64(i))} }
		fillRank(b, nc, c.subj, r, n, func(i int) dcp.Key { return keyOf(1, i) })
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		reset := peakOnly(func() {
			rep, err := bus.Call[wire.AdminRankResetReply](ctx, nc, c.subj.Admin(wire.AdminRankReset), wire.AdminRankResetRequest{Rank: r.String()})
			if err != nil || rep.Placements != n {
				b.Fatalf("reset: %+v %v", rep, err)
			}
		})

		inv := wire.Inventory{Rank: r, Incarnation: 2, Seq: 5, Objects: make([]wire.Placement, n)}
		for i := range inv.Objects {
			inv.Objects[i] = wire.Placement{Key: keyOf(2, i), Tier: wire.L2, Size: benchObject, Sum: uint64(i) + 1}
		}
		sub := serveBenchInventory(b, c, &inv)
		apply := peakOnly(func() { resyncAfterGap(b, ctx, c, nc, &inv, keyOf(3, 0)) })
		cancel()
		_ = sub.Unsubscribe()
		runtime.KeepAlive(inv)
		mib := func(v uint64) float64 { return float64(v) / (1 << 20) }
		b.Logf("%d placements: reset peak +%.1f MiB (%.0f B each); inventory resync peak +%.1f MiB (%.0f B each)",
			n, mib(reset), float64(reset)/float64(n), mib(apply), float64(apply)/float64(n))
		b.ReportMetric(mib(reset), "MiB-reset-peak")
		b.ReportMetric(mib(apply), "MiB-inventory-peak")
	}
}

// BenchmarkPlacementFlood replays issue 28.3's attack on a coordinator
// with the default config (in process, fsync on, embedded NATS, auth off
// so the test can publish as the rank): one rank sends
// KVTIER_BENCH_FLOOD invented placements of its own shard (default
// 2,000,000, the attack's size), batches of 8,192 one after another; each
// refused batch is sent on as the next (the attacker ignores refusals).
// Reported: the placements the index holds for the rank, the batches
// refused, HeapInuse after a GC above the empty coordinator's, and the
// index file's size:
//
//	go test -run '^$' -bench PlacementFlood -benchtime 1x ./coordinator/
func BenchmarkPlacementFlood(b *testing.B) {
	n := benchCount(b, "KVTIER_BENCH_FLOOD", 2_000_000)
	const batch = fillBatch
	for b.Loop() {
		c := benchCoord(b)
		nc := connect(b, c)
		ns := register(b, nc, c.subj, testSpec(1))
		r := wire.Rank{Instance: "flood", TPRank: 0}
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		base := ms.HeapInuse
		refused := 0
		t0 := time.Now()
		for lo := 0; lo < n; lo += batch {
			bt := &wire.Batch{Rank: r, Incarnation: 1}
			for i := lo; i < min(lo+batch, n); i++ {
				bt.Events = append(bt.Events, wire.Event{Seq: uint64(i) + 1, Kind: wire.Stored, Tier: wire.L2,
					Key: dcp.Key{NS: ns, Chunk: indextest.Chunk(1, uint64(i))}, Size: 2048, Sum: uint64(i) + 1})
			}
			if _, werr := sendBatch(b, nc, c.subj, bt); werr != nil {
				refused++
			}
		}
		took := time.Since(t0)
		ri, _ := c.idx.Rank(r)
		held := ri.L1Placements + ri.L2Placements + ri.L3Placements
		runtime.GC()
		runtime.ReadMemStats(&ms)
		fi, err := os.Stat(c.cfg.DataDir + "/" + IndexFile)
		if err != nil {
			b.Fatal(err)
		}
		b.Logf("%d invented placements in %v: the index holds %d, %d of %d batches refused; heap in use +%.1f MiB, index file %.1f MiB",
			n, took.Round(time.Millisecond), held, refused, (n+batch-1)/batch, float64(int64(ms.HeapInuse)-int64(base))/(1<<20),
			float64(fi.Size())/(1<<20))
		b.ReportMetric(float64(held), "placements-held")
		b.ReportMetric(float64(int64(ms.HeapInuse)-int64(base))/(1<<20), "MiB-heap")
	}
}

// fillBatch is the events of a batch with which these benchmarks fill a
// rank, and benchObject the size of testSpec's object
// (checkEventGeometry).
const (
	fillBatch   = 8192
	benchObject = 2048
)

// benchCount is the whole number in the environment variable name, def
// where it is unset; anything but a positive number fails b.
func benchCount(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q", name, v)
	}
	return n
}

// fillRank stores n objects of r through NATS, in batches of fillBatch
// events that must all apply: object i is key(i) in L2, testSpec's size,
// with sequence and sum i+1.
func fillRank(b *testing.B, nc *nats.Conn, subj wire.Subjects, r wire.Rank, n int, key func(int) dcp.Key) {
	for lo := 0; lo < n; lo += fillBatch {
		bt := &wire.Batch{Rank: r, Incarnation: 1}
		for i := lo; i < min(lo+fillBatch, n); i++ {
			bt.Events = append(bt.Events, wire.Event{Seq: uint64(i) + 1, Kind: wire.Stored, Tier: wire.L2, Key: key(i),
				Size: benchObject, Sum: uint64(i) + 1})
		}
		if ack, werr := sendBatch(b, nc, subj, bt); werr != nil || ack.AppliedThrough != uint64(min(lo+fillBatch, n)) {
			b.Fatalf("fill: %+v %v", ack, werr)
		}
	}
}

// serveBenchInventory answers the inventory requests of inv's rank with *inv,
// read at each request, in pages of wire.DefaultInventoryPageSize, on a
// connection of its own, until the subscription is dropped.
func serveBenchInventory(b *testing.B, c *Coordinator, inv *wire.Inventory) *nats.Subscription {
	srv := newInventoryServer(wire.DefaultInventoryPageSize)
	sub, err := connect(b, c).Subscribe(c.subj.Inventory(inv.Rank), func(m *nats.Msg) {
		srv.serve(m, func() wire.Inventory { return *inv })
	})
	if err != nil {
		b.Fatal(err)
	}
	return sub
}

// resyncAfterGap sends inv's rank a batch of one event (gapKey) two
// sequences short of inv's, which the coordinator answers by resyncing the
// rank, and waits until the index holds the rank whole at inv's sequence
// or ctx ends.
func resyncAfterGap(b *testing.B, ctx context.Context, c *Coordinator, nc *nats.Conn, inv *wire.Inventory, gapKey dcp.Key) {
	gap := &wire.Batch{Rank: inv.Rank, Incarnation: inv.Incarnation, Events: []wire.Event{{Seq: inv.Seq - 2, Kind: wire.Stored,
		Tier: wire.L2, Key: gapKey, Size: benchObject, Sum: 1}}}
	if ack, werr := sendBatch(b, nc, c.subj, gap); werr != nil || !ack.Resync {
		b.Fatalf("gap batch: %+v %v", ack, werr)
	}
	for {
		if ri, ok := c.idx.Rank(inv.Rank); ok && ri.LastSeq == inv.Seq && !ri.Partial {
			return
		}
		if ctx.Err() != nil {
			b.Fatal("the resync never landed")
		}
		time.Sleep(time.Millisecond)
	}
}

// peakOnly is testutil.PeakHeap's peak.
func peakOnly(f func()) uint64 {
	p, _ := testutil.PeakHeap(f)
	return p
}
