package transfer

import (
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/transfer/hostl1"
	"github.com/kvtier/kvtier/wire"
)

// L1 is one pinned host buffer carved into equal slabs; an object occupies
// a run of contiguous slabs (Gather and Scatter need each object contiguous
// in the host buffer). Placement is first fit; when no free run exists, the
// cheapest window of slabs holding no pinned object is chosen (cheapest =
// least recently used occupants) and its occupants evicted, after writing
// them to L2 first where they exist nowhere else. If every window holds a
// pinned object the placement fails at once with ErrL1Full. A store then
// gives back every slab it placed and waits for room holding none
// (placeAll), so stores holding room always finish and waiting ones
// never deadlock; a retrieve's L2 load does not wait (its batch holds
// pins) and fails with no_space.

type objState uint8

const (
	stFilling objState = iota // a store's gather or a retrieve's L2 read is writing it
	stReady                   // committed: its bytes match sum
)

// l1Obj is one object in L1. All fields are guarded by Engine.mu; the
// bytes [off, off+size) of the L1 buffer belong to whoever holds the
// object in stFilling, and are read-only once stReady.
type l1Obj struct {
	key   dcp.Key
	fp    [32]byte // layout fingerprint of the namespace (L2 header)
	size  uint64
	sum   uint64
	slab  int // first slab; -1 while unplaced
	nslab int
	state objState
	// pins counts users that need the bytes to stay: the filler, retrieves
	// scattering from it. A pinned object is never evicted.
	pins int
	// dirty: an L2 exists and does not hold the object yet.
	dirty bool
	// sharedOnly: a local copy of an object a share-group member's L2
	// file holds (Config.KeepSharedInL1, or read from that file by a
	// retrieve): committed clean, never written to L2 or L3
	// (l3QueueLocked, Store).
	sharedOnly bool
	// writing: an L2 writer has it queued or is writing it. It is not a
	// pin: an allocator may wait for it.
	writing         bool
	evictAfterWrite bool
	wbFailed        time.Time // last failed L2 write
	// doomed: removed from the catalog (evicted, failed, corrupt); its
	// slabs are freed once pins is 0 and no write is running.
	doomed bool
	tick   uint64 // last use
	prev   *l1Obj // LRU list of ready objects, head = least recent
	next   *l1Obj
	filled chan struct{} // closed when filling ends
	err    error         // why filling failed; valid after filled
	// pslot is the object's slot in the host L1 catalog while published
	// (committed and not dropped), else -1.
	pslot int64
	// prompt is the store request that last stored it and its position
	// there: its L2 write never evicts that prompt's objects at the same
	// or earlier positions (l2MakeRoomLocked).
	prompt promptPos
}

// l2Entry is one object this rank wrote to L2.
type l2Entry struct {
	size, sum uint64
	fp        [32]byte
	used      uint64    // last write or read (l2Clock), for LRU eviction
	prompt    promptPos // the store request that last wrote or stored it, and its position there
}

// catalog is everything the engine holds, guarded by Engine.mu.
type catalog struct {
	slabBytes uint64
	owner     []*l1Obj // per slab
	free      int      // free slabs
	objs      map[dcp.Key]*l1Obj
	l2        map[dcp.Key]l2Entry // change only through l2Set and l2Del
	l2acct    l2Accounting
	ready     int
	head      *l1Obj
	tail      *l1Obj
	ticks     uint64
	// changed is closed and replaced whenever room may have appeared or
	// an L2 write ended, if watched: taken by a waiter since the last time
	// (watchLocked; read it only through that).
	changed   chan struct{}
	watched   bool
	evictKick chan struct{}
	writeKick chan struct{}
	// writeQ holds first writes, retryQ writes tried again after a
	// failure: the writers take first writes first (nextWriteLocked), so
	// a retry backlog never takes the room a new prompt needs.
	writeQ   []*l1Obj
	retryQ   []*l1Obj
	retryRun int // first writes taken in a row while retries waited
	writing  int // objects queued or being written
	// L2 health (issue 11.3: a failing L2 never blocks L1). failStreak
	// counts consecutive failed writes; at l2DegradeAfter the tier is
	// degraded: new writes are skipped, objects only L1 holds become
	// evictable (dropped, counted), and one probe write is tried every
	// backoff (doubling up to l2MaxBackoff) until one succeeds.
	failStreak int
	retryWrite bool // a write failed while not degraded: retry it (write-through)
	degraded   bool
	probeAt    time.Time
	backoff    time.Duration
	// seg is the host L1 segment (nil unless Config.HostL1Dir): its
	// catalog lists the ready objects for peer rankds; leaseTTL (ns) is how
	// long a peer's lease keeps an object from being chosen for eviction.
	seg      *hostl1.Segment
	leaseTTL int64
	cursor   int      // where the last placement ended: findFree's next fit starts there
	prefix   []uint64 // scratch for window scans
	blocked  []int32
	waitable []int32
	slabTick []uint64
	window   []int
}

