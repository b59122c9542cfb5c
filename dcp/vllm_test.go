package dcp

import (
	"bytes"
	"encoding/json"
	"flag"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
)

// vLLM's DCP slot mapping, restated from its source (vllm/v1/worker/
// block_table.py, _compute_slot_mapping_kernel, and MultiGroupBlockTable) in
// the form vLLM evaluates it: every DCP rank of a group computes, for every
// position, the slot in its own cache or the pad id -1 when the position is
// not local to it. Tokens are dealt inside a virtual block of
// blockSize*world positions (one block id of the scheduler's table), in runs
// of interleave positions, to ranks 0, 1, ... world-1 in turn. vLLM's DCP
// group of a TP rank t is t's run of `world` consecutive TP ranks
// (parallel_state: all_ranks.reshape(-1, dcp_size)), so its rank in the
// group is t % world.
//
// This is kept separate from Layout.LocalSlot on purpose: it spells out
// vLLM's masked form, so the test below compares two derivations.
func vllmSlots(positions, table []int64, blockSize, world, rank, interleave int) []int64 {
	vbs := int64(blockSize * world)
	w, i := int64(world), int64(interleave)
	out := make([]int64, len(positions))
	for k, pos := range positions {
		blockIndex := pos / vbs
		blockNumber := table[blockIndex]
		vOff := pos - blockIndex*vbs
		local := (vOff/i)%w == int64(rank)
		localOff := (vOff/(w*i))*i + vOff%i
		if local {
			out[k] = blockNumber*int64(blockSize) + localOff
		} else {
			out[k] = -1
		}
	}
	return out
}

// kvtier's LocalSlot agrees with vLLM's mapping on every position, for every
// rank of the group: the owner gets LocalSlot's slot, every other rank pads.
func TestLocalSlotIsVLLMSlotMapping(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 3))
	cases := 0
	for _, w := range []int{1, 2, 3, 4, 8} {
		for _, i := range []int{1, 2, 4, 8, 16, 32} {
			for _, bs := range []int{16, 32, 64} {
				if bs%i != 0 {
					continue
				}
				checkAgainstVLLM(t, Layout{TP: w * 2, DCP: w, Interleave: i, PP: 1}, bs, 1+rng.IntN(5), rng)
				cases++
			}
		}
	}
	if cases < 50 {
		t.Fatalf("only %d layouts compared", cases)
	}
}

func checkAgainstVLLM(t *testing.T, l Layout, bs, vblocks int, rng *rand.Rand) {
	t.Helper()
	table := make([]int64, vblocks)
	for k, p := range rng.Perm(vblocks * 4)[:vblocks] {
		table[k] = int64(p)
	}
	n := int64(bs * l.DCP * vblocks)
	positions := make([]int64, n)
	for p := range positions {
		positions[p] = int64(p)
	}
	perRank := make([][]int64, l.DCP)
	for r := range perRank {
		perRank[r] = vllmSlots(positions, table, bs, l.DCP, r, l.Interleave)
	}
	for _, pos := range positions {
		r, slot, err := l.LocalSlot(pos, bs, table)
		if err != nil {
			t.Fatal(err)
		}
		for q := range l.DCP {
			want := int64(-1)
			if q == r {
				want = slot
			}
			if got := perRank[q][pos]; got != want {
				t.Fatalf("%+v bs=%d pos %d: vLLM's rank %d slot %d, kvtier says owner %d slot %d",
					l, bs, pos, q, got, r, slot)
			}
		}
		// The TP ranks of DCP rank r are r, r+W, ...: Layout.DCPRank agrees
		// with vLLM's rank in the group (t % W).
		for tp := r; tp < l.TP; tp += l.DCP {
			if l.DCPRank(tp) != r {
				t.Fatalf("%+v: TP rank %d has DCP rank %d, vLLM's group rank is %d", l, tp, l.DCPRank(tp), r)
			}
		}
	}
}

// The golden vectors of vLLM's mapping, shared with the Python client's
// tests (python/tests/test_dcp.py), so kvtier.dcp.Layout.local_slot is held
// to the same cases.
//
//	go test ./dcp -run VLLMSlotGolden -update    rewrites the file
var updateGolden = flag.Bool("update", false, "rewrite dcp/testdata/vllm_dcp_slots.json")

type slotCase struct {
	DCP        int       `json:"dcp"`
	Interleave int       `json:"interleave"`
	BlockSize  int       `json:"block_size"`
	Table      []int64   `json:"table"`
	Slots      [][]int64 `json:"slots"` // [dcp rank][position]: the slot, or -1 (not local)
}

func goldenSlotCases() []slotCase {
	var out []slotCase
	for _, c := range []struct{ w, i, bs int }{{1, 1, 16}, {2, 1, 16}, {2, 2, 4}, {2, 16, 16}, {4, 1, 32},
		{4, 4, 32}, {4, 32, 32}, {8, 2, 16}, {3, 1, 16}, {3, 8, 16}} {
		table := []int64{9, 2, 14, 5}
		n := int64(c.bs * c.w * len(table))
		pos := make([]int64, n)
		for p := range pos {
			pos[p] = int64(p)
		}
		sc := slotCase{DCP: c.w, Interleave: c.i, BlockSize: c.bs, Table: table}
		for r := range c.w {
			sc.Slots = append(sc.Slots, vllmSlots(pos, table, c.bs, c.w, r, c.i))
		}
		out = append(out, sc)
	}
	return out
}

func TestVLLMSlotGolden(t *testing.T) {
	path := filepath.Join("testdata", "vllm_dcp_slots.json")
	want, err := json.Marshal(goldenSlotCases())
	if err != nil {
		t.Fatal(err)
	}
	want = append(want, '\n')
	if *updateGolden {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test ./dcp -run VLLMSlotGolden -update writes it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs from vLLM's mapping as restated here (%d B vs %d B); rerun with -update", path,
			len(got), len(want))
	}
	var cases []slotCase
	if err := json.Unmarshal(got, &cases); err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		l := Layout{TP: c.DCP, DCP: c.DCP, Interleave: c.Interleave, PP: 1}
		for pos := range c.Slots[0] {
			r, slot, err := l.LocalSlot(int64(pos), c.BlockSize, c.Table)
			if err != nil {
				t.Fatal(err)
			}
			for q := range c.DCP {
				w := int64(-1)
				if q == r {
					w = slot
				}
				if c.Slots[q][pos] != w {
					t.Fatalf("%+v pos %d rank %d: golden %d, LocalSlot owner %d slot %d", l, pos, q,
						c.Slots[q][pos], r, slot)
				}
			}
		}
	}
}
