package transfer

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/cuda"
)

// A store future and the requests it belongs to: what Store returns and
// what callers wait on (C1: in-flight work is keyed by future, never by
// request id).

// StoreFuture is one store in flight (C1): it owns its producer event and
// its page list until the device has finished reading the pages and the
// objects are committed in L1.
type StoreFuture struct {
	e     *Engine
	id    uint64
	req   string
	start time.Time
	sp    *space
	ev    cuda.Event
	work  []storeWork // objects to gather
	dups  []storeWork // objects another store is gathering
	res   StoreResult
	tl    *Timeline // nil: not timed; the future's goroutine's until done
	// deadline is the deadline of Store's context, the engine's: it
	// bounds the waits before the gather (zero: only Config.StoreTimeout
	// does).
	deadline time.Time
	// gatherLimit is Store's context's (WithGatherLimit): a gather that
	// ends at or after it commits nothing (zero: no limit).
	gatherLimit time.Time

	released chan struct{} // the device no longer reads the blocks
	done     chan struct{} // res is final
	reaper   chan struct{} // set after a timeout; closed when the reaper is done

	cutMu sync.Mutex
	cut   context.CancelCauseFunc // ends the waits before the gather (Cut); nil until runStore sets it
	isCut bool                    // Cut was called
}

type storeWork struct {
	idx   int // in res.Objects
	o     *l1Obj
	spans []cuda.Span
}

var futureIDs atomic.Uint64

// Cut ends the store's waits before its gather (for L1 room, for another
// store's fill) now, as its deadline would: the objects not yet placed
// fail (ErrCut), a gather already begun still ends first (C1), and the
// store then answers. The engine cuts a store whose request vLLM preempted
// (its blocks freed without asking the engine), so that it need not wait
// for the store's deadline before reusing them. Safe at any time, more
// than once.
func (f *StoreFuture) Cut() {
	f.cutMu.Lock()
	defer f.cutMu.Unlock()
	f.isCut = true
	if f.cut != nil {
		f.cut(ErrCut)
	}
}

// cutContext derives the context of the waits before the gather from
// wait, ended by Cut (also by a Cut that came first).
func (f *StoreFuture) cutContext(wait context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(wait)
	f.cutMu.Lock()
	f.cut = cancel
	if f.isCut {
		cancel(ErrCut)
	}
	f.cutMu.Unlock()
	return ctx, func() { cancel(nil) }
}

// ID returns the future's unique id (for logs).
func (f *StoreFuture) ID() uint64 { return f.id }

// RequestID returns the request the store belongs to.
func (f *StoreFuture) RequestID() string { return f.req }

// Released is closed once the device will no longer read the store's
// blocks: the engine may reuse them. It is closed before Done except after
// a timeout, where the store fails at once but the blocks stay in use until
// the device has really finished (or the engine closes). A store deduped
// onto an object another store (or a load) is filling keeps its blocks
// until that fill's outcome is known: it gathers from them if it fails.
func (f *StoreFuture) Released() <-chan struct{} { return f.released }

// Done is closed once the result is final: every object committed in L1
// (its producer event already released) or failed.
func (f *StoreFuture) Done() <-chan struct{} { return f.done }

// Wait blocks until Done (or ctx ends) and returns the result and its Err.
func (f *StoreFuture) Wait(ctx context.Context) (StoreResult, error) {
	select {
	case <-f.done:
		return f.res, f.res.Err()
	case <-ctx.Done():
		return StoreResult{}, ctx.Err()
	}
}

// WaitReleased blocks until the blocks may be reused (or ctx ends).
func (f *StoreFuture) WaitReleased(ctx context.Context) error {
	select {
	case <-f.released:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// request groups the store futures of one request id.
type request struct {
	pending int
	idle    chan struct{}
}

// RequestDone reports whether every store future of reqID has finished
// (committed or failed, its blocks released). An unknown request is done.
func (e *Engine) RequestDone(reqID string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.reqs[reqID] == nil
}

// PendingStores returns how many store futures of reqID are in flight.
func (e *Engine) PendingStores(reqID string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if r := e.reqs[reqID]; r != nil {
		return r.pending
	}
	return 0
}

// WaitRequest blocks until every store future of reqID, including ones
// started while it waits, has finished, or ctx ends. Results are reported
// per future (StoreFuture.Wait).
func (e *Engine) WaitRequest(ctx context.Context, reqID string) error {
	for {
		e.mu.Lock()
		r := e.reqs[reqID]
		if r == nil {
			e.mu.Unlock()
			return nil
		}
		ch := r.idle
		e.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
