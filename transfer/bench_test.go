package transfer

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// Benchmarks of the host backend on this machine. Each reports the
// throughput of the engine path and, measured in the same run over the
// same bytes, a plain ceiling: memmove for L1, a sequential file write +
// fsync / read for L2. `make bench` runs them once each (-benchtime 1x):
// every op moves a few hundred MB.

// benchSpec: DeepSeek fp8_ds_mla rows (656 B), 64-token blocks, 8 layers,
// chunks of 4 blocks: objects of 1,343,488 B.
func benchSpec() dcp.Spec {
	return dcp.Spec{Model: "bench", Layout: dcp1, ChunkTokens: 256, Groups: []dcp.Group{
		{Kind: dcp.Attention, MLA: true, BlockSize: 64, Layers: 8, KVFormat: "fp8_ds_mla",
			SemanticBytes: 64 * 656, PageBytes: 64 * 656, StrideBytes: 64 * 656}}}
}

const benchChunks = 96 // 129 MB per op

type benchRig struct {
	*rig
	e      *Engine
	chunks []chunk
	bytes  int64
}

func newBenchRig(b *testing.B, l2 string) *benchRig {
	b.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "kvtier-bench-")
	if err != nil {
		dir = "" // no tmpfs: the pools live in a temp dir
	} else {
		b.Cleanup(func() { os.RemoveAll(dir) })
	}
	dev := openDevice(b, dir)
	r := newRig(b, dev, benchSpec(), []int64{int64(4 * 2 * benchChunks)})
	cfg := engineConfig(b, dev, 0, 1)
	cfg.Logger = zap.NewNop()
	cfg.L1Bytes = 2 * benchChunks * (2 << 20) // room for two rounds of objects
	cfg.L1SlabBytes = 2 << 20
	cfg.L2Dir = l2
	cfg.Registerer = nil
	e := newEngine(b, cfg)
	r.register(e)
	br := &benchRig{rig: r, e: e}
	for i := range benchChunks {
		c := r.newChunk(i, r.consecutiveN(i))
		br.chunks = append(br.chunks, c)
		br.bytes += int64(len(c.packed[0]))
		r.write(c, c.blocks, 0)
	}
	if err := r.stream.Synchronize(context.Background()); err != nil {
		b.Fatal(err)
	}
	return br
}

// renamed returns the chunks under fresh hashes (so stores never dedupe).
func (br *benchRig) renamed(round int) []chunk {
	out := make([]chunk, len(br.chunks))
	for i, c := range br.chunks {
		c.hash = chunkHash(round*benchChunks + i + 1_000_000)
		out[i] = c
	}
	return out
}

func (br *benchRig) store(b *testing.B, cs []chunk) {
	_, h := br.record()
	f, err := br.e.Store(context.Background(), br.storeReq("bench", h, cs...))
	if err != nil {
		b.Fatal(err)
	}
	if _, err := f.Wait(context.Background()); err != nil {
		b.Fatal(err)
	}
}

// memmoveGBps measures a plain copy of n bytes, as the L1 ceiling.
func memmoveGBps(n int64) float64 {
	src, dst := make([]byte, n), make([]byte, n)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src) // fault the pages in
	best := 0.0
	for range 3 {
		t := time.Now()
		copy(dst, src)
		best = max(best, float64(n)/time.Since(t).Seconds()/1e9)
	}
	return best
}

// kvsumGBps measures kvsum64 over n bytes: the checksum the host backend
// computes inside every gather and scatter.
func kvsumGBps(n int64) float64 {
	p := make([]byte, n)
	checksum.Sum(p)
	best := 0.0
	for range 3 {
		t := time.Now()
		checksum.Sum(p)
		best = max(best, float64(n)/time.Since(t).Seconds()/1e9)
	}
	return best
}

// copySumGBps is the single-core ceiling of the host backend's gather and
// scatter, which copy and hash every byte on one goroutine per stream:
// 1/(1/memmove + 1/kvsum64).
func copySumGBps(mm, ks float64) float64 { return 1 / (1/mm + 1/ks) }

func BenchmarkStoreL1(b *testing.B) {
	br := newBenchRig(b, "")
	br.store(b, br.renamed(-1)) // warm up: fault in all of L1; timed rounds
	br.store(b, br.renamed(-2)) // then evict the least recently used round
	b.SetBytes(br.bytes)
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		br.store(b, br.renamed(i))
	}
	gbps := float64(br.bytes) * float64(b.N) / time.Since(start).Seconds() / 1e9
	b.StopTimer()
	mm, ks := memmoveGBps(br.bytes), kvsumGBps(br.bytes)
	b.ReportMetric(gbps, "GB/s")
	b.ReportMetric(mm, "memmove_GB/s")
	b.ReportMetric(ks, "kvsum64_GB/s")
	b.ReportMetric(gbps/copySumGBps(mm, ks), "x_copy+kvsum")
}

