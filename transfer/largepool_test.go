package transfer

import (
	"bytes"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// TestLargePoolOffsetsBeyond2GiB stores block 2198 of a pool of
// 1,007,616-byte pages (offset 2,214,739,968 > 2^31) and restores it into
// block 2196, through L1 and through L2 after a restart.
//
// Memory: the pool is 2,200 pages (2.2 GB), allocated by the host backend
// as a file in a disk-backed temp dir and mapped; only the five pages
// around the ones used are ever touched, so the test runs under -race on a
// 2-core, 24 GiB machine without holding 2.2 GB of RAM. One layer.
func TestLargePoolOffsetsBeyond2GiB(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates a 2.2 GB sparse pool")
	}
	const (
		page   = 1536 * 656 // 1,007,616 B
		blocks = 2200
		src    = 2198
		dst    = 2196
		first  = 2195 // region checked: blocks [first, blocks)
	)
	spec := dcp.Spec{Model: "seed", Layout: dcp1, ChunkTokens: 1, Groups: []dcp.Group{
		{Kind: dcp.Recurrent, BlockSize: 1, Layers: 1, KVFormat: "fp8_ds_mla", SemanticBytes: page, PageBytes: page, StrideBytes: page}}}
	dev := openDevice(t, "")
	r := newRig(t, dev, spec, []int64{blocks})
	if r.image[0] != nil {
		t.Fatal("expected a pool too large to mirror")
	}
	if off := uint64(src) * page; off <= 1<<31 {
		t.Fatalf("offset %d not beyond 2^31", off)
	}
	pool := r.pools[0][0]
	regionOff := uint64(first) * page
	region := make([]byte, uint64(blocks-first)*page)
	sentinelAt(region, regionOff, 0x77)
	if err := dev.Write(pool, regionOff, region); err != nil {
		t.Fatal(err)
	}
	check := func(what string) {
		t.Helper()
		got := make([]byte, len(region))
		if err := dev.Read(pool, regionOff, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, region) {
			for i := range got {
				if got[i] != region[i] {
					t.Fatalf("%s: byte %d of block %d differs", what, uint64(i)%page, first+uint64(i)/page)
				}
			}
		}
	}

	c := r.newChunk(7, [][]int64{{src}})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = t.TempDir()
	e1 := newEngine(t, cfg)
	r.register(e1)
	r.write(c, c.blocks, 0)
	copy(region[(src-first)*page:], c.packed[0])
	_, h := r.record()
	f, err := e1.Store(testCtx(t), r.storeReq("big", h, c))
	if err != nil {
		t.Fatal(err)
	}
	sr, err := f.Wait(testCtx(t))
	if err != nil || sr.Objects[0].Sum != checksum.Sum(c.packed[0]) {
		t.Fatalf("store %+v: %v", sr, err)
	}
	check("after store")

	tgt := [][][]int64{{{dst}}}
	rr, err := e1.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, tgt))
	if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L1 {
		t.Fatalf("L1 retrieve %+v: %v", rr, err)
	}
	copy(region[(dst-first)*page:], c.packed[0])
	check("after L1 restore")
	closeEngine(t, e1)

	// Restart; put the sentinel back on the target first.
	sentinelAt(region[(dst-first)*page:(dst-first+1)*page], uint64(dst)*page, 0x77)
	if err := dev.Write(pool, uint64(dst)*page, region[(dst-first)*page:(dst-first+1)*page]); err != nil {
		t.Fatal(err)
	}
	cfg.Incarnation, cfg.Registerer = 0, nil
	e2 := newEngine(t, cfg)
	r.register(e2)
	rr, err = e2.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, tgt))
	if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L2 {
		t.Fatalf("L2 retrieve %+v: %v", rr, err)
	}
	copy(region[(dst-first)*page:], c.packed[0])
	check("after L2 restore")
}
