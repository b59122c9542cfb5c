package transfer

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/transfer/tier"
	"github.com/kvtier/kvtier/wire"
)

// The L3 tier in the engine (issue 15.3): every object a store commits is
// queued to be written behind to the object store, from L1 (pinned for the
// write) or, once L1 has evicted it, from this rank's L2 copy. The queue is
// bounded (Config.L3QueueObjects): when it is full the object is not
// queued (counted in l3_queue_full_total), so a slow or failing bucket
// never blocks a store, L1 or L2. A write that fails is counted and not
// retried; the next store of the object queues it again. Retrieves read
// L3 when neither L1 nor L2 holds the object (or L2's copy failed), and
// verify it (C5). Each object written is announced as an L3 placement,
// each one removed (eviction under L3Bytes, failed verification, found
// gone) as an L3 removal. One request per object runs at a time: a write
// queued while the object's eviction delete (or another write of it) is in
// flight waits for it (l3_deferred_writes_total), so a late delete never
// removes a fresh copy. A store deduplicated against L1 or L2 queues the
// object too, unless this rank's L3 copy exists. The objects this rank
// wrote are found again at start-up by a background scan of the
// instance's objects (headers only). A retrieve whose plan names the L3
// copy of another instance of the share group (Config.L3SharedWith) reads
// it under that instance's prefix and leaves it alone whatever it finds:
// only its writer deletes, rewrites or drops it from an inventory.

// l3State is the engine's L3 bookkeeping, guarded by Engine.mu.
type l3State struct {
	objs   map[dcp.Key]l2Entry // objects this rank wrote that L3 holds
	bytes  uint64              // header and payload bytes of objs
	hdr    uint64              // header bytes of every object this rank writes
	clock  uint64
	lru    l2Heap // lazy, by write (or read) stamp
	queue  []dcp.Key
	queued map[dcp.Key]struct{}
	// busy holds the keys with a PUT or DELETE in flight: one request per
	// object at a time, so an eviction's delete never lands after (and
	// removes) a rewrite of the same object. after holds the keys whose
	// write was asked for while busy: queued again when the request ends.
	busy     map[dcp.Key]struct{}
	after    map[dcp.Key]struct{}
	inflight int // writes and their evictions' deletes running
	kick     chan struct{}
	changed  chan struct{} // closed and replaced when a write ends
	scanDone chan struct{} // closed when the start-up scan ended
}

// l3Counters are the L3 metrics.
type l3Counters struct {
	queued        atomic.Int64  // objects queued or being written
	written       atomic.Uint64 // objects written
	failed        atomic.Uint64 // writes that failed
	bytesWritten  atomic.Uint64 // payload bytes written
	bytesRead     atomic.Uint64 // payload bytes read into L1
	queueFull     atomic.Uint64 // objects not queued: the queue was full
	sourceGone    atomic.Uint64 // queued objects neither L1 nor L2 held any more when their turn came
	checksum      atomic.Uint64 // objects that failed verification on read or scan
	evictions     atomic.Uint64 // objects deleted to stay under L3Bytes
	evictErrors   atomic.Uint64
	objects       atomic.Int64
	bytes         atomic.Uint64
	restoredFrom  atomic.Uint64 // objects a retrieve read from L3
	sharedRead    atomic.Uint64 // of which from a share-group member's prefix (Config.L3SharedWith)
	sharedRefused atomic.Uint64 // items whose plan named the L3 copy of an instance L3SharedWith does not name
	deferred      atomic.Uint64 // writes held back while a delete or write of the same key ran
	leftForWriter atomic.Uint64 // bad copies of other ranks' objects a read left in the bucket
	scanRunning   atomic.Bool
	scanFound     atomic.Uint64
	scanCorrupted atomic.Uint64
}

