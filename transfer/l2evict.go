package transfer

import (
	"cmp"
	"container/heap"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// errL2TooLarge is why an object larger than L2Bytes is not written.
var errL2TooLarge = errors.New("object larger than the L2 bound")

// errL2PromptFull is why an object is not written to L2: the room it
// needs is held by objects of the same prompt (store request) at the same
// or earlier positions, which its write does not evict (issue 29.3).
var errL2PromptFull = errors.New("L2 bound full of the same prompt's earlier objects")

// promptTag names a store request (a prompt: an engine stores one request
// id's chunks incrementally, in concurrent stores) for L2's eviction;
// never 0.
func promptTag(requestID string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(requestID))
	return h.Sum64() | 1
}

// promptPos is the prompt that last stored an object and the object's
// place in it, for L2's eviction (issue 29.3): a prompt's stores run
// concurrently, so the order its objects reach L2 is not their order in
// the prompt; the position is (wire.ChunkBlocks.Pos).
type promptPos struct {
	tag uint64 // promptTag; 0: none (an object a retrieve loaded or the L2 rescan found)
	pos uint32 // the chunk's index in the prompt; 0 when the engine sends none
}

// l2Accounting tracks the bytes of this rank's L2 files and their use
// order (issue 15.2: a bounded L2), guarded by Engine.mu with the catalog.
//
// bytes counts the files in catalog.l2; pending counts the files being
// written (reserved before the write starts, the whole new file) and the
// ones being deleted (until the unlink returned), so bytes+pending is an
// upper bound of what this rank has on disk at any instant: a write only
// starts once bytes+pending+its size fits the bound.
type l2Accounting struct {
	hdr      uint64 // header bytes of every file this rank writes
	bytes    uint64
	pending  uint64
	deleting map[dcp.Key]uint64 // evicted objects whose delete is running
	clock    uint64             // last use stamp handed out
	lru      l2Heap             // lazy: entries whose stamp no longer matches are stale
	gauge    *atomic.Uint64     // kvtier_transfer_l2_bytes
}

type l2Use struct {
	used uint64
	key  dcp.Key
}

// l2Heap is a min-heap of use stamps.
type l2Heap []l2Use