func (c *catalog) init(nslabs int, slabBytes uint64) {
	c.slabBytes = slabBytes
	c.owner = make([]*l1Obj, nslabs)
	c.free = nslabs
	c.objs = make(map[dcp.Key]*l1Obj)
	c.l2 = make(map[dcp.Key]l2Entry)
	c.l2acct.deleting = make(map[dcp.Key]uint64)
	c.changed = make(chan struct{})
	c.evictKick = make(chan struct{}, 1)
	c.writeKick = make(chan struct{}, 1)
}

// notifyLocked wakes whoever waits on changed. A channel nobody has taken
// since the last notification (watchLocked) is kept: no one can be waiting
// on it, and a restore of 1,024 small objects unpins each of them (a
// channel made and closed per object was a third of its allocations).
func (c *catalog) notifyLocked() {
	if !c.watched {
		return
	}
	close(c.changed)
	c.changed = make(chan struct{})
	c.watched = false
}

// watchLocked returns the channel the next notifyLocked closes, for a
// caller to wait on once it has let go of the engine's lock.
func (c *catalog) watchLocked() <-chan struct{} {
	c.watched = true
	return c.changed
}

func (c *catalog) off(o *l1Obj) uint64 { return uint64(o.slab) * c.slabBytes }

func (c *catalog) occupied() uint64 { return uint64(len(c.owner)-c.free) * c.slabBytes }

func (c *catalog) slabsFor(size uint64) int {
	n := (size + c.slabBytes - 1) / c.slabBytes
	if n == 0 {
		n = 1
	}
	if n > uint64(len(c.owner)) {
		return len(c.owner) + 1
	}
	return int(n)
}

func (c *catalog) lruPush(o *l1Obj) {
	c.ticks++
	o.tick = c.ticks
	o.prev, o.next = c.tail, nil
	if c.tail != nil {
		c.tail.next = o
	} else {
		c.head = o
	}
	c.tail = o
}

func (c *catalog) lruRemove(o *l1Obj) {
	if o.prev != nil {
		o.prev.next = o.next
	} else if c.head == o {
		c.head = o.next
	}
	if o.next != nil {
		o.next.prev = o.prev
	} else if c.tail == o {
		c.tail = o.prev
	}
	o.prev, o.next = nil, nil
}

// touch makes o the most recently used.
func (c *catalog) touch(o *l1Obj) {
	if o.state != stReady || o.doomed {
		return
	}
	c.lruRemove(o)
	c.lruPush(o)
	o.evictAfterWrite = false
}

func (c *catalog) assign(o *l1Obj, start int) {
	o.slab = start
	for i := start; i < start+o.nslab; i++ {
		c.owner[i] = o
	}
	c.free -= o.nslab
	c.cursor = start + o.nslab
}

func (c *catalog) freeSlabs(o *l1Obj) {
	if o.slab < 0 {
		return
	}
	for i := o.slab; i < o.slab+o.nslab; i++ {
		c.owner[i] = nil
	}
	c.free += o.nslab
	o.slab = -1
}

