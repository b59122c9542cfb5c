package transfer

import (
	"bytes"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

// TestOpaqueTailsTravel: pages whose declared size (40 B) exceeds the
// semantic shape (32 B) round-trip with their model-owned tail; the padding
// after the declared page (40 B of an 80 B stride) is never written. A
// transfer sized from the semantic shape would leave the target tails as
// they were, which this test rejects.
func TestOpaqueTailsTravel(t *testing.T) {
	spec := dcp.Spec{Model: "tail", Layout: dcp1, ChunkTokens: 4, Groups: []dcp.Group{
		{Kind: dcp.Attention, BlockSize: 1, Layers: 2, KVFormat: "bf16", SemanticBytes: 32, PageBytes: 40, StrideBytes: 80}}}
	dev := openDevice(t, "")
	r := newRig(t, dev, spec, []int64{12}) // the last page of a pool has no padding: keep it out of use
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(3, r.consecutiveN(0))
	sr := storeAll(t, e, r, "tail", c)
	if sr.Objects[0].Size != 4*2*40 {
		t.Fatalf("object of %d B, want 4 blocks x 2 layers x 40 declared bytes", sr.Objects[0].Size)
	}
	tgt := r.consecutiveN(1)
	before := r.readPages(tgt, 0, 80) // whole strides: tail and padding
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve: %+v %v", rr, err)
	}
	after := r.readPages(tgt, 0, 80)
	src := c.packed[0]
	for i := range after {
		want := src[i*40 : (i+1)*40]
		if !bytes.Equal(after[i][:40], want) {
			t.Fatalf("page %d: declared bytes differ", i)
		}
		if bytes.Equal(after[i][32:40], before[i][32:40]) {
			t.Fatalf("page %d: the opaque tail [32, 40) was not restored", i)
		}
		if !bytes.Equal(after[i][40:], before[i][40:]) {
			t.Fatalf("page %d: padding [40, 80) was written", i)
		}
	}
	r.expectRestored(c, tgt)
	r.check("after restoring tailed pages")
}

// readPages returns [from, to) of every page of blocks (group gi), layer
// by layer.
func (r *rig) readPages(blocks [][]int64, gi int, to uint64) [][]byte {
	r.t.Helper()
	g := r.res.Geometry[gi]
	var out [][]byte
	for li := range g.Layers {
		for _, b := range blocks[gi] {
			p := make([]byte, to)
			if err := r.dev.Read(r.pools[gi][li], uint64(b)*g.StrideBytes, p); err != nil {
				r.t.Fatal(err)
			}
			out = append(out, p)
		}
	}
	return out
}
