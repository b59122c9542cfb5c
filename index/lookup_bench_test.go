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

// BenchmarkLookup128x8 measures one Lookup of a 128-chunk chain over the 8
// shards of a TP8 non-MLA namespace, in an index holding 200,000 chunks
// (1.6 M objects, each in L1 and L2), without the trace.
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
	const nChunks = 200_000
	for tp := range 8 {
		r := wire.Rank{Instance: "bench", TPRank: tp}
		var seq uint64
		bt := wire.Batch{Rank: r, Incarnation: 1}
		for c := range uint64(nChunks) {
			k := dcp.Key{NS: res.Namespace, Chunk: indextest.Chunk(3, c), Shard: uint16(tp)}
			for _, tier := range []wire.Tier{wire.L1, wire.L2} {
				seq++
				bt.Events = append(bt.Events, wire.Event{Seq: seq, Kind: wire.Stored, Tier: tier, Key: k, Size: 1 << 20, Sum: c})
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
			cpu0 := threadCPU()
			for i := range b.N {
				lr, err := ix.Lookup("bench", res.Namespace, chains[i%len(chains)])
				if err != nil || lr.Prefix != 128 {
					b.Fatalf("prefix %d: %v", lr.Prefix, err)
				}
			}
			b.ReportMetric(float64((threadCPU()-cpu0).Nanoseconds())/1e3/float64(b.N), "cpu-us/op")
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
