package transfer

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
)

// BenchmarkRetrieveSmallObjects is the host side of a restore of many
// small chunks through the engine (issue 25.4): 1,024 chunks of one
// 16-token block of 8 layers, 256 B pages (2 KiB objects), all in L1,
// so that the host backend's copies are a small part and what is left is
// the per-object work every backend does (lookup and pins, plan, checks,
// verification, results). On an H100 the rankd spent 4-5 ms on such a
// restore with 8 KiB pages, of which ~1.2 ms were bytes (stop 62).
//
//	go test -run '^$' -bench RetrieveSmallObjects -benchmem ./transfer/
func BenchmarkRetrieveSmallObjects(b *testing.B) {
	r, e, cs := smallObjectsRig(b)
	storeSmall(b, r, e, cs)
	n := len(cs)
	tgts := make([][][]int64, n)
	for i := range tgts {
		tgts[i] = r.consecutive(int64(n + i))
	}
	req := r.retrieveReq(0, cs, tgts)
	if _, err := e.Retrieve(context.Background(), req); err != nil { // warm up
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		rr, err := e.Retrieve(context.Background(), req)
		if err != nil {
			b.Fatal(err)
		}
		for _, it := range rr.Items {
			if !it.OK {
				b.Fatalf("retrieve: chunk %d of %d failed: %+v", it.Chunk, n, it)
			}
		}
	}
	b.ReportMetric(float64(time.Since(start).Nanoseconds())/float64(b.N*n), "ns/object")
}

// smallChunks is the chunk count of the small-object benchmarks.
const smallChunks = 1024

// smallObjectsRig is an engine and 1,024 written chunks of one 16-token
// block of 8 layers, 256 B pages (2 KiB objects), L1 in 4 KiB slabs (the
// tests' default 64 KiB slabs would fill L1 and evict a quarter).
func smallObjectsRig(b *testing.B) (*rig, *Engine, []chunk) {
	spec := dcp.Spec{Model: "small", Layout: dcp1, ChunkTokens: 16, Groups: []dcp.Group{
		{Kind: dcp.Attention, BlockSize: 16, Layers: 8, KVFormat: "bf16", SemanticBytes: 256, PageBytes: 256, StrideBytes: 256}}}
	dev := openDevice(b, "")
	r := newRig(b, dev, spec, []int64{4 * smallChunks})
	cfg := engineConfig(b, dev, 0, 1)
	cfg.Logger = zap.NewNop()
	cfg.Registerer = nil
	cfg.L1SlabBytes = 4096
	e := newEngine(b, cfg)
	r.register(e)
	var cs []chunk
	for i := range smallChunks {
		c := r.newChunk(i, r.consecutive(int64(i)))
		cs = append(cs, c)
		r.write(c, c.blocks, 0)
	}
	if err := r.stream.Synchronize(context.Background()); err != nil {
		b.Fatal(err)
	}
	return r, e, cs
}

// BenchmarkStoreSmallObjects is the host side of a store of 1,024 small
// chunks in one request (hf_roundtrip.py's first store, 0.13-0.26 of CE
// on an H100 at stop 62), each op under fresh hashes, L1 only.
//
//	go test -run '^$' -bench StoreSmallObjects -benchmem ./transfer/
func BenchmarkStoreSmallObjects(b *testing.B) {
	r, e, cs := smallObjectsRig(b)
	start := time.Now()
	for i := range b.N {
		renamed := make([]chunk, len(cs))
		for k, c := range cs {
			c.hash = chunkHash((i+1)*smallChunks + k)
			renamed[k] = c
		}
		storeSmall(b, r, e, renamed)
	}
	b.ReportMetric(float64(time.Since(start).Nanoseconds())/float64(b.N*smallChunks), "ns/object")
}

// storeSmall stores cs in one request and waits for it.
func storeSmall(b *testing.B, r *rig, e *Engine, cs []chunk) {
	_, h := r.record()
	f, err := e.Store(context.Background(), r.storeReq("small", h, cs...))
	if err != nil {
		b.Fatal(err)
	}
	if _, err := f.Wait(context.Background()); err != nil {
		b.Fatal(err)
	}
}
