package transfer

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
)

// bigSpec: 656-byte rows, 60 layers, chunks of four 16-token blocks: one
// object of 60 x 4 x 10,496 B = 2,519,040 B (2.4 MiB) per chunk.
func bigSpec() dcp.Spec {
	return dcp.Spec{Model: "big", Layout: dcp1, ChunkTokens: 64, Groups: []dcp.Group{
		{Kind: dcp.Attention, MLA: true, BlockSize: 16, Layers: 60, KVFormat: "fp8_ds_mla",
			SemanticBytes: 16 * 656, PageBytes: 16 * 656, StrideBytes: 16 * 656}}}
}

// storeConcurrently stores each chunk in a store of its own, all in flight
// at once (as an engine does for an incrementally stored prompt), and
// fails the test on any failed object.
func storeConcurrently(t *testing.T, e *Engine, r *rig, reqID string, cs []chunk, compute time.Duration) {
	t.Helper()
	var fs []*StoreFuture
	for _, c := range cs {
		r.write(c, c.blocks, compute)
		_, h := r.record()
		f, err := e.Store(testCtx(t), r.storeReq(reqID, h, c))
		if err != nil {
			t.Fatalf("Store: %v", err)
		}
		fs = append(fs, f)
	}
	for i, f := range fs {
		if _, err := f.Wait(testCtx(t)); err != nil {
			t.Fatalf("%s: store of chunk %d: %v", reqID, i, err)
		}
	}
}

// TestL1PressureWriteBackPrompts (issue 18.1): a 64 MiB write-back L1. A
// 13-chunk prompt of 31 MiB per rank stores (all its stores in flight at
// once) and restores byte-exact, also after a second such prompt pushed
// it out to L2; a prompt larger than L1 restores from L2.
func TestL1PressureWriteBackPrompts(t *testing.T) {
	dev := openDevice(t, "")
	const small, large = 13, 30
	r := newRig(t, dev, bigSpec(), []int64{4 * (2*small + large)})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes = 64 << 20
	cfg.L1SlabBytes = SlabFor(cfg.L1Bytes)
	cfg.L2Dir = t.TempDir()
	cfg.L2Policy = WriteBackOnEvict
	e := newEngine(t, cfg)
	r.register(e)
	prompt := func(base, n, first int) []chunk {
		var cs []chunk
		for i := range n {
			cs = append(cs, r.newChunk(base+i, r.consecutiveN(first+i)))
		}
		return cs
	}
	a := prompt(0, small, 0)
	b := prompt(100, small, small)
	storeConcurrently(t, e, r, "a", a, 0)
	storeConcurrently(t, e, r, "b", b, 0)
	// A's targets: the blocks B occupies (the engine reuses them).
	var tgts [][][]int64
	for i := range a {
		tgts = append(tgts, r.consecutiveN(small+i))
	}
	restoreAll(t, e, r, "prompt A after prompt B", a, tgts)

	c := prompt(200, large, 2*small)
	for i, ch := range c {
		storeAll(t, e, r, fmt.Sprint("c", i), ch)
	}
	tgts = nil
	for i := range c {
		tgts = append(tgts, r.consecutiveN(i))
	}
	restoreAll(t, e, r, "prompt C, larger than L1", c, tgts)

	// A prompt larger than L1 whose stores are all in flight at once,
	// behind a producer still computing: stores wait for room (L2 takes
	// the bytes) instead of failing.
	d := prompt(300, large, 2*small)
	storeConcurrently(t, e, r, "d", d, 40*time.Millisecond)
	tgts = nil
	for i := range d {
		tgts = append(tgts, r.consecutiveN(i))
	}
	restoreAll(t, e, r, "prompt D, stored all at once, larger than L1", d, tgts)
	if st := e.Stats(); st.BytesReadL2 == 0 || st.PinnedEvictions != 0 {
		t.Fatalf("stats %+v: want reads from L2 and no pinned eviction", st)
	}
}

// TestStoresThrottleOnFullL1 (issue 18.1): more stores in flight than L1
// can hold, behind a slow producer (each holds its room while it waits
// for its event): under write-back the later stores wait for room (L2
// takes the bytes) instead of failing no_space, and every chunk restores.
func TestStoresThrottleOnFullL1(t *testing.T) {
	dev := openDevice(t, "")
	const n = 30 // 72 MiB of objects
	r := newRig(t, dev, bigSpec(), []int64{4 * 2 * n})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes = 64 << 20
	cfg.L1SlabBytes = SlabFor(cfg.L1Bytes)
	cfg.L2Dir = t.TempDir()
	cfg.L2Policy = WriteBackOnEvict
	e := newEngine(t, cfg)
	r.register(e)
	var cs []chunk
	var tgts [][][]int64
	for i := range n {
		cs = append(cs, r.newChunk(i, r.consecutiveN(i)))
		tgts = append(tgts, r.consecutiveN(n+i))
	}
	storeConcurrently(t, e, r, "slow", cs, 100*time.Millisecond)
	if st := e.Stats(); st.StoreFailures[ReasonNoSpace] != 0 {
		t.Fatalf("%d stores failed no_space", st.StoreFailures[ReasonNoSpace])
	}
	restoreAll(t, e, r, "every chunk of a prompt stored faster than L1 drains", cs, tgts)
}