func (e *Engine) l3Init() {
	s := &e.l3s
	s.objs = make(map[dcp.Key]l2Entry)
	s.queued = make(map[dcp.Key]struct{})
	s.busy = make(map[dcp.Key]struct{})
	s.after = make(map[dcp.Key]struct{})
	s.kick = make(chan struct{}, 1)
	s.changed = make(chan struct{})
	s.scanDone = make(chan struct{})
	s.hdr = tier.HeaderBytes(e.cfg.Rank.Instance)
}

// l3Start starts the writers and the start-up scan.
func (e *Engine) l3Start() {
	// Called by New: the group is open, nothing is refused.
	for range e.cfg.L3Writers {
		e.goroutines.Go("l3-write", e.l3WriteLoop)
	}
	e.l3c.scanRunning.Store(true)
	e.goroutines.Go("l3-scan", func() {
		defer close(e.l3s.scanDone)
		defer e.l3c.scanRunning.Store(false)
		if err := e.l3Rescan(); err != nil && e.life.Err() == nil {
			e.log.Error("L3 scan stopped early; serving the objects it found", zap.Error(err))
		}
	})
}

// l3QueueLocked queues key to be written to L3, unless this rank's L3
// copy already has sum, it is queued, the queue is full (counted), or L1
// holds key as a local copy of a share-group member's object
// (l1Obj.sharedOnly).
func (e *Engine) l3QueueLocked(key dcp.Key, sum uint64) {
	if o := e.cat.objs[key]; o != nil && o.sharedOnly {
		return
	}
	if e.l3 == nil {
		return
	}
	s := &e.l3s
	if ent, ok := s.objs[key]; ok && ent.sum == sum {
		return
	}
	if _, ok := s.queued[key]; ok {
		return
	}
	if len(s.queue) >= e.cfg.L3QueueObjects {
		if n := e.l3c.queueFull.Add(1); n&(n-1) == 0 { // log at powers of two
			e.log.Warn("L3 write-behind queue full; objects are not written to L3",
				zap.Int("queue", e.cfg.L3QueueObjects), zap.Uint64("not_queued", n))
		}
		return
	}
	s.queue = append(s.queue, key)
	s.queued[key] = struct{}{}
	e.l3c.queued.Add(1)
	kick(s.kick)
}

// l3WriteLoop writes queued objects to L3.
func (e *Engine) l3WriteLoop() {
	s := &e.l3s
	for {
		e.mu.Lock()
		for len(s.queue) == 0 {
			e.mu.Unlock()
			select {
			case <-s.kick:
			case <-e.life.Done():
				return
			}
			e.mu.Lock()
		}
		key := s.queue[0]
		s.queue = s.queue[1:]
		if len(s.queue) > 0 {
			kick(s.kick)
		}
		delete(s.queued, key)
		if _, ok := s.busy[key]; ok {
			// Its eviction's delete (or another write) is in flight: write
			// it when that ends, never alongside.
			s.after[key] = struct{}{}
			e.l3c.deferred.Add(1)
			e.l3c.queued.Add(-1)
			e.mu.Unlock()
			continue
		}
		s.busy[key] = struct{}{}
		s.inflight++
		var data []byte
		var meta L2Object
		o := e.cat.objs[key]
		ent, inL2 := e.cat.l2[key]
		switch {
		case o != nil && o.state == stReady && !o.doomed:
			o.pins++ // not a use: the L1 LRU order stays
			data = e.l1mem[e.cat.off(o) : e.cat.off(o)+o.size]
			meta = L2Object{Key: key, Fingerprint: o.fp, Size: o.size, Sum: o.sum}
		case inL2:
			o = nil
			meta = L2Object{Key: key, Fingerprint: ent.fp, Size: ent.size, Sum: ent.sum}
		default:
			o = nil
		}
		e.mu.Unlock()

		var err error
		switch {
		case data != nil:
			// Never write bytes that do not match their recorded checksum.
			err = verifyBytes(data, meta.Sum)
		case inL2:
			data = make([]byte, meta.Size)
			_, err = e.l2.Get(e.life, key, meta.Fingerprint, data)
			if ce := (*CorruptError)(nil); errors.As(err, &ce) {
				e.l2Corrupt(ce) // quarantined: accounted and announced like a read's
			} else if errors.Is(err, ErrNotFound) {
				e.l2Vanished(key)
			}
		default:
			err = ErrNotFound
		}
		if err == nil {
			meta.Writer, meta.Incarnation, meta.Created = e.cfg.Rank, e.cfg.Incarnation, e.cfg.Now()
			err = e.l3.Put(e.life, meta, data)
		}
		e.mu.Lock()
		if o != nil {
			e.unpinLocked(o)
		}
		delete(s.busy, key)
		victims := e.l3WriteDoneLocked(key, meta, err) // marks them busy
		if _, ok := s.busy[key]; !ok {
			e.l3ReleaseLocked(key)
		}
		e.mu.Unlock()
		e.l3Evict(victims)
		e.mu.Lock()
		s.inflight--
		e.l3c.queued.Add(-1)
		close(s.changed)
		s.changed = make(chan struct{})
		e.mu.Unlock()
	}
}

// l3ReleaseLocked queues key again when a write of it was asked for
// while its last request ran (and L3 does not hold it now).
func (e *Engine) l3ReleaseLocked(key dcp.Key) {
	s := &e.l3s
	if _, ok := s.after[key]; !ok {
		return
	}
	delete(s.after, key)
	if o := e.cat.objs[key]; o != nil && o.state == stReady && !o.doomed {
		e.l3QueueLocked(key, o.sum)
	} else if ent, ok := e.cat.l2[key]; ok {
		e.l3QueueLocked(key, ent.sum)
	} else {
		e.l3c.sourceGone.Add(1)
	}
}

// l3WriteDoneLocked accounts for one write of key and returns the
// objects to delete to stay under L3Bytes (already removed and announced,
// and marked busy until their delete ends).
func (e *Engine) l3WriteDoneLocked(key dcp.Key, meta L2Object, err error) []dcp.Key {
	s := &e.l3s
	switch {
	case errors.Is(err, ErrNotFound):
		e.l3c.sourceGone.Add(1)
		e.log.Debug("queued for L3 but held by neither L1 nor L2 any more", zap.Stringer("key", key))
		return nil
	case err != nil:
		e.l3c.failed.Add(1)
		e.log.Warn("L3 write failed; the next store of the object tries again", zap.Stringer("key", key), zap.Error(err))
		return nil
	}
	e.l3SetLocked(meta.Key, l2Entry{size: meta.Size, sum: meta.Sum, fp: meta.Fingerprint}, 0)
	e.l3c.written.Add(1)
	e.l3c.bytesWritten.Add(meta.Size)
	e.emitLocked(wire.Stored, wire.L3, meta.Key, meta.Size, meta.Sum)
	var victims []dcp.Key
	var skipped []l2Use
	for e.cfg.L3Bytes > 0 && s.bytes > e.cfg.L3Bytes && s.lru.Len() > 0 {
		u := heap.Pop(&s.lru).(l2Use)
		v, ok := s.objs[u.key]
		if !ok || v.used != u.used {
			continue // stale
		}
		if _, ok := s.busy[u.key]; ok {
			skipped = append(skipped, u) // being written again: not now
			continue
		}
		e.l3DelLocked(u.key)
		e.emitLocked(wire.Removed, wire.L3, u.key, v.size, v.sum)
		s.busy[u.key] = struct{}{}
		victims = append(victims, u.key)
	}
	for _, u := range skipped {
		heap.Push(&s.lru, u)
	}
	return victims
}

// l3Evict deletes evicted objects (announced removed already) and ends
// their busy marks, queueing again those stored meanwhile.
func (e *Engine) l3Evict(keys []dcp.Key) {
	for _, k := range keys {
		e.l3c.evictions.Add(1)
		if err := e.l3.Delete(e.life, k); err != nil {
			e.l3c.evictErrors.Add(1)
			e.log.Warn("L3 eviction: delete failed; the object stays in the bucket unannounced", zap.Stringer("key", k), zap.Error(err))
		}
		e.mu.Lock()
		delete(e.l3s.busy, k)
		e.l3ReleaseLocked(k)
		e.mu.Unlock()
	}
}

func (e *Engine) l3SetLocked(key dcp.Key, ent l2Entry, used uint64) {
	s := &e.l3s
	if old, ok := s.objs[key]; ok {
		s.bytes -= s.hdr + old.size
	}
	s.clock = max(s.clock+1, used)
	ent.used = s.clock
	s.objs[key] = ent
	s.bytes += s.hdr + ent.size
	if len(s.lru) > 2*len(s.objs)+1024 {
		s.lru = s.lru[:0]
		for k, v := range s.objs {
			s.lru = append(s.lru, l2Use{used: v.used, key: k})
		}
		heap.Init(&s.lru)
	} else {
		heap.Push(&s.lru, l2Use{used: ent.used, key: key})
	}
	e.l3c.objects.Store(int64(len(s.objs)))
	e.l3c.bytes.Store(s.bytes)
}

func (e *Engine) l3DelLocked(key dcp.Key) {
	s := &e.l3s
	if old, ok := s.objs[key]; ok {
		delete(s.objs, key)
		s.bytes -= s.hdr + old.size
		e.l3c.objects.Store(int64(len(s.objs)))
		e.l3c.bytes.Store(s.bytes)
	}
}

// l3Load is l3LoadFrom this instance's prefix.
func (e *Engine) l3Load(ctx context.Context, o *l1Obj, dst []byte) (L2Object, error) {
	return e.l3LoadFrom(ctx, o, dst, "")
}

// l3LoadFrom reads o from L3 into its L1 slabs (placed), verified: from
// the prefix of holder, the instance whose copy the plan names, when it is
// another instance (l3LoadShared: a share-group member of
// Config.L3SharedWith, or refused), else from this instance's. A copy that
// fails verification is left in the bucket unless this rank wrote it
// (l3RepairBad): only the writer can order its delete after its own
// writes of the object.
func (e *Engine) l3LoadFrom(ctx context.Context, o *l1Obj, dst []byte, holder string) (L2Object, error) {
	if holder != "" && holder != e.cfg.Rank.Instance {
		return e.l3LoadShared(ctx, o, dst, holder)
	}
	e.mu.Lock()
	stamp := e.l3s.clock
	e.mu.Unlock()
	meta, err := e.l3.Get(ctx, o.key, o.fp, dst)
	ce := (*CorruptError)(nil)
	switch {
	case err == nil:
		e.l3c.bytesRead.Add(o.size)
		e.l3c.restoredFrom.Add(1)
		if meta.Writer == e.cfg.Rank {
			e.mu.Lock()
			if ent, ok := e.l3s.objs[o.key]; ok {
				e.l3SetLocked(o.key, ent, 0) // a use, for the LRU
			}
			e.mu.Unlock()
		}
		return meta, nil
	case errors.As(err, &ce):
		e.l3c.checksum.Add(1)
		if !e.l3Writes(o.key) {
			e.l3c.leftForWriter.Add(1)
			e.log.Error("L3 object of another rank failed verification; not served, left in the bucket for its writer",
				zap.Stringer("key", ce.Key), zap.String("path", ce.Path), zap.String("why", ce.Reason))
			break
		}
		e.log.Error("L3 object failed verification; not served", zap.Stringer("key", ce.Key), zap.String("path", ce.Path),
			zap.String("why", ce.Reason))
		e.l3RepairBad(o.key, stamp)
	case errors.Is(err, ErrNotFound):
		e.l3Gone(o.key)
	}
	return meta, err
}

// l3LoadFor reads o for a retrieve item whose source is src when neither
// L1 nor L2 holds a good copy: from the L3 prefix l3Holder names (src's
// holder for an L3 source, else this instance's). When src names a copy of
// a share-group member in another tier (its L2 file, gone or failing its
// check, or its host-shared L1) and this instance's prefix has no good
// copy, the member's L3 copy is read too, when this rank reads the
// member's prefix (L3SharedWith): the coordinator named the member's
// better copy, and its L3 copy is the one left (issue 26). That read is
// checked like any other of the member's prefix (MAC, key, size), and the
// retrieve compares its sum with the recorded one. A rank not sharing the
// member's prefix does not try it, and counts no refusal: its plan never
// named it. When the member has nothing either, the error is this
// instance's.
func (e *Engine) l3LoadFor(ctx context.Context, o *l1Obj, dst []byte, src wire.Source) (L2Object, error) {
	meta, err := e.l3LoadFrom(ctx, o, dst, l3Holder(src))
	member := src.Holder.Instance
	switch {
	case err == nil || src.Tier == wire.L3 || member == "" || member == e.cfg.Rank.Instance:
		return meta, err
	case !slices.Contains(e.cfg.L3SharedWith, member) || ctx.Err() != nil:
		return meta, err
	case !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrCorrupt):
		return meta, err // an I/O error: not known missing
	}
	own := err
	meta, err = e.l3LoadShared(ctx, o, dst, member)
	if errors.Is(err, ErrNotFound) {
		return meta, own
	}
	if err == nil {
		e.log.Warn("the share-group member's copy the plan named is gone or failed its check; restored from the member's L3 copy",
			zap.Stringer("key", o.key), zap.String("member", member), zap.Stringer("tier", src.Tier))
	}
	return meta, err
}

// l3Holder is the instance whose L3 prefix a retrieve item reads first:
// its source's holder when the plan names an L3 copy, else "" (this
// instance's; for a plan naming a share-group member's copy in another
// tier, l3LoadFor then reads the member's prefix too).
func l3Holder(src wire.Source) string {
	if src.Tier != wire.L3 {
		return ""
	}
	return src.Holder.Instance
}

// l3LoadShared is l3Load of the copy that holder, another instance, wrote
// under its own prefix: refused (ErrNotFound, counted) unless
// Config.L3SharedWith names holder, which is the rankd's own authorization
// on top of the coordinator's share group. Nothing this rank holds changes
// whatever the read finds: a bad copy is counted and left for its writer,
// a missing one is the writer's to unannounce.
func (e *Engine) l3LoadShared(ctx context.Context, o *l1Obj, dst []byte, holder string) (L2Object, error) {
	if !slices.Contains(e.cfg.L3SharedWith, holder) {
		e.l3c.sharedRefused.Add(1)
		return L2Object{}, fmt.Errorf("%s: the plan names the L3 copy of instance %q, which this rank does not read (--l3-shared-with): %w",
			o.key, holder, ErrNotFound)
	}
	meta, err := e.l3.GetOf(ctx, holder, o.key, o.fp, dst)
	ce := (*CorruptError)(nil)
	switch {
	case err == nil:
		e.l3c.bytesRead.Add(o.size)
		e.l3c.restoredFrom.Add(1)
		e.l3c.sharedRead.Add(1)
	case errors.As(err, &ce):
		e.l3c.checksum.Add(1)
		e.l3c.leftForWriter.Add(1)
		e.log.Error("L3 object of a share-group member failed verification; not served, left in the bucket for its writer",
			zap.String("holder", holder), zap.Stringer("key", ce.Key), zap.String("path", ce.Path), zap.String("why", ce.Reason))
	}
	return meta, err
}

// l3Writes reports whether this rank writes key's L3 object: the object
// of shard s is written by TP rank s (dcp.StoreShard), as Scan reads it.
func (e *Engine) l3Writes(key dcp.Key) bool { return int(key.Shard) == e.cfg.Rank.TPRank }

// l3RepairBad handles a copy of key, written by this rank, that a read
// begun at clock stamp found bad: it is dropped from the inventory
// (announced removed) and written again from L1 or L2 when either holds
// the object, else deleted. Nothing is done when a write of key is queued
// or running, or one ended (or a read found the copy good) since the read
// began: that copy replaced what the read saw. The delete is ordered with
// this rank's writes of key like an eviction's (busy).
func (e *Engine) l3RepairBad(key dcp.Key, stamp uint64) {
	s := &e.l3s
	e.mu.Lock()
	defer e.mu.Unlock()
	_, busy := s.busy[key]
	_, queued := s.queued[key]
	ent, listed := s.objs[key]
	if busy || queued || (listed && ent.used > stamp) {
		e.log.Debug("L3 copy found bad was rewritten since the read; kept", zap.Stringer("key", key))
		return
	}
	if listed {
		e.l3DelLocked(key)
		e.emitLocked(wire.Removed, wire.L3, key, ent.size, ent.sum)
	}
	if o := e.cat.objs[key]; o != nil && o.state == stReady && !o.doomed {
		e.l3QueueLocked(key, o.sum) // the write replaces the bad copy
		return
	}
	if l2, ok := e.cat.l2[key]; ok {
		e.l3QueueLocked(key, l2.sum)
		return
	}
	s.busy[key] = struct{}{}
	s.inflight++
	e.mu.Unlock()
	err := e.l3.Delete(e.life, key)
	e.mu.Lock()
	if err != nil {
		e.log.Warn("L3: delete of a bad copy failed; it stays in the bucket unannounced", zap.Stringer("key", key), zap.Error(err))
	}
	delete(s.busy, key)
	e.l3ReleaseLocked(key)
	s.inflight--
	close(s.changed)
	s.changed = make(chan struct{})
}

// l3Gone drops key from this rank's L3 inventory (announced), when there.
func (e *Engine) l3Gone(key dcp.Key) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ent, ok := e.l3s.objs[key]; ok {
		e.l3DelLocked(key)
		e.emitLocked(wire.Removed, wire.L3, key, ent.size, ent.sum)
	}
}

// l3Rescan finds the objects this rank wrote to L3 (headers only).
func (e *Engine) l3Rescan() error {
	start := time.Now()
	var unverified int
	err := e.l3.Scan(e.life, e.cfg.Rank, func(s ScanEntry) {
		e.mu.Lock()
		defer e.mu.Unlock()
		if errors.Is(s.Err, ErrUnverified) {
			// C12: not announced (its sum is not one this cluster
			// recorded), left in the bucket; logged once, with the count.
			unverified++
			e.ctr.unverifiedL3.Add(1)
			e.log.Debug("L3 scan: an object whose header MAC does not verify is not announced", zap.Error(s.Err))
			e.emitLocked(wire.Removed, wire.L3, s.Object.Key, s.Object.Size, s.Object.Sum)
			return
		}
		if s.Err != nil {
			e.l3c.scanCorrupted.Add(1)
			e.l3c.checksum.Add(1)
			e.log.Warn("L3 scan: deleted an object whose header failed", zap.Error(s.Err))
			return
		}
		e.l3c.scanFound.Add(1)
		if _, ok := e.l3s.objs[s.Object.Key]; ok {
			return // written since the start: that entry is newer
		}
		if _, ok := e.l3s.queued[s.Object.Key]; ok {
			return // being written again: its write announces it
		}
		if _, ok := e.l3s.busy[s.Object.Key]; ok {
			return // being written or deleted: that request decides
		}
		e.l3SetLocked(s.Object.Key, l2Entry{size: s.Object.Size, sum: s.Object.Sum, fp: s.Object.Fingerprint},
			uint64(max(s.Object.Created.UnixNano(), 1)))
		e.emitLocked(wire.Stored, wire.L3, s.Object.Key, s.Object.Size, s.Object.Sum)
	})
	if unverified > 0 {
		e.log.Warn("L3 scan: objects whose header MAC does not verify with this cluster's storage key were not announced and are left in the bucket (another cluster's or a rotated key, written before storage MACs, or replaced by someone who can write the bucket); they are recomputed when needed",
			zap.Int("objects", unverified))
	}
	if err != nil {
		return fmt.Errorf("transfer: scan L3: %w", err)
	}
	e.log.Info("L3 scanned", zap.Uint64("objects", e.l3c.scanFound.Load()), zap.Uint64("deleted", e.l3c.scanCorrupted.Load()), zap.Int("unverified", unverified),
		zap.Duration("took", time.Since(start)))
	return nil
}

