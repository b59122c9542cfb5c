package dcp

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
)

var dcp1 = Layout{TP: 1, DCP: 1, Interleave: 1, PP: 1}

func layoutW(w int) Layout { return Layout{TP: w, DCP: w, Interleave: 1, PP: 1} }

// The seed geometry table of DESIGN.md, one row per case.
func TestSeedGeometry(t *testing.T) {
	const bs = 64
	cases := []struct {
		name   string
		layout Layout
		g      Group
		// expected verdict
		wantErr   string // substring of the rule; "" = valid
		tiled     bool
		slots     int
		slotBytes uint64
		padding   uint64
	}{
		{
			name:   "FP8 MLA row with index tail",
			layout: dcp1,
			g: Group{Kind: Attention, MLA: true, BlockSize: bs, Layers: 1, KVFormat: "fp8",
				SemanticBytes: bs * 528, PageBytes: bs * 561, StrideBytes: bs*561 + 37},
			tiled: true, slots: bs, slotBytes: 561, padding: 37,
		},
		{
			name:   "DeepSeek fp8_ds_mla",
			layout: dcp1,
			g: Group{Kind: Attention, MLA: true, BlockSize: bs, Layers: 1, KVFormat: "fp8_ds_mla",
				SemanticBytes: bs * 656, PageBytes: bs * 656, StrideBytes: bs * 656},
			tiled: true, slots: bs, slotBytes: 656, padding: 0,
		},
		{
			name:   "opaque tail 32/40/80",
			layout: dcp1,
			g: Group{Kind: Attention, BlockSize: 1, Layers: 1, KVFormat: "bf16",
				SemanticBytes: 32, PageBytes: 40, StrideBytes: 80},
			tiled: false, slots: 1, slotBytes: 40, padding: 40,
		},
		{
			name:   "packed NVFP4 page",
			layout: dcp1,
			g: Group{Kind: Attention, BlockSize: 512, Layers: 1, KVFormat: "nvfp4",
				SemanticBytes: 512 * 304, PageBytes: 177408, StrideBytes: 200000},
			tiled: false, slots: 1, slotBytes: 177408, padding: 200000 - 177408,
		},
		{
			name:   "recurrent page DCP1 exact fit",
			layout: dcp1,
			g: Group{Kind: Recurrent, BlockSize: 2304, Layers: 1, KVFormat: "mamba",
				SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 265},
			tiled: false, slots: 1, slotBytes: 1085440, padding: 0,
		},
		{
			name:   "recurrent page DCP2",
			layout: layoutW(2),
			g: Group{Kind: Recurrent, BlockSize: 2304, Layers: 1, KVFormat: "mamba",
				SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 265},
			tiled: true, slots: 2, slotBytes: 1085440 / 2,
		},
		{
			name:   "recurrent page DCP4",
			layout: layoutW(4),
			g: Group{Kind: Recurrent, BlockSize: 2304, Layers: 1, KVFormat: "mamba",
				SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 265},
			tiled: true, slots: 4, slotBytes: 1085440 / 4,
		},
		{
			name:   "recurrent page DCP8",
			layout: layoutW(8),
			g: Group{Kind: Recurrent, BlockSize: 2304, Layers: 1, KVFormat: "mamba",
				SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 265},
			tiled: true, slots: 8, slotBytes: 1085440 / 8,
		},
		{
			name:   "declared page over stride",
			layout: dcp1,
			g: Group{Kind: Attention, BlockSize: 512, Layers: 1,
				SemanticBytes: 155648, PageBytes: 177408, StrideBytes: 160000},
			wantErr: "declared page 177408 B exceeds block stride 160000 B",
		},
		{
			name:   "semantic over declared",
			layout: dcp1,
			g: Group{Kind: Attention, BlockSize: 16, Layers: 1,
				SemanticBytes: 41, PageBytes: 40, StrideBytes: 80},
			wantErr: "semantic page 41 B exceeds declared page 40 B",
		},
		{
			name:   "interleave does not divide block size",
			layout: Layout{TP: 4, DCP: 4, Interleave: 3, PP: 1},
			g: Group{Kind: Attention, BlockSize: 64, Layers: 1,
				SemanticBytes: 64, PageBytes: 64, StrideBytes: 64},
			wantErr: "DCP interleave 3 does not divide block size 64",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pg, err := c.g.Resolve(c.layout)
			if c.wantErr != "" {
				if err == nil || !errors.Is(err, ErrGeometry) || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err = %v, want ErrGeometry naming %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if pg.Tiled != c.tiled || pg.Slots != c.slots || pg.SlotBytes != c.slotBytes {
				t.Fatalf("tiled=%v slots=%d slotBytes=%d, want %v %d %d",
					pg.Tiled, pg.Slots, pg.SlotBytes, c.tiled, c.slots, c.slotBytes)
			}
			if pg.Tiled && uint64(pg.Slots)*pg.SlotBytes != pg.PageBytes {
				t.Fatalf("tiles %d x %d != declared %d", pg.Slots, pg.SlotBytes, pg.PageBytes)
			}
			if c.padding != 0 && pg.Padding() != c.padding {
				t.Fatalf("padding %d, want %d", pg.Padding(), c.padding)
			}
			if pg.LogicalTokens != c.g.BlockSize {
				t.Fatalf("logical tokens %d, want %d (kept apart from %d slots)", pg.LogicalTokens, c.g.BlockSize, pg.Slots)
			}
			// The transfer width is the declared page, never the semantic shape,
			// and the padding after it is never inside an extent.
			ext, err := pg.Extents([]int64{0, 3, 1}, 0)
			if err != nil {
				t.Fatal(err)
			}
			for i, id := range []int64{0, 3, 1} {
				if ext[i].Len != c.g.PageBytes || ext[i].Off != uint64(id)*c.g.StrideBytes {
					t.Fatalf("extent %d = %+v, want [%d, +%d)", i, ext[i], uint64(id)*c.g.StrideBytes, c.g.PageBytes)
				}
			}
		})
	}
}