// TestRetrieveBatchesOverlap (issue 12.6): a restore larger than one
// retrieve batch (L1/4 of a 64 MiB L1 here) enqueues the scatter of batch
// b+1 before it waits for batch b, so the device is not idle while the host
// prepares the next batch; every byte still arrives.
func TestRetrieveBatchesOverlap(t *testing.T) {
	for _, serial := range []bool{false, true} {
		t.Run(fmt.Sprintf("serial=%v", serial), func(t *testing.T) { testRetrieveBatchesOverlap(t, serial) })
	}
}

// testRetrieveBatchesOverlap: with RetrieveSerialBatches (the ablation)
// every batch completes before the next is enqueued; without, they overlap.
func testRetrieveBatchesOverlap(t *testing.T, serial bool) {
	dev := openDevice(t, "")
	const n = 13 // 31 MiB: two batches of 16 MiB
	r := newRig(t, dev, bigSpec(), []int64{4 * 2 * n})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes = 64 << 20
	cfg.L1SlabBytes = SlabFor(cfg.L1Bytes)
	cfg.RetrieveSerialBatches = serial
	e := newEngine(t, cfg)
	r.register(e)
	var cs []chunk
	for i := range n {
		cs = append(cs, r.newChunk(i, r.consecutiveN(i)))
	}
	storeConcurrently(t, e, r, "p", cs, 0)
	var events []string
	batchOf := map[int]int{} // first item of a batch -> batch number
	e.hooks.scatterEnqueued = func(_ string, idx []int) {
		batchOf[idx[0]] = len(batchOf)
		events = append(events, fmt.Sprintf("enqueue %d", batchOf[idx[0]]))
	}
	e.hooks.scatterCompleted = func(_ string, idx []int) {
		events = append(events, fmt.Sprintf("complete %d", batchOf[idx[0]]))
	}
	var tgts [][][]int64
	for i := range cs {
		tgts = append(tgts, r.consecutiveN(n+i))
	}
	restoreAll(t, e, r, "prompt of two batches", cs, tgts)
	if len(batchOf) < 2 {
		t.Fatalf("%d batches (events %v): the test needs a restore of several", len(batchOf), events)
	}
	pos := map[string]int{}
	for i, ev := range events {
		pos[ev] = i
	}
	for b := 1; b < len(batchOf); b++ {
		enq, done := pos[fmt.Sprintf("enqueue %d", b)], pos[fmt.Sprintf("complete %d", b-1)]
		if serial && enq < done {
			t.Fatalf("serial batches: batch %d was enqueued before batch %d completed (events %v)", b, b-1, events)
		}
		if !serial && enq > done {
			t.Fatalf("batch %d was enqueued after batch %d completed (events %v): batches do not overlap", b, b-1, events)
		}
	}
}

// waitEvicted waits until e's L1 is at most at its high watermark: a
// placement past it kicks the evictor, which on its own goroutine brings
// L1 down to the low watermark under e.mu, so this sees L1 before or after
// that pass, never in it.
func waitEvicted(t *testing.T, e *Engine) {
	t.Helper()
	high := uint64(e.cfg.HighWatermark * float64(e.ctr.l1CapacityBytes))
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
		e.mu.Lock()
		occ := e.cat.occupied()
		e.mu.Unlock()
		if occ <= high {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("L1 still holds %d B after 20 s, high watermark %d B: the evictor did not run", occ, high)
		}
	}
}

// besideFirstBatch runs a retrieve of req on its own goroutine and, once
// the scatter of its first batch is enqueued (the rest waiting in L1),
// runs beside on the test's goroutine while the retrieve waits; then lets
// the retrieve go on and returns its result. A test that fails in beside
// still lets the retrieve finish before the engine's Close.
func besideFirstBatch(t *testing.T, e *Engine, req RetrieveRequest, beside func()) RetrieveResult {
	t.Helper()
	return besideRetrieve(t, e, req, func(reached func()) {
		e.hooks.scatterEnqueued = func(string, []int) { reached() }
	}, beside)
}

// besideRetrieve is besideFirstBatch at the point where hook's function
// first calls reached.
func besideRetrieve(t *testing.T, e *Engine, req RetrieveRequest, hook func(reached func()), beside func()) RetrieveResult {
	t.Helper()
	reached, resume := make(chan struct{}), make(chan struct{})
	var first, released sync.Once
	release := func() { released.Do(func() { close(resume) }) }
	t.Cleanup(release) // runs before newEngine's Close, registered earlier
	hook(func() {
		first.Do(func() {
			close(reached)
			<-resume
		})
	})
	type result struct {
		rr  RetrieveResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		rr, err := e.Retrieve(testCtx(t), req)
		done <- result{rr, err}
	}()
	select {
	case <-reached:
	case res := <-done:
		t.Fatalf("the retrieve ended before the point beside runs at: %+v, %v", res.rr.Items, res.err)
	}
	beside()
	release()
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	return res.rr
}

