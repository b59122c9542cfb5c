package transfer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
)

// The life of a store future after Store admitted it: placement in L1,
// the gather from the engine's pages, the commit, the release of the
// producer event and the blocks (C10), and the durability of the result.

// placeWait places o in L1, waiting for L2 writes that make room.
func (e *Engine) placeWait(ctx context.Context, o *l1Obj) error {
	for {
		e.mu.Lock()
		ch, err := e.placeLocked(o)
		e.mu.Unlock()
		if err != nil {
			e.ctr.l1Full.Add(1)
			return err
		}
		if ch == nil {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("waiting for L1 room for %s: %w", o.key, ctxErr(ctx))
		}
	}
}

// placeAll places every object of a store, or none: when L1 has no room
// because it is full of pinned or filling objects (other stores waiting
// on their producers, retrieves scattering), it gives back what it placed
// and waits for room, until ctx ends (the store timeout, or earlier the
// engine's deadline: waitContext). A store that
// waits holds no room, so waiting stores never deadlock one another; the
// ones holding room finish, and under write-back their objects are then
// written to L2 and evicted to make the room (throttling, not failing).
// Only an object larger than the whole of L1 fails at once.
func (e *Engine) placeAll(ctx context.Context, work []storeWork) error {
	waited := false
	for {
		var wait <-chan struct{}
		var err error
		e.mu.Lock()
		placed := 0
		for _, w := range work {
			if w.o.slab >= 0 {
				placed++
				continue
			}
			var ch <-chan struct{}
			if ch, err = e.placeLocked(w.o); err != nil || ch != nil {
				wait = ch
				break
			}
			placed++
		}
		if err == nil && wait == nil {
			e.mu.Unlock()
			return nil
		}
		if errors.Is(err, errL1TooSmall) {
			e.mu.Unlock()
			e.ctr.l1Full.Add(1)
			return err
		}
		if err != nil {
			// Full of pinned or filling objects: hold nothing while waiting.
			for _, w := range work {
				e.cat.freeSlabs(w.o)
			}
			e.ctr.l1OccupiedBytes.Store(e.cat.occupied())
			if placed > 0 {
				e.cat.notifyLocked() // the room given back may serve another store
			}
			wait = e.cat.watchLocked()
			if !waited {
				waited = true
				e.ctr.storeThrottled.Add(1)
				e.log.Debug("store waits for L1 room", zap.Int("objects", len(work)), zap.Error(err))
			}
		}
		e.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			e.ctr.l1Full.Add(1)
			if err == nil {
				err = fmt.Errorf("waiting for L2 writes to make L1 room: %w", ErrL1Full)
			}
			return fmt.Errorf("%w (waited until %w)", err, ctxErr(ctx))
		}
	}
}

// ctxErr maps a context's end to ErrTimeout or ErrClosed/Canceled; an
// end caused by the engine's deadline (waitContext) also wraps ErrDeadline,
// one by StoreFuture.Cut is ErrCut.
func ctxErr(ctx context.Context) error {
	if cause := context.Cause(ctx); errors.Is(cause, ErrCut) {
		return cause
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		if cause := context.Cause(ctx); errors.Is(cause, ErrDeadline) {
			return fmt.Errorf("%w: %w", ErrTimeout, cause)
		}
		return fmt.Errorf("%w: %w", ErrTimeout, ctx.Err())
	}
	return ctx.Err()
}

// waitContext is the context of the waits of f before its gather begins
// (L1 room, another store's fill): ctx (the store timeout) cut
// at the engine's deadline, so a store never keeps the engine's blocks
// past it waiting on the cache (C11). The gather itself runs under ctx: a
// store answers only once the device no longer reads the pages (C1, C10).
func waitContext(ctx context.Context, f *StoreFuture) (context.Context, context.CancelFunc) {
	if f.deadline.IsZero() {
		return ctx, func() {}
	}
	return context.WithDeadlineCause(ctx, f.deadline,
		fmt.Errorf("%w (%s)", ErrDeadline, f.deadline.Format("15:04:05.000")))
}

// runStore is the life of one store future.
func (e *Engine) runStore(f *StoreFuture) {
	ctx, cancel := context.WithTimeout(e.life, e.cfg.StoreTimeout)
	defer cancel()
	wait, wcancel := waitContext(ctx, f)
	defer wcancel()
	wait, ccancel := f.cutContext(wait)
	defer ccancel()

	// 1. Room in L1 for every object to gather (waiting for it: issue 18.1,
	// at most until the engine's deadline).
	var live []storeWork
	if err := e.placeAll(wait, f.work); err != nil {
		e.mu.Lock()
		for _, w := range f.work {
			e.failFillLocked(w.o, err)
			e.unpinLocked(w.o)
		}
		e.mu.Unlock()
		for _, w := range f.work {
			e.failObj(f, w.idx, err)
		}
	} else {
		live = f.work
	}
	f.tl.Lap(StagePlace, -1)

	// 2. Wait for the producer, gather, wait for the device. While objects
	// another store is filling are pending, the pages and the event stay
	// held: a failed fill is gathered again from them (step 3).
	handled := false
	if len(live) > 0 {
		handled = e.gather(ctx, f, live, len(f.dups) > 0)
	}

	// 3. Objects another store was filling.
	if len(f.dups) > 0 {
		handled = e.settleDups(ctx, wait, f, handled)
	}
	if !handled {
		close(f.released) // nothing is or will be reading the pages
		e.releaseEvent(f)
	}
	f.res.NotDurable = e.durability(f)
	e.ctr.storeLatency.Observe(time.Since(f.start).Seconds())
	close(f.done)
	if f.reaper != nil {
		<-f.reaper // a timed-out store is finished when the device is
	}
	e.finishFuture(f)
}

// settleDups waits for the objects of f another store (or a load) was
// filling and takes their outcomes. When such a fill fails (a superseded
// session's producer died under it, its L2 read failed) while f's own
// context is live, f does not inherit that failure: it gathers the object
// from its own pages under its own event, unless handled says the pages
// and event are already given up (a timed-out gather's reaper owns them).
// It waits for fills and L1 room under wait (waitContext), gathers under
// ctx. It reports
// whether f.released and the event have been taken care of.
func (e *Engine) settleDups(ctx, wait context.Context, f *StoreFuture, handled bool) bool {
	pending := f.dups
	for len(pending) > 0 {
		var next, refill []storeWork
		for _, w := range pending {
			var err error
			select {
			case <-w.o.filled:
				err = w.o.err
			case <-wait.Done():
				err = fmt.Errorf("waiting for another store of %s: %w", w.o.key, ctxErr(wait))
			}
			retry := err != nil && wait.Err() == nil && !handled
			e.mu.Lock()
			sum := w.o.sum
			if err == nil {
				e.l3QueueLocked(w.o.key, sum) // the fill may have been a load, not queued
			}
			e.unpinLocked(w.o)
			if retry {
				switch o := e.cat.objs[w.o.key]; {
				case o == nil:
					e.log.Warn("the fill a store waited on failed; gathering the object from the store's own pages",
						zap.String("request", f.req), zap.Uint64("future", f.id), zap.Stringer("key", w.o.key), zap.Error(err))
					o = e.newObjLocked(w.o.key, f.sp.res.Fingerprint, w.o.size)
					refill = append(refill, storeWork{idx: w.idx, o: o, spans: w.spans})
				case o.state == stReady: // another waiter gathered it again first
					e.cat.touch(o)
					sum, err = o.sum, nil
				default: // another waiter is gathering it again: wait for that
					o.pins++
					next = append(next, storeWork{idx: w.idx, o: o, spans: w.spans})
				}
			}
			e.mu.Unlock()
			if retry && err != nil {
				continue // gathered again or waited on again below
			}
			if err != nil {
				e.failObj(f, w.idx, err)
				continue
			}
			f.res.Objects[w.idx].Status, f.res.Objects[w.idx].Sum = Deduped, sum
			e.ctr.dedupeHits.Add(1)
		}
		if len(refill) > 0 {
			if err := e.placeAll(wait, refill); err != nil {
				e.mu.Lock()
				for _, w := range refill {
					e.failFillLocked(w.o, err)
					e.unpinLocked(w.o)
				}
				e.mu.Unlock()
				for _, w := range refill {
					e.failObj(f, w.idx, err)
				}
			} else {
				handled = e.gather(ctx, f, refill, len(next) > 0)
			}
		}
		pending = next
	}
	return handled
}

// L2Checker is implemented by L2 tiers that can tell cheaply whether a
// write could succeed now (FileTier: its root is there and safe).
type L2Checker interface {
	Check() error
}

