package index_test

import (
	"bufio"
	"container/list"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// BenchmarkTraceReplay replays the Mooncake conversation trace (12,031
// requests; hash_ids are 512-token block hashes) as placement events from
// a world of 8 ranks, durably (fsync on), then looks up every request's
// full chain. One iteration is one full replay, so `make bench`
// (-benchtime 1x) runs it once per world:
//
//   - TP8: non-MLA, every rank stores its own shard of every chunk, in L1
//     and then (write-behind) in L2; each rank's L1 holds 32768 objects
//     and evicts LRU (a Removed L1 event);
//   - TP8-MLA: MLA without DCP, rank 0 stores the only shard and all 8
//     ranks read it (7 of them from L2).
//
// Each rank applies its events in batches of KVTIER_BENCH_BATCH (default
// 1024) from its own goroutine with ApplyAsync, keeping up to
// KVTIER_BENCH_INFLIGHT (default 8) unacknowledged batches, like a rankd
// publishing with asynchronous EventAcks. Reported: durable events/s (ingest until the
// last Apply returned, checkpoints included) and with the final fold; lookup
// p50/p99 over every request's chain; lookup p99 of 128-chunk chains (x8
// expectations), quiescent and while a second instance's replay is being
// ingested.
//
// KVTIER_BENCH_CHECKPOINT_MB overrides Config.CheckpointBytes (default 128
// MiB: the trace's 115 MiB of change log then folds only at the end), to
// measure ingest with folds in the steady state.
//
// Trace: $KVTIER_TRACE, or ../shared/data/traces/mooncake_conversation_trace.jsonl
// relative to the repository root; skipped when absent.
func BenchmarkTraceReplay(b *testing.B) {
	reqs := loadTrace(b)
	batch, inflight := 1024, 8
	if v, err := strconv.Atoi(os.Getenv("KVTIER_BENCH_BATCH")); err == nil && v > 0 {
		batch = v
	}
	if v, err := strconv.Atoi(os.Getenv("KVTIER_BENCH_INFLIGHT")); err == nil && v > 0 {
		inflight = v
	}
	worlds := []struct {
		name string
		spec dcp.Spec
	}{
		{"TP8", benchGQA(8)},
		{"TP8-MLA", benchMLA(8)},
	}
	for _, w := range worlds {
		b.Run(w.name, func(b *testing.B) {
			for range b.N {
				replayTrace(b, reqs, w.spec, batch, inflight)
			}
		})
	}
}

func benchGQA(tp int) dcp.Spec {
	g := dcp.Group{Kind: dcp.Attention, BlockSize: 16, Layers: 32, KVFormat: "bf16",
		SemanticBytes: 16 * 1024, PageBytes: 16 * 1024, StrideBytes: 16 * 1024}
	return dcp.Spec{Model: "trace-gqa", Layout: dcp.Layout{TP: tp, DCP: 1, Interleave: 1, PP: 1},
		ChunkTokens: 512, Groups: []dcp.Group{g}}
}

func benchMLA(tp int) dcp.Spec {
	s := mlaSpec(tp, 1)
	s.Model, s.ChunkTokens = "trace-mla", 512
	return s
}

func tracePath() string {
	if p := os.Getenv("KVTIER_TRACE"); p != "" {
		return p
	}
	dir, _ := os.Getwd()
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return filepath.Join(d, "..", "shared", "data", "traces", "mooncake_conversation_trace.jsonl")
		}
		if filepath.Dir(d) == d {
			return ""
		}
	}
}

func loadTrace(b *testing.B) [][]dcp.ChunkHash {
	path := tracePath()
	f, err := os.Open(path)
	if err != nil {
		b.Skipf("trace not available (%v); set KVTIER_TRACE", err)
	}
	defer f.Close()
	var reqs [][]dcp.ChunkHash
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var rec struct {
			HashIDs []uint64 `json:"hash_ids"`
		}
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			b.Fatalf("%s: %v", path, err)
		}
		chain := make([]dcp.ChunkHash, len(rec.HashIDs))
		for i, id := range rec.HashIDs {
			chain[i] = traceChunk(id)
		}
		reqs = append(reqs, chain)
	}
	if err := sc.Err(); err != nil {
		b.Fatal(err)
	}
	return reqs
}

