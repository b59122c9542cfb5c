package transfer

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// readChunk reads back the declared pages of blocks (layer-major, block
// order) from the pools: what a restore placed.
func (r *rig) readChunk(blocks [][]int64) [][]byte {
	r.t.Helper()
	var out [][]byte
	for gi, g := range r.res.Geometry {
		var b []byte
		for li := range g.Layers {
			for _, id := range blocks[gi] {
				p := make([]byte, g.PageBytes)
				if err := r.dev.Read(r.pools[gi][li], uint64(id)*g.StrideBytes, p); err != nil {
					r.t.Fatal(err)
				}
				b = append(b, p...)
			}
		}
		out = append(out, b)
	}
	return out
}

// TestL1PressureWriteBack runs concurrent stores and retrieves through an
// L1 far smaller than the working set with write-back to L2: no pinned
// object is ever evicted, and every stored object is retrievable
// byte-exact afterwards (from L1 or L2).
func TestL1PressureWriteBack(t *testing.T) {
	// One-slab objects: 2 layers x 2 blocks x 10,496 B = 41,984 B in 64 KiB
	// slabs, 12 slabs for 48 objects.
	t.Run("one_slab_objects", func(t *testing.T) {
		runPressure(t, c1Spec(), 64<<10, 12*(64<<10))
	})
	// Objects of 11 slabs (41,984 B) and of 1 slab (1,280 B) in 4 KiB slabs:
	// fragmentation, multi-slab placement and window eviction.
	t.Run("mixed_multi_slab_objects", func(t *testing.T) {
		runPressure(t, twoGroupSpec(), 4<<10, 80*(4<<10))
	})
}

func runPressure(t *testing.T, spec dcp.Spec, slab, l1 uint64) {
	const (
		storers    = 3
		perStorer  = 16
		retrievers = 2
		nChunks    = storers * perStorer
	)
	dev := openDevice(t, "")
	var blocks []int64
	for range spec.Groups {
		blocks = append(blocks, 2*(nChunks+retrievers+1))
	}
	r := newRig(t, dev, spec, blocks)
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1SlabBytes, cfg.L1Bytes = slab, l1
	cfg.HighWatermark, cfg.LowWatermark = 0.75, 0.5
	cfg.L2Dir = t.TempDir()
	cfg.L2Policy = WriteBackOnEvict
	cfg.Streams = 3
	e := newEngine(t, cfg)
	var pinnedEvicted atomic.Int64
	e.hooks.evicting = func(_ dcp.Key, pins int) {
		if pins > 0 {
			pinnedEvicted.Add(1)
		}
	}
	r.register(e)

	chunks := make([]chunk, nChunks)
	for i := range chunks {
		chunks[i] = r.newChunk(i, r.consecutiveN(i))
	}
	var (
		mu     sync.Mutex
		stored []int
		wg     sync.WaitGroup
		done   = make(chan struct{})
		errs   = make(chan error, 100)
	)
	var writeMu sync.Mutex // one engine-side writer at a time keeps uploads and records paired
	for s := range storers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range perStorer {
				i := s*perStorer + k
				writeMu.Lock()
				r.write(chunks[i], chunks[i].blocks, 0)
				_, h := r.record()
				writeMu.Unlock()
				f, err := e.Store(testCtx(t), r.storeReq(fmt.Sprintf("req-%d", i), h, chunks[i]))
				if err != nil {
					errs <- err
					return
				}
				if _, err := f.Wait(testCtx(t)); err != nil {
					errs <- fmt.Errorf("store of chunk %d: %w", i, err)
					return
				}
				mu.Lock()
				stored = append(stored, i)
				mu.Unlock()
			}
		}()
	}
	var retrieved atomic.Int64
	var rwg sync.WaitGroup
	for k := range retrievers {
		rwg.Add(1)
		go func() {
			defer rwg.Done()
			rng := rand.New(rand.NewPCG(uint64(k), 1))
			tgt := r.consecutiveN(nChunks + k)
			for {
				select {
				case <-done:
					return
				default:
				}
				mu.Lock()
				if len(stored) == 0 {
					mu.Unlock()
					time.Sleep(time.Millisecond)
					continue
				}
				i := stored[rng.IntN(len(stored))]
				mu.Unlock()
				rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{chunks[i]}, [][][]int64{tgt}))
				if err != nil {
					errs <- err
					return
				}
				if !rr.ChunkOK(0) {
					errs <- fmt.Errorf("retrieve of chunk %d: %+v", i, rr.Items[0])
					return
				}
				if !sameChunk(r.readChunk(tgt), chunks[i].packed) {
					errs <- fmt.Errorf("retrieve of chunk %d placed other bytes", i)
					return
				}
				retrieved.Add(1)
			}
		}()
	}
	wg.Wait()
	close(done)
	rwg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}

	// Every stored object is retrievable, byte-exact.
	tgt := r.consecutiveN(nChunks + retrievers)
	var fromL2 int
	for i, c := range chunks {
		rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{tgt}))
		if err != nil || !rr.ChunkOK(0) {
			t.Fatalf("chunk %d lost: %+v %v", i, rr.Items, err)
		}
		if rr.Items[0].From == wire.L2 {
			fromL2++
		}
		if !sameChunk(r.readChunk(tgt), c.packed) {
			t.Fatalf("chunk %d restored other bytes", i)
		}
	}
	st := e.Stats()
	if pinnedEvicted.Load() != 0 || st.PinnedEvictions != 0 {
		t.Fatalf("%d pinned objects evicted (%d refused)", pinnedEvicted.Load(), st.PinnedEvictions)
	}
	if st.Evictions == 0 || st.WriteBacks == 0 || fromL2 == 0 {
		t.Fatalf("no pressure: %d evictions, %d write-backs, %d restores from L2", st.Evictions, st.WriteBacks, fromL2)
	}
	if st.L1OccupiedBytes > st.L1CapacityBytes {
		t.Fatalf("L1 occupancy %d over capacity %d", st.L1OccupiedBytes, st.L1CapacityBytes)
	}
	t.Logf("%d concurrent retrieves; %d evictions, %d write-backs, %d of %d final restores from L2, %d L1-full",
		retrieved.Load(), st.Evictions, st.WriteBacks, fromL2, nChunks, st.L1Full)
}

