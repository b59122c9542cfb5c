package index_test

import (
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// BenchmarkAdminStall measures, in process (fsync on), how long admin
// operations hold up event acknowledgements at 2 M placements: 8 ranks of
// instance "big" hold 250,000 L1 placements each, ranks of "small" 1,000
// each. While one producer applies 1-event batches back to back (each
// Apply is one acknowledgement), it runs FenceRank of a small rank, an
// empty inventory of another small rank, FenceRank of a big rank (250,000
// placements to drop) and Verify, and reports per operation its duration
// and the longest Apply that overlapped it, next to the producer's p99
// Apply when nothing else runs (the fsync floor).
//
//	go test -run '^$' -bench AdminStall -benchtime 1x ./index/
//	# KVTIER_BENCH_FENCE_SLICE sets Config.FenceSliceChunks (1000000: the
//	# whole rank in one commit, as before the sliced fences)
func BenchmarkAdminStall(b *testing.B) {
	const bigRanks, perRank, small = 8, 250_000, 1_000
	cfg := index.DefaultConfig()
	cfg.Path = filepath.Join(b.TempDir(), "index.db")
	cfg.Logger = zap.NewNop()
	if v := os.Getenv("KVTIER_BENCH_FENCE_SLICE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			b.Fatalf("KVTIER_BENCH_FENCE_SLICE=%q: %v", v, err)
		}
		cfg.FenceSliceChunks = n
	}
	b.Logf("FenceSliceChunks %d", cfg.FenceSliceChunks)
	ix, err := index.Open(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = ix.Close() }()
	res, err := ix.RegisterNamespace(ctx, benchGQA(8))
	if err != nil {
		b.Fatal(err)
	}
	ns := res.Namespace
	fill := func(r wire.Rank, n int, seed uint64) {
		bt := wire.Batch{Rank: r, Incarnation: 1}
		var seq uint64
		for c := range uint64(n) {
			seq++
			k := dcp.Key{NS: ns, Chunk: indextest.Chunk(seed, c), Shard: uint16(r.TPRank)}
			bt.Events = append(bt.Events, wire.Event{Seq: seq, Kind: wire.Stored, Tier: wire.L1, Key: k, Size: 1 << 20, Sum: c + 1})
			if len(bt.Events) == 1<<16 || int(c) == n-1 {
				if _, err := ix.Apply(ctx, bt); err != nil {
					b.Fatal(err)
				}
				bt.Events = bt.Events[:0]
			}
		}
	}
	for tp := range bigRanks {
		fill(wire.Rank{Instance: "big", TPRank: tp}, perRank, 7)
	}
	for tp := range 2 {
		fill(wire.Rank{Instance: "small", TPRank: tp}, small, 9)
	}
	runtime.GC()
	var mem runtime.MemStats
	runtime.ReadMemStats(&mem)
	st := ix.Stats()
	b.Logf("index: %+v; heap in use %.0f MiB (%.0f B per placement)", st, float64(mem.HeapInuse)/(1<<20),
		float64(mem.HeapInuse)/float64(st.L1Placements+st.L2Placements))

	// The producer: 1-event batches of its own rank, back to back.
	var (
		mu      sync.Mutex
		applies []struct{ start, end time.Time }
		stop    atomic.Bool
		wg      sync.WaitGroup
	)
	wg.Go(func() {
		r := wire.Rank{Instance: "prod", TPRank: 0}
		for seq := uint64(1); !stop.Load(); seq++ {
			k := dcp.Key{NS: ns, Chunk: indextest.Chunk(11, seq), Shard: 0}
			t0 := time.Now()
			if _, err := ix.Apply(ctx, wire.Batch{Rank: r, Incarnation: 1,
				Events: []wire.Event{{Seq: seq, Kind: wire.Stored, Tier: wire.L1, Key: k, Size: 1, Sum: seq}}}); err != nil {
				b.Error(err)
				return
			}
			mu.Lock()
			applies = append(applies, struct{ start, end time.Time }{t0, time.Now()})
			mu.Unlock()
		}
	})
	// overlapping returns the Applies overlapping [from, to], sorted.
	overlapping := func(from, to time.Time) []time.Duration {
		mu.Lock()
		defer mu.Unlock()
		var ds []time.Duration
		for _, a := range applies {
			if a.end.After(from) && a.start.Before(to) {
				ds = append(ds, a.end.Sub(a.start))
			}
		}
		slices.Sort(ds)
		return ds
	}
	run := func(name string, f func() error) {
		time.Sleep(200 * time.Millisecond)
		t0 := time.Now()
		if err := f(); err != nil {
			b.Fatalf("%s: %v", name, err)
		}
		t1 := time.Now()
		time.Sleep(50 * time.Millisecond) // an Apply queued behind it ends after it
		ds := overlapping(t0, t1)
		if len(ds) == 0 {
			ds = []time.Duration{0}
		}
		w := ds[len(ds)-1]
		b.Logf("%-22s took %8.1f ms; longest overlapping ack %8.1f ms (%d acks overlapped it: p50 %.1f ms, p99 %.1f ms)",
			name, ms(t1.Sub(t0)), ms(w), len(ds), ms(ds[len(ds)/2]), ms(ds[len(ds)*99/100]))
		b.ReportMetric(ms(w), name+"-stall-ms")
	}
	for b.Loop() {
		time.Sleep(time.Second)
		mu.Lock()
		var base []time.Duration
		for _, a := range applies {
			base = append(base, a.end.Sub(a.start))
		}
		mu.Unlock()
		slices.Sort(base)
		if len(base) > 0 {
			b.Logf("idle ack p50 %.1f ms, p99 %.1f ms over %d acks", ms(base[len(base)/2]), ms(base[len(base)*99/100]), len(base))
			b.ReportMetric(ms(base[len(base)*99/100]), "idle-ack-p99-ms")
		}
		run("fence-small", func() error {
			_, err := ix.FenceRank(ctx, wire.Rank{Instance: "small", TPRank: 0}, 1)
			return err
		})
		run("empty-inventory-small", func() error {
			_, err := ix.ApplyInventory(ctx, wire.Inventory{Rank: wire.Rank{Instance: "small", TPRank: 1}, Incarnation: 1, Seq: small})
			return err
		})
		run("fence-big", func() error {
			_, err := ix.FenceRank(ctx, wire.Rank{Instance: "big", TPRank: 3}, 1)
			return err
		})
		run("verify", func() error {
			rep, err := ix.Verify(ctx)
			if err == nil {
				err = rep.Err()
			}
			return err
		})
	}
	stop.Store(true)
	wg.Wait()

	// Restart: what `coordinator serve` does before it answers a lookup
	// (open, then verify), and the first lookup.
	if err := ix.Close(); err != nil {
		b.Fatal(err)
	}
	t0 := time.Now()
	ix, err = index.Open(cfg)
	if err != nil {
		b.Fatal(err)
	}
	opened := time.Since(t0)
	rep, err := ix.Verify(ctx)
	if err == nil {
		err = rep.Err()
	}
	if err != nil {
		b.Fatal(err)
	}
	verified := time.Since(t0)
	chain := []dcp.ChunkHash{indextest.Chunk(7, 0), indextest.Chunk(7, 1)}
	if _, err := ix.Lookup("big", ns, chain); err != nil { // big/3 is fenced: prefix 0, still a lookup
		b.Fatalf("first lookup after the restart: %v", err)
	}
	first := time.Since(t0)
	b.Logf("restart at %d placements: open %.0f ms, + verify %.0f ms, first lookup at %.0f ms",
		ix.Stats().L1Placements, ms(opened), ms(verified), ms(first))
	b.ReportMetric(ms(opened), "reopen-ms")
	b.ReportMetric(ms(first), "restart-to-lookup-ms")
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }
