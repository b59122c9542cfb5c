package transfer

import (
	"context"
	"testing"
	"time"
)

// TestRetrievePastItsDeadlinePlacesNothing: a retrieve whose context ends
// (the engine's deadline, wire.HeaderDeadline, which rankd puts on the
// context) while its L2 read is stuck places nothing once the read
// returns: the engine took the blocks back at its deadline and wrote its
// own bytes there, and those stay. (The read's own check guards this path:
// a read that returns after the context ended fails its item. One that
// returns after the deadline but before the context's timer has ended it,
// as happens on a loaded host, is stopped by the check before the scatter,
// which reads the clock: TestRetrievePastItsDeadlineBeforeItsTimerPlacesNothing.)
func TestRetrievePastItsDeadlinePlacesNothing(t *testing.T) {
	e, r, c, held := supersedeRig(t, true, 30*time.Second) // deaf: the read ignores the context
	tgt := r.consecutiveN(1)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	done := make(chan retrieveOutcome, 1)
	go func() {
		rr, err := e.Retrieve(ctx, r.retrieveReq(0, []chunk{c}, [][][]int64{tgt}))
		done <- retrieveOutcome{rr, err}
	}()
	select {
	case <-held.entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the retrieve never reached its L2 read")
	}
	<-ctx.Done()
	overwrite(t, r, 77, tgt) // the engine's own use of its blocks after its deadline
	close(held.release)
	var o retrieveOutcome
	select {
	case o = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the retrieve did not end after its read returned")
	}
	r.check("the pools after a retrieve past its deadline")
	if o.err == nil && o.res.ChunkOK(0) {
		t.Fatalf("retrieve past its deadline: chunk 0 placed (%+v)", o.res)
	}
}

// TestRetrieveFromL1PastItsDeadlinePlacesNothing: the same for a chunk in
// L1 (no read to fail): a retrieve whose deadline has passed when its
// scatter would be enqueued places nothing. Red without the check: the
// chunk was scattered over the engine's own bytes.
func TestRetrieveFromL1PastItsDeadlinePlacesNothing(t *testing.T) {
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
	defer cancel()
	retrieveFromL1Past(t, ctx)
}

// retrieveFromL1Past stores a chunk in L1, writes the engine's own bytes
// into the target blocks and retrieves the chunk there under ctx, whose
// deadline has passed: the pools must keep the engine's bytes and the
// item fail with ReasonTimeout.
func retrieveFromL1Past(t *testing.T, ctx context.Context) {
	t.Helper()
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e, r, "s", c)
	tgt := r.consecutiveN(1)
	overwrite(t, r, 77, tgt) // the engine's own bytes in the target blocks
	res, err := e.Retrieve(ctx, r.retrieveReq(0, []chunk{c}, [][][]int64{tgt}))
	r.check("the pools after a retrieve past its deadline")
	if err == nil && res.ChunkOK(0) {
		t.Fatalf("retrieve past its deadline: chunk 0 placed (%+v)", res)
	}
	if err == nil && res.Items[0].Reason != ReasonTimeout {
		t.Fatalf("retrieve past its deadline: reason %q (%v), want %q", res.Items[0].Reason, res.Items[0].Err, ReasonTimeout)
	}
}

// lateTimerCtx is a context whose deadline has passed but whose timer has
// not run yet, so it is not done: what a loaded host shows for a while
// after the engine's deadline (the timer goroutine runs late, and a
// derived context ends after its parent).
type lateTimerCtx struct {
	context.Context // never done
	deadline        time.Time
}

func (c lateTimerCtx) Deadline() (time.Time, bool) { return c.deadline, true }

// TestRetrievePastItsDeadlineBeforeItsTimerPlacesNothing: the engine takes
// its blocks back at its deadline by the clock, not when the context's
// timer gets to run; a retrieve whose deadline has passed places nothing
// even though its context has not ended yet. Red with the check before the
// scatter reading ctx.Err only: the chunk was scattered over the engine's
// bytes ("byte ... = ..., want ..."), as TestRetrievePastItsDeadlinePlacesNothing
// saw a few times in 60 on a loaded host.
func TestRetrievePastItsDeadlineBeforeItsTimerPlacesNothing(t *testing.T) {
	retrieveFromL1Past(t, lateTimerCtx{context.Background(), time.Now().Add(-time.Millisecond)})
}

// TestRetrievePartialPastItsDeadlinePlacesNothing: the same for an item
// that skips its chunk's first blocks (its scatter runs apart, through
// scatterFrom, as one from a peer's L1 does), with a context that has
// ended and with one whose timer has not run yet. Red without the check
// in scatterFrom: the later blocks got the chunk's pages over the
// engine's bytes.
func TestRetrievePartialPastItsDeadlinePlacesNothing(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, partialSpec(), []int64{24, 24})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e, r, "partial", c)
	ended, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
	defer cancel()
	for i, ctx := range []context.Context{ended, lateTimerCtx{context.Background(), time.Now().Add(-time.Millisecond)}} {
		tgt := r.consecutiveN(1 + i)
		overwrite(t, r, 77+i, tgt) // the engine's own bytes in the target blocks
		res, err := e.Retrieve(ctx, skipItems(r.retrieveReq(0, []chunk{c}, [][][]int64{tgt}), 0, 1))
		r.check("the pools after a partial retrieve past its deadline")
		if err == nil && res.ChunkOK(0) {
			t.Fatalf("context %d: partial retrieve past its deadline: chunk 0 placed (%+v)", i, res)
		}
	}
}
