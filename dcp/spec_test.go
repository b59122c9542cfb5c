package dcp

import (
	"reflect"
	"slices"
	"testing"
)

func mlaSpec(tp, w int) Spec {
	return Spec{
		Model: "deepseek", Layout: Layout{TP: tp, DCP: w, Interleave: 1, PP: 1}, ChunkTokens: 64 * w,
		Groups: []Group{{Kind: Attention, MLA: true, BlockSize: 64, Layers: 2, KVFormat: "fp8_ds_mla",
			SemanticBytes: 64 * 656, PageBytes: 64 * 656, StrideBytes: 64 * 656}},
	}
}

func TestWhoStoresWhat(t *testing.T) {
	cases := []struct {
		name  string
		spec  Spec
		plans []ShardPlan
	}{
		{"MLA without DCP: rank 0 stores, all read", mlaSpec(4, 1), []ShardPlan{{0, 0, []int{0, 1, 2, 3}}}},
		{"MLA with DCP4 on TP4: each rank its shard", mlaSpec(4, 4),
			[]ShardPlan{{0, 0, []int{0}}, {1, 1, []int{1}}, {2, 2, []int{2}}, {3, 3, []int{3}}}},
		{"MLA with DCP2 on TP8: TP/W readers per shard", mlaSpec(8, 2),
			[]ShardPlan{{0, 0, []int{0, 2, 4, 6}}, {1, 1, []int{1, 3, 5, 7}}}},
	}
	nonMLA := mlaSpec(4, 2)
	nonMLA.Groups[0].MLA = false
	cases = append(cases, struct {
		name  string
		spec  Spec
		plans []ShardPlan
	}{"non-MLA attention: every rank its own", nonMLA,
		[]ShardPlan{{0, 0, []int{0}}, {1, 1, []int{1}}, {2, 2, []int{2}}, {3, 3, []int{3}}}})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, err := c.spec.Resolve()
			if err != nil {
				t.Fatal(err)
			}
			got := r.Shards(0)
			if !reflect.DeepEqual(got, c.plans) {
				t.Fatalf("Shards = %+v, want %+v", got, c.plans)
			}
			// Consistency: StoreShard/ReadShard agree with the plan, and
			// Expectations lists every reader of every shard exactly once.
			for _, p := range got {
				if s, ok := r.StoreShard(0, p.Writer); !ok || s != p.Shard {
					t.Fatalf("StoreShard(%d) = %d,%v, want %d", p.Writer, s, ok, p.Shard)
				}
				for _, rd := range p.Readers {
					if r.ReadShard(0, rd) != p.Shard {
						t.Fatalf("ReadShard(%d) = %d, want %d", rd, r.ReadShard(0, rd), p.Shard)
					}
				}
			}
			exp := r.Expectations()
			if len(exp) != r.Layout.TP {
				t.Fatalf("%d expectations for TP %d", len(exp), r.Layout.TP)
			}
			for _, e := range exp {
				if !slices.Contains(got[e.Shard].Readers, e.Rank) {
					t.Fatalf("expectation %+v not in plan", e)
				}
			}
			writers := 0
			for tp := range r.Layout.TP {
				if _, ok := r.StoreShard(0, tp); ok {
					writers++
				}
			}
			if writers != len(got) {
				t.Fatalf("%d writers for %d shards", writers, len(got))
			}
			if keys := r.ObjectKeys(ChunkHash{1}); len(keys) != len(got) {
				t.Fatalf("%d object keys for %d shards", len(keys), len(got))
			}
		})
	}
}

// Changing any geometry input changes the namespace; names do not.
func TestNamespaceCoversGeometry(t *testing.T) {
	base := Spec{
		Model: "m", CacheSalt: "s", Layout: Layout{TP: 4, DCP: 2, Interleave: 2, PP: 1}, ChunkTokens: 256,
		Groups: []Group{
			{Name: "attn", Kind: Attention, BlockSize: 64, Layers: 3, KVFormat: "bf16", SemanticBytes: 64 * 32, PageBytes: 64 * 40, StrideBytes: 64 * 80},
			{Name: "ssm", Kind: Recurrent, BlockSize: 128, Layers: 1, KVFormat: "mamba", SemanticBytes: 1000, PageBytes: 1024, StrideBytes: 2048},
		},
	}
	r0, err := base.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	clone := func() Spec {
		s := base
		s.Groups = slices.Clone(base.Groups)
		return s
	}
	muts := map[string]func(*Spec){
		"model":       func(s *Spec) { s.Model = "m2" },
		"salt":        func(s *Spec) { s.CacheSalt = "" },
		"tp":          func(s *Spec) { s.Layout.TP = 8 },
		"dcp":         func(s *Spec) { s.Layout.DCP = 4; s.ChunkTokens = 256 },
		"interleave":  func(s *Spec) { s.Layout.Interleave = 1 },
		"chunk":       func(s *Spec) { s.ChunkTokens = 512 },
		"kind":        func(s *Spec) { s.Groups[0].Kind = SlidingWindow },
		"mla":         func(s *Spec) { s.Groups[0].MLA = true },
		"block size":  func(s *Spec) { s.Groups[0].BlockSize = 32 },
		"layers":      func(s *Spec) { s.Groups[0].Layers = 4 },
		"semantic":    func(s *Spec) { s.Groups[0].SemanticBytes = 64 * 31 },
		"declared":    func(s *Spec) { s.Groups[0].PageBytes = 64 * 39 },
		"stride":      func(s *Spec) { s.Groups[0].StrideBytes = 64 * 81 },
		"kv format":   func(s *Spec) { s.Groups[1].KVFormat = "mamba2" },
		"group order": func(s *Spec) { s.Groups[0], s.Groups[1] = s.Groups[1], s.Groups[0] },
		"rec span":    func(s *Spec) { s.Groups[1].BlockSize = 64 },
		"groups":      func(s *Spec) { s.Groups = s.Groups[:1] },
	}
	seen := map[Namespace]string{r0.Namespace: "base"}
	for name, mut := range muts {
		s := clone()
		mut(&s)
		r, err := s.Resolve()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if prev, dup := seen[r.Namespace]; dup {
			t.Errorf("changing %s gives the namespace of %s", name, prev)
		}
		seen[r.Namespace] = name
	}
	s := clone()
	s.Groups[0].Name = "renamed"
	if r, _ := s.Resolve(); r.Namespace != r0.Namespace {
		t.Error("a group's name changed the namespace")
	}
	// TP is in even when every group is MLA: the readers that must confirm differ.
	a, b := mlaSpec(4, 1), mlaSpec(8, 1)
	ra, _ := a.Resolve()
	rb, _ := b.Resolve()
	if ra.Namespace == rb.Namespace {
		t.Error("MLA-only layouts at TP4 and TP8 share a namespace, but expect different readers")
	}
}