// findFree returns the start of a run of n free slabs, or -1: the first
// run at or after the cursor (where the previous placement ended), else
// the first before it (next fit). Placements follow one another through
// L1 and the LRU evictions free the oldest objects, which next fit placed
// in the same order, so once L1 is full a free run lies just ahead of the
// cursor. First fit scanned every occupied slab from the start on each
// placement: 36 us a placement at 256 GiB of 1 MiB slabs, linear in L1
// (BenchmarkL1Placement).
func (c *catalog) findFree(n int) int {
	if c.free < n {
		return -1
	}
	ns, from := len(c.owner), c.cursor
	if from >= ns {
		from = 0
	}
	if s := c.freeRun(n, from, ns); s >= 0 {
		return s
	}
	// Runs are contiguous in memory (none wraps past the last slab): the
	// second pass covers those that start before the cursor.
	return c.freeRun(n, 0, min(from+n-1, ns))
}

// freeRun returns the start of the first run of n free slabs within
// [from, to), or -1.
func (c *catalog) freeRun(n, from, to int) int {
	run := 0
	for i := from; i < to; i++ {
		if c.owner[i] != nil {
			run = 0
			continue
		}
		run++
		if run == n {
			return i - n + 1
		}
	}
	return -1
}

// slab classes for window scans.
const (
	slabFree     = iota
	slabClean    // evictable now
	slabWaitable // evictable once its L2 write is done
	slabBlocked  // pinned or filling, or its write-back just failed
)

func (c *catalog) classify(o *l1Obj, now time.Time) int {
	switch {
	case o == nil:
		return slabFree
	case o.pins > 0 || o.state != stReady || o.doomed || c.peerLeased(o, now):
		return slabBlocked
	case o.writing:
		return slabWaitable
	case o.dirty && c.degraded:
		return slabClean // L2 is failing: dropped (counted) rather than block L1
	case o.dirty && now.Sub(o.wbFailed) < writeBackRetry:
		return slabBlocked
	case o.dirty:
		return slabWaitable
	}
	return slabClean
}

// writeBackRetry is how long an object whose L2 write failed is left alone
// before the next attempt.
const writeBackRetry = time.Second

// findWindow returns the start of the best window of n slabs holding no
// blocked slab: one without waitable slabs if any exists; then the one whose
// most recently used occupant is least recent, so that a placement never
// evicts an object while a window of only older ones would do (LRU across
// windows: a sum of ages would trade one object stored a moment ago for a
// window of free slabs beside it); then the fewest and least recently used
// occupants. It returns -1 if none exists.
func (c *catalog) findWindow(n int, now time.Time) (start int, needsWait bool) {
	ns := len(c.owner)
	if cap(c.prefix) < ns+1 {
		c.prefix = make([]uint64, ns+1)
		c.blocked = make([]int32, ns+1)
		c.waitable = make([]int32, ns+1)
		c.slabTick = make([]uint64, ns)
		c.window = make([]int, 0, ns)
	}
	pre, blk, wt, tick := c.prefix[:ns+1], c.blocked[:ns+1], c.waitable[:ns+1], c.slabTick[:ns]
	for i, o := range c.owner {
		pre[i+1], blk[i+1], wt[i+1] = pre[i], blk[i], wt[i]
		tick[i] = 0
		switch c.classify(o, now) {
		case slabClean:
			pre[i+1] += o.tick
			tick[i] = o.tick
		case slabWaitable:
			pre[i+1] += o.tick
			wt[i+1]++
			tick[i] = o.tick
		case slabBlocked:
			blk[i+1]++
		}
	}
	// dq[head:] holds slabs of the current window whose ticks decrease:
	// dq[head] is the window's most recent occupant.
	dq, head := c.window[:0], 0
	best, bestWait, bestNewest, bestCost := -1, true, uint64(0), uint64(0)
	for i := range ns {
		for len(dq) > head && tick[dq[len(dq)-1]] <= tick[i] {
			dq = dq[:len(dq)-1]
		}
		dq = append(dq, i)
		s := i - n + 1
		if s < 0 {
			continue
		}
		if dq[head] < s {
			head++
		}
		if blk[s+n]-blk[s] != 0 {
			continue
		}
		wait := wt[s+n]-wt[s] != 0
		newest, cost := tick[dq[head]], pre[s+n]-pre[s]
		better := best < 0 || (bestWait && !wait)
		if !better && wait == bestWait {
			better = newest < bestNewest || (newest == bestNewest && cost < bestCost)
		}
		if better {
			best, bestWait, bestNewest, bestCost = s, wait, newest, cost
		}
	}
	return best, bestWait
}