func (h l2Heap) Len() int           { return len(h) }
func (h l2Heap) Less(i, j int) bool { return h[i].used < h[j].used }
func (h l2Heap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *l2Heap) Push(x any)        { *h = append(*h, x.(l2Use)) }
func (h *l2Heap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

func (c *catalog) fileBytes(size uint64) uint64 { return c.l2acct.hdr + size }

// stamp returns a use stamp after every earlier one, at least at (a
// wall-clock stamp in Unix ns, or 0).
func (c *catalog) stamp(at uint64) uint64 {
	a := &c.l2acct
	a.clock = max(a.clock+1, at)
	return a.clock
}

// l2Set enters (or replaces) key in this rank's L2 inventory, used at
// stamp used (0: now, the most recent use).
func (c *catalog) l2Set(key dcp.Key, ent l2Entry, used uint64) {
	a := &c.l2acct
	if old, ok := c.l2[key]; ok {
		a.bytes -= c.fileBytes(old.size)
	}
	if used == 0 {
		used = c.stamp(0)
	} else {
		a.clock = max(a.clock, used)
	}
	ent.used = used
	c.l2[key] = ent
	a.bytes += c.fileBytes(ent.size)
	c.l2push(l2Use{used: used, key: key})
	c.l2gauge()
}

// l2Del removes key from this rank's L2 inventory.
func (c *catalog) l2Del(key dcp.Key) {
	if old, ok := c.l2[key]; ok {
		delete(c.l2, key)
		c.l2acct.bytes -= c.fileBytes(old.size)
		c.l2gauge()
	}
}

// l2Touch marks key used now (a read of this rank's object).
func (c *catalog) l2Touch(key dcp.Key) {
	if ent, ok := c.l2[key]; ok {
		ent.used = c.stamp(0)
		c.l2[key] = ent
		c.l2push(l2Use{used: ent.used, key: key})
	}
}

// l2Claim marks key used now by the store request tagged prompt, at its
// position there (a store that deduplicated it): that prompt's writes at
// the same or later positions do not evict it.
func (c *catalog) l2Claim(key dcp.Key, prompt promptPos) {
	if ent, ok := c.l2[key]; ok {
		ent.prompt = prompt
		c.l2[key] = ent
		c.l2Touch(key)
	}
}

func (c *catalog) l2gauge() {
	if c.l2acct.gauge != nil {
		c.l2acct.gauge.Store(c.l2acct.bytes)
	}
}

// l2push adds a use to the heap, rebuilding it from the inventory when
// stale entries make up most of it (so it stays O(objects)).
func (c *catalog) l2push(u l2Use) {
	a := &c.l2acct
	if len(a.lru) > 2*len(c.l2)+1024 {
		a.lru = a.lru[:0]
		for k, ent := range c.l2 {
			a.lru = append(a.lru, l2Use{used: ent.used, key: k})
		}
		heap.Init(&a.lru)
		return // u is among them
	}
	heap.Push(&a.lru, u)
}

// l2Victim is an object evicted from L2, its delete still to do.
type l2Victim struct {
	key dcp.Key
	ent l2Entry
}

// l2FreeSpacer is implemented by tiers that know the free space of their
// file system (FileTier).
type l2FreeSpacer interface {
	FreeBytes() (uint64, error)
}

// l2MakeRoomLocked picks the least recently used objects of this rank to
// evict so that a new file of need bytes fits L2Bytes and leaves the free-
// space floor: it removes them from the inventory, announces each as an L2
// removal and marks them deleting (their bytes stay pending until l2Evict
// returned). Objects L1 holds dirty or is writing are never picked.
//
// The writing object's own prompt (prompt.tag, non-zero) is protected by
// position: its objects at positions up to prompt.pos are never picked, so
// a prompt larger than the bound keeps its first chunks in L2 (its prefix,
// what a restore needs; with MLA the other TP ranks read them only there)
// whatever order its concurrent stores reach L2 in (issue 29.3). Its
// objects at later positions are picked only once no other prompt's
// object is left to pick, the highest positions first, and only for room
// the deletes in flight do not make: a prompt's earlier chunks displace
// its later ones, never another prompt's less recently used objects
// first. Objects with no position (an engine that sends none: all at 0)
// are all protected against their own prompt.
//
// fits says whether the write then fits the bound; when it does not,
// other writes or deletes are in flight (pending), nothing is left to
// evict, or only the prompt's protected objects are (kept). It returns
// errL2TooLarge when need alone passes the bound.
func (e *Engine) l2MakeRoomLocked(need uint64, prompt promptPos) (victims []l2Victim, fits, kept bool, err error) {
	c := &e.cat
	a := &c.l2acct
	bound, floor := e.cfg.L2Bytes, e.cfg.L2FreeFloorBytes
	if bound == 0 && floor == 0 {
		return nil, true, false, nil
	}
	if bound != 0 && need > bound {
		return nil, false, false, fmt.Errorf("%d B file, bound %d B: %w", need, bound, errL2TooLarge)
	}
	var deficit uint64 // bytes the floor wants freed
	if fs, ok := e.l2.(l2FreeSpacer); ok && floor != 0 {
		free, err := fs.FreeBytes()
		if err != nil {
			e.log.Warn("L2 free-space floor not checked", zap.Error(err))
		} else if free < floor+need {
			deficit = floor + need - free
		}
	}
	var freed uint64
	// This call's victims are deleted before its write starts (the same
	// writer does both), so they do not count against it; other writers
	// see them pending until their deletes returned.
	room := func() bool {
		overBound := bound != 0 && a.bytes+a.pending-freed+need > bound
		return !overBound && freed >= deficit
	}
	evict := func(u l2Use, ent l2Entry) {
		fb := c.fileBytes(ent.size)
		c.l2Del(u.key)
		a.pending += fb
		a.deleting[u.key] += fb
		freed += fb
		e.emitLocked(wire.Removed, wire.L2, u.key, ent.size, ent.sum)
		victims = append(victims, l2Victim{key: u.key, ent: ent})
	}
	var keep []l2Use
	var later []l2Use // the prompt's own objects after its position
	for a.lru.Len() > 0 && !room() {
		u := heap.Pop(&a.lru).(l2Use)
		ent, ok := c.l2[u.key]
		if !ok || ent.used != u.used {
			continue // stale
		}
		if o := c.objs[u.key]; o != nil && (o.dirty || o.writing) {
			keep = append(keep, u)
			continue
		}
		if prompt.tag != 0 && ent.prompt.tag == prompt.tag {
			if ent.prompt.pos > prompt.pos {
				later = append(later, u)
			} else {
				keep = append(keep, u)
				kept = true
			}
			continue
		}
		evict(u, ent)
	}
	// Then the prompt's later positions, the highest first (the least
	// recently used first among one position's objects: stable). Only for
	// room that the deletes in flight (other writers' victims, this
	// call's) do not make once they return: concurrent writers of the
	// prompt would otherwise each evict its objects for the same room, and
	// a prompt's chunk evicted is gone from L2 for good (its write is not
	// tried again). Without room then, the caller waits for the deletes.
	var deleting uint64
	if len(later) > 0 {
		for _, b := range a.deleting {
			deleting += b
		}
	}
	roomOnceDeleted := func() bool {
		overBound := bound != 0 && a.bytes+a.pending-deleting+need > bound
		return !overBound && freed >= deficit
	}
	slices.SortStableFunc(later, func(x, y l2Use) int {
		return cmp.Compare(c.l2[y.key].prompt.pos, c.l2[x.key].prompt.pos)
	})
	for i, u := range later {
		if roomOnceDeleted() {
			keep = append(keep, later[i:]...)
			break
		}
		ent := c.l2[u.key]
		evict(u, ent)
		deleting += c.fileBytes(ent.size)
	}
	for _, u := range keep {
		heap.Push(&a.lru, u)
	}
	e.ctr.l2Objects.Store(int64(len(c.l2)))
	fits = (bound == 0 || a.bytes+a.pending-freed+need <= bound) && (!kept || freed >= deficit)
	return victims, fits, kept, nil
}

// l2ReserveLocked makes room for a new file of need bytes and reserves it
// (pending) once it fits the bound, deleting victims and waiting for other
// writers' writes and deletes as needed; it returns with e.mu held. When
// nothing is in flight and nothing is left to evict the write goes ahead
// (a store never fails because of the bound), unless what is left holds
// the same prompt's objects at the same or earlier positions (prompt,
// l2MakeRoomLocked): then nothing is reserved and the error is
// errL2PromptFull. errL2TooLarge: need alone passes the bound, nothing
// reserved.
func (e *Engine) l2ReserveLocked(need uint64, prompt promptPos) error {
	a := &e.cat.l2acct
	if e.cfg.L2Bytes != 0 {
		// Until the rescan has counted every file of this rank, bytes
		// undercounts the disk: bounded writes wait for it (the objects
		// stay in L1; the rescan reads headers only).
		select {
		case <-e.rescanDone:
		default:
			e.mu.Unlock()
			select {
			case <-e.rescanDone:
			case <-e.life.Done():
			}
			e.mu.Lock()
			if err := e.life.Err(); err != nil {
				return fmt.Errorf("wait for the L2 rescan: %w", err)
			}
		}
	}
	for {
		victims, fits, kept, err := e.l2MakeRoomLocked(need, prompt)
		if err != nil {
			return err
		}
		if len(victims) > 0 {
			e.mu.Unlock()
			e.l2Evict(victims) // before the write starts: they count no more
			e.mu.Lock()
			// While e.mu was released another writer may have reserved
			// the room the victims left: fits is stale, decide again.
			continue
		}
		if !fits && kept && a.pending == 0 {
			return fmt.Errorf("%d B file: %w", need, errL2PromptFull)
		}
		if fits || a.pending == 0 {
			a.pending += need
			return nil
		}
		ch := e.cat.watchLocked()
		e.mu.Unlock()
		<-ch // a write or delete in flight ends (finishWriteLocked, l2Evict notify)
		e.mu.Lock()
	}
}

// l2Evict deletes the victims l2MakeRoomLocked picked (not holding e.mu).
// A victim whose delete failed is entered and announced again.
func (e *Engine) l2Evict(victims []l2Victim) {
	if len(victims) == 0 {
		return
	}
	errs := make([]error, len(victims))
	for i, v := range victims {
		errs[i] = e.l2.Delete(e.life, v.key)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.l2EvictedLocked(victims, errs)
}

func (e *Engine) l2EvictedLocked(victims []l2Victim, errs []error) {
	c := &e.cat
	for i, v := range victims {
		fb := c.fileBytes(v.ent.size)
		c.l2acct.pending -= fb
		if c.l2acct.deleting[v.key] -= fb; c.l2acct.deleting[v.key] == 0 {
			delete(c.l2acct.deleting, v.key)
		}
		if errs[i] != nil {
			e.ctr.l2EvictErrors.Add(1)
			e.log.Warn("L2 eviction: delete failed; the object is kept", zap.Stringer("key", v.key), zap.Error(errs[i]))
			if _, ok := c.l2[v.key]; !ok {
				c.l2Set(v.key, v.ent, v.ent.used)
				e.emitLocked(wire.Stored, wire.L2, v.key, v.ent.size, v.ent.sum)
			}
			continue
		}
		e.ctr.l2Evictions.Add(1)
		e.log.Debug("evicted from L2", zap.Stringer("key", v.key), zap.Uint64("size", v.ent.size))
	}
	e.ctr.l2Objects.Store(int64(len(c.l2)))
	c.notifyLocked()
}
