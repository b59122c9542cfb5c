package transfer

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// The packing golden vector: the kvsum64 of objects packed from known pool
// bytes by the rankd's own plans. The vLLM connector's engine-side
// verification (python/src/kvtier/_kvsum_torch.py, kvtier_verify_on_engine)
// computes the same sums from vLLM's KV tensors and compares them with the
// coordinator's recorded ones, so it must pack exactly as the rankd does;
// python/tests/test_engine_verify.py reads this file and checks that it
// does. A change of the packing order on either side turns one of the two
// red.
//
//	go test ./transfer -run PackedObjectGolden -update-packed    rewrites the file
var updatePacked = flag.Bool("update-packed", false, "rewrite "+packedGoldenFile+" from the Go packing")

const packedGoldenFile = "../checksum/testdata/packed_object.json"

// packedGolden is the file's content.
type packedGolden struct {
	Comment   string         `json:"comment"`
	Spec      dcp.Spec       `json:"spec"`
	NumBlocks int64          `json:"num_blocks"`
	Fill      string         `json:"fill"`
	Objects   []packedObject `json:"objects"`
}

type packedObject struct {
	Chunk  int     `json:"chunk"`
	Group  int     `json:"group"`
	Blocks []int64 `json:"blocks"`
	Size   uint64  `json:"size"`
	Sum    string  `json:"sum"` // "0x" and 16 hex digits
}

// packedFill is the byte at offset off of pool (layer) p of group g.
func packedFill(g, p int, off uint64) byte {
	return byte(off*7 + (off>>8)*13 + uint64(p)*31 + uint64(g)*101 + 3)
}

// goldenMem is a pool whose bytes are packedFill's.
type goldenMem struct {
	g, p int
	size uint64
}

func (m *goldenMem) Size() uint64   { return m.size }
func (m *goldenMem) Release() error { return nil }

// packedGoldenSpec is what the connector derives (kvtier.vllm.spec) from
// a vLLM config of two groups under kvtier_pool_layout=kv_split: group 0
// FlashAttention's K/V split (2 vLLM layers of 128 B pages: 4 pools of 64 B
// half pages), group 1 MLA, block-major even under kv_split (3 layers of
// 100 B pages: a page that is not a whole number of 8-byte words, so the
// object's words straddle pages). Chunks of 16 tokens: 4 blocks of each.
func packedGoldenSpec() dcp.Spec {
	return dcp.Spec{
		Model:  "golden-pack",
		Layout: dcp.Layout{TP: 1, DCP: 1, Interleave: 1, PP: 1},
		Groups: []dcp.Group{
			{Name: "g0:FullAttentionSpec", Kind: dcp.Attention, BlockSize: 4, Layers: 4, SemanticBytes: 64,
				PageBytes: 64, StrideBytes: 64, KVFormat: "bfloat16:kv_split"},
			{Name: "g1:MLAAttentionSpec", Kind: dcp.Attention, MLA: true, BlockSize: 4, Layers: 3,
				SemanticBytes: 100, PageBytes: 100, StrideBytes: 100, KVFormat: "float8_e4m3fn"},
		},
		ChunkTokens: 16,
	}
}

// packedGoldenBlocks are the block ids of each chunk and group, shuffled
// and never vLLM's null block 0.
var packedGoldenBlocks = [][][]int64{
	{{7, 2, 9, 4}, {3, 11, 5, 8}},
	{{1, 10, 3, 6}, {6, 1, 10, 2}},
}

// spanBytes is the concatenation of spans over goldenMems.
func spanBytes(t *testing.T, spans []cuda.Span) []byte {
	t.Helper()
	var b []byte
	for _, s := range spans {
		m, ok := s.Mem.(*goldenMem)
		if !ok || s.Off+s.Len > m.size {
			t.Fatalf("span %+v outside its golden pool", s)
		}
		for o := s.Off; o < s.Off+s.Len; o++ {
			b = append(b, packedFill(m.g, m.p, o))
		}
	}
	return b
}

// TestPackedObjectGolden packs every object of the golden vector with the
// store plan (pageSpans) and the retrieve plan (planRetrieve), checks that
// they agree, and compares the sums with checksum/testdata.
func TestPackedObjectGolden(t *testing.T) {
	spec := packedGoldenSpec()
	res, err := spec.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	const numBlocks = 12
	sp := &space{res: res, pools: make([][]cuda.Mem, len(res.Groups))}
	for gi, g := range res.Geometry {
		for p := range g.Layers {
			sp.pools[gi] = append(sp.pools[gi], &goldenMem{g: gi, p: p, size: g.PoolBytes(numBlocks)})
		}
	}
	e := &Engine{}
	e.cfg.Rank = wire.Rank{Instance: "golden", TPRank: 0}
	req := RetrieveRequest{RestoreID: "golden", Namespace: res.Namespace, Session: "s"}
	for c, per := range packedGoldenBlocks {
		for gi, blocks := range per {
			if len(blocks) != res.BlocksPerChunk(gi) {
				t.Fatalf("chunk %d group %d: %d blocks, a chunk holds %d", c, gi, len(blocks), res.BlocksPerChunk(gi))
			}
			key := dcp.Key{NS: res.Namespace, Chunk: chunkHash(c), Shard: uint16(res.ReadShard(gi, 0)), Group: uint16(gi)}
			req.Items = append(req.Items, wire.RetrieveItem{Chunk: c, Group: gi, Key: key, Blocks: blocks})
		}
	}
	planned, err := e.planRetrieve(sp, req)
	if err != nil {
		t.Fatal(err)
	}
	got := packedGolden{
		Comment: "kvsum64 of objects packed by the rankd (transfer.pageSpans, planRetrieve) from pools whose byte " +
			"at offset o of pool p of group g is fill; written by go test ./transfer -run PackedObjectGolden " +
			"-update-packed, read by python/tests/test_engine_verify.py",
		Spec: spec, NumBlocks: numBlocks,
		Fill: "(o*7 + (o>>8)*13 + p*31 + g*101 + 3) mod 256",
	}
	for i, it := range req.Items {
		stored, err := e.pageSpans(sp, it.Group, it.Blocks)
		if err != nil {
			t.Fatal(err)
		}
		obj := spanBytes(t, stored)
		if back := spanBytes(t, planned[i]); !bytes.Equal(back, obj) {
			t.Fatalf("chunk %d group %d: the retrieve plan places other bytes than the store plan packed", it.Chunk, it.Group)
		}
		if uint64(len(obj)) != res.ObjectSize(it.Group) {
			t.Fatalf("chunk %d group %d: %d B packed, ObjectSize %d", it.Chunk, it.Group, len(obj), res.ObjectSize(it.Group))
		}
		got.Objects = append(got.Objects, packedObject{Chunk: it.Chunk, Group: it.Group, Blocks: it.Blocks,
			Size: uint64(len(obj)), Sum: fmt.Sprintf("%#016x", checksum.Sum(obj))})
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(got); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	if *updatePacked {
		if err := os.WriteFile(packedGoldenFile, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(packedGoldenFile)
	if err != nil {
		t.Fatalf("%v (run go test ./transfer -run PackedObjectGolden -update-packed)", err)
	}
	if !bytes.Equal(b, want) {
		t.Fatalf("%s differs from the Go packing (the packing order changed? Python's engine verification must "+
			"change with it; then run go test ./transfer -run PackedObjectGolden -update-packed)\n got %s\nwant %s",
			packedGoldenFile, b, want)
	}
}