// traceChunk maps a trace hash id to a chunk hash: SHA-256 of the id's
// 8 little-endian bytes, first 16 bytes (so keys spread like real ones).
func traceChunk(id uint64) dcp.ChunkHash {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], id)
	s := sha256.Sum256(b[:])
	return dcp.ChunkHash(s[:16])
}

// lruRank is one simulated rank's L1 (LRU, bounded) and its event stream.
type lruRank struct {
	rank   wire.Rank
	seq    uint64
	cap    int
	lru    *list.List // of dcp.Key, front = most recent
	where  map[dcp.Key]*list.Element
	events []wire.Event
}

func (r *lruRank) emit(kind wire.EventKind, tier wire.Tier, k dcp.Key, size, sum uint64) {
	r.seq++
	r.events = append(r.events, wire.Event{Seq: r.seq, Kind: kind, Tier: tier, Key: k, Size: size, Sum: sum})
}

func (r *lruRank) touch(k dcp.Key) {
	if e, ok := r.where[k]; ok {
		r.lru.MoveToFront(e)
	}
}

func (r *lruRank) store(k dcp.Key, size uint64) {
	sum := binary.LittleEndian.Uint64(k.Chunk[:]) ^ uint64(k.Shard)
	r.emit(wire.Stored, wire.L1, k, size, sum)
	r.where[k] = r.lru.PushFront(k)
	r.emit(wire.Stored, wire.L2, k, size, sum) // write-behind
	if r.lru.Len() > r.cap {
		old := r.lru.Remove(r.lru.Back()).(dcp.Key)
		delete(r.where, old)
		r.emit(wire.Removed, wire.L1, old, 0, 0)
	}
}

// buildWorld simulates the ranks of one engine instance serving the trace
// in namespace res and returns each rank's event batches.
func buildWorld(reqs [][]dcp.ChunkHash, res *dcp.Resolved, inst string, batchSize int) ([][]wire.Batch, int) {
	tp := res.Layout.TP
	ranks := make([]*lruRank, tp)
	for i := range ranks {
		ranks[i] = &lruRank{rank: wire.Rank{Instance: inst, TPRank: i}, cap: 32768, lru: list.New(),
			where: make(map[dcp.Key]*list.Element)}
	}
	var writers []int // who stores what: the TP ranks that store a shard
	for t := range tp {
		if _, ok := res.StoreShard(0, t); ok {
			writers = append(writers, t)
		}
	}
	size := res.ObjectSize(0)
	seen := make(map[dcp.ChunkHash]bool)
	for _, chain := range reqs {
		for _, c := range chain {
			for _, t := range writers {
				sh, _ := res.StoreShard(0, t)
				k := dcp.Key{NS: res.Namespace, Chunk: c, Shard: uint16(sh)}
				if seen[c] {
					ranks[t].touch(k)
				} else {
					ranks[t].store(k, size)
				}
			}
			seen[c] = true
		}
	}
	var batches [][]wire.Batch
	total := 0
	for _, r := range ranks {
		var bs []wire.Batch
		for i := 0; i < len(r.events); i += batchSize {
			bs = append(bs, wire.Batch{Rank: r.rank, Incarnation: 1, Events: r.events[i:min(i+batchSize, len(r.events))]})
		}
		total += len(r.events)
		batches = append(batches, bs)
	}
	return batches, total
}

// ingest applies every rank's batches, one goroutine per rank with up to
// inflight batches unacknowledged, and returns the wall and CPU time.
func ingest(b *testing.B, ix *index.Index, batches [][]wire.Batch, inflight int) (time.Duration, time.Duration) {
	start, cpu0 := time.Now(), processCPU()
	var wg sync.WaitGroup
	for _, bs := range batches {
		wg.Add(1)
		go func(bs []wire.Batch) {
			defer wg.Done()
			var window []*index.Pending
			wait := func(p *index.Pending) bool {
				o, err := p.Wait()
				if err != nil || o.Applied == 0 {
					b.Errorf("apply: %+v %v", o, err)
					return false
				}
				return true
			}
			for _, bt := range bs {
				if len(window) == inflight {
					if !wait(window[0]) {
						return
					}
					window = window[1:]
				}
				p, err := ix.ApplyAsync(ctx, bt)
				if err != nil {
					b.Errorf("apply: %v", err)
					return
				}
				window = append(window, p)
			}
			for _, p := range window {
				if !wait(p) {
					return
				}
			}
		}(bs)
	}
	wg.Wait()
	return time.Since(start), processCPU() - cpu0
}

