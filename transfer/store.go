package transfer

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// StoreRequest asks the engine to store chunks from the engine's pages once
// the producer event has completed. It has the fields of wire.StoreRequest
// and the caller (StoreRequestOf).
type StoreRequest struct {
	// RequestID is the engine's request; many stores may share it (a long
	// prompt is stored incrementally). It only groups futures for
	// RequestDone/WaitRequest: in-flight work is never keyed by it (C1).
	RequestID string
	Namespace dcp.Namespace
	// Session is the registration whose pools the blocks are in
	// (Session.ID); a store is never served against another's.
	Session string
	// Chunks name each chunk and, per group, its block ids in this rank's
	// pools: Blocks[g] has BlocksPerChunk(g) ids for every group this rank
	// stores (dcp StoreShard); it is ignored for the others.
	Chunks []wire.ChunkBlocks
	// Event is the producer's interprocess event, recorded after the
	// engine's writes to these pages were enqueued. The store imports it
	// and holds it until the device has read the pages and the objects are
	// committed.
	Event cuda.EventHandle
	// Caller is the engine identity that sent the request, as the
	// connection layer authenticated it: it must be the session's owner
	// (the owner Register was given), checked under the lock that finds
	// the session (ErrUnauthorized). Never from the request's bytes.
	Caller string
}

// StoreRequestOf is the store that caller sent as req.
func StoreRequestOf(req *wire.StoreRequest, caller string) StoreRequest {
	return StoreRequest{RequestID: req.RequestID, Namespace: req.Namespace, Session: req.Session,
		Chunks: req.Chunks, Event: req.Event, Caller: caller}
}

// MaxStoreChunks bounds the chunks of one store or retrieve request.
const MaxStoreChunks = 1 << 16

// StoreStatus is the outcome of one object of a store.
type StoreStatus uint8

const (
	Stored  StoreStatus = iota + 1 // gathered and committed in L1
	Deduped                        // already held (L1 or this rank's L2); nothing copied
	Failed                         // not stored; see Reason and Err
)

func (s StoreStatus) String() string {
	switch s {
	case Stored:
		return "stored"
	case Deduped:
		return "deduped"
	case Failed:
		return "failed"
	}
	return fmt.Sprintf("status(%d)", uint8(s))
}

// StoredObject is the outcome of one object (chunk, shard, group) of a store.
type StoredObject struct {
	Chunk  int // index in StoreRequest.Chunks
	Group  int
	Key    dcp.Key
	Status StoreStatus
	Size   uint64
	Sum    uint64 // kvsum64 recorded at commit (Stored, Deduped)
	Reason Reason // Failed only
	Err    error  // Failed only
}

// StoreResult is the outcome of one store: one entry per object this rank
// stores, in chunk then group order.
type StoreResult struct {
	RequestID string
	Objects   []StoredObject
	// NotDurable, when not empty, says why objects this store committed
	// are in L1 only although the policy is WriteThrough: L2 is degraded
	// or fails its health check (its root is gone, say). Counted in
	// kvtier_transfer_stores_not_durable_total.
	NotDurable string
}

// Err joins the errors of the failed objects; nil when every object was
// stored or deduplicated.
func (r StoreResult) Err() error {
	var errs []error
	for _, o := range r.Objects {
		if o.Status == Failed {
			errs = append(errs, fmt.Errorf("chunk %d group %d (%s): %w", o.Chunk, o.Group, o.Key, o.Err))
		}
	}
	return errors.Join(errs...)
}

// Wire converts r to the engine API reply.
func (r StoreResult) Wire() wire.StoreReply {
	w := wire.StoreReply{NotDurable: r.NotDurable}
	for _, o := range r.Objects {
		switch o.Status {
		case Stored:
			w.Stored++
		case Deduped:
			w.Deduped++
		default:
			w.Failed = append(w.Failed, o.Key.String()+": "+string(o.Reason))
		}
	}
	return w
}

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

	released chan struct{} // the device no longer reads the blocks
	done     chan struct{} // res is final
	reaper   chan struct{} // set after a timeout; closed when the reaper is done
}

type storeWork struct {
	idx   int // in res.Objects
	o     *l1Obj
	spans []cuda.Span
}

var futureIDs atomic.Uint64

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

