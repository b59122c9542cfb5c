package transfer

import (
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
)

var dcp1 = dcp.Layout{TP: 1, DCP: 1, Interleave: 1, PP: 1}

func TestBasicRoundTripL1(t *testing.T) {
	dev := openDevice(t, "")
	spec := dcp.Spec{Model: "m", Layout: dcp1, ChunkTokens: 32, Groups: []dcp.Group{
		{Kind: dcp.Attention, BlockSize: 16, Layers: 2, SemanticBytes: 16 * 528, PageBytes: 16 * 561, StrideBytes: 16*561 + 37, KVFormat: "fp8"},
	}}
	r := newRig(t, dev, spec, []int64{16})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(1, r.consecutive(2))
	res := storeAll(t, e, r, "req", c)
	if len(res.Objects) != 1 || res.Objects[0].Status != Stored || res.Objects[0].Sum != checksum.Sum(c.packed[0]) {
		t.Fatalf("store result %+v", res)
	}
	target := r.consecutive(8)
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{target}))
	if err != nil {
		t.Fatal(err)
	}
	if !rr.ChunkOK(0) {
		t.Fatalf("retrieve %+v", rr)
	}
	r.expectRestored(c, target)
	r.check("after retrieve")
}