func BenchmarkRetrieveL1(b *testing.B) {
	br := newBenchRig(b, "")
	br.store(b, br.chunks)
	tgts := make([][][]int64, benchChunks)
	for i := range tgts {
		tgts[i] = br.consecutiveN(benchChunks + i)
	}
	req := br.retrieveReq(0, br.chunks, tgts)
	if _, err := br.e.Retrieve(context.Background(), req); err != nil { // warm up the targets
		b.Fatal(err)
	}
	b.SetBytes(br.bytes)
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		rr, err := br.e.Retrieve(context.Background(), req)
		if err != nil || len(rr.FailedChunks()) > 0 {
			b.Fatalf("retrieve: %v %v", err, rr.FailedChunks())
		}
	}
	gbps := float64(br.bytes) * float64(b.N) / time.Since(start).Seconds() / 1e9
	b.StopTimer()
	mm, ks := memmoveGBps(br.bytes), kvsumGBps(br.bytes)
	b.ReportMetric(gbps, "GB/s")
	b.ReportMetric(mm, "memmove_GB/s")
	b.ReportMetric(ks, "kvsum64_GB/s")
	b.ReportMetric(gbps/copySumGBps(mm, ks), "x_copy+kvsum")
}

// dropCache asks the kernel to forget a file's (clean) cached pages, so
// reads come from the device.
func dropCache(path string) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	const fadvDontNeed = 4
	_, _, _ = syscall.Syscall6(syscall.SYS_FADVISE64, f.Fd(), 0, 0, fadvDontNeed, 0, 0)
}

// plainWrite writes objs to one file sequentially, fsyncs it and returns
// MB/s; plainRead reads it back (cold) and returns MB/s.
func plainWrite(b *testing.B, path string, objs [][]byte) float64 {
	var n int
	t := time.Now()
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	for _, o := range objs {
		if _, err := f.Write(o); err != nil {
			b.Fatal(err)
		}
		n += len(o)
	}
	if err := f.Sync(); err != nil {
		b.Fatal(err)
	}
	f.Close()
	return float64(n) / time.Since(t).Seconds() / 1e6
}

func plainRead(b *testing.B, path string, objs [][]byte) float64 {
	dropCache(path)
	var n int
	t := time.Now()
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	for _, o := range objs {
		buf := make([]byte, len(o))
		if _, err := io.ReadFull(f, buf); err != nil {
			b.Fatal(err)
		}
		n += len(o)
	}
	return float64(n) / time.Since(t).Seconds() / 1e6
}

