package index

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

// randomDirty is n dirty entries over a few namespaces, some chunks twice
// (deleted and re-created in the epoch: noRecord second).
func randomDirty(n int, seed uint64) []dirtyRef {
	r := rand.New(rand.NewPCG(seed, 7))
	var nss [3]dcp.Namespace
	for i := range nss {
		for j := range nss[i] {
			nss[i][j] = byte(r.Uint32())
		}
	}
	nss[2] = nss[1]
	nss[2][15] ^= 1 // differs from nss[1] in its last byte only
	out := make([]dirtyRef, 0, n)
	for len(out) < n {
		var d dirtyRef
		d.ref.ns = nss[r.IntN(len(nss))]
		for j := range d.ref.chunk {
			d.ref.chunk[j] = byte(r.Uint32())
		}
		if r.IntN(4) == 0 {
			d.ref.chunk[0], d.ref.chunk[8] = 0, 0 // equal leading bytes: the later halves decide
		}
		if len(out) > 0 && r.IntN(8) == 0 {
			// The first half of another entry's chunk: a key sort's prefix
			// ties, which the full comparison must order.
			copy(d.ref.chunk[:8], out[r.IntN(len(out))].ref.chunk[:8])
		}
		d.prev = r.Uint32N(5)
		out = append(out, d)
		if r.IntN(8) == 0 && len(out) < n {
			out = append(out, dirtyRef{ref: d.ref, prev: noRecord})
		}
	}
	return out
}

// TestSortDirtyOrder: sortDirty orders refs as their snapshot keys sort
// (bytes of the namespace, then of the chunk) and keeps each chunk's first
// entry by prev, against a reference sort with bytes.Compare: by its key
// sort (a few namespaces, chunks sharing their first 8 bytes, the same
// chunk twice) and by the comparison sort it falls back to (more
// namespaces than the key holds).
func TestSortDirtyOrder(t *testing.T) {
	for seed := range uint64(24) {
		dirty := randomDirty(5000, seed)
		if seed%4 == 3 {
			for i := range dirty {
				dirty[i].ref.ns[0] = byte(i % 100) // 100 namespaces or more: the fallback
			}
			if keyOrder(slices.Clone(dirty)) != nil {
				t.Fatal("keyOrder took a list of more namespaces than its key holds")
			}
		} else if keyOrder(slices.Clone(dirty)) == nil {
			t.Fatal("keyOrder refused a list of three namespaces")
		}
		want := slices.Clone(dirty)
		slices.SortStableFunc(want, func(a, b dirtyRef) int {
			k := append(append([]byte(nil), a.ref.ns[:]...), a.ref.chunk[:]...)
			l := append(append([]byte(nil), b.ref.ns[:]...), b.ref.chunk[:]...)
			if c := bytes.Compare(k, l); c != 0 {
				return c
			}
			switch {
			case a.prev < b.prev:
				return -1
			case a.prev > b.prev:
				return 1
			}
			return 0
		})
		want = slices.CompactFunc(want, func(a, b dirtyRef) bool { return a.ref == b.ref })
		refs, prevs := sortDirty(dirty)
		if len(refs) != len(want) {
			t.Fatalf("seed %d: %d refs, want %d", seed, len(refs), len(want))
		}
		for i := range want {
			if refs[i] != want[i].ref || prevs[i] != want[i].prev {
				t.Fatalf("seed %d: entry %d is %v/%d, want %v/%d", seed, i, refs[i], prevs[i], want[i].ref, want[i].prev)
			}
		}
	}
}

// BenchmarkSortDirty: a fold's sort of one million dirty chunks.
func BenchmarkSortDirty(b *testing.B) {
	src := randomDirty(1<<20, 1)
	work := make([]dirtyRef, len(src))
	for b.Loop() {
		copy(work, src)
		sortDirty(work)
	}
}