// durability says why the objects f committed are not on their way to L2
// although the policy promises it ("" when they are, or nothing was
// committed, or the policy is write-back).
func (e *Engine) durability(f *StoreFuture) string {
	if e.l2 == nil || e.cfg.L2Policy != WriteThrough {
		return ""
	}
	stored := false
	for _, o := range f.res.Objects {
		stored = stored || o.Status == Stored
	}
	if !stored {
		return ""
	}
	why := ""
	e.mu.Lock()
	if e.cat.degraded {
		why = "L2 is degraded: its writes keep failing; the objects are in L1 only"
	}
	e.mu.Unlock()
	if ck, ok := e.l2.(L2Checker); why == "" && ok {
		if err := ck.Check(); err != nil {
			why = "L2 is unavailable (" + err.Error() + "); the objects are in L1 only"
		}
	}
	if why != "" {
		e.ctr.storesNotDurable.Add(1)
		e.log.Warn("store committed to L1 only although the policy is write-through", zap.String("request", f.req), zap.String("why", why))
	}
	return why
}

// gather runs the device part of a store. It reports true when it has
// taken care of f.released and the producer event: after a commit, or
// after a timeout with device work still pending, where a reaper owns the
// event, the stream and the pins until the device is done.
//
// With keep, a commit leaves f.released open and the event held (and
// reports false): more objects of f may still be gathered from the pages.
func (e *Engine) gather(ctx context.Context, f *StoreFuture, live []storeWork, keep bool) (handled bool) {
	failAll := func(err error) {
		e.mu.Lock()
		for _, w := range live {
			e.failFillLocked(w.o, err)
			e.unpinLocked(w.o)
		}
		e.mu.Unlock()
		for _, w := range live {
			e.failObj(f, w.idx, err)
		}
	}
	stream, err := e.storeStreams.get(ctx)
	if err != nil {
		failAll(fmt.Errorf("no stream: %w", ctxErr(ctx)))
		return false
	}
	f.tl.Lap(StageStream, 0)
	// Marks before the wait on the producer, after it and after the gather.
	tm := newCopyTimers(e.dev, f.tl, 3).mark(stream, 0)
	defer func() { tm.release() }()
	if err := stream.WaitEvent(f.ev); err != nil {
		e.storeStreams.put(stream, false)
		failAll(fmt.Errorf("wait on the producer event: %w: %w", ErrDevice, err))
		return false
	}
	objs := make([]cuda.Object, len(live))
	var bytes uint64
	e.mu.Lock()
	for i, w := range live {
		objs[i] = cuda.Object{HostOff: e.cat.off(w.o), Spans: w.spans}
		bytes += w.o.size
	}
	e.mu.Unlock()
	tm = tm.mark(stream, 1)
	op, err := stream.Gather(e.l1buf, objs)
	if err != nil {
		e.storeStreams.put(stream, false) // its wait may still be pending
		failAll(fmt.Errorf("gather: %w: %w", ErrDevice, err))
		return false
	}
	e.ctr.countOp(false, op)
	f.tl.LapTo(StageEnqueue, 0, op.Started())
	tm = tm.began(op).mark(stream, 2)
	f.tl.Lap(StageLaunch, 0)
	err = op.Wait(ctx)
	switch {
	case err == nil:
		late := gatherLate(f, time.Now())
		tm = f.tl.copyDone(tm, 0, time.Now(), StageProducer, StageGather)
		if f.tl != nil {
			f.tl.Bytes += bytes
		}
		if !keep {
			close(f.released) // the device has read every page: the blocks are free
		}
		e.storeStreams.put(stream, true)
		if late != nil {
			// The engine stopped waiting before the device had read the
			// pages and may have written new bytes into some of them while
			// they were read: the copies and their sums are of no one
			// prompt. Nothing is committed (not in L1, so never written to
			// L2 or L3); a later store of the chunks gathers them again.
			failAll(late)
			e.log.Warn("store's gather ended after the engine stopped waiting; its objects are not stored",
				zap.String("request", f.req), zap.Uint64("future", f.id), zap.Int("objects", len(live)), zap.Error(late))
			if keep {
				return false
			}
			e.releaseEvent(f)
			return true
		}
		sums := op.Sums()
		e.mu.Lock()
		for i, w := range live {
			e.commitLocked(w.o, sums[i], true)
			e.unpinLocked(w.o)
			r := &f.res.Objects[w.idx]
			r.Status, r.Sum = Stored, sums[i]
		}
		e.mu.Unlock()
		e.ctr.objectsStored.Add(uint64(len(live)))
		e.ctr.bytesStoredL1.Add(bytes)
		f.tl.Lap(StageCommit, 0)
		if ce := e.log.Check(zap.DebugLevel, "stored"); ce != nil {
			for _, w := range live {
				e.log.Debug("stored", zap.String("request", f.req), zap.Uint64("future", f.id),
					zap.Stringer("key", w.o.key), zap.Uint64("size", w.o.size), zap.Uint64("sum", f.res.Objects[w.idx].Sum))
			}
		}
		if keep {
			return false
		}
		e.releaseEvent(f) // only now: pages read and objects committed (C1)
		return true
	case ctx.Err() != nil:
		// The device may still read the pages and write the slabs: fail
		// the store now, keep everything until the stream has drained.
		err = fmt.Errorf("gather of %d objects: %w", len(live), ctxErr(ctx))
		e.mu.Lock()
		for _, w := range live {
			e.failFillLocked(w.o, err) // pins kept: the slabs stay reserved
		}
		e.mu.Unlock()
		for _, w := range live {
			e.failObj(f, w.idx, err)
		}
		f.reaper = make(chan struct{})
		e.goFunc(func() { e.reapStore(f, stream, live) })
		return true
	default:
		// The stream failed: nothing after the failure ran.
		e.storeStreams.put(stream, false)
		failAll(fmt.Errorf("gather: %w: %w", ErrDevice, err))
		return false
	}
}