// Store validates req, imports its producer event and starts a store
// future; it returns without waiting for the device. This rank stores the
// shard dcp.StoreShard assigns it for every group (none for some MLA
// ranks); objects already held are deduplicated. Errors: ErrUnknownSession,
// ErrStaleSession, ErrUnauthorized (req.Caller is not the session's
// owner), ErrUnknownNamespace, ErrBadRequest (wrapping dcp or cuda
// causes), ErrClosed.
func (e *Engine) Store(ctx context.Context, req StoreRequest) (*StoreFuture, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	sp, err := e.acquireSpace(req.Namespace, req.Session, req.Caller)
	if err != nil {
		return nil, fmt.Errorf("store %q: %w", req.RequestID, err)
	}
	f := &StoreFuture{e: e, id: futureIDs.Add(1), req: req.RequestID, start: time.Now(), sp: sp,
		res: StoreResult{RequestID: req.RequestID}, released: make(chan struct{}), done: make(chan struct{})}
	planned, err := e.planStore(sp, req)
	if err != nil {
		e.releaseSpace(sp)
		return nil, fmt.Errorf("store %q: %w", req.RequestID, err)
	}
	ev, err := e.dev.ImportEvent(req.Event)
	if err != nil {
		e.releaseSpace(sp)
		return nil, fmt.Errorf("store %q: import producer event: %w: %w", req.RequestID, ErrBadRequest, err)
	}
	f.ev = ev
	if e.hooks.imported != nil {
		e.hooks.imported(req.RequestID, ev)
	}

	l2ok := e.checkL2Dedupe(ctx, planned)

	e.mu.Lock()
	if e.closing {
		e.mu.Unlock()
		_ = ev.Release()
		e.releaseSpace(sp)
		return nil, fmt.Errorf("store %q: %w", req.RequestID, ErrClosed)
	}
	for _, p := range planned {
		idx := len(f.res.Objects)
		f.res.Objects = append(f.res.Objects, StoredObject{Chunk: p.chunk, Group: p.group, Key: p.key, Size: p.size})
		r := &f.res.Objects[idx]
		if o := e.cat.objs[p.key]; o != nil {
			if o.state == stReady {
				r.Status, r.Sum = Deduped, o.sum
				e.cat.touch(o)
				e.ctr.dedupeHits.Add(1)
				// Held in L1, maybe not in L3 (a failed or dropped write
				// behind, an eviction): queued unless L3 has it.
				e.l3QueueLocked(p.key, o.sum)
				if l2ok[p.key] == l2Gone {
					// Readers found the L2 copy damaged (quarantined) or
					// gone: the re-store heals it from L1 (issue 11.12).
					e.l2CopyGoneLocked(o)
				}
			} else {
				// Another store or a load is filling it: take its outcome,
				// or gather it from these pages if that fill fails.
				o.pins++
				f.dups = append(f.dups, storeWork{idx: idx, o: o, spans: p.spans})
			}
			continue
		}
		if ent, ok := e.cat.l2[p.key]; ok {
			switch l2ok[p.key] {
			case l2Present:
				r.Status, r.Sum = Deduped, ent.sum
				e.ctr.dedupeHits.Add(1)
				e.l3QueueLocked(p.key, ent.sum) // written from the L2 copy
				continue
			case l2Gone:
				// The file is gone or damaged (another rank may have
				// quarantined it): no copy is left, so store it again.
				e.cat.l2Del(p.key)
				e.ctr.l2Objects.Store(int64(len(e.cat.l2)))
				e.emitLocked(wire.Removed, wire.L2, p.key, ent.size, ent.sum)
				e.log.Error("an L2 object of this rank vanished; storing it again", zap.Stringer("key", p.key))
			}
		}
		o := e.newObjLocked(p.key, sp.res.Fingerprint, p.size)
		f.work = append(f.work, storeWork{idx: idx, o: o, spans: p.spans})
	}
	e.futures++
	r := e.reqs[req.RequestID]
	if r == nil {
		r = &request{idle: make(chan struct{})}
		e.reqs[req.RequestID] = r
	}
	r.pending++
	e.mu.Unlock()
	e.ctr.storesInflight.Add(1)
	e.goFunc(func() { e.runStore(f) })
	return f, nil
}

// checkL2Dedupe stats, through the L2 tier, the planned objects this
// rank's L2 inventory holds (also those L1 holds: readers may have
// quarantined the file), and reports which of them may be deduplicated:
// present, naming their key, of the recorded size and sum. A key not
// checked (not in the inventory, or being filled or written) is absent. The file may have been
// quarantined or deleted by another rank sharing the L2 root, so the
// inventory alone cannot be trusted to hold a copy.
func (e *Engine) checkL2Dedupe(ctx context.Context, planned []plannedObj) map[dcp.Key]l2Check {
	if e.l2 == nil {
		return nil
	}
	var check map[dcp.Key]l2Entry
	e.mu.Lock()
	for _, p := range planned {
		if o := e.cat.objs[p.key]; o != nil && (o.state != stReady || o.dirty || o.writing) {
			continue // no L2 copy to check, or one being written
		}
		if ent, ok := e.cat.l2[p.key]; ok {
			if check == nil {
				check = make(map[dcp.Key]l2Entry)
			}
			check[p.key] = ent
		}
	}
	e.mu.Unlock()
	if check == nil {
		return nil
	}
	res := make(map[dcp.Key]l2Check, len(check))
	for key, ent := range check {
		o, err := e.l2.Stat(ctx, key)
		switch {
		case err == nil && o.Size == ent.size && o.Sum == ent.sum:
			res[key] = l2Present
		case err == nil || errors.Is(err, ErrNotFound) || errors.Is(err, ErrCorrupt):
			res[key] = l2Gone
		default: // I/O error or ctx: not known gone, but no dedupe either
			res[key] = l2Unknown
		}
	}
	return res
}

