package transfer

import (
	"bytes"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// seedCase is one row of DESIGN.md's seed geometry table as a spec, with
// the TP rank the engine under test plays.
type seedCase struct {
	name string
	spec dcp.Spec
	tp   int
}

func seedCases() []seedCase {
	const bs = 64
	layout := func(w int) dcp.Layout { return dcp.Layout{TP: w, DCP: w, Interleave: 1, PP: 1} }
	return []seedCase{
		{name: "fp8_mla_561_index_tail", spec: dcp.Spec{Model: "seed", Layout: dcp1, ChunkTokens: 2 * bs, Groups: []dcp.Group{
			{Kind: dcp.Attention, MLA: true, BlockSize: bs, Layers: 2, KVFormat: "fp8",
				SemanticBytes: bs * 528, PageBytes: bs * 561, StrideBytes: bs*561 + 37}}}},
		{name: "fp8_ds_mla_656", spec: dcp.Spec{Model: "seed", Layout: dcp1, ChunkTokens: 2 * bs, Groups: []dcp.Group{
			{Kind: dcp.Attention, MLA: true, BlockSize: bs, Layers: 2, KVFormat: "fp8_ds_mla",
				SemanticBytes: bs * 656, PageBytes: bs * 656, StrideBytes: bs * 656}}}},
		{name: "opaque_tail_32_40_80", spec: dcp.Spec{Model: "seed", Layout: dcp1, ChunkTokens: 4, Groups: []dcp.Group{
			{Kind: dcp.Attention, BlockSize: 1, Layers: 3, KVFormat: "bf16",
				SemanticBytes: 32, PageBytes: 40, StrideBytes: 80}}}},
		{name: "nvfp4_177408_in_200000", spec: dcp.Spec{Model: "seed", Layout: dcp1, ChunkTokens: 512, Groups: []dcp.Group{
			{Kind: dcp.Attention, BlockSize: 512, Layers: 2, KVFormat: "nvfp4",
				SemanticBytes: 512 * 304, PageBytes: 177408, StrideBytes: 200000}}}},
		{name: "recurrent_1085440_dcp1", spec: dcp.Spec{Model: "seed", Layout: dcp1, ChunkTokens: 2304, Groups: []dcp.Group{
			{Kind: dcp.Recurrent, BlockSize: 2304, Layers: 2, KVFormat: "mamba",
				SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 265}}}},
		// Hybrid attention + recurrent under DCP2: the attention span is
		// 16*2 = 32 tokens, the recurrent 2304; the chunk is their LCM.
		{name: "hybrid_recurrent_dcp2_tiled", tp: 1, spec: dcp.Spec{Model: "seed", Layout: layout(2), ChunkTokens: 2304, Groups: []dcp.Group{
			{Kind: dcp.Attention, BlockSize: 16, Layers: 1, KVFormat: "fp8_ds_mla",
				SemanticBytes: 16 * 656, PageBytes: 16 * 656, StrideBytes: 16 * 656},
			{Kind: dcp.Recurrent, BlockSize: 2304, Layers: 1, KVFormat: "mamba",
				SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 265}}}},
	}
}

// TestSeedGeometryRoundTrips stores every seed geometry, restores it into
// other blocks through L1, then restarts the rank (new Engine on the same
// L2 directory, new incarnation, empty L1) and restores it again from L2;
// every byte of every pool is compared, padding included.
func TestSeedGeometryRoundTrips(t *testing.T) {
	for _, sc := range seedCases() {
		t.Run(sc.name, func(t *testing.T) {
			dev := openDevice(t, "")
			res, err := sc.spec.Resolve()
			if err != nil {
				t.Fatal(err)
			}
			var blocks []int64
			for gi := range res.Groups {
				blocks = append(blocks, int64(4*res.BlocksPerChunk(gi)))
			}
			r := newRig(t, dev, sc.spec, blocks)
			l2dir := t.TempDir()
			cfg := engineConfig(t, dev, sc.tp, sc.spec.Layout.TP)
			cfg.L2Dir = l2dir
			e1 := newEngine(t, cfg)
			r.register(e1)

			// Source blocks: chunk 0 in [0, n), chunk 1 in [n, 2n), per group.
			c0 := r.newChunk(0, r.consecutiveN(0))
			c1 := r.newChunk(1, r.consecutiveN(1))
			sr := storeAll(t, e1, r, "seed", c0, c1)
			for _, o := range sr.Objects {
				if o.Status != Stored || o.Sum != checksum.Sum([]byte(r.chunkOf(o.Chunk, c0, c1).packed[o.Group])) {
					t.Fatalf("store %+v", o)
				}
				if o.Size != res.ObjectSize(o.Group) {
					t.Fatalf("object size %d, want %d (declared pages, never the semantic shape)", o.Size, res.ObjectSize(o.Group))
				}
			}
			r.check("after store (the engine never writes the engine's pages on store)")

			// Through L1 into the third and fourth slots, swapped.
			tgt := [][][]int64{r.consecutiveN(3), r.consecutiveN(2)}
			tails := r.tails(tgt)
			rr, err := e1.Retrieve(testCtx(t), r.retrieveReq(sc.tp, []chunk{c0, c1}, tgt))
			if err != nil {
				t.Fatal(err)
			}
			for _, it := range rr.Items {
				if !it.OK || it.From != wire.L1 || it.Sum != checksum.Sum(r.chunkOf(it.Chunk, c0, c1).packed[it.Group]) {
					t.Fatalf("L1 retrieve item %+v", it)
				}
			}
			r.expectRestored(c0, tgt[0])
			r.expectRestored(c1, tgt[1])
			r.check("after L1 restore")
			r.checkTailsChanged(tgt, tails)
			closeEngine(t, e1)

			// Restart: the pools are refilled with the sentinel so the L2
			// restore has to bring every byte back.
			r.resetTargets(tgt)
			cfg.Incarnation = 0
			cfg.Registerer = nil
			e2 := newEngine(t, cfg)
			if e2.Incarnation() == e1.Incarnation() {
				t.Fatal("a restarted engine kept its incarnation")
			}
			if st := e2.Stats(); st.L1Objects != 0 || st.L2Objects != int64(len(sr.Objects)) {
				t.Fatalf("after restart: %d L1 objects, %d L2 objects, want 0 and %d", st.L1Objects, st.L2Objects, len(sr.Objects))
			}
			r.register(e2)
			rr, err = e2.Retrieve(testCtx(t), r.retrieveReq(sc.tp, []chunk{c0, c1}, tgt))
			if err != nil {
				t.Fatal(err)
			}
			for _, it := range rr.Items {
				if !it.OK || it.From != wire.L2 {
					t.Fatalf("L2 retrieve item %+v", it)
				}
			}
			r.expectRestored(c0, tgt[0])
			r.expectRestored(c1, tgt[1])
			r.check("after L2 restore")
			r.checkTailsChanged(tgt, tails)
		})
	}
}

// consecutiveN returns the blocks of chunk slot k: [k*n, (k+1)*n) per group.
func (r *rig) consecutiveN(k int) [][]int64 {
	var out [][]int64
	for gi := range r.res.Geometry {
		n := r.res.BlocksPerChunk(gi)
		var ids []int64
		for b := range n {
			ids = append(ids, int64(k*n+b))
		}
		out = append(out, ids)
	}
	return out
}

func (r *rig) chunkOf(i int, cs ...chunk) chunk { return cs[i] }

// tails returns the current bytes [semantic, declared) of every target page
// of groups with an opaque tail.
func (r *rig) tails(tgt [][][]int64) map[[3]int64][]byte {
	out := map[[3]int64][]byte{}
	for _, blocks := range tgt {
		for gi, g := range r.res.Geometry {
			if g.PageBytes == g.SemanticBytes || r.image[gi] == nil {
				continue
			}
			for li := range g.Layers {
				for _, b := range blocks[gi] {
					off := uint64(b) * g.StrideBytes
					out[[3]int64{int64(gi), int64(li), b}] = bytes.Clone(r.image[gi][li][off+g.SemanticBytes : off+g.PageBytes])
				}
			}
		}
	}
	return out
}

// checkTailsChanged asserts the opaque tails of the targets were replaced:
// a transfer sized from the semantic shape would have left them as before.
func (r *rig) checkTailsChanged(tgt [][][]int64, before map[[3]int64][]byte) {
	r.t.Helper()
	for k, old := range before {
		g := r.res.Geometry[k[0]]
		got := make([]byte, g.PageBytes-g.SemanticBytes)
		off := uint64(k[2])*g.StrideBytes + g.SemanticBytes
		if err := r.dev.Read(r.pools[k[0]][k[1]], off, got); err != nil {
			r.t.Fatal(err)
		}
		if bytes.Equal(got, old) {
			r.t.Fatalf("group %d layer %d block %d: the opaque tail did not travel", k[0], k[1], k[2])
		}
	}
}

// resetTargets writes the sentinel back over the target pages (so a second
// restore must bring every byte again).
func (r *rig) resetTargets(tgt [][][]int64) {
	r.t.Helper()
	for _, blocks := range tgt {
		for gi, g := range r.res.Geometry {
			for li := range g.Layers {
				for _, b := range blocks[gi] {
					off := uint64(b) * g.StrideBytes
					n := min(g.StrideBytes, r.pools[gi][li].Size()-off)
					fresh := make([]byte, n)
					sentinelAt(fresh, off, byte(gi*16+li))
					if err := r.dev.Write(r.pools[gi][li], off, fresh[:n]); err != nil {
						r.t.Fatal(err)
					}
					copy(r.image[gi][li][off:], fresh[:n])
				}
			}
		}
	}
	r.check("after reset")
}
