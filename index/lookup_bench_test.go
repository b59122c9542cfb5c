package index_test

import (
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// BenchmarkLookup128x8 measures LookupInto of 128-chunk chains over the 8
// shards of a TP8 non-MLA namespace, in an index holding 150,000 chunks
// (1.2 M objects, each in L1 and L2), without the trace. One iteration is
// 10,000 lookups (so -benchtime 1x measures something); it reports the
// p50/p99 wall time and the CPU time per lookup. "cold" spreads the chains
// over the whole index (mostly out of the CPU caches): the worst case;
// "warm" repeats one chain.
func BenchmarkLookup128x8(b *testing.B) {
	cfg := index.DefaultConfig()
	cfg.Path = filepath.Join(b.TempDir(), "index.db")
	cfg.Logger = zap.NewNop()
	cfg.NoSync = true // setup speed only; lookups never touch bbolt
	ix, err := index.Open(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer ix.Close()
	res, err := ix.RegisterNamespace(ctx, benchGQA(8))
	if err != nil {
		b.Fatal(err)
	}
	const nChunks = 150_000
	for tp := range 8 {
		r := wire.Rank{Instance: "bench", TPRank: tp}
		var seq uint64
		bt := wire.Batch{Rank: r, Incarnation: 1}
		for c := range uint64(nChunks) {
			k := dcp.Key{NS: res.Namespace, Chunk: indextest.Chunk(3, c), Shard: uint16(tp)}
			for _, tier := range []wire.Tier{wire.L1, wire.L2} {
				seq++
				bt.Events = append(bt.Events, wire.Event{Seq: seq, Kind: wire.Stored, Tier: tier, Key: k, Size: 1 << 20, Sum: c + 1})
			}
			if len(bt.Events) >= 1<<16 || c == nChunks-1 {
				if _, err := ix.Apply(ctx, bt); err != nil {
					b.Fatal(err)
				}
				bt.Events = bt.Events[:0]
			}
		}
	}
	// cold: 1024 chains of random chunks (most of the index, out of the
	// CPU caches); warm: one chain again and again.
	for _, c := range []struct {
		name   string
		chains int
	}{{"cold", 1024}, {"warm", 1}} {
		chains := make([][]dcp.ChunkHash, c.chains)
		for i := range chains {
			for j := range 128 {
				chains[i] = append(chains[i], indextest.Chunk(3, uint64((i*7919+j*104729)%nChunks)))
			}
		}
		b.Run(c.name, func(b *testing.B) {
			// The thread's CPU time per lookup, next to the wall time: on a
			// shared machine the wall time includes other processes.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			const perIter = 10_000
			lat := make([]time.Duration, 0, perIter*b.N)
			var lr index.LookupResult
			cpu0 := threadCPU()
			for i := range b.N * perIter {
				t0 := time.Now()
				err := ix.LookupInto(&lr, "bench", res.Namespace, chains[i%len(chains)])
				lat = append(lat, time.Since(t0))
				if err != nil || lr.Prefix != 128 {
					b.Fatalf("prefix %d: %v", lr.Prefix, err)
				}
			}
			b.ReportMetric(float64((threadCPU()-cpu0).Nanoseconds())/1e3/float64(len(lat)), "cpu-us/lookup")
			b.ReportMetric(us(pct(lat, 0.5)), "p50-us")
			b.ReportMetric(us(pct(lat, 0.99)), "p99-us")
		})
	}
}

// threadCPU returns the calling thread's CPU time (user + system).
func threadCPU() time.Duration {
	var ru syscall.Rusage
	const rusageThread = 1 // RUSAGE_THREAD (Linux)
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
