package transfer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// RetrieveRequest asks the engine to place objects into the engine's
// pages. It has the fields of wire.RetrieveRequest and the caller
// (RetrieveRequestOf).
type RetrieveRequest struct {
	// RestoreID names the coordinator's restore, for logs ("" if none).
	RestoreID string
	Namespace dcp.Namespace
	// Session is the registration whose pools receive the bytes
	// (Session.ID); a retrieve never writes into another's.
	Session string
	// Items are the objects to place: Key is this rank's ReadShard of
	// Group for the chunk; Blocks are BlocksPerChunk(Group) target block
	// ids, less Skip (the chunk's first blocks, which the engine holds:
	// retrievepartial.go); Sum, when not 0, is the checksum the
	// coordinator recorded at store time and the object must match it;
	// Source is a hint (the engine always looks in L1 first, then in the
	// shared L2, whichever rank wrote it, then in L3: the prefix of the
	// source's holder for an L3 source, else this instance's and then,
	// for a share-group member's source, the member's, l3LoadFor).
	Items []wire.RetrieveItem
	// Caller is the engine identity that sent the request (as
	// StoreRequest.Caller): it must own the session, checked under the
	// lock that finds it, before anything is placed (ErrUnauthorized).
	Caller string
	// Pace, when not 0, bounds the rate of the retrieve's copies (bytes
	// per second; rankd: wire.HeaderPace or --restore-pace-gbps): each
	// batch after the first starts no sooner than the bytes before it take
	// at Pace, and no batch is larger than Pace moves in
	// Config.RetrievePaceWindow; a retrieve that would take more than half
	// the time left to its deadline at Pace goes faster (effectivePace).
	// An engine that decodes other requests while a prompt loads trades
	// the load's time for their steps (issue 24.4: at full speed, copies
	// from another context slow the model's steps beside them). 0: full
	// speed.
	Pace uint64
}

// MinPace is the slowest RetrieveRequest.Pace accepted: a slower one would
// hold a batch's L1 pins for seconds.
const MinPace = 100 << 20

// RetrieveRequestOf is the retrieve that caller sent as req.
func RetrieveRequestOf(req *wire.RetrieveRequest, caller string) RetrieveRequest {
	return RetrieveRequest{RestoreID: req.RestoreID, Namespace: req.Namespace, Session: req.Session,
		Items: req.Items, Caller: caller}
}

// ItemResult is the authoritative outcome of one item.
type ItemResult struct {
	Chunk int
	Group int
	Key   dcp.Key
	// OK: the bytes were placed and the checksum the scatter computed over
	// them equals the recorded one. Never true otherwise.
	OK bool
	// Sum is the kvsum64 the scatter computed of the bytes it stored (OK,
	// or a mismatch found after the scatter); on the CUDA backend of the
	// values as they were stored, not read back (cuda.Stream.Scatter).
	Sum uint64
	// From is where the object was found: L1, or L2 or L3 (read into L1
	// first; L3 only when L1 and L2 hold no good copy).
	From   wire.Tier
	Reason Reason
	Err    error
}

// RetrieveResult answers a retrieve: one ItemResult per item, in order. A
// chunk is restored only if every one of its items is OK; when any item of
// a chunk fails before the scatter, nothing is written into any of that
// chunk's pages.
type RetrieveResult struct {
	Items []ItemResult
	// BlocksInUse: a timed-out scatter could not be drained before the
	// answer because the engine is closing; the device may still write
	// the items' pages. Otherwise every answer, failed or not, is given
	// once the device has stopped writing them (C10).
	BlocksInUse bool
}

