package rankd

import (
	"encoding/json"
	"os"
	"strconv"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/wire"
)

// benchRequests builds the requests of TP rank 0 in the daemon-path
// benchmark's geometry (enginesim --bench, scenario tp4dcp4, sized so a
// rank stores KVTIER_BENCH_GB GB, default 1.3): the retrieve of the whole
// prompt (every group's read shard of every chunk, the restore table's
// blocks) and its stores, per chunks per request.
func benchRequests(b *testing.B, per int) (retrieve *wire.RetrieveRequest, stores []*wire.StoreRequest) {
	b.Helper()
	gb := 1.3
	if s := os.Getenv("KVTIER_BENCH_GB"); s != "" {
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			b.Fatal(err)
		}
		gb = v
	}
	sc, err := enginesim.LookupScenario("tp4dcp4")
	if err != nil {
		b.Fatal(err)
	}
	if sc.Chunks, err = enginesim.BenchChunks(sc, gb); err != nil {
		b.Fatal(err)
	}
	p, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		b.Fatal(err)
	}
	const t = 0
	session := "5e5510a1d00000000000000000c0ffee"
	retrieve = &wire.RetrieveRequest{RestoreID: "r-00000001", Namespace: p.R.Namespace, Session: session}
	for c := range sc.Chunks {
		for gi := range p.R.Geometry {
			shard := p.R.ReadShard(gi, t)
			retrieve.Items = append(retrieve.Items, wire.RetrieveItem{Chunk: c, Group: gi,
				Key: dcp.Key{NS: p.R.Namespace, Chunk: p.Hashes[c], Shard: uint16(shard), Group: uint16(gi)},
				Sum: 0x9e3779b97f4a7c15 * uint64(c*len(p.R.Geometry)+gi+1), Source: wire.Source{Holder: wire.Rank{Instance: "engine0", TPRank: shard}, Tier: wire.L1},
				Blocks: p.ChunkBlocks(enginesim.PhaseRestoreTable, gi, c)})
		}
	}
	ev := wire.EventHandle{Backend: "cuda", Device: "GPU-5e1c0d2a-7f7e-4a8e-9c1b-0123456789ab", Raw: make([]byte, 64)}
	for c0 := 0; c0 < sc.Chunks; c0 += per {
		req := &wire.StoreRequest{RequestID: "bench-1-0", Namespace: p.R.Namespace, Session: session, Event: ev}
		for c := c0; c < min(c0+per, sc.Chunks); c++ {
			cb := wire.ChunkBlocks{Chunk: p.Hashes[c], Blocks: make([][]int64, len(p.R.Geometry))}
			for gi := range p.R.Geometry {
				cb.Blocks[gi] = []int64{}
				if _, ok := p.R.StoreShard(gi, t); ok {
					cb.Blocks[gi] = p.ChunkBlocks(enginesim.PhaseStoreTable, gi, c)
				}
			}
			req.Chunks = append(req.Chunks, cb)
		}
		stores = append(stores, req)
	}
	return retrieve, stores
}

// BenchmarkDecodeRetrieveRequest decodes the retrieve request of one rank
// of the 1.3 GB/rank daemon-path benchmark, as JSON and as binary: ns per
// item and per request, allocations.
func BenchmarkDecodeRetrieveRequest(b *testing.B) {
	req, _ := benchRequests(b, 1)
	js, err := json.Marshal(req)
	if err != nil {
		b.Fatal(err)
	}
	bin, err := req.MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	blocks := 0
	for _, it := range req.Items {
		blocks += len(it.Blocks)
	}
	for _, c := range []struct {
		name string
		data []byte
	}{{"json", js}, {"binary", bin}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(c.data)))
			for b.Loop() {
				got, err := DecodeRetrieveRequest(c.data)
				if err != nil || len(got.Items) != len(req.Items) {
					b.Fatalf("decoded %d items of %d: %v", len(got.Items), len(req.Items), err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(req.Items)), "ns/item")
			b.ReportMetric(float64(len(req.Items)), "items")
			b.ReportMetric(float64(blocks), "blocks")
			b.ReportMetric(float64(len(c.data)), "request-B")
		})
	}
}

// BenchmarkDecodeStoreRequests decodes the store requests of one rank of
// the same benchmark: one chunk per request (as enginesim --bench sent
// them) and 64, as JSON and as binary; ns per chunk and allocations per
// chunk.
func BenchmarkDecodeStoreRequests(b *testing.B) {
	for _, per := range []int{1, 64} {
		_, stores := benchRequests(b, per)
		chunks := 0
		for _, s := range stores {
			chunks += len(s.Chunks)
		}
		for _, form := range []string{"json", "binary"} {
			data := make([][]byte, len(stores))
			for i, s := range stores {
				var err error
				if form == "json" {
					data[i], err = json.Marshal(s)
				} else {
					data[i], err = s.MarshalBinary()
				}
				if err != nil {
					b.Fatal(err)
				}
			}
			b.Run(form+"/per="+strconv.Itoa(per), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					for _, d := range data {
						if _, err := DecodeStoreRequest(d); err != nil {
							b.Fatal(err)
						}
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(chunks), "ns/chunk")
				b.ReportMetric(float64(len(stores)), "requests")
			})
		}
	}
}
