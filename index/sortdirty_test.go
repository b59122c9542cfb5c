package index

import (
	"bytes"
	"context"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
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

// TestSortDirtyEmptyAndOne: a checkpoint may fold an empty dirty list (log
// bytes of events that changed no chunk, or only a fold's rest): no
// entries, no panic; one entry is itself.
func TestSortDirtyEmptyAndOne(t *testing.T) {
	for _, dirty := range [][]dirtyRef{nil, {}} {
		if refs, prevs := sortDirty(dirty); len(refs) != 0 || len(prevs) != 0 {
			t.Fatalf("sortDirty(%v) = %v, %v; want nothing", dirty, refs, prevs)
		}
	}
	one := randomDirty(1, 3)[:1]
	if refs, prevs := sortDirty(slices.Clone(one)); len(refs) != 1 || refs[0] != one[0].ref || prevs[0] != one[0].prev {
		t.Fatalf("sortDirty(%v) = %v, %v", one, refs, prevs)
	}
}

// TestCheckpointDuringAFoldWithNothingDirty: a Checkpoint while an
// automatic fold is still sorting, with no chunk changed since the fold's
// cut, folds an empty dirty list (after the fold's rest). Seen red: the
// key sort indexed the namespaces of an empty list and the committer
// panicked.
func TestCheckpointDuringAFoldWithNothingDirty(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Path = filepath.Join(t.TempDir(), "index.db")
	cfg.NoSync = true
	cfg.Logger = zaptest.NewLogger(t)
	cfg.CheckpointBytes = 1 // every batch starts an automatic fold
	hold := make(chan struct{})
	testHookFoldSort = func() { <-hold }
	defer func() { testHookFoldSort = nil }()
	ix, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	ctx := context.Background()
	b := wire.Batch{Rank: wire.Rank{Instance: "e"}, Incarnation: 1, Events: []wire.Event{
		{Seq: 1, Kind: wire.Stored, Tier: wire.L1, Key: dcp.Key{NS: dcp.Namespace{1}}, Size: 1, Sum: 1}}}
	if _, err := ix.Apply(ctx, b); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- ix.Checkpoint(ctx) }()
	time.Sleep(200 * time.Millisecond) // the Checkpoint waits for the held sort
	select {
	case err := <-done:
		t.Fatalf("Checkpoint returned (%v) while the fold it must finish was still sorting", err)
	default:
	}
	close(hold)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if rep, err := ix.Verify(ctx); err != nil || rep.Chunks != 1 {
		t.Fatalf("verify after the checkpoint: %+v %v", rep, err)
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