// BenchmarkL2FileTier writes and reads objects through the file tier
// (header, temp file, fsync, rename, directory fsync; verified reads) and
// reports both as a fraction of a plain sequential write + fsync / cold
// read of the same bytes in the same directory. The VM's disk is noisy, so
// each op alternates the plain and tier measurements for several rounds
// and reports medians.
func BenchmarkL2FileTier(b *testing.B) {
	root := b.TempDir()
	ft, err := OpenFileTier(filepath.Join(root, "l2"), nil)
	if err != nil {
		b.Fatal(err)
	}
	objs := make([][]byte, 48)
	var total int64
	for i := range objs {
		objs[i] = testutil.RandomBytes(1343488, uint64(i))
		total += int64(len(objs[i]))
	}
	const rounds = 5
	b.SetBytes(total * rounds)
	ctx := context.Background()
	var w, w2, r, r2, pw, pr []float64
	mbps := func(t time.Time) float64 { return float64(total) / time.Since(t).Seconds() / 1e6 }
	put := func(ns byte, round, first, step int) error {
		for k := first; k < len(objs); k += step {
			key := dcp.Key{NS: dcp.Namespace{ns}, Chunk: chunkHash(round*1000 + k)}
			obj := L2Object{Key: key, Writer: wire.Rank{Instance: "bench"}, Size: uint64(len(objs[k])), Sum: checksum.Sum(objs[k])}
			if err := ft.Put(ctx, obj, objs[k]); err != nil {
				return err
			}
		}
		return nil
	}
	for i := range b.N {
		for j := range rounds {
			round := i*rounds + j
			plain := filepath.Join(root, fmt.Sprintf("plain-%d", round))
			pw = append(pw, plainWrite(b, plain, objs))
			t := time.Now()
			if err := put(1, round, 0, 1); err != nil {
				b.Fatal(err)
			}
			w = append(w, mbps(t))
			// The engine writes with L2Writers goroutines.
			t = time.Now()
			nw := DefaultConfig().L2Writers
			errs := make(chan error, max(nw, DefaultConfig().L2Readers))
			for g := range nw {
				go func() { errs <- put(2, round, g, nw) }()
			}
			for range nw {
				if err := <-errs; err != nil {
					b.Fatal(err)
				}
			}
			w2 = append(w2, mbps(t))
			pr = append(pr, plainRead(b, plain, objs))
			for k := range objs {
				dropCache(ft.Path(dcp.Key{NS: dcp.Namespace{1}, Chunk: chunkHash(round*1000 + k)}))
			}
			t = time.Now()
			for k, o := range objs {
				key := dcp.Key{NS: dcp.Namespace{1}, Chunk: chunkHash(round*1000 + k)}
				if _, err := ft.Get(ctx, key, [32]byte{}, make([]byte, len(o))); err != nil {
					b.Fatal(err)
				}
			}
			r = append(r, mbps(t))
			// The engine reads with L2Readers goroutines per retrieve.
			for k := range objs {
				dropCache(ft.Path(dcp.Key{NS: dcp.Namespace{2}, Chunk: chunkHash(round*1000 + k)}))
			}
			nr := DefaultConfig().L2Readers
			t = time.Now()
			for g := range nr {
				go func() {
					for k := g; k < len(objs); k += nr {
						key := dcp.Key{NS: dcp.Namespace{2}, Chunk: chunkHash(round*1000 + k)}
						_, err := ft.Get(ctx, key, [32]byte{}, make([]byte, len(objs[k])))
						if err != nil {
							errs <- err
							return
						}
					}
					errs <- nil
				}()
			}
			for range nr {
				if err := <-errs; err != nil {
					b.Fatal(err)
				}
			}
			r2 = append(r2, mbps(t))
			_ = os.Remove(plain)
		}
	}
	b.ReportMetric(median(w), "write_MB/s")
	b.ReportMetric(median(w2), "write_engine_writers_MB/s")
	b.ReportMetric(median(pw), "plain_write_fsync_MB/s")
	b.ReportMetric(median(w)/median(pw), "x_plain_write")
	b.ReportMetric(median(w2)/median(pw), "x_plain_write_engine_writers")
	b.ReportMetric(median(r), "read_MB/s")
	b.ReportMetric(median(pr), "plain_read_MB/s")
	b.ReportMetric(median(r)/median(pr), "x_plain_read")
	b.ReportMetric(median(r2), "read_engine_readers_MB/s")
	b.ReportMetric(median(r2)/median(pr), "x_plain_read_engine_readers")
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkRetrieveL2 restores objects a previous incarnation wrote, with
// an empty L1: verified L2 reads into L1, then scatter and verification.
func BenchmarkRetrieveL2(b *testing.B) {
	l2 := b.TempDir()
	br := newBenchRig(b, l2)
	br.store(b, br.chunks)
	if err := br.e.Flush(context.Background()); err != nil {
		b.Fatal(err)
	}
	tgts := make([][][]int64, benchChunks)
	for i := range tgts {
		tgts[i] = br.consecutiveN(benchChunks + i)
	}
	req := br.retrieveReq(0, br.chunks, tgts)
	b.SetBytes(br.bytes)
	b.ResetTimer()
	var elapsed time.Duration
	for range b.N {
		b.StopTimer()
		closeEngine(b, br.e)
		cfg := br.e.cfg
		cfg.Incarnation = 0
		br.e = newEngine(b, cfg)
		br.register(br.e)
		for _, c := range br.chunks {
			dropCache(br.e.L2().(*FileTier).Path(dcp.Key{NS: br.res.Namespace, Chunk: c.hash}))
		}
		b.StartTimer()
		t := time.Now()
		rr, err := br.e.Retrieve(context.Background(), req)
		elapsed += time.Since(t)
		if err != nil || len(rr.FailedChunks()) > 0 || rr.Items[0].From != wire.L2 {
			b.Fatalf("retrieve: %v %v", err, rr.FailedChunks())
		}
	}
	b.ReportMetric(float64(br.bytes)*float64(b.N)/elapsed.Seconds()/1e6, "MB/s_cold")
}