// gatherLate is the error of f's objects when a gather of f that ended at
// end did so at or after f's gather limit (nil when it has none or ended
// before). The clock is read when the device's completion is seen, never
// earlier, and compared with the limit itself, as timeUp does: a context
// timer would end some time after the limit, when the engine may already
// have reused the pages.
func gatherLate(f *StoreFuture, end time.Time) error {
	if f.gatherLimit.IsZero() || end.Before(f.gatherLimit) {
		return nil
	}
	return fmt.Errorf("gather ended %v after the engine stopped waiting (%s): %w: %w",
		end.Sub(f.gatherLimit).Round(time.Millisecond), f.gatherLimit.Format("15:04:05.000"), ErrTimeout, ErrGatherLate)
}

// reapStore waits until a timed-out store's device work has drained (or
// the engine stops, which cuts it short), then frees what it held.
func (e *Engine) reapStore(f *StoreFuture, stream cuda.Stream, live []storeWork) {
	err := stream.Synchronize(e.life)
	e.storeStreams.put(stream, err == nil)
	e.mu.Lock()
	for _, w := range live {
		e.unpinLocked(w.o)
	}
	e.mu.Unlock()
	close(f.released)
	e.releaseEvent(f)
	close(f.reaper)
}

// releaseEvent releases the producer event: only once the device has
// finished reading the pages and the objects are committed (C1).
func (e *Engine) releaseEvent(f *StoreFuture) {
	if e.hooks.releasing != nil {
		e.hooks.releasing(f)
	}
	if err := f.ev.Release(); err != nil {
		e.log.Warn("release of a producer event failed", zap.String("request", f.req), zap.Error(err))
	}
}

func (e *Engine) failObj(f *StoreFuture, idx int, err error) {
	r := &f.res.Objects[idx]
	r.Status, r.Err, r.Reason = Failed, err, reasonOf(err)
	e.ctr.storeFailures[reasonIndex(r.Reason)].Add(1)
	if errors.Is(err, ErrDeadline) {
		// The throttle's expected end under a disk slower than the
		// stores (counted; rankd logs the store): not an error per object.
		e.log.Debug("store of an object gave up at the engine's deadline", zap.String("request", f.req), zap.Uint64("future", f.id),
			zap.Stringer("key", r.Key), zap.Error(err))
		return
	}
	e.log.Error("store of an object failed", zap.String("request", f.req), zap.Uint64("future", f.id),
		zap.Stringer("key", r.Key), zap.String("reason", string(r.Reason)), zap.Error(err))
}

// finishFuture ends the accounting of f: its request may now be finished.
func (e *Engine) finishFuture(f *StoreFuture) {
	e.releaseSpace(f.sp)
	e.ctr.storesInflight.Add(-1)
	e.mu.Lock()
	defer e.mu.Unlock()
	if r := e.reqs[f.req]; r != nil {
		r.pending--
		if r.pending == 0 {
			close(r.idle)
			delete(e.reqs, f.req)
		}
	}
	e.futures--
	e.workDoneLocked()
}