// errL1TooSmall: an object larger than the whole of L1.
var errL1TooSmall = errors.New("larger than L1")

func (c *catalog) countDirty() int {
	n := 0
	for _, o := range c.objs {
		if o.dirty {
			n++
		}
	}
	return n
}

// placeLocked gives the unplaced object o its slabs. It returns nil when o
// is placed; a channel to wait on (then call again) when room is being
// made by L2 writes; or an error wrapping ErrL1Full (errL1TooSmall when o
// can never fit). The caller counts a final failure (l1Full).
func (e *Engine) placeLocked(o *l1Obj) (<-chan struct{}, error) {
	c := &e.cat
	if o.nslab > len(c.owner) {
		return nil, fmt.Errorf("object %s of %d B needs %d slabs of %d B, L1 has %d: %w: %w",
			o.key, o.size, o.nslab, c.slabBytes, len(c.owner), errL1TooSmall, ErrL1Full)
	}
	if s := c.findFree(o.nslab); s >= 0 {
		e.assignLocked(o, s)
		return nil, nil
	}
	s, wait := c.findWindow(o.nslab, e.cfg.Now())
	if s < 0 {
		return nil, fmt.Errorf("object %s of %d B needs %d contiguous slabs of %d B; every such run of L1 (%d slabs, %d free) holds a pinned or filling object: %w",
			o.key, o.size, o.nslab, c.slabBytes, len(c.owner), c.free, ErrL1Full)
	}
	if !wait {
		for i := s; i < s+o.nslab; i++ {
			if v := c.owner[i]; v != nil {
				e.evictLocked(v)
			}
		}
		e.assignLocked(o, s)
		return nil, nil
	}
	now := e.cfg.Now()
	for i := s; i < s+o.nslab; i++ {
		if v := c.owner[i]; v != nil && c.classify(v, now) == slabWaitable {
			v.evictAfterWrite = true
			if !v.writing {
				e.queueWriteLocked(v)
			}
		}
	}
	return c.watchLocked(), nil
}

func (e *Engine) assignLocked(o *l1Obj, s int) {
	e.cat.assign(o, s)
	e.ctr.l1OccupiedBytes.Store(e.cat.occupied())
	if float64(e.cat.occupied()) > e.cfg.HighWatermark*float64(e.ctr.l1CapacityBytes) {
		kick(e.cat.evictKick)
	}
}

// evictLocked removes a ready, unpinned, clean object from L1 (or, while
// L2 is degraded, one only L1 holds: dropped and counted).
func (e *Engine) evictLocked(o *l1Obj) {
	if e.hooks.evicting != nil {
		e.hooks.evicting(o.key, o.pins)
	}
	if o.pins > 0 || o.writing || (o.dirty && !e.cat.degraded) || o.state != stReady || o.doomed {
		e.ctr.pinnedEvictions.Add(1)
		e.log.Error("BUG: refused to evict an object in use", zap.Stringer("key", o.key),
			zap.Int("pins", o.pins), zap.Bool("writing", o.writing), zap.Bool("dirty", o.dirty))
		return
	}
	e.ctr.evictions.Add(1)
	if o.dirty {
		o.dirty = false
		e.ctr.l2DroppedDirty.Add(1)
		e.log.Error("L2 is failing: an object only L1 held was dropped to make room", zap.Stringer("key", o.key), zap.Uint64("size", o.size))
	} else {
		e.log.Debug("evicted from L1", zap.Stringer("key", o.key), zap.Uint64("size", o.size))
	}
	e.dropLocked(o)
}

// dropLocked removes o from the catalog (announcing it if it was
// committed) and frees its slabs as soon as nothing uses them.
func (e *Engine) dropLocked(o *l1Obj) {
	c := &e.cat
	if o.doomed {
		return
	}
	o.doomed = true
	if c.objs[o.key] == o {
		delete(c.objs, o.key)
	}
	e.peerRetireLocked(o) // peers stop finding it before its slabs can be reused
	if o.state == stReady {
		c.lruRemove(o)
		c.ready--
		e.ctr.l1Objects.Store(int64(c.ready))
		e.emitLocked(wire.Removed, wire.L1, o.key, o.size, o.sum)
	}
	e.maybeFreeLocked(o)
}

