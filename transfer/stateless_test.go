package transfer

import (
	"slices"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

// hybridSpec is a Mamba / attention hybrid: group 0 a recurrent state page
// per chunk, group 1 attention.
func hybridSpec() dcp.Spec {
	s := c1Spec()
	s.Model = "hybrid"
	s.Groups = []dcp.Group{{Kind: dcp.Recurrent, BlockSize: 32, Layers: 1, KVFormat: "mamba_f32",
		SemanticBytes: 512, PageBytes: 512, StrideBytes: 512}, s.Groups[0]}
	return s
}

// TestStoreWithoutState: a hybrid's chunk stored with no block ids for its
// recurrent group (the engine kept no state at its end) stores its other
// groups' objects only; leaving out a non-recurrent group, or the only
// group of a recurrent-only spec, is still refused.
func TestStoreWithoutState(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, hybridSpec(), []int64{8, 8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	ctx := testCtx(t)
	c0 := r.newChunk(0, [][]int64{{}, {0, 1}}) // no state
	c1 := r.newChunk(1, [][]int64{{3}, {2, 3}})
	r.write(c0, c0.blocks, 0)
	r.write(c1, c1.blocks, 0)
	_, h := r.record()
	f, err := e.Store(ctx, r.storeReq("s", h, c0, c1))
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.Wait(ctx)
	if err != nil || len(res.Objects) != 3 {
		t.Fatalf("store: %+v, %v; want 3 objects (chunk 0's attention, chunk 1's state and attention)", res.Objects, err)
	}
	var got []string
	for _, o := range e.Inventory().Objects {
		got = append(got, o.Key.String()[33:]) // chunk hash, shard, group
	}
	slices.Sort(got)
	want := []string{chunkHash(0).String() + ".0.1", chunkHash(1).String() + ".0.0", chunkHash(1).String() + ".0.1"}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("inventory %v, want %v", got, want)
	}
	// Restored byte-exact: chunk 1 both groups, chunk 0 its attention.
	rq := r.retrieveReq(0, []chunk{c1}, [][][]int64{{{5}, {4, 5}}})
	rq.Items = append(rq.Items, r.retrieveReq(0, []chunk{c0}, [][][]int64{{{}, {6, 7}}}).Items[1])
	rq.Items[2].Chunk = 1
	rp, err := e.Retrieve(ctx, rq)
	if err != nil {
		t.Fatal(err)
	}
	if len(rp.Items) != 3 || len(rp.FailedChunks()) != 0 {
		t.Fatalf("retrieve: %+v", rp)
	}
	r.expectRestored(c1, [][]int64{{5}, {4, 5}})
	r.expectRestored(c0, [][]int64{{}, {6, 7}})

	c2 := r.newChunk(2, [][]int64{{4}, {}}) // attention left out
	if _, err := e.Store(ctx, r.storeReq("bad", h, c2)); err == nil || !strings.Contains(err.Error(), "group 1: 0 block ids") {
		t.Fatalf("a chunk without its attention blocks: %v, want refused", err)
	}
	if got := statelessOK(mustResolve(t, c1Spec())); got[0] {
		t.Fatal("an attention-only spec lets a store leave its group out")
	}
	only := hybridSpec()
	only.Groups = only.Groups[:1]
	if got := statelessOK(mustResolve(t, only)); got[0] {
		t.Fatal("a recurrent-only spec lets a store leave its only group out")
	}
}

func mustResolve(t *testing.T, s dcp.Spec) *dcp.Resolved {
	t.Helper()
	r, err := s.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	return r
}