// FlushL3 waits until the L3 write-behind queue is empty and no write is
// running (or ctx ends). Without L3 it returns at once.
func (e *Engine) FlushL3(ctx context.Context) error { return e.flushL3(ctx, false) }

// flushL3 is FlushL3; with giveUp (Close) it also returns as soon as a
// write fails while it waits: a failing bucket does not hold a shutdown
// for the rest of the queue (write-behind is best effort; the objects are
// in L2).
func (e *Engine) flushL3(ctx context.Context, giveUp bool) error {
	if e.l3 == nil {
		return nil
	}
	failed := e.l3c.failed.Load()
	for {
		e.mu.Lock()
		n, ch := len(e.l3s.queue)+e.l3s.inflight, e.l3s.changed
		e.mu.Unlock()
		if n == 0 {
			return nil
		}
		if giveUp && e.l3c.failed.Load() > failed {
			return fmt.Errorf("flush L3: writes fail; %d objects left unwritten: %w", n, ErrIO)
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("flush L3: %d objects still queued: %w", n, ctx.Err())
		case <-e.life.Done():
			return ErrClosed
		}
	}
}

// L3Stats is a snapshot of the L3 counters.
type L3Stats struct {
	Queued       int64  // objects queued or being written
	Written      uint64 // objects written
	Failed       uint64 // writes that failed
	BytesWritten uint64
	BytesRead    uint64
	QueueFull    uint64 // objects not queued: the queue was full
	SourceGone   uint64 // queued objects neither L1 nor L2 held when their turn came
	Checksum     uint64 // objects that failed verification (read or scan)
	Evictions    uint64
	Objects      int64  // objects this rank wrote that L3 holds
	Bytes        uint64 // their header and payload bytes
	RestoredFrom uint64 // objects retrieves read from L3
	Deferred     uint64 // writes held back while a delete or write of the same object ran
	Scanning     bool
}

// L3Stats returns the L3 counters.
func (e *Engine) L3Stats() L3Stats {
	c := &e.l3c
	return L3Stats{Queued: c.queued.Load(), Written: c.written.Load(), Failed: c.failed.Load(),
		BytesWritten: c.bytesWritten.Load(), BytesRead: c.bytesRead.Load(), QueueFull: c.queueFull.Load(),
		SourceGone: c.sourceGone.Load(), Checksum: c.checksum.Load(), Evictions: c.evictions.Load(),
		Objects: c.objects.Load(), Bytes: c.bytes.Load(), RestoredFrom: c.restoredFrom.Load(), Deferred: c.deferred.Load(), Scanning: c.scanRunning.Load()}
}