func sameChunk(got, want [][]byte) bool {
	for g := range want {
		if !bytes.Equal(got[g], want[g]) {
			return false
		}
	}
	return len(got) == len(want)
}

// TestL1FullThrottlesWithoutDeadlock: when every run of slabs holds a
// pinned object, a store waits for room holding none (it is throttled,
// counted) instead of failing or deadlocking with the store that holds
// the pins; an object larger than the whole of L1 fails at once with
// no_space (counted).
func TestL1FullThrottlesWithoutDeadlock(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes = 3 * (64 << 10)
	e := newEngine(t, cfg)
	r.register(e)
	a0, a1 := r.newChunk(0, r.consecutiveN(0)), r.newChunk(1, r.consecutiveN(1))
	// Store A waits on a slow producer while its two objects are pinned.
	r.write(a0, a0.blocks, 300*time.Millisecond)
	r.write(a1, a1.blocks, 0)
	_, ha := r.record()
	fa, err := e.Store(testCtx(t), r.storeReq("a", ha, a0, a1))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for e.Stats().L1OccupiedBytes != 2*(64<<10) {
		if time.Now().After(deadline) {
			t.Fatal("store A never placed its objects")
		}
		time.Sleep(time.Millisecond)
	}
	b0, b1 := r.newChunk(2, r.consecutiveN(2)), r.newChunk(3, r.consecutiveN(3))
	r.write(b0, b0.blocks, 0)
	r.write(b1, b1.blocks, 0)
	_, hb := r.record()
	fb, err := e.Store(testCtx(t), r.storeReq("b", hb, b0, b1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fa.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	resB, err := fb.Wait(testCtx(t))
	if err != nil || resB.Objects[0].Status != Stored || resB.Objects[1].Status != Stored {
		t.Fatalf("store B: %+v, %v; want both stored once A let go of L1", resB.Objects, err)
	}
	if st := e.Stats(); st.StoresThrottled == 0 || st.L1Full != 0 {
		t.Fatalf("throttled %d, l1 full %d; want B throttled and nothing failed", st.StoresThrottled, st.L1Full)
	}

	// An object larger than all of L1 fails at once.
	dev2 := openDevice(t, "")
	r2 := newRig(t, dev2, c1Spec(), []int64{4})
	cfg2 := engineConfig(t, dev2, 0, 1)
	cfg2.L1Bytes, cfg2.L1SlabBytes = 2*4096, 4096
	e2 := newEngine(t, cfg2)
	r2.register(e2)
	c := r2.newChunk(0, r2.consecutiveN(0))
	r2.write(c, c.blocks, 0)
	_, h := r2.record()
	f, err := e2.Store(testCtx(t), r2.storeReq("big", h, c))
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.Wait(testCtx(t))
	if err == nil || res.Objects[0].Reason != ReasonNoSpace {
		t.Fatalf("store of an object larger than L1: %+v, %v; want no_space", res.Objects, err)
	}
	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_l1_full_total"); v != 1 {
		t.Fatalf("l1_full_total = %v, want 1", v)
	}
	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_store_failures_total", "reason", "no_space"); v != 1 {
		t.Fatalf("store_failures_total{reason=no_space} = %v, want 1", v)
	}
}