// TestRetrieveKeepsItsLaterBatches: a restore whose later batches wait in
// L1 while its first is on the device counts as their use. A store beside
// it that needs room evicts the older prompt that no restore reads, not
// the restore's waiting chunks: every chunk restores byte-exact, and the
// room came from the other prompt.
func TestRetrieveKeepsItsLaterBatches(t *testing.T) {
	testRetrieveKeepsItsChunks(t, besideFirstBatch)
}

// TestRetrieveKeepsItsChunksBeforeItsFirstCopy: the same store beside a
// restore that has not yet looked up its first batch (on the H100 a store
// evicted a restore's chunks in the milliseconds before its first copy was
// enqueued, when only that marked them used).
func TestRetrieveKeepsItsChunksBeforeItsFirstCopy(t *testing.T) {
	testRetrieveKeepsItsChunks(t, func(t *testing.T, e *Engine, req RetrieveRequest, beside func()) RetrieveResult {
		return besideRetrieve(t, e, req, func(reached func()) {
			e.hooks.retrieveTouched = func(string) { reached() }
		}, beside)
	})
}

func testRetrieveKeepsItsChunks(t *testing.T, beside func(*testing.T, *Engine, RetrieveRequest, func()) RetrieveResult) {
	dev := openDevice(t, "")
	const n = 8 // chunks of each prompt, 2.4 MiB each: two fit under the low watermark, three pass the high
	r := newRig(t, dev, bigSpec(), []int64{4 * 2 * 4 * n})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes = 64 << 20
	cfg.L1SlabBytes = SlabFor(cfg.L1Bytes)
	e := newEngine(t, cfg)
	r.register(e)
	prompt := func(base int) []chunk {
		var cs []chunk
		for i := range n {
			cs = append(cs, r.newChunk(base+i, r.consecutiveN(base+i)))
		}
		return cs
	}
	a, b, c := prompt(0), prompt(n), prompt(2*n)
	storeConcurrently(t, e, r, "a", a, 0)
	storeConcurrently(t, e, r, "b", b, 0) // newer than a
	var tgts [][][]int64
	for i := range a {
		tgts = append(tgts, r.consecutiveN(3*n+i))
	}
	rr := beside(t, e, r.retrieveReq(0, a, tgts), func() {
		// The restore has begun and a waits in L1: c needs room, and
		// a's chunks were stored before b's.
		storeConcurrently(t, e, r, "c", c, 0)
		waitEvicted(t, e)
	})
	for i := range a {
		if !rr.ChunkOK(i) {
			t.Fatalf("a restore beside a store that needs room: chunk %d of %d: %+v", i, n, rr.Items[i])
		}
		r.expectRestored(a[i], tgts[i])
	}
	r.check("a restore beside a store that needs room")
	e.mu.Lock()
	var left int
	for _, ch := range b {
		if e.cat.objs[dcp.Key{NS: r.res.Namespace, Chunk: ch.hash}] != nil {
			left++
		}
	}
	e.mu.Unlock()
	if left == n {
		t.Fatalf("all of b is still in L1: the store beside the restore needed no room, the test proves nothing")
	}
}

// TestRetrieveEvictsItsLastBatchesFirst: where a store beside a restore
// must evict some of the restore's waiting chunks, it takes those needed
// last (a retrieve touches its batches last batch first): the
// chunks that fail are a suffix of the prompt, the next batch's restore.
func TestRetrieveEvictsItsLastBatchesFirst(t *testing.T) {
	dev := openDevice(t, "")
	const n, fill = 8, 18 // 8 + 18 chunks of 2.4 MiB fill the 64 MiB L1
	r := newRig(t, dev, bigSpec(), []int64{4 * (2*n + fill)})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes = 64 << 20
	cfg.L1SlabBytes = SlabFor(cfg.L1Bytes)
	e := newEngine(t, cfg)
	r.register(e)
	var a, c []chunk
	for i := range n {
		a = append(a, r.newChunk(i, r.consecutiveN(i)))
	}
	for i := range fill {
		c = append(c, r.newChunk(n+i, r.consecutiveN(n+i)))
	}
	storeConcurrently(t, e, r, "a", a, 0)
	var tgts [][][]int64
	for i := range a {
		tgts = append(tgts, r.consecutiveN(n+fill+i))
	}
	rr := besideFirstBatch(t, e, r.retrieveReq(0, a, tgts), func() {
		storeConcurrently(t, e, r, "c", c, 0) // past the high watermark: the evictor takes the oldest
		waitEvicted(t, e)
	})
	failed := rr.FailedChunks()
	if len(failed) == 0 {
		t.Fatal("no chunk of the restore was evicted: the test proves nothing")
	}
	for k, ch := range failed {
		if want := n - len(failed) + k; ch != want {
			t.Fatalf("failed chunks %v, want the last %d (%d..%d): the restore lost chunks it needed sooner", failed, len(failed), n-len(failed), n-1)
		}
	}
	for i := range n - len(failed) {
		r.expectRestored(a[i], tgts[i])
	}
	r.check("the restored chunks placed, the failed chunks' blocks untouched")
}
