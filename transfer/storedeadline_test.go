package transfer

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
)

// stuckTier is an L2 tier whose writes do not return until open is
// closed (a disk slower than the stores): under write-through the objects
// L1 holds stay dirty, so L1 fills with objects nothing may evict.
type stuckTier struct {
	L2Tier
	open    chan struct{}
	entered atomic.Int32
}

func (s *stuckTier) Put(ctx context.Context, obj L2Object, payload []byte) error {
	s.entered.Add(1)
	select {
	case <-s.open:
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.L2Tier.Put(ctx, obj, payload)
}

// stuckChunk is the chunk a test stores into a stuckL2Rig's full L1:
// written, its producer event recorded, and the engine's releases counted
// from here on.
func stuckChunk(e *Engine, r *rig) (chunk, cuda.EventHandle, *atomic.Int32) {
	releases := new(atomic.Int32)
	e.hooks.releasing = func(*StoreFuture) { releases.Add(1) }
	c := r.newChunk(2, r.consecutiveN(2))
	r.write(c, c.blocks, 0)
	_, h := r.record()
	return c, h, releases
}

// stuckL2Rig is an engine whose L1 (two slabs) is full of two committed
// c1Spec objects whose write-through L2 writes are stuck, with blocks for
// more chunks; opening the tier lets the writes through.
func stuckL2Rig(t *testing.T) (*Engine, *rig, *stuckTier) {
	t.Helper()
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	ft, err := OpenFileTier(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	st := &stuckTier{L2Tier: ft, open: make(chan struct{})}
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes, cfg.L1SlabBytes = 2*(64<<10), 64<<10 // one slab per object
	cfg.L2, cfg.L2Policy = st, WriteThrough
	cfg.StoreTimeout = 30 * time.Second // the default: far longer than any deadline here
	e := newEngine(t, cfg)
	r.register(e)
	t.Cleanup(func() { // before the engine's Close, which flushes
		select {
		case <-st.open:
		default:
			close(st.open)
		}
	})
	for i := range 2 {
		c := r.newChunk(i, r.consecutiveN(i))
		if res := storeAll(t, e, r, "full", c); res.Objects[0].Status != Stored {
			t.Fatalf("filling L1: %+v", res.Objects[0])
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for st.entered.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the L2 writes of the objects filling L1 never began")
		}
		time.Sleep(time.Millisecond)
	}
	return e, r, st
}

// TestStoreWaitForL1RoomEndsAtTheEnginesDeadline (issue 24, C11): L1 is
// full of objects waiting for slow L2 writes. A store whose engine
// deadline is 200 ms away answers failed (ErrDeadline, not stored) within
// the deadline and some slack, not after the 30 s store timeout, with its
// pages released (the engine frees its blocks on the answer), its event
// released and nothing of it left in L1. Once L2 takes the writes the same
// chunk stores. Red when placeAll waits under the store timeout instead
// (the store answered only after 30 s).
func TestStoreWaitForL1RoomEndsAtTheEnginesDeadline(t *testing.T) {
	e, r, st := stuckL2Rig(t)
	c, h, releases := stuckChunk(e, r)
	const dl = 200 * time.Millisecond
	start := time.Now()
	ctx, cancel := context.WithDeadline(testCtx(t), start.Add(dl)) // as rankd does with the engine's
	defer cancel()
	f, err := e.Store(ctx, r.storeReq("late", h, c))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-f.Done():
	case <-time.After(10 * time.Second):
		t.Fatalf("the store had not answered %v after its %v deadline (store timeout %v)", 10*time.Second, dl, e.cfg.StoreTimeout)
	}
	took := time.Since(start)
	if took < dl || took > dl+2*time.Second {
		t.Fatalf("the store answered after %v; want its %v deadline plus slack", took, dl)
	}
	res, err := f.Wait(testCtx(t))
	o := res.Objects[0]
	if err == nil || o.Status != Failed || !errors.Is(o.Err, ErrDeadline) || !errors.Is(o.Err, ErrTimeout) || o.Reason != ReasonTimeout {
		t.Fatalf("store past its deadline: %+v (%v); want failed, ErrDeadline, reason timeout", o, err)
	}
	if n := res.PastDeadline(); n != 1 {
		t.Fatalf("PastDeadline %d, want 1 (rankd counts the store as cut)", n)
	}
	expectFailedStoreLeftNothing(t, e, f, o, releases, 2*(64<<10)) // the two dirty objects stay

	close(st.open) // L2 takes the writes: L1 makes room
	storesAgain(t, e, r, c)
}

// storesAgain stores chunk c anew (written again, a new event) and wants
// it stored: once L2 took the writes, L1 has room.
func storesAgain(t *testing.T, e *Engine, r *rig, c chunk) {
	t.Helper()
	r.write(c, c.blocks, 0)
	_, h := r.record()
	f, err := e.Store(testCtx(t), r.storeReq("again", h, c))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := f.Wait(testCtx(t)); err != nil || res.Objects[0].Status != Stored {
		t.Fatalf("the same chunk once L2 took the writes: %+v, %v", res.Objects, err)
	}
}

// TestStoreDeadlineNeverCutsAGather (C1, C10): a store that found room
// and enqueued its gather behind a slow producer is not cut by its
// engine deadline: it answers stored, after the device has read the
// pages, though the deadline passed long before. Red when the gather
// waits under the deadline: the store failed while the device was still
// to read the pages.
func TestStoreDeadlineNeverCutsAGather(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	open := r.gate() // the producer: its writes wait for the gate
	r.write(c, c.blocks, 0)
	_, h := r.record()
	ctx, cancel := context.WithTimeout(testCtx(t), 100*time.Millisecond)
	defer cancel()
	f, err := e.Store(ctx, r.storeReq("slow-producer", h, c))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond) // the deadline passes while the gather waits on the producer
	select {
	case <-f.Done():
		t.Fatalf("the store answered before the device read its pages: %+v", f.res.Objects)
	default:
	}
	open()
	expectStoredAndRestored(t, e, r, f, c, "the chunk stored while its deadline passed")
}