func (e *Engine) maybeFreeLocked(o *l1Obj) {
	if o.doomed && o.pins == 0 && !o.writing && o.slab >= 0 {
		e.cat.freeSlabs(o)
		e.ctr.l1OccupiedBytes.Store(e.cat.occupied())
		e.cat.notifyLocked()
	}
}

// pinLocked takes a pin on o (and marks it used).
func (e *Engine) pinLocked(o *l1Obj) {
	o.pins++
	e.cat.touch(o)
}

func (e *Engine) unpinLocked(o *l1Obj) {
	o.pins--
	if o.pins < 0 {
		panic("transfer: unbalanced unpin of " + o.key.String())
	}
	if o.pins == 0 {
		e.maybeFreeLocked(o)
		e.cat.notifyLocked()
	}
}

// commitLocked turns a filled object into a ready one and announces it.
func (e *Engine) commitLocked(o *l1Obj, sum uint64, dirty bool) {
	c := &e.cat
	if o.sharedOnly {
		dirty = false // the member's file holds it
	}
	o.sum = sum
	o.state = stReady
	o.dirty = dirty && e.l2 != nil
	c.ready++
	e.ctr.l1Objects.Store(int64(c.ready))
	c.lruPush(o)
	e.peerPublishLocked(o)
	e.emitLocked(wire.Stored, wire.L1, o.key, o.size, o.sum)
	close(o.filled)
	if dirty {
		e.l3QueueLocked(o.key, o.sum) // a store's object: written behind to L3
	}
	if o.dirty && e.cfg.L2Policy == WriteThrough {
		if c.degraded {
			o.wbFailed = e.cfg.Now()
			e.ctr.l2Skipped.Add(1)
		} else {
			e.queueWriteLocked(o)
		}
	}
}

// failFillLocked ends the filling of o with err and drops it.
func (e *Engine) failFillLocked(o *l1Obj, err error) {
	o.err = err
	close(o.filled)
	e.dropLocked(o)
}

// newObjLocked creates an unplaced, filling object of key, pinned once by
// its filler, and enters it in the catalog.
func (e *Engine) newObjLocked(key dcp.Key, fp [32]byte, size uint64) *l1Obj {
	o := &l1Obj{key: key, fp: fp, size: size, slab: -1, nslab: e.cat.slabsFor(size), pins: 1, filled: make(chan struct{}), pslot: -1}
	e.cat.objs[key] = o
	return o
}

// evictLoop keeps L1 occupancy under the high watermark.
func (e *Engine) evictLoop() {
	t := time.NewTicker(writeBackRetry)
	defer t.Stop()
	for {
		select {
		case <-e.cat.evictKick:
		case <-t.C:
		case <-e.life.Done():
			return
		}
		e.mu.Lock()
		e.probeL2Locked()
		e.retryWritesLocked()
		e.evictToLowLocked()
		e.mu.Unlock()
	}
}

// evictToLowLocked evicts least recently used objects once occupancy is
// over the high watermark, until it is at the low watermark; objects only
// L1 holds are written to L2 first and dropped when their write is done.
func (e *Engine) evictToLowLocked() {
	c := &e.cat
	capb := float64(e.ctr.l1CapacityBytes)
	occ := float64(c.occupied())
	if occ <= e.cfg.HighWatermark*capb {
		return
	}
	need := occ - e.cfg.LowWatermark*capb
	now := e.cfg.Now()
	for o := c.head; o != nil && need > 0; {
		next := o.next
		bytes := float64(uint64(o.nslab) * c.slabBytes)
		switch c.classify(o, now) {
		case slabClean:
			if o.dirty {
				break // L2 is degraded: dropped only when a placement needs the room
			}
			e.evictLocked(o)
			need -= bytes
		case slabWaitable:
			o.evictAfterWrite = true
			e.queueWriteLocked(o)
			need -= bytes
		}
		o = next
	}
}