// FailedChunks returns the sorted chunk indexes with a failed item.
func (r RetrieveResult) FailedChunks() []int {
	var out []int
	for _, it := range r.Items {
		if !it.OK {
			out = append(out, it.Chunk)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// ChunkOK reports whether every item of chunk was placed and verified.
func (r RetrieveResult) ChunkOK(chunk int) bool {
	seen := false
	for _, it := range r.Items {
		if it.Chunk == chunk {
			if !it.OK {
				return false
			}
			seen = true
		}
	}
	return seen
}

// Wire converts r to the engine API reply.
func (r RetrieveResult) Wire() wire.RetrieveReply {
	out := wire.RetrieveReply{Results: make([]wire.ItemResult, len(r.Items))}
	for i, it := range r.Items {
		out.Results[i] = wire.ItemResult{Chunk: it.Chunk, Group: it.Group, OK: it.OK, Sum: it.Sum, Reason: string(it.Reason)}
	}
	return out
}

// Retrieve places req's objects into the engine's pages and answers once
// the device has finished and every placed object is verified. Each object
// comes from L1, or from L2 into L1 (verified before any scatter), is
// pinned, scattered, and its checksum compared with the recorded one. The
// error is for the request as a whole (ErrUnknownSession, ErrStaleSession,
// ErrUnauthorized, ErrUnknownNamespace, ErrBadRequest, ErrClosed);
// per-object failures are in the result.
func (e *Engine) Retrieve(ctx context.Context, req RetrieveRequest) (RetrieveResult, error) {
	start := time.Now()
	if req.Pace != 0 && req.Pace < MinPace {
		return RetrieveResult{}, fmt.Errorf("retrieve %q: pace %d B/s, below the least accepted (%d B/s): %w", req.RestoreID, req.Pace, MinPace, ErrBadRequest)
	}
	sp, err := e.acquireSpace(req.Namespace, req.Session, req.Caller)
	if err != nil {
		return RetrieveResult{}, fmt.Errorf("retrieve %q: %w", req.RestoreID, err)
	}
	spans, err := e.planRetrieve(sp, req)
	if err != nil {
		e.releaseSpace(sp)
		return RetrieveResult{}, fmt.Errorf("retrieve %q: %w", req.RestoreID, err)
	}
	e.mu.Lock()
	if e.closing {
		e.mu.Unlock()
		e.releaseSpace(sp)
		return RetrieveResult{}, fmt.Errorf("retrieve %q: %w", req.RestoreID, ErrClosed)
	}
	if !e.beginWriteLocked(sp) {
		e.mu.Unlock()
		e.releaseSpace(sp)
		return RetrieveResult{}, fmt.Errorf("retrieve %q: session %s was retired as the retrieve began: %w", req.RestoreID, sp.id, ErrStaleSession)
	}
	e.retrieves++
	e.mu.Unlock()
	e.ctr.retrievesInflight.Add(1)

	tl := TimelineFrom(ctx)
	tl.Lap(StagePlan, -1)
	r := &retrieval{e: e, sp: sp, req: req, spans: spans, tl: tl,
		res:  RetrieveResult{Items: make([]ItemResult, len(req.Items))},
		objs: make([]*l1Obj, len(req.Items)), peer: make([]*peerItem, len(req.Items))}
	ctx, cancel := context.WithTimeout(ctx, e.cfg.RetrieveTimeout)
	defer cancel()
	stop := context.AfterFunc(e.life, cancel)
	defer stop()
	// A retired session's retrieve stops: a registration that superseded
	// it waits for it to write nothing more (Register).
	stopRetired := context.AfterFunc(sp.stop, cancel)
	defer stopRetired()
	// The items go through L1 in batches of whole chunks, each pinned only
	// until its scatter is verified, so a prompt larger than L1 restores
	// from L2 whatever L1's size (issue 18.1). Batches overlap by one: batch
	// b+1 is prepared and its scatter enqueued (on another stream) before
	// batch b's scatter is waited for and verified, so the device never
	// idles between batches while the host plans the next one (issue 12.6).
	// At most two batches are pinned at once.
	var prev *pendingScatter
	var paced pacer
	if req.Pace != 0 {
		var total uint64
		for _, it := range req.Items {
			total += sp.res.ObjectSize(it.Group)
		}
		dl, _ := ctx.Deadline() // the retrieve's timeout at least
		paced.pace = effectivePace(req.Pace, total, time.Now(), dl)
		r.pace = paced.pace
	}
	bs := r.batches()
	r.touch(bs)
	if e.hooks.retrieveTouched != nil {
		e.hooks.retrieveTouched(req.RestoreID)
	}
	for bi, b := range bs {
		if paced.pace != 0 {
			if due := paced.next(r.batchBytes(b)); time.Until(due) > 0 {
				// A wait holds nothing: the batch before is verified and
				// its stream and pins given back first (its copies, at a
				// pace slower than the device's, are done or nearly).
				if prev != nil {
					r.complete(ctx, prev)
					prev = nil
				}
				if e.hooks.paceWaiting != nil {
					e.hooks.paceWaiting(req.RestoreID)
				}
				sleepUntil(ctx, due)
			}
			tl.Lap(StagePace, bi)
		}
		next := r.start(ctx, bi, b, &prev)
		if prev != nil {
			r.complete(ctx, prev)
		}
		prev = next
	}
	if prev != nil {
		r.complete(ctx, prev)
	}
	r.account()
	r.finish()
	tl.Lap(StageFinish, -1)
	e.ctr.retrieveLatency.Observe(time.Since(start).Seconds())
	return r.res, nil
}

// retrieval is one Retrieve call in progress.
type retrieval struct {
	e     *Engine
	sp    *space
	req   RetrieveRequest
	spans [][]cuda.Span
	res   RetrieveResult
	objs  []*l1Obj // pinned object of each item, nil once unpinned
	// peer is, for an item read from another rank's L1 (host-shared L1),
	// its lease; nil once given back.
	peer []*peerItem
	// partial is, for an item that skips blocks, its verified source
	// (checkPartial); nil when none does.
	partial map[int]*partialSource
	tl      *Timeline // nil: not timed
	pace    uint64    // bytes per second (effectivePace); 0: not paced
}

// planRetrieve validates req and returns each item's target spans
// (planFast; the reference, planRetrieveChecked, names what it refused).
func (e *Engine) planRetrieve(sp *space, req RetrieveRequest) ([][]cuda.Span, error) {
	if !skipsBlocks(req) { // planFast knows only whole chunks
		if out, ok := planFast(sp.res, sp.pools, e.cfg.Rank.TPRank, req); ok {
			return out, nil
		}
	}
	return e.planRetrieveChecked(sp, req)
}

// planRetrieveChecked validates req item by item and returns each item's
// target spans, or an error naming the first item that fails a check.
func (e *Engine) planRetrieveChecked(sp *space, req RetrieveRequest) ([][]cuda.Span, error) {
	res := sp.res
	if len(req.Items) > MaxStoreChunks*dcp.MaxGroups {
		return nil, fmt.Errorf("%d items, limit %d: %w", len(req.Items), MaxStoreChunks*dcp.MaxGroups, ErrBadRequest)
	}
	type target struct {
		group int
		block int64
	}
	seen := make(map[target]int)
	out := make([][]cuda.Span, len(req.Items))
	for i, it := range req.Items {
		switch {
		case it.Group < 0 || it.Group >= len(res.Groups):
			return nil, fmt.Errorf("item %d: group %d outside 0..%d: %w", i, it.Group, len(res.Groups)-1, ErrBadRequest)
		case it.Key.NS != req.Namespace:
			return nil, fmt.Errorf("item %d: key %s is of another namespace than %s: %w", i, it.Key, req.Namespace, ErrBadRequest)
		case int(it.Key.Group) != it.Group:
			return nil, fmt.Errorf("item %d: key %s names group %d, the item group %d: %w", i, it.Key, it.Key.Group, it.Group, ErrBadRequest)
		case int(it.Key.Shard) != res.ReadShard(it.Group, e.cfg.Rank.TPRank):
			return nil, fmt.Errorf("item %d: key %s names shard %d, TP rank %d reads shard %d of group %d: %w",
				i, it.Key, it.Key.Shard, e.cfg.Rank.TPRank, res.ReadShard(it.Group, e.cfg.Rank.TPRank), it.Group, ErrBadRequest)
		}
		for _, b := range it.Blocks {
			t := target{it.Group, b}
			if j, dup := seen[t]; dup {
				return nil, fmt.Errorf("items %d and %d both write block %d of group %d: %w", j, i, b, it.Group, ErrBadRequest)
			}
			seen[t] = i
		}
		var s []cuda.Span
		var err error
		if it.Skip != 0 {
			s, err = e.placedSpans(sp, it.Group, it.Blocks, it.Skip)
		} else {
			s, err = e.pageSpans(sp, it.Group, it.Blocks)
		}
		if err != nil {
			return nil, fmt.Errorf("item %d: %w", i, err)
		}
		out[i] = s
	}
	return out, nil
}

// pendingScatter is a batch whose scatter is enqueued but not yet waited
// for: idx are all its items, scatter those in the scatter (op on stream;
// nil op when nothing was enqueued), fromPeers those read from another
// rank's L1 and partial those that skip blocks (both scattered in
// complete).
type pendingScatter struct {
	batch                            int // index of the batch in the retrieve
	idx, scatter, fromPeers, partial []int
	stream                           cuda.Stream
	op                               *cuda.Op
	timers                           *copyTimers // marks before and after the scatter; nil: not timed
}

// start prepares batch idx (prepare) and enqueues its scatter. When no
// stream is free it first completes *prev (and sets it to nil), so a
// retrieve never waits for a stream while holding one.
func (r *retrieval) start(ctx context.Context, bi int, idx []int, prev **pendingScatter) *pendingScatter {
	e := r.e
	if e.cfg.RetrieveSerialBatches && *prev != nil {
		r.complete(ctx, *prev)
		*prev = nil
	}
	scatter, fromPeers, partial := r.prepare(ctx, idx)
	r.tl.Lap(StageLookup, bi)
	p := &pendingScatter{batch: bi, idx: idx, fromPeers: fromPeers, partial: partial}
	if len(scatter) == 0 {
		return p
	}
	p.scatter = scatter
	stream, err := e.retrieveStreams.tryGet()
	if stream == nil && err == nil {
		if *prev != nil {
			r.complete(ctx, *prev)
			*prev = nil
		}
		stream, err = e.retrieveStreams.get(ctx)
	}
	if err != nil {
		if ctx.Err() != nil {
			err = ctxErr(ctx)
		}
		for _, i := range scatter {
			r.fail(i, fmt.Errorf("no stream: %w", err))
		}
		p.scatter = nil
		return p
	}
	r.tl.Lap(StageStream, bi)
	objs := make([]cuda.Object, len(scatter))
	e.mu.Lock()
	retired := r.sp.retired
	for k, i := range scatter {
		objs[k] = cuda.Object{HostOff: e.cat.off(r.objs[i]), Spans: r.spans[i]}
	}
	e.mu.Unlock()
	if retired {
		e.retrieveStreams.put(stream, true)
		r.failRetired(scatter)
		p.scatter = nil
		return p
	}
	if err := timeUp(ctx); err != nil {
		// The retrieve's time is up (the engine's deadline, or its
		// timeout): the engine may have given these blocks to other use,
		// so nothing more is placed.
		e.retrieveStreams.put(stream, true)
		for _, i := range scatter {
			r.fail(i, fmt.Errorf("not placed: %w", err))
		}
		p.scatter = nil
		return p
	}
	tm := newCopyTimers(e.dev, r.tl, 2).mark(stream, 0)
	if op, ok := r.enqueueScatter(stream, e.l1buf, scatter, objs); ok {
		r.tl.LapTo(StageEnqueue, bi, op.Started())
		p.stream, p.op = stream, op
		p.timers = tm.began(op).mark(stream, 1)
		r.tl.Lap(StageLaunch, bi)
	} else {
		tm.release()
		r.tl.Lap(StageEnqueue, bi)
	}
	if e.hooks.scatterEnqueued != nil {
		e.hooks.scatterEnqueued(r.req.RestoreID, idx)
	}
	return p
}

// complete waits for and verifies the scatter of batch p, scatters its
// items held by peers, and unpins the batch.
func (r *retrieval) complete(ctx context.Context, p *pendingScatter) {
	defer func() { p.timers.release() }()
	if p.op != nil {
		if sums, ok := r.waitScatter(ctx, p.stream, p.op, p.scatter); ok {
			p.timers = r.tl.copyDone(p.timers, p.batch, time.Now(), StageScatter)
			r.verifyScatter(p.scatter, sums)
		}
	}
	if e := r.e; e.hooks.scatterCompleted != nil {
		e.hooks.scatterCompleted(r.req.RestoreID, p.idx)
	}
	if len(p.fromPeers) > 0 {
		r.scatterPeers(ctx, p.fromPeers)
	}
	if len(p.partial) > 0 {
		r.scatterPartial(ctx, p.partial)
	}
	r.unpinBatch(p.idx)
	r.tl.Lap(StageVerify, p.batch)
}

// prepare pins and loads the items of batch idx, gives each its verdict
// before the scatter, and returns the items to scatter from this rank's L1,
// those to scatter from peers' L1 and those (from either) that skip blocks.
func (r *retrieval) prepare(ctx context.Context, idx []int) (scatter, fromPeers, partial []int) {
	e := r.e
	res := r.sp.res
	var loads, waits, remote []int
	e.mu.Lock()
	for _, i := range idx {
		it := r.req.Items[i]
		ir := &r.res.Items[i]
		ir.Chunk, ir.Group, ir.Key = it.Chunk, it.Group, it.Key
		if o := e.cat.objs[it.Key]; o != nil {
			e.pinLocked(o)
			r.objs[i] = o
			ir.From = wire.L1
			if o.state != stReady {
				waits = append(waits, i)
			}
		} else {
			remote = append(remote, i)
		}
	}
	e.mu.Unlock()
	// Then the L1 of the other ranks of this host (host-shared L1), then L2.
	if remote = r.findPeers(remote); len(remote) > 0 {
		e.mu.Lock()
		for _, i := range remote {
			it := r.req.Items[i]
			ir := &r.res.Items[i]
			o := e.cat.objs[it.Key] // another retrieve may be loading it meanwhile
			switch {
			case o != nil:
				e.pinLocked(o)
				r.objs[i] = o
				ir.From = wire.L1
				if o.state != stReady {
					waits = append(waits, i)
				}
			case e.l2 == nil && e.l3 == nil:
				r.fail(i, fmt.Errorf("%s is not in L1 and there is no L2 or L3: %w", it.Key, ErrNotFound))
			default:
				r.objs[i] = e.newObjLocked(it.Key, res.Fingerprint, res.ObjectSize(it.Group))
				ir.From = wire.L2
				loads = append(loads, i)
			}
		}
		e.mu.Unlock()
	}

	// Loads from L2, a few at a time; each is verified before it is used.
	if len(loads) > 0 {
		var wg sync.WaitGroup
		next := make(chan int)
		readers := 0
		for range min(e.cfg.L2Readers, len(loads)) {
			wg.Add(1)
			if !e.goroutines.Go("retrieve-l2-read", func() {
				defer wg.Done()
				for i := range next {
					r.load(ctx, i)
				}
			}) {
				wg.Done()
				break
			}
			readers++
		}
		if readers == 0 {
			// Close has stopped the engine (ctx ends with its life): load
			// here, one by one, so each item and its L1 fill are still
			// settled (they fail at once) and the retrieve answers.
			for _, i := range loads {
				r.load(ctx, i)
			}
		} else {
			for _, i := range loads {
				next <- i
			}
		}
		close(next)
		wg.Wait()
	}
	for _, i := range waits {
		o := r.objs[i]
		select {
		case <-o.filled:
		case <-ctx.Done():
		}
	}

	// Verdicts before the scatter.
	e.mu.Lock()
	for _, i := range idx {
		it := r.req.Items[i]
		o := r.objs[i]
		if o == nil {
			continue
		}
		var err error
		switch {
		case o.state != stReady && o.err != nil:
			err = o.err
		case o.state != stReady:
			err = fmt.Errorf("%s still being filled: %w", o.key, ctxErr(ctx))
		case o.size != res.ObjectSize(it.Group):
			err = fmt.Errorf("%s holds %d B, the geometry says %d B: %w", o.key, o.size, res.ObjectSize(it.Group), ErrCorrupt)
		case it.Sum != 0 && o.sum != it.Sum:
			err = fmt.Errorf("%s holds kvsum64 %016x, the restore expects %016x: %w", o.key, o.sum, it.Sum, ErrCorrupt)
		}
		if err != nil {
			r.fail(i, err)
		}
	}
	e.mu.Unlock()
	// The sources of items that skip blocks are hashed now, outside the
	// lock (the objects are pinned, peers' leased), so that a bad one
	// fails its chunk before anything of it is written (retrievepartial.go).
	r.checkPartial(idx)
	e.mu.Lock()
	failed := map[int]bool{}
	for _, i := range idx {
		if r.res.Items[i].Reason != ReasonNone {
			failed[r.req.Items[i].Chunk] = true
		}
	}
	for _, i := range idx {
		it := r.req.Items[i]
		switch {
		case r.res.Items[i].Reason != ReasonNone:
		case failed[it.Chunk]:
			r.fail(i, fmt.Errorf("another object of chunk %d failed; nothing of the chunk is written", it.Chunk))
			r.res.Items[i].Reason = ReasonSibling
		case it.Skip != 0:
			partial = append(partial, i)
		case r.peer[i] != nil:
			fromPeers = append(fromPeers, i)
		default:
			scatter = append(scatter, i)
		}
	}
	for _, i := range idx {
		if r.res.Items[i].Reason != ReasonNone && r.objs[i] != nil {
			e.unpinLocked(r.objs[i])
			r.objs[i] = nil
		}
		if r.res.Items[i].Reason != ReasonNone {
			r.releasePeer(i)
		}
	}
	e.mu.Unlock()
	return scatter, fromPeers, partial
}

// load reads item i's object from L2 into its (unplaced) L1 object.
func (r *retrieval) load(ctx context.Context, i int) {
	e := r.e
	o := r.objs[i]
	err := e.placeWait(ctx, o)
	var meta L2Object
	if err == nil {
		dst := e.l1mem[e.cat.off(o) : e.cat.off(o)+o.size]
		err = fmt.Errorf("%s: no L2: %w", o.key, ErrNotFound)
		if e.l2 != nil {
			meta, err = e.l2.Get(ctx, o.key, o.fp, dst)
			if ce := (*CorruptError)(nil); errors.As(err, &ce) {
				e.l2Corrupt(ce)
			} else if errors.Is(err, ErrNotFound) {
				e.l2Vanished(o.key)
			}
		}
		// Neither L1 nor L2 holds a good copy: L3 may (issue 15.3).
		if e.l3 != nil && (errors.Is(err, ErrNotFound) || errors.Is(err, ErrCorrupt)) && ctx.Err() == nil {
			l2err := err
			meta, err = e.l3LoadFor(ctx, o, dst, r.req.Items[i].Source)
			if err == nil {
				r.res.Items[i].From = wire.L3
			} else if errors.Is(err, ErrNotFound) {
				err = l2err // say what L2 said: L3 has nothing to add
			}
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil {
		if errors.Is(err, ErrNotFound) && ctx.Err() == nil {
			err = fmt.Errorf("%s is in neither L1 nor L2: %w", o.key, err)
		} else if ctx.Err() != nil && !errors.Is(err, ErrCorrupt) {
			err = fmt.Errorf("read %s from L2: %w", o.key, ctxErr(ctx))
		}
		e.failFillLocked(o, err)
		return
	}
	if r.res.Items[i].From == wire.L2 {
		e.ctr.bytesReadL2.Add(o.size)
		e.ctr.l2Reads.Add(1)
	}
	if meta.Writer == e.cfg.Rank && r.res.Items[i].From == wire.L2 {
		e.cat.l2Touch(o.key) // a use, for L2's LRU eviction
	}
	if from := r.res.Items[i].From; from == wire.L2 && e.memberWrote(meta.Writer) ||
		from == wire.L3 && meta.Writer.Instance != e.cfg.Rank.Instance && slices.Contains(e.cfg.L3SharedWith, meta.Writer.Instance) {
		// A share-group member's copy (its L2 file, or its L3 copy when
		// that file was gone, l3LoadFor): this L1 copy is a local copy of
		// the member's object, as a store deduplicated onto that file
		// keeps (KeepSharedInL1). A later store of it must not write it
		// to L2, where the file's path is the key's and this rank's
		// copy would replace the member's, nor to this rank's L3 (a
		// second L3 copy in the group): the member's placements serve the
		// group (issue 26.3).
		o.sharedOnly = true
	}
	e.commitLocked(o, meta.Sum, false)
	e.log.Debug("loaded", zap.Stringer("from", r.res.Items[i].From), zap.Stringer("key", o.key), zap.Uint64("size", o.size), zap.Stringer("writer", meta.Writer))
}

// memberWrote reports whether w, the writer an L2 file names, is a rank of
// another instance whose files this rank shares (L2SharedWith): the rule
// by which a store deduplicates onto a member's file (sharedCopy).
func (e *Engine) memberWrote(w wire.Rank) bool {
	return w.Instance != e.cfg.Rank.Instance && slices.Contains(e.cfg.L2SharedWith, w.Instance)
}

// l2Corrupt accounts for an L2 object that failed verification on read.
func (e *Engine) l2Corrupt(ce *CorruptError) {
	e.ctr.checksumL2.Add(1)
	if ce.Quarantine != "" {
		e.ctr.quarantined.Add(1)
	}
	e.log.Error("L2 object failed verification; not served", zap.Stringer("key", ce.Key), zap.String("path", ce.Path),
		zap.String("quarantine", ce.Quarantine), zap.String("why", ce.Reason))
	e.mu.Lock()
	defer e.mu.Unlock()
	if ent, ok := e.cat.l2[ce.Key]; ok && (!ce.WriterKnown || ce.Writer == e.cfg.Rank) {
		if o := e.cat.objs[ce.Key]; o != nil && o.state == stReady && !o.doomed {
			e.l2CopyGoneLocked(o)
			return
		}
		e.cat.l2Del(ce.Key)
		e.ctr.l2Objects.Store(int64(len(e.cat.l2)))
		e.emitLocked(wire.Removed, wire.L2, ce.Key, ent.size, ent.sum)
	}
}

// l2CopyGoneLocked handles an object L1 holds whose L2 copy (this rank's)
// was found quarantined or gone: the copy is announced removed, and the
// object becomes dirty and is written again, whatever the policy (it was
// durable before), so a re-store or a read heals the tier and the new
// copy is announced again (issue 11.12).
func (e *Engine) l2CopyGoneLocked(o *l1Obj) {
	if ent, ok := e.cat.l2[o.key]; ok {
		e.cat.l2Del(o.key)
		e.ctr.l2Objects.Store(int64(len(e.cat.l2)))
		e.emitLocked(wire.Removed, wire.L2, o.key, ent.size, ent.sum)
	}
	if e.l2 == nil || o.dirty {
		return
	}
	o.dirty = true
	e.ctr.l2Rewrites.Add(1)
	e.log.Warn("the L2 copy of an object L1 holds is gone or quarantined; writing it again", zap.Stringer("key", o.key))
	e.queueWriteLocked(o)
}

// l2Vanished drops an object of this rank's L2 inventory whose file is
// gone (deleted behind the engine's back).
func (e *Engine) l2Vanished(key dcp.Key) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if o := e.cat.objs[key]; o != nil && o.state == stReady && !o.doomed {
		if _, ok := e.cat.l2[key]; ok {
			e.l2CopyGoneLocked(o)
			return
		}
	}
	if ent, ok := e.cat.l2[key]; ok {
		e.cat.l2Del(key)
		e.ctr.l2Objects.Store(int64(len(e.cat.l2)))
		e.emitLocked(wire.Removed, wire.L2, key, ent.size, ent.sum)
		e.log.Error("an L2 object of this rank vanished", zap.Stringer("key", key))
	}
}

// fail records item i as failed (with Engine.mu held or not: it touches
// only the result).
func (r *retrieval) fail(i int, err error) {
	ir := &r.res.Items[i]
	ir.OK, ir.Err, ir.Reason = false, err, reasonOf(err)
}

// account counts and logs the failed items.
func (r *retrieval) account() {
	e := r.e
	for _, it := range r.res.Items {
		if !it.OK {
			e.ctr.retrieveFailures[reasonIndex(it.Reason)].Add(1)
			if it.Reason != ReasonSibling {
				e.log.Warn("retrieve of an object failed", zap.String("restore", r.req.RestoreID),
					zap.Int("chunk", it.Chunk), zap.Int("group", it.Group), zap.Stringer("key", it.Key),
					zap.String("reason", string(it.Reason)), zap.Error(it.Err))
			}
		}
	}
}

// touch marks the L1 objects of every batch as used when the retrieve
// begins: a restore the coordinator planned is a use of every object it
// will read, so a store beside it that needs room evicts older objects
// first rather than the chunks waiting for their batch (which would fail as
// missing and be recomputed; seen on the H200 and the H100 with a store and
// a restore of two prompts in an L1 of little more). Marking them only once
// the first batch was on the device left the store a few milliseconds to
// take them (the H100 at stop 47). They are touched last batch first, so
// that where eviction must take some of them it takes those needed last.
func (r *retrieval) touch(bs [][]int) {
	e := r.e
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, b := range slices.Backward(bs) {
		for _, i := range slices.Backward(b) {
			if o := e.cat.objs[r.req.Items[i].Key]; o != nil {
				e.cat.touch(o)
			}
		}
	}
}

// batches splits the items into runs of whole chunks, in request order,
// the first Config.RetrieveRamp growing to the batch bound (each prepared
// while the last one copies), the last Config.RetrieveTailRamp of an
// unpaced retrieve shrinking from it (the last batch's checksum follows
// every copy), and the rest each needing at most the bound's L1 slabs (a
// chunk larger than its batch's bound is a batch of its own).
func (r *retrieval) batches() [][]int {
	e := r.e
	bound := r.batchBound()
	// The items grouped by chunk, chunks in order of first appearance
	// (k), items in request order within each: one flat slice, chunk k's
	// items at flat[start[k]:start[k+1]], and the L1 each chunk needs. No
	// allocation per chunk: a restore of 1,024 small chunks is mostly
	// per-chunk work (issue 25.4).
	items := r.req.Items
	rank := newChunkRanks(items) // chunk -> k
	ks := make([]int, len(items))
	var need []uint64
	for i, it := range items {
		k, ok := rank.get(it.Chunk)
		if !ok {
			k = len(need)
			rank.set(it.Chunk, k)
			need = append(need, 0)
		}
		ks[i] = k
		need[k] += uint64(e.cat.slabsFor(r.sp.res.ObjectSize(it.Group))) * e.cat.slabBytes
	}
	start := make([]int, len(need)+1)
	for _, k := range ks {
		start[k+1]++
	}
	for k := range need {
		start[k+1] += start[k]
	}
	flat := make([]int, len(items))
	next := slices.Clone(start[:len(need)])
	for i, k := range ks {
		flat[next[k]] = i
		next[k]++
	}
	tailRamp := e.cfg.RetrieveTailRamp
	if r.pace != 0 {
		tailRamp = 0
	}
	runs := batchRuns(need, e.cat.slabBytes, bound, e.cfg.RetrieveRamp, tailRamp)
	out := make([][]int, 0, len(runs))
	for _, run := range runs {
		lo, hi := start[run[0]], start[run[1]]
		out = append(out, flat[lo:hi:hi])
	}
	return out
}

// chunkRanks numbers a retrieve's chunks in order of first appearance:
// in a slice by chunk when the chunks are small numbers (the restore's
// chunk positions, as engines send them), in a map otherwise. The map
// grew through ~10 rehashes for a restore of 1,024 chunks.
type chunkRanks struct {
	dense  []int // k+1 by chunk; 0: not seen
	sparse map[int]int
}

func newChunkRanks(items []wire.RetrieveItem) chunkRanks {
	hi := -1
	for _, it := range items {
		if it.Chunk < 0 || it.Chunk > 4*len(items)+64 {
			return chunkRanks{sparse: make(map[int]int, min(len(items), 1<<16))}
		}
		hi = max(hi, it.Chunk)
	}
	return chunkRanks{dense: make([]int, hi+1)}
}

func (c chunkRanks) get(chunk int) (int, bool) {
	if c.sparse != nil {
		k, ok := c.sparse[chunk]
		return k, ok
	}
	return c.dense[chunk] - 1, c.dense[chunk] != 0
}

func (c chunkRanks) set(chunk, k int) {
	if c.sparse != nil {
		c.sparse[chunk] = k
		return
	}
	c.dense[chunk] = k + 1
}

// batchRuns cuts the chunks' L1 needs into a retrieve's batches [from,
// to): the last tailRamp of them shrinking towards the end (cut from the
// sizes reversed, at most half of the bytes), the ones before them ramping
// up over ramp doublings, each first batch at most bound >> its ramp (a
// slab at least).
func batchRuns(need []uint64, slab, bound uint64, ramp, tailRamp int) [][2]int {
	first := func(ramp int) uint64 { return max(slab, bound>>uint(ramp)) }
	var total uint64
	for _, n := range need {
		total += n
	}
	var tail [][2]int
	split := len(need)
	if tailRamp > 0 {
		rev := slices.Clone(need)
		slices.Reverse(rev)
		runs, n := rampRuns(rev, first(tailRamp), bound, tailRamp, total/2)
		for _, run := range slices.Backward(runs) {
			tail = append(tail, [2]int{len(need) - run[1], len(need) - run[0]})
		}
		split -= n
	}
	head, _ := rampRuns(need[:split], first(ramp), bound, split, total)
	return append(head, tail...)
}

// rampRuns cuts need (bytes per chunk) from its start into runs [from, to)
// of whole chunks: the first of at most first bytes, each next of at most
// twice the last's bound, up to bound (a run holds one chunk at least). It
// stops after maxRuns runs, or before the chunk that would take the runs
// past maxBytes, and returns the runs and how many chunks they hold.
func rampRuns(need []uint64, first, bound uint64, maxRuns int, maxBytes uint64) (runs [][2]int, n int) {
	limit := first
	var cur, taken uint64
	from, end := 0, len(need)
	for i, b := range need {
		if taken+b > maxBytes {
			end = i
			break
		}
		if i > from && cur+b > limit {
			runs = append(runs, [2]int{from, i})
			if len(runs) == maxRuns {
				return runs, i
			}
			from, cur, limit = i, 0, min(bound, 2*limit)
		}
		cur += b
		taken += b
	}
	if end > from {
		runs = append(runs, [2]int{from, end})
	}
	return runs, end
}

// retrieveBatchBytes is the most L1 one retrieve pins at a time.
func (e *Engine) retrieveBatchBytes() uint64 {
	return max(e.cat.slabBytes, min(e.cfg.RetrieveBatchBytes, e.ctr.l1CapacityBytes/4))
}

// batchBound is retrieveBatchBytes, and for a paced retrieve at most what
// its pace moves in Config.RetrievePaceWindow.
func (r *retrieval) batchBound() uint64 {
	bound := r.e.retrieveBatchBytes()
	if p := r.pace; p != 0 {
		bound = max(r.e.cat.slabBytes, uint64(min(float64(bound), float64(p)*r.e.cfg.RetrievePaceWindow.Seconds())))
	}
	return bound
}

// batchBytes is the bytes the items idx place.
func (r *retrieval) batchBytes(idx []int) uint64 {
	var n uint64
	for _, i := range idx {
		n += r.sp.res.ObjectSize(r.req.Items[i].Group)
	}
	return n
}

// pacer spaces a paced retrieve's batches: the first starts at once, each
// next one when the bytes before it would have taken their time at the
// pace since the first began.
type pacer struct {
	pace  uint64 // bytes per second; 0: not paced
	start time.Time
	sent  uint64 // bytes of the batches started
}

// effectivePace is the pace of a retrieve of total bytes that begins at
// now and must be done by deadline (zero: none): the asked pace, or faster
// where at that pace the copies would take more than half the time left,
// so that pacing never costs a load its deadline (the engine gives up on
// it there and recomputes it).
func effectivePace(pace, total uint64, now, deadline time.Time) uint64 {
	if deadline.IsZero() {
		return pace
	}
	half := deadline.Sub(now) / 2
	if half <= 0 {
		return math.MaxUint64 // no time to spare: full speed
	}
	need := uint64(math.Ceil(float64(total) / half.Seconds()))
	return max(pace, need)
}

// next returns when the next batch, of n bytes, may start at p.pace: the
// first at once.
func (p *pacer) next(n uint64) time.Time {
	if p.start.IsZero() {
		p.start, p.sent = time.Now(), n
		return p.start
	}
	due := p.start.Add(time.Duration(float64(p.sent) / float64(p.pace) * float64(time.Second)))
	p.sent += n
	return due
}

// sleepUntil returns at t or when ctx is done (a paced batch then fails as
// not placed in start).
func sleepUntil(ctx context.Context, t time.Time) {
	d := time.Until(t)
	if d <= 0 {
		return
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
	case <-ctx.Done():
	}
}

// unpinBatch gives back the pins and peer leases of the items idx.
func (r *retrieval) unpinBatch(idx []int) {
	e := r.e
	for _, i := range idx {
		r.releasePeer(i)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, i := range idx {
		if o := r.objs[i]; o != nil {
			e.unpinLocked(o)
			r.objs[i] = nil
		}
	}
}

// finish unpins everything and ends the call.
func (r *retrieval) finish() {
	e := r.e
	for i := range r.peer {
		r.releasePeer(i)
	}
	e.mu.Lock()
	for i, o := range r.objs {
		if o != nil {
			e.unpinLocked(o)
			r.objs[i] = nil
		}
	}
	e.retrieves--
	e.workDoneLocked()
	e.endWriteLocked(r.sp)
	e.mu.Unlock()
	e.releaseSpace(r.sp)
	e.ctr.retrievesInflight.Add(-1)
}