func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

func replayTrace(b *testing.B, reqs [][]dcp.ChunkHash, spec dcp.Spec, batchSize, inflight int) {
	b.StopTimer()
	res, err := spec.Resolve()
	if err != nil {
		b.Fatal(err)
	}
	const inst = "trace"
	batches, total := buildWorld(reqs, res, inst, batchSize)

	dir := b.TempDir()
	cfg := index.DefaultConfig()
	cfg.Path = filepath.Join(dir, "index.db")
	cfg.Logger = zap.NewNop()
	if d, err := time.ParseDuration(os.Getenv("KVTIER_BENCH_GROUP_DELAY")); err == nil {
		cfg.MaxGroupDelay = d
	}
	if mb, err := strconv.Atoi(os.Getenv("KVTIER_BENCH_CHECKPOINT_MB")); err == nil && mb > 0 {
		cfg.CheckpointBytes = int64(mb) << 20
	}
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	ix, err := index.Open(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer ix.Close()
	if _, err := ix.RegisterNamespace(ctx, spec); err != nil {
		b.Fatal(err)
	}

	b.StartTimer()
	start := time.Now()
	wall, cpu := ingest(b, ix, batches, inflight)
	commits := testutil.Metric(b, reg, "kvtier_index_commits_total")
	commitSecs := histSum(b, reg, "kvtier_index_commit_seconds")
	folds := testutil.Metric(b, reg, "kvtier_index_checkpoints_total")
	logBytes := testutil.Metric(b, reg, "kvtier_index_log_bytes")
	if err := ix.Checkpoint(ctx); err != nil {
		b.Fatal(err)
	}
	withFold := time.Since(start)
	b.StopTimer()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heap := ms.HeapAlloc
	b.StartTimer()

	// Lookup of every request's full chain, on the quiescent index.
	lat := make([]time.Duration, 0, len(reqs))
	hits, chunks := 0, 0
	for _, chain := range reqs {
		t0 := time.Now()
		lr, err := ix.Lookup(inst, res.Namespace, chain)
		lat = append(lat, time.Since(t0))
		if err != nil {
			b.Fatal(err)
		}
		hits += lr.Prefix
		chunks += len(chain)
	}
	// 128-chunk chains (the first 128 chunks of the 257 requests that long)
	// over the 8 expectations: with Lookup, then with LookupInto reusing
	// one result (no allocation).
	var long [][]dcp.ChunkHash
	for _, chain := range reqs {
		if len(chain) >= 128 {
			long = append(long, chain[:128])
		}
	}
	const n128 = 20000
	lat128 := make([]time.Duration, 0, n128)
	lat128r := make([]time.Duration, 0, n128)
	var reuse index.LookupResult
	for i := 0; len(long) > 0 && i < n128; i++ {
		t0 := time.Now()
		lr, err := ix.Lookup(inst, res.Namespace, long[i%len(long)])
		lat128 = append(lat128, time.Since(t0))
		if err != nil || lr.Prefix != 128 {
			b.Fatalf("128-chunk chain: prefix %d: %v", lr.Prefix, err)
		}
	}
	for i := 0; len(long) > 0 && i < n128; i++ {
		t0 := time.Now()
		err := ix.LookupInto(&reuse, inst, res.Namespace, long[i%len(long)])
		lat128r = append(lat128r, time.Since(t0))
		if err != nil || reuse.Prefix != 128 {
			b.Fatalf("128-chunk chain: prefix %d: %v", reuse.Prefix, err)
		}
	}

	// Mixed: a second instance replays the trace into its own namespace
	// while 128-chunk lookups of the first run every 500 us.
	spec2 := spec
	spec2.Model += "-2"
	res2, err := ix.RegisterNamespace(ctx, spec2)
	if err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	batches2, total2 := buildWorld(reqs, res2, inst+"2", batchSize)
	b.StartTimer()
	stop := make(chan struct{})
	var latMixed []time.Duration
	var lwg sync.WaitGroup
	lwg.Add(1)
	go func() {
		defer lwg.Done()
		var r index.LookupResult
		tick := time.NewTicker(500 * time.Microsecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			t0 := time.Now()
			err := ix.LookupInto(&r, inst, res.Namespace, long[i%len(long)])
			latMixed = append(latMixed, time.Since(t0))
			if err != nil || r.Prefix != 128 {
				b.Errorf("mixed lookup: prefix %d: %v", r.Prefix, err)
				return
			}
		}
	}()
	wall2, _ := ingest(b, ix, batches2, inflight)
	close(stop)
	lwg.Wait()
	b.StopTimer()

	st := ix.Stats()
	if rep, err := ix.Verify(ctx); err != nil {
		b.Fatalf("verify: %v %v", err, rep.Problems)
	}
	evs := float64(total) / wall.Seconds()
	b.ReportMetric(evs, "events/s")
	b.ReportMetric(float64(total)/withFold.Seconds(), "events/s-with-fold")
	b.ReportMetric(float64(total)/cpu.Seconds(), "events/cpu-s")
	b.ReportMetric(us(pct(lat, 0.5)), "lookup-p50-us")
	b.ReportMetric(us(pct(lat, 0.99)), "lookup-p99-us")
	b.ReportMetric(us(pct(lat128, 0.99)), "lookup128x8-p99-us")
	b.ReportMetric(us(pct(lat128r, 0.99)), "lookupinto128x8-p99-us")
	b.ReportMetric(us(pct(latMixed, 0.99)), "mixed-lookup128x8-p99-us")
	fmt.Printf("index %s: %d events from %d ranks (batch %d, %d in flight) in %v = %.0f events/s durable (%.0f events per CPU-second); "+
		"with the final fold %v = %.0f events/s; %.0f group commits, %.0f events and %.2f ms each on average; "+
		"%.0f automatic folds during ingest, change log then %.1f MiB (%.1f B/event); heap %.0f MiB\n"+
		"index %s: lookup of each request's chain (%d lookups, %d/%d chunks hit): p50 %.1f us, p99 %.1f us; "+
		"128-chunk x %d-expectation chain: Lookup p50 %.1f us p99 %.1f us, LookupInto p50 %.1f us p99 %.1f us (%d each)\n"+
		"index %s: mixed: second instance ingests %d events at %.0f events/s while 128x%d LookupInto every 500 us: p50 %.1f us p99 %.1f us (%d lookups); "+
		"index then %d chunks, %d objects, %d L1 + %d L2 placements\n"+
		"index %s: targets: >= 1,000,000 events/s %v; 128x8 lookup p99 <= 100 us %v (Lookup) %v (LookupInto)\n",
		spec.Model, total, res.Layout.TP, batchSize, inflight, wall.Round(time.Millisecond), evs, float64(total)/cpu.Seconds(),
		withFold.Round(time.Millisecond), float64(total)/withFold.Seconds(), commits, float64(total)/commits, commitSecs/commits*1e3,
		folds, logBytes/(1<<20), logBytes/float64(total), float64(heap)/(1<<20),
		spec.Model, len(lat), hits, chunks, us(pct(lat, 0.5)), us(pct(lat, 0.99)),
		len(res.Expectations()), us(pct(lat128, 0.5)), us(pct(lat128, 0.99)), us(pct(lat128r, 0.5)), us(pct(lat128r, 0.99)), len(lat128),
		spec.Model, total2, float64(total2)/wall2.Seconds(), len(res.Expectations()), us(pct(latMixed, 0.5)), us(pct(latMixed, 0.99)), len(latMixed),
		st.Chunks, st.Objects, st.L1Placements, st.L2Placements,
		spec.Model, evs >= 1e6, pct(lat128, 0.99) <= 100*time.Microsecond, pct(lat128r, 0.99) <= 100*time.Microsecond)
}

// processCPU returns the process's CPU time (user + system, all threads).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// histSum returns the sum of a histogram's observations.
func histSum(b *testing.B, reg *prometheus.Registry, name string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			return mf.GetMetric()[0].GetHistogram().GetSampleSum()
		}
	}
	return 0
}
