package index_test

import (
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
)

// TestResetRankInSlices (issue 28.3): ResetRank of a rank with more chunks
// than FenceSliceChunks is committed one slice per group commit (40 chunks
// in slices of 4: 10 commits), with other ranks' acknowledgements in
// between; from the first slice on, lookups and Get see none of the rank's
// placements, L1 or L2, although most are still in their chunks; the rank
// reads as reset (incarnation 0, sequence 0); it returns every placement
// dropped (45), and Verify and a reopen agree. Seen failing with the
// sliced path off (startReset returning false): the second held commit
// never came.
func TestResetRankInSlices(t *testing.T) {
	f := newSlicedFence(t, "", nil)
	r0 := wire.Rank{Instance: "a", TPRank: 0}
	before := f.commits.Load()
	f.hold.Store(true)
	type result struct {
		n   int
		err error
	}
	reset := make(chan result, 1)
	go func() {
		n, err := f.ix.ResetRank(ctx, r0)
		reset <- result{n, err}
	}()
	f.waitCommit(t, "of the first slice")
	f.proceed <- struct{}{}
	f.waitCommit(t, "of the second slice: the reset was not sliced")
	select {
	case res := <-reset:
		t.Fatalf("ResetRank returned %+v after its second commit of 10", res)
	default:
	}
	if res, err := f.ix.Lookup("a", f.ns, f.chain); err != nil || res.Prefix != 0 {
		t.Fatalf("during the reset: prefix %d, %v; want 0 (rank 0 hidden whole, its L2 copies too)", res.Prefix, err)
	}
	for _, c := range []dcp.ChunkHash{f.chain[0], f.chain[sfChunks-1]} {
		if hs := f.ix.Get(dcp.Key{NS: f.ns, Chunk: c, Shard: 0}); len(hs) != 0 {
			t.Fatalf("during the reset: Get shows %+v of rank 0", hs)
		}
	}
	if ri, _ := f.ix.Rank(r0); ri.Incarnation != 0 || ri.LastSeq != 0 || ri.Fenced {
		t.Fatalf("during the reset: %+v, want incarnation 0, seq 0, not fenced", ri)
	}
	other := wire.Batch{Rank: wire.Rank{Instance: "b", TPRank: 0}, Incarnation: 1,
		Events: []wire.Event{stored(1, wire.L1, dcp.Key{NS: f.ns, Chunk: indextest.Chunk(6, 0)}, 1, 1)}}
	p, err := f.ix.ApplyAsync(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	f.proceed <- struct{}{}
	f.waitCommit(t, "of the third slice")
	f.proceed <- struct{}{}
	f.waitCommit(t, "of the fourth slice")
	select {
	case <-p.Done():
	default:
		t.Fatal("another rank's batch queued during the reset was not acknowledged within two slices")
	}
	f.hold.Store(false)
	f.proceed <- struct{}{}
	res := <-reset
	if res.err != nil || res.n != sfChunks+5 {
		t.Fatalf("ResetRank = %d, %v; want %d placements", res.n, res.err, sfChunks+5)
	}
	if got := f.commits.Load() - before; got != sfChunks/4 {
		t.Errorf("the reset took %d commits, want %d (one per slice of 4 chunks)", got, sfChunks/4)
	}
	ri, _ := f.ix.Rank(r0)
	if ri.L1Placements != 0 || ri.L2Placements != 0 || ri.Incarnation != 0 || ri.Fenced || ri.FenceGen != 1 {
		t.Fatalf("after the reset: %+v; want nothing held, incarnation 0, fence generation 1", ri)
	}
	if res, err := f.ix.Lookup("a", f.ns, f.chain); err != nil || res.Prefix != 0 {
		t.Fatalf("after the reset: prefix %d, %v", res.Prefix, err)
	}
	for i, c := range f.chain {
		if n := f.l1Holders(dcp.Key{NS: f.ns, Chunk: c, Shard: 1}); n != 1 {
			t.Fatalf("chunk %d: rank 1's L1 copy gone (%d holders)", i, n)
		}
	}
	mustVerify(t, f.ix.Index)
	path := f.ix.path
	if err := f.ix.Close(); err != nil {
		t.Fatal(err)
	}
	ix2 := openTest(t, dirOf(path), nil)
	if ri2, _ := ix2.Rank(r0); !reflect.DeepEqual(ri2, ri) {
		t.Fatalf("after reopen: %+v, want %+v", ri2, ri)
	}
	mustVerify(t, ix2.Index)
}

// TestSlicedResetCrash: a copy of the bbolt file taken after the second
// slice of a reset is committed (most of the rank's placements still in
// the file) opens as a fully reset rank, with folds due after every commit
// (CheckpointBytes 1): every slice's record replays the whole reset.
func TestSlicedResetCrash(t *testing.T) {
	f := newSlicedFence(t, "", func(c *index.Config) { c.CheckpointBytes = 1 })
	r0 := wire.Rank{Instance: "a", TPRank: 0}
	f.hold.Store(true)
	reset := make(chan error, 1)
	go func() {
		_, err := f.ix.ResetRank(ctx, r0)
		reset <- err
	}()
	f.waitCommit(t, "of the first slice")
	f.proceed <- struct{}{}
	f.waitCommit(t, "of the second slice")
	crash := filepath.Join(t.TempDir(), "index.db")
	copyFile(t, f.ix.path, crash)
	f.hold.Store(false)
	f.proceed <- struct{}{}
	if err := <-reset; err != nil {
		t.Fatal(err)
	}
	ix2 := openTest(t, filepath.Dir(crash), nil)
	ri, ok := ix2.Rank(wire.Rank{Instance: "a", TPRank: 0})
	if !ok || ri.L1Placements != 0 || ri.L2Placements != 0 || ri.Incarnation != 0 || ri.FenceGen != 1 {
		t.Fatalf("crash copy: %+v; want reset: nothing held, incarnation 0, fence generation 1", ri)
	}
	mustVerify(t, ix2.Index)
}

// TestSlicedResetThenBatchAndFence: during a sliced reset a fence of the
// rank marks it fenced at once (nothing left to drop), and a batch of its
// real incarnation finishes the reset first and is then applied as a new
// incarnation of a rank that holds nothing (its sequence gap asks for a
// resync), as after a one-shot reset.
func TestSlicedResetThenBatchAndFence(t *testing.T) {
	f := newSlicedFence(t, "", nil)
	r0 := wire.Rank{Instance: "a", TPRank: 0}
	f.hold.Store(true)
	reset := make(chan error, 1)
	go func() {
		_, err := f.ix.ResetRank(ctx, r0)
		reset <- err
	}()
	f.waitCommit(t, "of the first slice")
	fenced := make(chan error, 1)
	go func() {
		n, err := f.ix.FenceRank(ctx, r0, 3)
		if err == nil && n != 0 {
			t.Errorf("fence during the reset dropped %d placements, want 0", n)
		}
		fenced <- err
	}()
	b := wire.Batch{Rank: r0, Incarnation: 3, Events: []wire.Event{
		stored(200, wire.L2, dcp.Key{NS: f.ns, Chunk: f.chain[0]}, 100, 7)}}
	applied := make(chan error, 1)
	var out index.Outcome
	go func() {
		var err error
		out, err = f.ix.Apply(ctx, b)
		applied <- err
	}()
	f.hold.Store(false)
	f.proceed <- struct{}{}
	for _, ch := range []chan error{reset, fenced, applied} {
		select {
		case err := <-ch:
			if err != nil {
				t.Fatal(err)
			}
		case <-f.commit:
			f.proceed <- struct{}{}
		case <-time.After(10 * time.Second):
			t.Fatal("reset, fence or batch never returned")
		}
	}
	if !out.NewIncarnation || !out.Resync || out.Applied != 0 {
		t.Fatalf("batch after the reset: %+v, want a new incarnation whose gap asks for a resync", out)
	}
	ri, _ := f.ix.Rank(r0)
	if ri.L1Placements != 0 || ri.L2Placements != 0 || ri.Incarnation != 3 || ri.FenceGen != 2 {
		t.Fatalf("after reset, fence and batch: %+v; want nothing held, incarnation 3, fence generation 2", ri)
	}
	mustVerify(t, f.ix.Index)
}
