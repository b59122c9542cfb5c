package cudatest

import (
	"bytes"
	"fmt"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/cuda"
)

// PathOpener opens a fresh device whose Gather and Scatter take the copy
// path named (cuda.PathSM or cuda.PathDMA) for every transfer that moves
// bytes.
type PathOpener func(t *testing.T, path string) cuda.Device

// RunPaths checks the two copy paths against each other on the seed
// geometries: every case runs once with the copy kernels and once with the
// copy engine forced. Each run must report its path on every Gather and
// Scatter and pass the round trip's own checks (every byte of the host
// buffer and of every pool, padding included, and the sums against
// package checksum); then the two runs' host buffers, sums and pools must
// be identical. The cases are the widths of RoundTrip at random pages (one
// copy per page), runs of consecutive pages (one long copy per run, or
// one 2D copy where padding separates the pages), objects back to back in
// the host buffer (copies that cross objects), pages gathered twice, the
// multi-pool objects of MultiMem and the 8B model's pages (32 KiB K or V
// halves, 64 KiB block-major pages, two layers).
func RunPaths(t *testing.T, open PathOpener) {
	for _, pc := range pathCases() {
		t.Run(pc.name, func(t *testing.T) {
			var res [2]rtResult
			for k, path := range []string{cuda.PathSM, cuda.PathDMA} {
				c := pc.c
				c.path = path
				res[k] = roundTrip(t, openDev(t, func(t *testing.T) cuda.Device { return open(t, path) }), c)
			}
			sm, dma := res[0], res[1]
			if !slices.Equal(sm.gsums, dma.gsums) || !slices.Equal(sm.ssums, dma.ssums) {
				t.Fatalf("sums differ: sm gather %x scatter %x, dma gather %x scatter %x", sm.gsums, sm.ssums, dma.gsums, dma.ssums)
			}
			if !bytes.Equal(sm.host, dma.host) {
				t.Fatalf("host buffers differ: %v", diff(dma.host, sm.host))
			}
			for l := range sm.pools {
				if !bytes.Equal(sm.pools[l], dma.pools[l]) {
					t.Fatalf("destination pool %d differs: %v", l, diff(dma.pools[l], sm.pools[l]))
				}
			}
		})
	}
}

type pathCase struct {
	name string
	c    rtCase
}

// runs returns lists of n consecutive pages from first on, k lists.
func runs(first, n, k int) [][]int {
	var out [][]int
	for i := range k {
		l := make([]int, n)
		for j := range l {
			l[j] = first + i*n + j
		}
		out = append(out, l)
	}
	return out
}

func seq(first, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = first + i
	}
	return s
}

func pathCases() []pathCase {
	var cs []pathCase
	for wi, w := range widths {
		blocks := min(max(int((1<<20)/(w+37)), 3), 12)
		cs = append(cs, pathCase{fmt.Sprintf("random/width=%d", w), rtCase{
			layers: []layer{{w, w + 37, 7}},
			blocks: blocks,
			maxPer: 3,
			seed:   uint64(3000 + wi),
		}})
	}
	for _, w := range []uint64{16, 561, 4096, 65536} {
		for _, sc := range []struct {
			name   string
			stride uint64
			offs   []uint64
		}{
			{"contiguous", w, nil},
			{"2d", w + 37, nil},
			{"contiguous,back-to-back", w, []uint64{0}},
			{"2d,back-to-back", w + 37, []uint64{3, 0}},
		} {
			cs = append(cs, pathCase{fmt.Sprintf("runs/width=%d/%s", w, sc.name), rtCase{
				layers:   []layer{{w, sc.stride, 5}},
				blocks:   24,
				lists:    runs(0, 4, 3),
				dests:    seq(12, 12),
				hostOffs: sc.offs,
				seed:     4000 + w,
			}})
		}
	}
	cs = append(cs,
		pathCase{"duplicates", rtCase{
			layers: []layer{{561, 598, 0}, {17, 17, 5}},
			blocks: 8,
			lists:  [][]int{{2, 2, 2}, {0}, {2}, {5, 0, 5}},
			seed:   1002,
		}},
		pathCase{"multi-pool", rtCase{
			layers: []layer{{561 * 16, 561*16 + 37, 0}, {656 * 16, 656 * 16, 3}, {40, 80, 0}, {177408, 200000, 1}, {1, 1, 0}},
			blocks: 8,
			maxPer: 3,
			seed:   1001,
		}},
		pathCase{"8b/kv_split", rtCase{
			layers:   []layer{{32 << 10, 32 << 10, 0}, {32 << 10, 32 << 10, 0}, {32 << 10, 32 << 10, 0}, {32 << 10, 32 << 10, 0}},
			blocks:   32,
			lists:    runs(0, 4, 4),
			dests:    seq(16, 16),
			hostOffs: []uint64{0},
			seed:     5001,
		}},
		pathCase{"8b/block_major", rtCase{
			layers:   []layer{{64 << 10, 64 << 10, 0}, {64 << 10, 64 << 10, 0}},
			blocks:   32,
			lists:    [][]int{{0, 1, 2, 3}, {9, 8, 7}, {20, 21}},
			dests:    []int{16, 17, 18, 19, 4, 5, 6, 25, 27},
			hostOffs: []uint64{0},
			seed:     5002,
		}},
	)
	return cs
}