// l2Check is what checkL2Dedupe found of an inventoried L2 object.
type l2Check uint8

const (
	l2Unchecked l2Check = iota
	l2Present
	l2Gone
	l2Unknown
)

type plannedObj struct {
	chunk, group int
	key          dcp.Key
	size         uint64
	spans        []cuda.Span
}

// planStore validates req against sp and returns the objects this rank
// stores, with their page spans: layer-major, then block order, each span
// exactly the declared page (C2).
func (e *Engine) planStore(sp *space, req StoreRequest) ([]plannedObj, error) {
	res := sp.res
	if len(req.Chunks) > MaxStoreChunks {
		return nil, fmt.Errorf("%d chunks, limit %d: %w", len(req.Chunks), MaxStoreChunks, ErrBadRequest)
	}
	var out []plannedObj
	for ci, ch := range req.Chunks {
		if len(ch.Blocks) != len(res.Groups) {
			return nil, fmt.Errorf("chunk %d: block ids for %d groups, the spec has %d: %w", ci, len(ch.Blocks), len(res.Groups), ErrBadRequest)
		}
		for gi := range res.Groups {
			shard, ok := res.StoreShard(gi, e.cfg.Rank.TPRank)
			if !ok {
				continue
			}
			spans, err := e.pageSpans(sp, gi, ch.Blocks[gi])
			if err != nil {
				return nil, fmt.Errorf("chunk %d group %d: %w", ci, gi, err)
			}
			out = append(out, plannedObj{chunk: ci, group: gi,
				key:  dcp.Key{NS: res.Namespace, Chunk: ch.Chunk, Shard: uint16(shard), Group: uint16(gi)},
				size: res.ObjectSize(gi), spans: spans})
		}
	}
	return out, nil
}

// pageSpans returns the spans of an object of group gi over blocks.
func (e *Engine) pageSpans(sp *space, gi int, blocks []int64) ([]cuda.Span, error) {
	res := sp.res
	g := res.Geometry[gi]
	if want := res.BlocksPerChunk(gi); len(blocks) != want {
		return nil, fmt.Errorf("%d block ids, a chunk of %d tokens holds %d blocks of span %d: %w",
			len(blocks), res.ChunkTokens, want, g.Span, ErrBadRequest)
	}
	pools := sp.pools[gi]
	spans := make([]cuda.Span, 0, len(pools)*len(blocks))
	for li, m := range pools {
		ext, err := g.Extents(blocks, m.Size())
		if err != nil {
			return nil, fmt.Errorf("layer %d: %w: %w", li, ErrBadRequest, err)
		}
		for _, x := range ext {
			spans = append(spans, cuda.Span{Mem: m, Off: x.Off, Len: x.Len})
		}
	}
	return spans, nil
}

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
// and waits for room, until ctx ends (the store timeout). A store that
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
			wait = e.cat.changed
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

// ctxErr maps a context's end to ErrTimeout or ErrClosed/Canceled.
func ctxErr(ctx context.Context) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("%w: %w", ErrTimeout, ctx.Err())
	}
	return ctx.Err()
}

// runStore is the life of one store future.
func (e *Engine) runStore(f *StoreFuture) {
	ctx, cancel := context.WithTimeout(e.life, e.cfg.StoreTimeout)
	defer cancel()

	// 1. Room in L1 for every object to gather (waiting for it: issue 18.1).
	var live []storeWork
	if err := e.placeAll(ctx, f.work); err != nil {
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

	// 2. Wait for the producer, gather, wait for the device. While objects
	// another store is filling are pending, the pages and the event stay
	// held: a failed fill is gathered again from them (step 3).
	handled := false
	if len(live) > 0 {
		handled = e.gather(ctx, f, live, len(f.dups) > 0)
	}

	// 3. Objects another store was filling.
	if len(f.dups) > 0 {
		handled = e.settleDups(ctx, f, handled)
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
// It reports whether f.released and the event have been taken care of.
func (e *Engine) settleDups(ctx context.Context, f *StoreFuture, handled bool) bool {
	pending := f.dups
	for len(pending) > 0 {
		var next, refill []storeWork
		for _, w := range pending {
			var err error
			select {
			case <-w.o.filled:
				err = w.o.err
			case <-ctx.Done():
				err = fmt.Errorf("waiting for another store of %s: %w", w.o.key, ctxErr(ctx))
			}
			retry := err != nil && ctx.Err() == nil && !handled
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
			if err := e.placeAll(ctx, refill); err != nil {
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
	op, err := stream.Gather(e.l1buf, objs)
	if err != nil {
		e.storeStreams.put(stream, false) // its wait may still be pending
		failAll(fmt.Errorf("gather: %w: %w", ErrDevice, err))
		return false
	}
	err = op.Wait(ctx)
	switch {
	case err == nil:
		if !keep {
			close(f.released) // the device has read every page: the blocks are free
		}
		e.storeStreams.put(stream, true)
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
