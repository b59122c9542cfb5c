package transfer

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// TestStoreGatherEndingAfterItsLimitCommitsNothing (issue 24, C11): an
// engine whose step waits on a store's answer stops waiting at the
// store's gather limit (its deadline plus a grace) and may then reuse the
// blocks. A gather that ends after that limit read pages the engine may
// have been overwriting: its bytes and their sum are of no one prompt.
// Here the producer holds the gather past the limit: the object fails
// with ErrGatherLate (and ErrDeadline, reason timeout), counted apart from
// the objects cut before their gather, nothing of it is in L1, a retrieve
// of the chunk finds it missing, the pages and the event are released;
// the same chunk stores again later. Red when gather commits without
// gatherLate's check: the object is stored.
func TestStoreGatherEndingAfterItsLimitCommitsNothing(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	var releases atomic.Int32
	e.hooks.releasing = func(*StoreFuture) { releases.Add(1) }
	c := r.newChunk(0, r.consecutiveN(0))
	open := r.gate() // the producer: its writes wait for the gate
	r.write(c, c.blocks, 0)
	_, h := r.record()
	start := time.Now()
	ctx, cancel := context.WithDeadline(testCtx(t), start.Add(100*time.Millisecond))
	defer cancel()
	limit := start.Add(300 * time.Millisecond)
	f, err := e.Store(WithGatherLimit(ctx, limit), r.storeReq("late-gather", h, c))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(limit) + 100*time.Millisecond) // the engine has stopped waiting
	select {
	case <-f.Done():
		t.Fatalf("the store answered before the device read its pages: %+v", f.res.Objects)
	default:
	}
	open()
	res, err := f.Wait(testCtx(t))
	o := res.Objects[0]
	if err == nil || o.Status != Failed || !errors.Is(o.Err, ErrGatherLate) || !errors.Is(o.Err, ErrDeadline) ||
		!errors.Is(o.Err, ErrTimeout) || o.Reason != ReasonTimeout {
		t.Fatalf("a gather that ended after its limit: %+v (%v); want failed, ErrGatherLate, reason timeout", o, err)
	}
	if late, cut := res.GatherLate(), res.PastDeadline(); late != 1 || cut != 0 {
		t.Fatalf("GatherLate %d, PastDeadline %d; want 1 and 0 (rankd counts gather_late, not cut)", late, cut)
	}
	expectFailedStoreLeftNothing(t, e, f, o, &releases, 0)
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{r.consecutiveN(1)}))
	if err != nil || rr.ChunkOK(0) {
		t.Fatalf("retrieve of the chunk whose gather ended late: %+v, %v; want it missing", rr, err)
	}

	if res := storeAll(t, e, r, "again", c); res.Objects[0].Status != Stored {
		t.Fatalf("the same chunk stored again, no limit: %+v", res.Objects[0])
	}
}

// TestStoreGatherEndingWithinItsGraceIsStored: a gather that began before
// the store's deadline and ends after it but before the gather limit (the
// engine still waits) is stored and restores byte for byte. Red when the
// check compares the gather's end with the deadline instead of the limit.
func TestStoreGatherEndingWithinItsGraceIsStored(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	open := r.gate()
	r.write(c, c.blocks, 0)
	_, h := r.record()
	start := time.Now()
	ctx, cancel := context.WithDeadline(testCtx(t), start.Add(100*time.Millisecond))
	defer cancel()
	f, err := e.Store(WithGatherLimit(ctx, start.Add(time.Minute)), r.storeReq("within-grace", h, c))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // past the deadline, well within the limit
	open()
	expectStoredAndRestored(t, e, r, f, c, "the chunk stored within its grace")
}
