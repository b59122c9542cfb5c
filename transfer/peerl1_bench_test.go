package transfer

import (
	"context"
	"os"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
)

// BenchmarkRetrievePeerL1: host-shared L1 on the host backend. Rank 0 of
// a TP2 MLA instance stores 32 chunks (objects of 1,343,488 B, 43 MB);
// rank 1 restores them straight from rank 0's segment (the production
// path of a TP reader: find, lease, scatter from the peer's mapping,
// verify). Reported beside it, measured in the same run over the same
// bytes: rank 0 restoring the same chunks from its own L1, memmove, and
// kvsum64; x_copy+kvsum is the peer figure over the single-core ceiling
// of a copy that hashes every byte (the host backend's scatter). With
// KVTIER_BENCH_CUDA=1 it runs on CUDA device 0 instead (the segments are
// then registered with cuMemHostRegister: the holder's read-write, the
// peer's read-only); the figures to read there are x_ce, the peer restore
// over the copy engine's host-to-device ceiling measured in the same run
// (cuda.CopyCeilingHtoD: one cuMemcpyHtoDAsync of the same bytes from a
// pinned buffer), and x_own_L1 (own L1 is cuMemHostRegister'd shared
// memory too). On the H200, from make gpu-build:
//
//	KVTIER_BENCH_CUDA=1 .gpu/transfer.test -test.run '^$' -test.bench RetrievePeerL1 -test.benchtime 5x
func BenchmarkRetrievePeerL1(b *testing.B) {
	const n = 32
	dir, err := os.MkdirTemp("/dev/shm", "kvtier-bench-")
	if err != nil {
		b.Skip("no /dev/shm")
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	l1dir, err := os.MkdirTemp("/dev/shm", "kvtier-bench-l1-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(l1dir) })
	dev := openDevice(b, dir)
	onCUDA := os.Getenv("KVTIER_BENCH_CUDA") == "1"
	if onCUDA { // the H200: the driver backend, device 0
		d, err := cuda.OpenCUDA(0)
		if err != nil {
			b.Fatalf("KVTIER_BENCH_CUDA=1: %v", err)
		}
		b.Cleanup(func() { _ = d.Close() })
		dev = d
	}
	spec := benchSpec()
	spec.Layout = dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}
	var rigs []*rig
	var engs []*Engine
	for tp := range 2 {
		r := newRig(b, dev, spec, []int64{int64(4 * 2 * n)})
		cfg := engineConfig(b, dev, tp, 2)
		cfg.Logger, cfg.Registerer = zap.NewNop(), nil
		cfg.L1Bytes, cfg.L1SlabBytes = 2*n*(2<<20), 2<<20
		cfg.HostL1Dir = l1dir
		e := newEngine(b, cfg)
		r.register(e)
		rigs, engs = append(rigs, r), append(engs, e)
	}
	var cs []chunk
	var bytes int64
	for i := range n {
		c := rigs[0].newChunk(i, rigs[0].consecutiveN(i))
		cs = append(cs, c)
		bytes += int64(len(c.packed[0]))
	}
	storeAll(b, engs[0], rigs[0], "bench", cs...)
	retrieve := func(tp int) float64 {
		tgts := make([][][]int64, n)
		for i := range tgts {
			tgts[i] = rigs[tp].consecutiveN(n + i)
		}
		req := rigs[tp].retrieveReq(tp, cs, tgts)
		if _, err := engs[tp].Retrieve(context.Background(), req); err != nil { // warm up the targets
			b.Fatal(err)
		}
		start := time.Now()
		for range b.N {
			rr, err := engs[tp].Retrieve(context.Background(), req)
			if err != nil || len(rr.FailedChunks()) > 0 {
				b.Fatalf("rank %d retrieve: %v %v", tp, err, rr.FailedChunks())
			}
		}
		return float64(bytes) * float64(b.N) / time.Since(start).Seconds() / 1e9
	}
	b.SetBytes(bytes)
	b.ResetTimer()
	peer := retrieve(1)
	b.StopTimer()
	if st := engs[1].Stats(); st.PeerL1Reads != uint64(n*(b.N+1)) || st.L2Reads != 0 {
		b.Fatalf("rank 1: %d peer reads, %d L2 reads; want %d and 0", st.PeerL1Reads, st.L2Reads, n*(b.N+1))
	}
	own := retrieve(0)
	if onCUDA {
		ce, err := cuda.CopyCeilingHtoD(dev, uint64(bytes), 5)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(ce, "ce_GB/s")
		b.ReportMetric(peer/ce, "x_ce")
		b.ReportMetric(own/ce, "x_ce_own_L1")
	}
	mm, ks := memmoveGBps(bytes), kvsumGBps(bytes)
	b.ReportMetric(peer, "GB/s")
	b.ReportMetric(own, "own_L1_GB/s")
	b.ReportMetric(mm, "memmove_GB/s")
	b.ReportMetric(ks, "kvsum64_GB/s")
	b.ReportMetric(peer/copySumGBps(mm, ks), "x_copy+kvsum")
	b.ReportMetric(peer/own, "x_own_L1")
}
