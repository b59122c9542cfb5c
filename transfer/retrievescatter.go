package transfer

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
)

// The scatter of a retrieve's batch: enqueued from L1 (or a peer's L1) on
// a retrieve stream, waited for, drained before any failure reply (C10),
// and the sums it read back checked against the recorded ones. The batch
// loop that calls these is in retrieve.go.

// scatterFrom runs one scatter of objs (the objects of items) from buf and
// returns its sums; on failure every item is failed and ok is false. It
// returns only once the device has stopped writing the items' pages, also
// after a timeout (C10).
func (r *retrieval) scatterFrom(ctx context.Context, buf cuda.HostBuf, items []int, objs []cuda.Object) (sums []uint64, ok bool) {
	e := r.e
	failAll := func(err error) {
		for _, i := range items {
			r.fail(i, err)
		}
	}
	e.mu.Lock()
	retired := r.sp.retired
	e.mu.Unlock()
	if retired {
		r.failRetired(items)
		return nil, false
	}
	stream, err := e.retrieveStreams.get(ctx)
	if err != nil {
		failAll(fmt.Errorf("no stream: %w", ctxErr(ctx)))
		return
	}
	if err := timeUp(ctx); err != nil { // the blocks may not be the engine's to fill any more
		e.retrieveStreams.put(stream, true)
		failAll(fmt.Errorf("not placed: %w", err))
		return nil, false
	}
	op, ok := r.enqueueScatter(stream, buf, items, objs)
	if !ok {
		return nil, false
	}
	return r.waitScatter(ctx, stream, op, items)
}

// timeUp says why nothing more may be placed under ctx, or nil: the
// context has ended, or its deadline (the engine's, wire.HeaderDeadline,
// or the retrieve timeout) has passed by the clock. The engine takes its
// blocks back at that deadline by the same clock, but the timer that ends
// the context runs some time after it (milliseconds on a loaded host) and
// a derived context ends later still, so ctx.Err alone lets a scatter be
// enqueued after the deadline, over the engine's own bytes.
func timeUp(ctx context.Context) error {
	if ctx.Err() != nil {
		return ctxErr(ctx)
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return fmt.Errorf("%w: %w (by the clock, before the context's timer ran)", ErrTimeout, context.DeadlineExceeded)
	}
	return nil
}

// enqueueScatter enqueues the scatter of objs (the objects of items) from
// buf on stream. On failure it fails every item, discards the stream and
// returns false.
func (r *retrieval) enqueueScatter(stream cuda.Stream, buf cuda.HostBuf, items []int, objs []cuda.Object) (*cuda.Op, bool) {
	e := r.e
	op, err := stream.Scatter(buf, objs)
	if err != nil {
		// Never reuse it: on the CUDA backend a failed enqueue can leave
		// the stream failed for good, failing every later retrieve on it.
		e.retrieveStreams.put(stream, false)
		for _, i := range items {
			r.fail(i, fmt.Errorf("scatter: %w: %w", ErrDevice, err))
		}
		return nil, false
	}
	e.ctr.countOp(true, op)
	return op, true
}

// waitScatter waits for op, the scatter of items on stream, gives the
// stream back and returns the sums; on failure every item is failed and ok
// is false. It returns only once the device has stopped writing the items'
// pages, also after a timeout (C10).
func (r *retrieval) waitScatter(ctx context.Context, stream cuda.Stream, op *cuda.Op, items []int) (sums []uint64, ok bool) {
	e := r.e
	failAll := func(err error) {
		for _, i := range items {
			r.fail(i, err)
		}
	}
	if err := op.Wait(ctx); err != nil {
		if ctx.Err() != nil {
			failAll(fmt.Errorf("scatter of %d objects: %w", len(items), ctxErr(ctx)))
			// C10: a failure reply means the device has stopped writing
			// the engine's pages, which it recomputes at once. The scatter
			// is still enqueued: wait for the stream to drain before
			// answering (only Close cuts the wait short).
			start := time.Now()
			serr := stream.Synchronize(e.life)
			e.retrieveStreams.put(stream, serr == nil)
			e.ctr.retrieveDrains.Add(1)
			if serr != nil {
				r.res.BlocksInUse = true
				e.log.Error("a timed-out scatter could not be drained before the reply; the target blocks may still be written",
					zap.String("restore", r.req.RestoreID), zap.Int("objects", len(items)), zap.Error(serr))
			} else {
				e.log.Warn("a timed-out scatter was drained before the reply", zap.String("restore", r.req.RestoreID),
					zap.Int("objects", len(items)), zap.Duration("drained", time.Since(start)))
			}
			return
		}
		e.retrieveStreams.put(stream, false)
		failAll(fmt.Errorf("scatter: %w: %w", ErrDevice, err))
		return
	}
	e.retrieveStreams.put(stream, true)
	return op.Sums(), true
}

// verifyScatter checks the sums a scatter of items from this rank's L1
// read back against the objects' recorded sums.
func (r *retrieval) verifyScatter(items []int, sums []uint64) {
	e := r.e
	var nok, bytes uint64
	e.mu.Lock()
	for k, i := range items {
		o := r.objs[i]
		ir := &r.res.Items[i]
		ir.Sum = sums[k]
		if sums[k] != o.sum {
			r.fail(i, fmt.Errorf("the scatter of %s read kvsum64 %016x, recorded %016x: %w", o.key, sums[k], o.sum, ErrCorrupt))
			e.ctr.checksumL1.Add(1)
			e.log.Error("L1 object failed verification after its scatter; dropped", zap.Stringer("key", o.key),
				zap.Uint64("sum", sums[k]), zap.Uint64("recorded", o.sum))
			e.dropLocked(o)
			continue
		}
		ir.OK = true
		nok++
		bytes += o.size
	}
	e.mu.Unlock()
	if r.tl != nil {
		r.tl.Bytes += bytes
	}
	e.ctr.objectsRestored.Add(nok)
	e.ctr.bytesRetrievedL1.Add(bytes)
}

// failRetired fails items that were not scattered because the session was
// retired (superseded or released): its pools may already be the memory
// of a newer registration.
func (r *retrieval) failRetired(items []int) {
	for _, i := range items {
		r.fail(i, fmt.Errorf("session %s was retired before the scatter; nothing written: %w", r.sp.id, context.Canceled))
	}
}
