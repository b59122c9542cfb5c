package index_test

import (
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// hybridSpec is a TP1 Mamba / attention hybrid: group 0 a recurrent state
// page per chunk, group 1 attention.
func hybridSpec() dcp.Spec {
	s := gqaSpec(1)
	s.Groups = []dcp.Group{{Kind: dcp.Recurrent, BlockSize: 256, Layers: 1, KVFormat: "mamba_f32",
		SemanticBytes: 512, PageBytes: 512, StrideBytes: 512}, s.Groups[0]}
	return s
}

// TestLookupStateAtEnd: with LookupOpts.StateAtEnd a chunk stored without
// its state does not end a hybrid's prefix, the prefix ends on the last
// chunk with its state, and the inner chunks' missing states are never
// needed; without it (and in a namespace without recurrent groups) the
// lookup is the strict one. The same through a share group's members.
func TestLookupStateAtEnd(t *testing.T) {
	ix := openTest(t, "", nil)
	w, _ := newWorld(t, ix.Index, hybridSpec())
	// Attention of chunks 0-4 and 6 (5 missing), states at the ends of
	// chunks 1, 3 and 6; the same in L2 for a share group's reader.
	for _, tier := range []wire.Tier{wire.L1, wire.L2} {
		for _, c := range []int{0, 1, 2, 3, 4, 6} {
			w.store(rk("e1", 0), tier, c, 0, 1)
		}
		for _, c := range []int{1, 3, 5, 6} { // chunk 5: a state without its attention
			w.store(rk("e1", 0), tier, c, 0, 0)
		}
	}
	look := func(inst string, shared []string, atEnd bool, n int) index.LookupResult {
		t.Helper()
		var res index.LookupResult
		if err := ix.LookupOptsInto(&res, inst, shared, w.ns, chunks(n), index.LookupOpts{StateAtEnd: atEnd}); err != nil {
			t.Fatal(err)
		}
		if len(res.Sources) != res.Prefix*len(res.Expectations) || (len(res.Members) > 0 && len(res.Members) != len(res.Sources)) {
			t.Fatalf("%d sources, %d members for prefix %d", len(res.Sources), len(res.Members), res.Prefix)
		}
		return res
	}
	if got := look("e1", nil, false, 7); got.Prefix != 0 {
		t.Fatalf("strict lookup: prefix %d, want 0 (chunk 0 has no state)", got.Prefix)
	}
	for _, c := range []struct {
		inst   string
		shared []string
		tier   wire.Tier
	}{{"e1", nil, wire.L1}, {"e2", []string{"e1"}, wire.L2}} {
		// The chain ending at chunk 4, which has no state: back to chunk 3.
		if got := look(c.inst, c.shared, true, 5); got.Prefix != 4 {
			t.Fatalf("%s: StateAtEnd lookup of 5 chunks: prefix %d, want 4", c.inst, got.Prefix)
		}
		got := look(c.inst, c.shared, true, 7)
		// The run of attention ends before chunk 5; its last state is chunk 3's.
		if got.Prefix != 4 {
			t.Fatalf("%s: StateAtEnd lookup: prefix %d, want 4", c.inst, got.Prefix)
		}
		exp := index.ExpectFromLookup(&got, got.Prefix, true)
		if len(exp) != 4+1 {
			t.Fatalf("%s: %d expectations, want 5 (attention of 4 chunks, the state of the last): %+v", c.inst, len(exp), exp)
		}
		for _, e := range exp {
			if e.Sum != sumFor(e.Chunk, 0, e.Group, 1) || (e.Group == 0 && e.Chunk != 3) {
				t.Fatalf("%s: expectation %+v", c.inst, e)
			}
		}
		for i := range got.Prefix {
			for j, e := range got.Expectations {
				src, need := got.Source(i, j), got.Needed(i, j, got.Prefix, true)
				if need != (e.Group == 1 || i == 3) {
					t.Fatalf("%s: chunk %d group %d needed %v", c.inst, i, e.Group, need)
				}
				if need && (src.Tier != c.tier || src.Sum == 0) {
					t.Fatalf("%s: chunk %d group %d: source %+v", c.inst, i, e.Group, src)
				}
				if !got.Needed(i, j, got.Prefix, false) {
					t.Fatalf("without StateAtEnd every expectation is needed")
				}
			}
		}
		if c.shared != nil && got.SharedSources(got.Prefix, true) != 5 {
			t.Fatalf("%s: %d shared sources, want 5", c.inst, got.SharedSources(got.Prefix, true))
		}
	}
	// A namespace without recurrent groups: the option changes nothing.
	g, _ := newWorld(t, ix.Index, gqaSpec(1))
	for c := range 3 {
		g.store(rk("e3", 0), wire.L1, c, 0, 0)
	}
	g.store(rk("e3", 0), wire.L1, 0, 0, 1)
	var res index.LookupResult
	if err := ix.LookupOptsInto(&res, "e3", nil, g.ns, chunks(3), index.LookupOpts{StateAtEnd: true}); err != nil || res.Prefix != 1 {
		t.Fatalf("attention-only namespace with StateAtEnd: prefix %d (%v), want 1", res.Prefix, err)
	}
}
