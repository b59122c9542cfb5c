package index_test

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// BenchmarkIngestGrowth measures, in process (fsync on), ingest as the
// index grows (issue 12): 8 ranks of one TP8 instance each store their
// shard of new chunks in L1, batches of 1024 events, one batch in flight
// per rank (rankd's publisher without a window), in steps of
// KVTIER_BENCH_STEP placements (default 1 M) up to KVTIER_BENCH_GROWTH
// (default 10 M). Per step: events/s, ack p50/p99/max, the folds
// (checkpoints) that ran, the bbolt file's bytes per placement and the
// bytes this process wrote to storage (/proc/self/io) per placement
// stored in the step.
//
// Then, at the final size: a crash copy of the file as a commit left it
// (the snapshot stream's file, change log unfolded), Close (what SIGTERM
// does to the index: the final fold), Open of the closed file and of the
// crash copy (log replay) until a Lookup answers, and Verify of the
// reopened index.
//
//	KVTIER_BENCH_GROWTH=10000000 go test -v -run '^$' -bench IngestGrowth -benchtime 1x ./index/
//	# KVTIER_BENCH_FOLD_SLICE sets Config.FoldSliceChunks
func BenchmarkIngestGrowth(b *testing.B) {
	const ranks, batch = 8, 1024
	total, step := envInt(b, "KVTIER_BENCH_GROWTH", 10_000_000), envInt(b, "KVTIER_BENCH_STEP", 1_000_000)
	if step%(ranks*batch) != 0 {
		step -= step % (ranks * batch)
	}
	var rates, maxAck [][]float64 // per step, one per repetition
	var closes, restarts, crashes []float64
	defer func() {
		med := func(v []float64) float64 {
			if len(v) == 0 {
				return 0
			}
			v = slices.Clone(v)
			slices.Sort(v)
			return v[len(v)/2]
		}
		for i := range rates {
			b.Logf("median of %d: step %d (to %.1f M): %7.0f k events/s, max ack %7.1f ms", len(rates[i]), i+1,
				float64((i+1)*step)/1e6, med(rates[i])/1e3, med(maxAck[i]))
		}
		b.Logf("median of %d: Close %.0f ms, restart to lookup %.0f ms, crash to lookup %.0f ms", len(closes),
			med(closes), med(restarts), med(crashes))
	}()
	for b.Loop() {
		dir := b.TempDir()
		cfg := index.DefaultConfig()
		cfg.Path = filepath.Join(dir, "index.db")
		cfg.Logger = zap.NewNop()
		reg := prometheus.NewRegistry()
		cfg.Registerer = reg
		if n := envInt(b, "KVTIER_BENCH_FOLD_SLICE", 0); n > 0 {
			cfg.FoldSliceChunks = n
		}
		ix, ns := openBenchIndex(b, cfg, ranks)
		seqs := make([]uint64, ranks)
		var chunk uint64 // chunks stored so far (each holds one placement per rank)
		for done := 0; done+step <= total; done += step {
			folds0 := testutil.Metric(b, reg, "kvtier_index_checkpoints_total")
			w0 := writeBytes(b)
			per := step / ranks
			var (
				mu   sync.Mutex
				acks []time.Duration
				wg   sync.WaitGroup
			)
			t0 := time.Now()
			for tp := range ranks {
				wg.Go(func() {
					r := wire.Rank{Instance: "grow", TPRank: tp}
					bt := wire.Batch{Rank: r, Incarnation: 1, Events: make([]wire.Event, 0, batch)}
					mine := make([]time.Duration, 0, per/batch)
					for c := range uint64(per) {
						seqs[tp]++
						k := dcp.Key{NS: ns, Chunk: indextest.Chunk(3, chunk+c), Shard: uint16(tp)}
						bt.Events = append(bt.Events, wire.Event{Seq: seqs[tp], Kind: wire.Stored, Tier: wire.L1, Key: k, Size: 1 << 20, Sum: chunk + c + 1})
						if len(bt.Events) == batch {
							a0 := time.Now()
							if _, err := ix.Apply(ctx, bt); err != nil {
								b.Error(err)
								return
							}
							mine = append(mine, time.Since(a0))
							bt.Events = bt.Events[:0]
						}
					}
					mu.Lock()
					acks = append(acks, mine...)
					mu.Unlock()
				})
			}
			wg.Wait()
			if b.Failed() {
				return
			}
			wall := time.Since(t0)
			chunk += uint64(per)
			slices.Sort(acks)
			fi, err := os.Stat(cfg.Path)
			if err != nil {
				b.Fatal(err)
			}
			size := done + step
			if i := done / step; i >= len(rates) {
				rates, maxAck = append(rates, nil), append(maxAck, nil)
			}
			rates[done/step] = append(rates[done/step], float64(step)/wall.Seconds())
			maxAck[done/step] = append(maxAck[done/step], ms(acks[len(acks)-1]))
			b.Logf("step %5.1f-%5.1f M: %7.0f k events/s; ack p50 %6.1f ms p99 %7.1f ms max %7.1f ms; %d folds; file %5.1f B/placement; wrote %6.1f B/placement",
				float64(done)/1e6, float64(size)/1e6, float64(step)/wall.Seconds()/1e3,
				ms(acks[len(acks)/2]), ms(acks[len(acks)*99/100]), ms(acks[len(acks)-1]),
				int(testutil.Metric(b, reg, "kvtier_index_checkpoints_total")-folds0),
				float64(fi.Size())/float64(size), float64(writeBytes(b)-w0)/float64(step))
		}
		st := ix.Stats()
		var mem runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&mem)
		b.Logf("index %+v; heap in use %.0f MiB; change log %.1f MiB unfolded", st, float64(mem.HeapInuse)/(1<<20),
			testutil.Metric(b, reg, "kvtier_index_log_bytes")/(1<<20))

		// The crash copy: the file as the last commit left it.
		crash := filepath.Join(dir, "crash.db")
		if err := crashCopy(ix, crash); err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		if err := ix.Close(); err != nil {
			b.Fatal(err)
		}
		closed := time.Since(t0)
		chain := []dcp.ChunkHash{indextest.Chunk(3, 0), indextest.Chunk(3, 1)}
		reopen := func(path string) (open, lookup, verify time.Duration) {
			c := cfg
			c.Path, c.Registerer = path, prometheus.NewRegistry()
			t0 := time.Now()
			ix, err := index.Open(c)
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = ix.Close() }()
			open = time.Since(t0)
			lr, err := ix.Lookup("grow", ns, chain)
			if err != nil || lr.Prefix != len(chain) {
				b.Fatalf("first lookup of %s: %+v %v", path, lr, err)
			}
			lookup = time.Since(t0)
			rep, err := ix.Verify(ctx)
			if err != nil {
				b.Fatalf("verify %s: %v %v", path, err, rep.Problems)
			}
			return open, lookup, time.Since(t0)
		}
		o1, l1, v1 := reopen(cfg.Path)
		o2, l2, v2 := reopen(crash)
		_ = os.Remove(crash)
		n := st.L1Placements
		b.Logf("at %d placements: Close (final fold) %.0f ms; restart: open %.0f ms, first lookup at %.0f ms, verified at %.0f ms; crash replay: open %.0f ms, first lookup at %.0f ms, verified at %.0f ms",
			n, ms(closed), ms(o1), ms(l1), ms(v1), ms(o2), ms(l2), ms(v2))
		closes, restarts, crashes = append(closes, ms(closed)), append(restarts, ms(l1)), append(crashes, ms(l2))
		b.ReportMetric(ms(closed), "close-ms")
		b.ReportMetric(ms(l1), "restart-to-lookup-ms")
		b.ReportMetric(ms(l2), "crash-to-lookup-ms")
	}
}

