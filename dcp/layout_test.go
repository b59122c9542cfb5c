package dcp

import (
	"math/rand/v2"
	"testing"
)

// Every position is owned by exactly one DCP rank, and each rank's local
// slots are dense and collision-free: a block of blockSize slots per
// virtual block, each used exactly once.
func checkOwnership(t *testing.T, l Layout, blockSize, vblocks int, rng *rand.Rand) {
	t.Helper()
	// A block table of distinct physical block ids, in random order.
	table := make([]int64, vblocks)
	for i, p := range rng.Perm(vblocks * 3)[:vblocks] {
		table[i] = int64(p)
	}
	used := make([]map[int64]int64, l.DCP) // rank -> slot -> position
	for r := range used {
		used[r] = map[int64]int64{}
	}
	n := int64(blockSize * l.DCP * vblocks)
	perRank := make([]int64, l.DCP)
	for pos := int64(0); pos < n; pos++ {
		r, slot, err := l.LocalSlot(pos, blockSize, table)
		if err != nil {
			t.Fatal(err)
		}
		if r != l.Owner(pos, blockSize) {
			t.Fatalf("pos %d: LocalSlot rank %d != Owner %d", pos, r, l.Owner(pos, blockSize))
		}
		if prev, dup := used[r][slot]; dup {
			t.Fatalf("%+v bs=%d: positions %d and %d share rank %d slot %d", l, blockSize, prev, pos, r, slot)
		}
		used[r][slot] = pos
		perRank[r]++
		// The slot lies in the physical block the table names for its virtual block.
		vb := pos / int64(blockSize*l.DCP)
		if slot/int64(blockSize) != table[vb] {
			t.Fatalf("pos %d: slot %d outside block %d", pos, slot, table[vb])
		}
	}
	for r, c := range perRank {
		if c != int64(blockSize*vblocks) {
			t.Fatalf("%+v bs=%d: rank %d owns %d positions, want %d", l, blockSize, r, c, blockSize*vblocks)
		}
		// Dense: every slot of every block in the table is used.
		for _, b := range table {
			for s := range int64(blockSize) {
				if _, ok := used[r][b*int64(blockSize)+s]; !ok {
					t.Fatalf("%+v bs=%d: rank %d slot %d of block %d unused", l, blockSize, r, s, b)
				}
			}
		}
	}
}

func TestOwnershipDenseAndCollisionFree(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	for _, w := range []int{1, 2, 4, 8} {
		for _, i := range []int{1, 2, 4, 16} {
			for _, bs := range []int{16, 64} {
				if bs%i != 0 {
					continue
				}
				l := Layout{TP: w * 2, DCP: w, Interleave: i, PP: 1}
				if err := l.Validate(); err != nil {
					t.Fatal(err)
				}
				checkOwnership(t, l, bs, 3, rng)
			}
		}
	}
}

// Property test over random sizes.
func TestOwnershipRandomSizes(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 9))
	for range 200 {
		w := []int{1, 2, 4, 8}[rng.IntN(4)]
		i := 1 + rng.IntN(8)
		bs := i * (1 + rng.IntN(12))
		checkOwnership(t, Layout{TP: w, DCP: w, Interleave: i, PP: 1}, bs, 1+rng.IntN(4), rng)
	}
}

// The vLLM formula, spelled out on a small case: W=2, I=2, block size 4.
func TestLocalSlotExample(t *testing.T) {
	l := Layout{TP: 2, DCP: 2, Interleave: 2, PP: 1}
	table := []int64{5, 9}
	want := []struct {
		rank int
		slot int64
	}{
		{0, 20}, {0, 21}, {1, 20}, {1, 21}, {0, 22}, {0, 23}, {1, 22}, {1, 23},
		{0, 36}, {0, 37}, {1, 36}, {1, 37}, {0, 38}, {0, 39}, {1, 38}, {1, 39},
	}
	for pos, w := range want {
		r, s, err := l.LocalSlot(int64(pos), 4, table)
		if err != nil || r != w.rank || s != w.slot {
			t.Fatalf("pos %d: rank %d slot %d err %v, want %d %d", pos, r, s, err, w.rank, w.slot)
		}
	}
	if _, _, err := l.LocalSlot(16, 4, table); err == nil {
		t.Fatal("position past the block table accepted")
	}
	if _, _, err := l.LocalSlot(-1, 4, table); err == nil {
		t.Fatal("negative position accepted")
	}
}