// expectStoredAndRestored: the one-chunk store f of c is stored, and c
// restores into the next free blocks byte for byte, padding untouched.
func expectStoredAndRestored(t *testing.T, e *Engine, r *rig, f *StoreFuture, c chunk, what string) {
	t.Helper()
	res, err := f.Wait(testCtx(t))
	if err != nil || res.Objects[0].Status != Stored {
		t.Fatalf("%s: %+v, %v; want stored", what, res.Objects, err)
	}
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{r.consecutiveN(1)}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("%s: retrieve %+v, %v", what, rr, err)
	}
	r.expectRestored(c, r.consecutiveN(1))
	r.check(what)
}

// expectFailedStoreLeftNothing: the store f whose object o failed gave the
// engine's blocks back, released its producer event exactly once, and left
// o out of L1's catalog, L1 holding occupied bytes (other objects') only.
func expectFailedStoreLeftNothing(t *testing.T, e *Engine, f *StoreFuture, o StoredObject, releases *atomic.Int32, occupied uint64) {
	t.Helper()
	select {
	case <-f.Released():
	default:
		t.Fatal("a failed store still holds the engine's blocks")
	}
	if n := releases.Load(); n != 1 {
		t.Fatalf("producer event released %d times, want once", n)
	}
	e.mu.Lock()
	left := e.cat.objs[o.Key]
	e.mu.Unlock()
	if left != nil {
		t.Fatalf("the failed object is in L1's catalog (state %v, pins %d, sum %#x)", left.state, left.pins, left.sum)
	}
	if s := e.Stats(); s.L1OccupiedBytes != occupied {
		t.Fatalf("L1 occupancy %d after the failed store, want %d", s.L1OccupiedBytes, occupied)
	}
}

// TestStoreCutEndsItsWaitForL1Room: the engine cuts a store waiting for L1
// room (its request was preempted: vLLM freed the blocks without asking):
// it answers at once, not at its deadline, its object failed with ErrCut
// (not stored, its pages never read) and nothing of it left in L1; a
// second cut does nothing; the chunk stores again later. Red without the cut context (the store waited its
// 20 s deadline).
func TestStoreCutEndsItsWaitForL1Room(t *testing.T) {
	e, r, st := stuckL2Rig(t)
	c, h, releases := stuckChunk(e, r)
	ctx, cancel := context.WithDeadline(testCtx(t), time.Now().Add(20*time.Second))
	defer cancel()
	f, err := e.Store(ctx, r.storeReq("preempted", h, c))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // waiting for room by now
	start := time.Now()
	f.Cut()
	select {
	case <-f.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the cut store had not answered 5 s after the cut")
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("the cut store answered after %v", took)
	}
	res, err := f.Wait(testCtx(t))
	o := res.Objects[0]
	if err == nil || o.Status != Failed || !errors.Is(o.Err, ErrCut) || !errors.Is(o.Err, ErrDeadline) {
		t.Fatalf("cut store: %+v (%v); want failed with ErrCut", o, err)
	}
	f.Cut() // again, after the end: nothing
	expectFailedStoreLeftNothing(t, e, f, o, releases, 2*(64<<10))

	close(st.open)
	storesAgain(t, e, r, c)
}