// WaitL3Scan waits until the start-up L3 scan has ended (tests, tools).
func (e *Engine) WaitL3Scan(ctx context.Context) error {
	if e.l3 == nil {
		return nil
	}
	select {
	case <-e.l3s.scanDone:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// l3Collector exports the L3 counters.
type l3Collector struct {
	c     *l3Counters
	descs map[string]*prometheus.Desc
}

func newL3Collector(c *l3Counters, rank string) *l3Collector {
	cl := &l3Collector{c: c, descs: map[string]*prometheus.Desc{}}
	labels := prometheus.Labels{"rank": rank}
	add := func(name, help string, varLabels ...string) {
		cl.descs[name] = prometheus.NewDesc(metricPrefix+name, help, varLabels, labels)
	}
	add("l3_queued", "Objects queued to be written behind to L3, or being written.")
	add("l3_written_total", "Objects written to L3.")
	add("l3_write_failures_total", "L3 writes that failed (not retried; the next store of the object queues it again).")
	add("l3_bytes_total", "Payload bytes moved to (store) and from (retrieve) L3.", "direction")
	add("l3_queue_full_total", "Objects not written to L3 because the write-behind queue was full (a slow bucket never blocks a store).")
	add("l3_source_gone_total", "Objects queued for L3 that neither L1 nor L2 held any more when their turn came.")
	add("l3_checksum_failures_total", "L3 objects that failed verification on read or in the start-up scan (never served; this rank's own are rewritten or deleted).")
	add("l3_left_for_writer_total", "Objects of another rank that failed verification on read here: not served, left in the bucket (only their writer deletes or rewrites them; a reader's delete could remove a rewrite).")
	add("l3_evictions_total", "L3 objects of this rank deleted to stay under --l3-bytes (each announced as a removal).")
	add("l3_objects", "Objects this rank wrote that L3 holds.")
	add("l3_object_bytes", "Header and payload bytes of the L3 objects this rank wrote.")
	add("l3_restored_objects_total", "Objects retrieves read from L3 (neither L1 nor L2 held them).")
	add("l3_shared_restored_objects_total", "Objects retrieves read from the L3 copy of another instance of the share group, under its prefix (--l3-shared-with); also in l3_restored_objects_total.")
	add("l3_shared_refused_total", "Retrieve items whose plan named the L3 copy of an instance --l3-shared-with does not name: not read, the item fails (the engine recomputes the chunk).")
	add("l3_deferred_writes_total", "L3 writes held back until a delete (an eviction) or a write of the same object ended.")
	add("l3_scanning", "1 while the start-up scan of L3 (headers only, in the background) runs.")
	return cl
}

func (cl *l3Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range cl.descs {
		ch <- d
	}
}

func (cl *l3Collector) Collect(ch chan<- prometheus.Metric) {
	c := cl.c
	counter := func(name string, v uint64, lv ...string) {
		ch <- prometheus.MustNewConstMetric(cl.descs[name], prometheus.CounterValue, float64(v), lv...)
	}
	gauge := func(name string, v float64) {
		ch <- prometheus.MustNewConstMetric(cl.descs[name], prometheus.GaugeValue, v)
	}
	gauge("l3_queued", float64(c.queued.Load()))
	counter("l3_written_total", c.written.Load())
	counter("l3_write_failures_total", c.failed.Load())
	counter("l3_bytes_total", c.bytesWritten.Load(), "store")
	counter("l3_bytes_total", c.bytesRead.Load(), "retrieve")
	counter("l3_queue_full_total", c.queueFull.Load())
	counter("l3_source_gone_total", c.sourceGone.Load())
	counter("l3_checksum_failures_total", c.checksum.Load())
	counter("l3_evictions_total", c.evictions.Load())
	gauge("l3_objects", float64(c.objects.Load()))
	gauge("l3_object_bytes", float64(c.bytes.Load()))
	counter("l3_restored_objects_total", c.restoredFrom.Load())
	counter("l3_shared_restored_objects_total", c.sharedRead.Load())
	counter("l3_shared_refused_total", c.sharedRefused.Load())
	counter("l3_deferred_writes_total", c.deferred.Load())
	counter("l3_left_for_writer_total", c.leftForWriter.Load())
	sc := 0.0
	if c.scanRunning.Load() {
		sc = 1
	}
	gauge("l3_scanning", sc)
}