func TestLargeRecurrentPoolOffsetsBeyond2To31(t *testing.T) {
	const page = 1536 * 656 // 1,007,616 B
	g := Group{Kind: Recurrent, BlockSize: 1, Layers: 1, SemanticBytes: page, PageBytes: page, StrideBytes: page}
	pg, err := g.Resolve(dcp1)
	if err != nil {
		t.Fatal(err)
	}
	pool := pg.PoolBytes(2199)
	ext, err := pg.Extents([]int64{2198}, pool)
	if err != nil {
		t.Fatal(err)
	}
	want := uint64(2198) * page
	if ext[0].Off != want || want <= 1<<31 {
		t.Fatalf("offset %d, want %d > 2^31", ext[0].Off, want)
	}
	if ext[0].Off+ext[0].Len != pool {
		t.Fatalf("last page ends at %d, pool is %d", ext[0].Off+ext[0].Len, pool)
	}
	if _, err := pg.Extents([]int64{2199}, pool); !errors.Is(err, ErrBlock) {
		t.Fatalf("block 2199 of a 2199-block pool: err = %v, want ErrBlock", err)
	}
	if _, err := pg.Extents([]int64{-1}, pool); !errors.Is(err, ErrBlock) {
		t.Fatalf("block -1: err = %v, want ErrBlock", err)
	}
	if _, err := pg.PageExtent(1 << 62); !errors.Is(err, ErrBlock) {
		t.Fatalf("block 2^62: err = %v, want overflow ErrBlock", err)
	}
}

// GLM with DCP4: attention 2304 x 4 = 9216, recurrent 2304 -> scheduler block 9216.
func TestGLMSchedulerBlock(t *testing.T) {
	s := Spec{
		Model: "glm", Layout: Layout{TP: 4, DCP: 4, Interleave: 1, PP: 1}, ChunkTokens: 9216,
		Groups: []Group{
			{Kind: Attention, MLA: true, BlockSize: 2304, Layers: 2, SemanticBytes: 2304 * 656, PageBytes: 2304 * 656, StrideBytes: 2304 * 656},
			{Kind: Recurrent, BlockSize: 2304, Layers: 2, SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 265},
		},
	}
	r, err := s.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	if r.Geometry[0].Span != 9216 || r.Geometry[1].Span != 2304 || r.SchedulerBlock != 9216 {
		t.Fatalf("spans %d, %d, scheduler block %d; want 9216, 2304, 9216",
			r.Geometry[0].Span, r.Geometry[1].Span, r.SchedulerBlock)
	}
	if r.BlocksPerChunk(0) != 1 || r.BlocksPerChunk(1) != 4 {
		t.Fatalf("blocks per chunk %d, %d; want 1, 4", r.BlocksPerChunk(0), r.BlocksPerChunk(1))
	}
	s.ChunkTokens = 4608
	if _, err := s.Resolve(); err == nil || !strings.Contains(err.Error(), "not a multiple of the scheduler block 9216") {
		t.Fatalf("chunk 4608: err = %v", err)
	}
}