// crashCopy writes the index file as of the last commit (the snapshot
// stream without its 24-byte header) to path.
func crashCopy(ix *index.Index, path string) error {
	s, err := ix.Snapshot(ctx)
	if err != nil {
		return err
	}
	defer s.Release()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	if _, err := s.WriteTo(&skipWriter{w: w, skip: 24}); err != nil {
		_ = f.Close()
		return err
	}
	if err := w.Flush(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

type skipWriter struct {
	w    *bufio.Writer
	skip int
}

func (s *skipWriter) Write(p []byte) (int, error) {
	n := len(p)
	if s.skip > 0 {
		k := min(s.skip, len(p))
		s.skip -= k
		p = p[k:]
	}
	_, err := s.w.Write(p)
	return n, err
}

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		b.Fatalf("%s=%q: want an integer >= 0", name, v)
	}
	return n
}

// writeBytes is this process's write_bytes from /proc/self/io (bytes sent
// to the storage layer).
func writeBytes(b *testing.B) int64 {
	p, err := os.ReadFile("/proc/self/io")
	if err != nil {
		b.Fatal(err)
	}
	for line := range bytes.Lines(p) {
		if v, ok := bytes.CutPrefix(line, []byte("write_bytes: ")); ok {
			n, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n
		}
	}
	b.Fatal(errors.New("/proc/self/io has no write_bytes"))
	return 0
}
