package enginesim

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

func plans(t *testing.T) []*Plan {
	t.Helper()
	var out []*Plan
	for _, name := range ScenarioNames() {
		sc, err := LookupScenario(name)
		if err != nil {
			t.Fatal(err)
		}
		p, err := NewPlan(sc, 1)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

// TokenPos inverts vLLM's local slot formula for every row of every block.
func TestTokenPosInvertsLocalSlot(t *testing.T) {
	for _, p := range plans(t) {
		for gi, g := range p.R.Geometry {
			if g.Kind == dcp.Recurrent || !g.Tiled {
				continue
			}
			table := p.Tables[PhaseStoreTable][gi]
			// The layout's table maps virtual blocks of span tokens.
			for d := range p.R.Layout.DCP {
				for v := range 3 {
					for j := range g.Slots {
						pos := p.TokenPos(gi, v, j, d)
						rank, slot, err := p.R.Layout.LocalSlot(pos, g.BlockSize, table)
						if err != nil {
							t.Fatal(err)
						}
						if rank != d || slot != table[v]*int64(g.BlockSize)+int64(j) {
							t.Fatalf("%s group %s: v %d row %d rank %d -> pos %d -> rank %d slot %d",
								p.Scenario.Name, g.Name, v, j, d, pos, rank, slot)
						}
					}
				}
			}
		}
	}
}

func TestPlanIsDeterministicAndVerifies(t *testing.T) {
	for _, p := range plans(t) {
		q, _ := NewPlan(p.Scenario, 1)
		if q.Hashes[len(q.Hashes)-1] != p.Hashes[len(p.Hashes)-1] || len(p.Hashes) != p.Scenario.Chunks {
			t.Fatalf("%s: chunk hashes differ between two plans or count %d", p.Scenario.Name, len(p.Hashes))
		}
		gi := 0 // the 561-byte rows with a 37-byte pad
		img := make([]byte, p.AllocBytes(gi))
		p.Blank(gi, img)
		for c := range p.Scenario.Chunks {
			for l := range p.R.Geometry[gi].Layers {
				for k, b := range p.ChunkBlocks(PhaseRestoreTable, gi, c) {
					off := p.PageOffset(gi, l, b)
					p.Page(1, gi, l, c*p.BPC[gi]+k, img[off:off+p.R.Geometry[gi].PageBytes])
				}
			}
		}
		if m := p.Verify(1, gi, PhaseRestoreTable, img, nil); m.Outside != 0 || len(m.Chunks) != 0 {
			t.Fatalf("%s: a correct image fails: %+v", p.Scenario.Name, m)
		}
		// A changed padding byte, a changed page byte of chunk 2.
		pad := p.PageOffset(gi, 1, 0) + p.R.Geometry[gi].PageBytes + 3
		img[pad] ^= 1
		b := p.ChunkBlocks(PhaseRestoreTable, gi, 2)[0]
		img[p.PageOffset(gi, 0, b)+560] ^= 0x80
		m := p.Verify(1, gi, PhaseRestoreTable, img, nil)
		if m.Outside != 1 || m.Chunks[2] != 1 || len(m.Chunks) != 1 {
			t.Fatalf("%s: want 1 padding and 1 chunk-2 difference, got %+v", p.Scenario.Name, m)
		}
		if m := p.Verify(1, gi, PhaseRestoreTable, img, map[int]bool{2: true}); m.Outside != 1 || len(m.Chunks) != 0 {
			t.Fatalf("%s: skipped chunk still counted: %+v", p.Scenario.Name, m)
		}
		// MLA content is the same on the TP ranks that read one shard.
		if p.R.Layout.DCP == 1 {
			a, b := make([]byte, p.R.Geometry[gi].PageBytes), make([]byte, p.R.Geometry[gi].PageBytes)
			p.Page(0, gi, 0, 5, a)
			p.Page(3, gi, 0, 5, b)
			if string(a) != string(b) {
				t.Fatal("MLA page differs between TP ranks 0 and 3 at DCP1")
			}
		}
	}
}

// TestPlanTokensSharePrefix: two replayed prompts that share their first
// chunk under one seed share its chunk hash and every byte of its pages on
// every rank; the second chunk differs; a prompt of the wrong length is
// refused with the numbers.
func TestPlanTokensSharePrefix(t *testing.T) {
	sc, err := LookupScenario("tp4dcp4")
	if err != nil {
		t.Fatal(err)
	}
	ct := sc.Spec.ChunkTokens
	mk := func(second uint32) []uint32 {
		tok := make([]uint32, 2*ct)
		for i := range tok {
			tok[i] = uint32(i % 1000)
			if i >= ct {
				tok[i] = second + uint32(i%7)
			}
		}
		return tok
	}
	ps := make([]*Plan, 2)
	for i, second := range []uint32{5000, 6000} {
		s := sc
		s.Tokens, s.Chunks, s.TailTokens = mk(second), 2, 0
		if ps[i], err = NewPlan(s, 1); err != nil {
			t.Fatal(err)
		}
	}
	a, b := ps[0], ps[1]
	if a.Hashes[0] != b.Hashes[0] {
		t.Fatalf("shared first chunk hashes differ: %v vs %v", a.Hashes[0], b.Hashes[0])
	}
	if a.Hashes[1] == b.Hashes[1] {
		t.Fatalf("different second chunks share hash %v", a.Hashes[1])
	}
	for gi, g := range a.R.Geometry {
		pa, pb := make([]byte, g.PageBytes), make([]byte, g.PageBytes)
		for tp := range a.R.Layout.TP {
			for v := range a.BPC[gi] { // the blocks of chunk 0
				a.Page(tp, gi, 0, v, pa)
				b.Page(tp, gi, 0, v, pb)
				if !bytes.Equal(pa, pb) {
					t.Fatalf("group %s rank %d virtual block %d of the shared chunk differs", g.Name, tp, v)
				}
			}
		}
	}
	s := sc
	s.Tokens, s.Chunks, s.TailTokens = mk(1)[:ct+3], 2, 0
	if _, err := NewPlan(s, 1); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("prompt of %d tokens, want 2 chunks x %d + 0 tail = %d", ct+3, ct, 2*ct)) {
		t.Fatalf("wrong-length prompt: %v", err)
	}
}