func TestLayoutRules(t *testing.T) {
	for _, c := range []struct {
		l    Layout
		rule string
	}{
		{Layout{TP: 0, DCP: 1, Interleave: 1, PP: 1}, "TP size 0 must be >= 1"},
		{Layout{TP: 4, DCP: 0, Interleave: 1, PP: 1}, "DCP size 0 must be >= 1"},
		{Layout{TP: 4, DCP: 4, Interleave: 0, PP: 1}, "DCP interleave 0 must be >= 1"},
		{Layout{TP: 6, DCP: 4, Interleave: 1, PP: 1}, "TP size 6 is not divisible by DCP size 4"},
		{Layout{TP: 4, DCP: 4, Interleave: 1, PP: 0}, "PP size 0: want 1..256"},
		{Layout{TP: 4, DCP: 4, Interleave: 1, PP: 257}, "PP size 257: want 1..256"},
		{Layout{TP: 4, DCP: 4, Interleave: 1, PP: 2, PPStage: 2}, "PP stage 2 of PP size 2: want 0..1"},
		{Layout{TP: 4, DCP: 4, Interleave: 1, PP: 2, PPStage: -1}, "PP stage -1"},
		{Layout{TP: 4, DCP: 4, Interleave: 1, PP: 1, PPStage: 1}, "PP stage 1 of PP size 1"},
		{Layout{TP: 8192, DCP: 1, Interleave: 1, PP: 1}, "exceeds the supported 4096"},
	} {
		err := c.l.Validate()
		if !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), c.rule) {
			t.Errorf("%+v: err = %v, want ErrLayout naming %q", c.l, err, c.rule)
		}
	}
	if err := (Layout{TP: 8, DCP: 4, Interleave: 2, PP: 1}).Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (Layout{TP: 8, DCP: 4, Interleave: 2, PP: 4, PPStage: 3}).Validate(); err != nil {
		t.Fatal(err)
	}
}

// Each pipeline stage is a world of its own: its own namespace even when
// its groups are the same as another stage's, while PP 1 keeps the
// namespace it had before stages existed (the encoding appends nothing).
func TestPipelineStagesHaveTheirOwnNamespaces(t *testing.T) {
	base := Spec{Model: "m", Layout: Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}, ChunkTokens: 32,
		Groups: []Group{{Kind: Attention, BlockSize: 16, Layers: 2, SemanticBytes: 64, PageBytes: 64, StrideBytes: 64}}}
	r1, err := base.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	// A PP-1 namespace is pinned by wire/testdata/golden/identity.json.
	seen := map[Namespace]string{r1.Namespace: "pp1"}
	for stage := range 3 {
		s := base
		s.Layout.PP, s.Layout.PPStage = 3, stage
		r, err := s.Resolve()
		if err != nil {
			t.Fatal(err)
		}
		name := fmt.Sprintf("pp3 stage %d", stage)
		if other, dup := seen[r.Namespace]; dup {
			t.Fatalf("%s has the namespace of %s", name, other)
		}
		seen[r.Namespace] = name
		if !bytes.HasPrefix(r.canonical(), r1.canonical()) {
			t.Fatalf("%s: the encoding does not extend PP 1's", name)
		}
	}
}

func TestGroupRules(t *testing.T) {
	ok := Group{Kind: Attention, BlockSize: 16, Layers: 1, SemanticBytes: 16, PageBytes: 16, StrideBytes: 16}
	for _, c := range []struct {
		mut  func(*Group)
		rule string
	}{
		{func(g *Group) { g.Kind = 9 }, "unknown kind 9"},
		{func(g *Group) { g.Kind = Recurrent; g.MLA = true }, "MLA applies to attention groups"},
		{func(g *Group) { g.BlockSize = 0 }, "block size 0 tokens must be >= 1"},
		{func(g *Group) { g.Layers = 0 }, "layer count 0 must be >= 1"},
		{func(g *Group) { g.SemanticBytes = 0 }, "semantic page 0 B must be >= 1"},
		{func(g *Group) { g.KVFormat = strings.Repeat("x", 65) }, "KV format name is 65 bytes"},
	} {
		g := ok
		c.mut(&g)
		_, err := g.Resolve(dcp1)
		if !errors.Is(err, ErrGeometry) || !strings.Contains(err.Error(), c.rule) {
			t.Errorf("err = %v, want ErrGeometry naming %q", err, c.rule)
		}
	}
}

func TestSlotExtents(t *testing.T) {
	g := Group{Kind: Attention, BlockSize: 4, Layers: 1, SemanticBytes: 4 * 528, PageBytes: 4 * 561, StrideBytes: 4*561 + 37}
	pg, err := g.Resolve(dcp1)
	if err != nil {
		t.Fatal(err)
	}
	for s := range 4 {
		e, err := pg.SlotExtent(5, s)
		if err != nil {
			t.Fatal(err)
		}
		if e.Off != 5*pg.StrideBytes+uint64(s)*561 || e.Len != 561 {
			t.Fatalf("slot %d = %+v", s, e)
		}
	}
	if _, err := pg.SlotExtent(5, 4); !errors.Is(err, ErrBlock) {
		t.Fatalf("slot 4 of 4: err = %v", err)
	}
}
