package index

import (
	"fmt"
	"iter"
	"maps"
	"math"
	"math/bits"
	"slices"
	"sync"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/group"
	"github.com/kvtier/kvtier/wire"
)

// Lookups never wait for a publish (issue 12). Two structures make that so:
//
//   - A namespace's chunks are a chunkMap: chunkShards hash tables
//     (chunktable.go) by the chunk hash's first byte, each with its own
//     lock. The committer holds a shard's lock for one entry's write per
//     published chunk (and Index.mu for writing around its slice, for the
//     admin queries); a lookup holds a shard's read lock for its reads of
//     that shard, so it waits at most for one entry's write, never for a
//     slice of a publish.
//     A chunk's placement slice (a range of its shard's slab, below) is
//     never modified once published, so what a lookup reads of a chunk is
//     one whole published version of it.
//   - What else a lookup reads (namespace plans, rank and instance ids,
//     and the fence state of each rank) is a lookupView, immutable, that
//     the committer replaces through an atomic pointer (Index.view) when
//     one of its inputs changes: a new rank or instance, a registration,
//     an incarnation, a fence or a sliced fence's start or end — rare
//     events, each O(ranks + namespaces).
//
// Ordering. A lookup loads the view first, then reads its chunks, so every
// chunk it reads is at least as new as the view. The committer publishes
// a view that restricts (a fence, a hidden rank, a new incarnation) before
// the group's chunks, merged with the previous view so nothing is relaxed
// early, and the exact view (which may relax: an unfence, an unhide, a
// reset) after them. So a lookup sees a fence as soon as it sees any chunk
// of the group that fences, and never sees it lifted while a chunk it
// reads still holds the copies the fence removed.

// chunkShards is the number of locked maps a namespace's chunks are
// spread over (by the first byte of the chunk hash, itself a hash).
const chunkShards = 256

// Where a chunk's placements live (issue 26.5). The garbage collector
// marks every pointer of the live heap at every cycle: a map whose values
// each held their own []placement made it scan every bucket and mark
// every chunk's small array, 38 % of the coordinator's CPU during ingest.
// So a shard keeps the placements of all its chunks in one array of its
// own, the slab, and its table holds where (chunkSlot: offset, count and
// epoch, no pointer): the table and the slab are never scanned.
//
// The slab is append-only, and the safety argument rests on that alone:
//
//   - A range of the slab that an entry has pointed at is never written
//     again. set writes the chunk's new version after the slab's end
//     (beyond len, where no entry points and no reader reads), then points
//     the entry at it; set and del leave the old range as garbage. So a
//     slice of the slab, taken under the shard's lock (loadAll) or by the
//     writer (get), is one whole published version of the chunk for as
//     long as anyone holds it: after the lock is released, after later
//     sets and dels, after compactions. Slices are handed out capped
//     (slab[off:off+n:off+n]), so an append to one allocates.
//   - Compaction (compactShard: when the slab is full and a third of it
//     is garbage, or removals made it mostly garbage) never reuses the
//     array: it copies the live ranges into a new array and builds a new
//     table pointing into it, both off the lock, then installs the pair
//     under the write lock. A slice of the old array stays valid (the
//     collector keeps the array while a slice of it is held); every entry
//     read after the swap is resolved in the new array. A move to a larger
//     array (makeRoom) copies the whole slab, so every offset stays valid,
//     and a table's growth (chunktable.go) copies the entries as they are.
//   - A table and the array its offsets point into change together under
//     the write lock, and readers read both under the read lock (or as
//     the writer, or under Index.mu), so an offset is always resolved in
//     the array it was made for. all, whose walk may span compactions
//     (Verify's copy releases Index.mu between slices), re-reads the
//     entry of a chunk from the current table once its shard's table was
//     replaced.
//   - No two writers append into one array: a clone's slab is capped at
//     its length (slab[:len:len]), so the first append of either copy
//     moves that copy to an array of its own.
//
// Nothing outside this file sees an offset: whatever holds a chunk's value
// outside its table across a publish (a txn's old value, Verify's undo map,
// warmBatch's reads, a fold's slices, a queued chunkInstall) holds a
// chunkVal, a slice of the slab, which survives compaction.

// chunkMap is a namespace's chunks. Writers: the committer only, holding
// Index.mu for writing and the shard's lock (set, del); Open and snapshot
// installs build maps no reader can reach yet. Readers: the committer
// (without locks: it is the only writer), the admin queries under
// Index.mu (get, len, all), lookups under the shards' read locks (loadAll).
type chunkMap struct {
	sh [chunkShards]chunkShard
}

// chunkShard is one locked table and its slab. 64 bytes: one cache line
// per shard, so lookups on several cores do not share reader counts
// (TestChunkShardSize).
type chunkShard struct {
	// mu guards the pointers t and slab, and the entries of t, against
	// lookups (see chunkMap).
	mu sync.RWMutex
	// t: each chunk's placements, slab[off:off+n]; nil while the shard
	// holds no chunk.
	t    *chunkTable
	slab []placement
	// garbage counts the placements of slab no entry of t points at;
	// gen counts the compactions. Writers only (and holders of Index.mu).
	garbage uint32
	gen     uint32
}

// chunkSlot is where a chunk's entry in its shard's table says its
// placements are: slab[off:off+n]; epoch is chunkVal.epoch.
type chunkSlot struct {
	off, n, epoch uint32
}

// slabCompactMin is the garbage, in placements, below which removals do
// not compact a shard that still holds chunks (a variable for tests):
// 48 KiB.
var slabCompactMin uint32 = 1024

func newChunkMap() *chunkMap { return &chunkMap{} }

// at is e's placements, capped; e must be an entry of sh.t now (or of a
// table sh.slab is the array of: see all).
func (sh *chunkShard) at(e chunkSlot) []placement {
	return sh.slab[e.off : e.off+e.n : e.off+e.n]
}

// get reads a chunk without locking: the committer, or a holder of
// Index.mu.
func (cm *chunkMap) get(c dcp.ChunkHash) (chunkVal, bool) {
	sh := &cm.sh[c[0]]
	e, ok := sh.t.find(&c)
	if !ok {
		return chunkVal{}, false
	}
	return chunkVal{s: sh.at(e), epoch: e.epoch}, true
}

// loadAll reads the placements of cs into out (len(out) >= len(cs), nil
// for a chunk not in the map) under the read locks of their shards, each
// taken once (a read lock taken twice would wait behind a writer queued on
// it) and all held until every map read is done: the reads of one window
// then overlap their cache misses, where a lock per read (an atomic
// read-modify-write, a full fence on x86) would wait for each read's
// misses before starting the next. The locks are taken in shard order: a
// read lock waits behind a writer queued on its shard, and the install
// writes several shards at once (installAll), so two lookups taking two
// shards in opposite orders, with a writer queued on each, would wait for
// each other for good (TestLoadAllLockOrder). In one order, the lookup
// holding the highest shard of such a chain waits for nothing. A writer
// holds one shard's lock, for one entry's write. The slices stay valid
// after the locks are released (see the top of this file).
func (cm *chunkMap) loadAll(cs []dcp.ChunkHash, out [][]placement) {
	var held [chunkShards / 64]uint64
	for _, c := range cs {
		held[c[0]>>6] |= 1 << (c[0] & 63)
	}
	for w, set := range held {
		for set != 0 {
			cm.sh[w<<6|bits.TrailingZeros64(set)].mu.RLock()
			set &= set - 1
		}
	}
	for i := range cs {
		sh := &cm.sh[cs[i][0]]
		if e, ok := sh.t.find(&cs[i]); ok {
			out[i] = sh.at(e)
		} else {
			out[i] = nil
		}
	}
	for w, set := range held {
		for set != 0 {
			cm.sh[w<<6|bits.TrailingZeros64(set)].mu.RUnlock()
			set &= set - 1
		}
	}
}

// set installs a chunk's value, a copy of v.s; the committer, with
// Index.mu held for writing (or before the map is reachable). The copy is
// made off the lock: only this goroutine writes the shard, and it writes
// beyond the slab's length, where no reader reads (makeRoom, moving the
// slab, only reads the published ranges). So are the probe for the
// chunk's slot and a rebuild of the table when it must grow (a new table,
// which no reader reaches before the swap). The lock is held for the
// entry's write (and the swap) alone.
func (cm *chunkMap) set(c dcp.ChunkHash, v chunkVal) {
	sh := &cm.sh[c[0]]
	n := len(v.s)
	if uint64(len(sh.slab))+uint64(n) > math.MaxUint32 {
		panic(fmt.Sprintf("index: chunk shard slab of %d placements cannot take %d more: offsets are 32-bit", len(sh.slab), n))
	}
	slab := sh.slab
	if len(slab)+n > cap(slab) {
		slab = sh.makeRoom(n) // may compact: sh.t and sh.slab then are new
	}
	off := len(slab)
	slab = append(slab, v.s...) // within its capacity: the array stays
	k0, k1 := keyWords(&c)
	t := sh.t
	var i uint64
	grow, reseed := t == nil, false
	if t != nil {
		var found bool
		var probe int
		i, found, probe = t.slotFor(k0, k1)
		if !found {
			grow, reseed = t.rebuildFor(i, probe)
		}
	}
	if grow || reseed {
		t = t.rebuilt(reseed)
		i, _, _ = t.slotFor(k0, k1)
	}
	prev := t.slots[i]
	sh.mu.Lock()
	sh.t, sh.slab = t, slab
	t.slots[i] = chunkEntry{k0: k0, k1: k1, chunkSlot: chunkSlot{off: uint32(off), n: uint32(n), epoch: v.epoch}, state: slotFull}
	sh.mu.Unlock()
	switch prev.state {
	case slotFull:
		sh.garbage += prev.n
	case slotDead:
		t.dead--
		t.live++
	default:
		t.live++
	}
}

// del removes a chunk; as set.
func (cm *chunkMap) del(c dcp.ChunkHash) {
	sh := &cm.sh[c[0]]
	t := sh.t
	if t == nil {
		return
	}
	k0, k1 := keyWords(&c)
	i, found, _ := t.slotFor(k0, k1)
	if !found {
		return
	}
	old := t.slots[i].n
	sh.mu.Lock()
	t.slots[i].state = slotDead
	sh.mu.Unlock()
	t.live--
	t.dead++
	sh.garbage += old
	// Removals do not grow the slab, so they have their own trigger: each
	// compaction here copies at most as many placements as were removed
	// since the last, O(1) amortized per removal.
	if live := uint32(len(sh.slab)) - sh.garbage; sh.garbage > live && (sh.garbage >= slabCompactMin || live == 0) {
		sh.compactShard(int(live) + int(live)/4)
	}
}

// makeRoom returns the shard's slab in a new array with room for n more
// placements. When a third or more of the slab is garbage: the live
// ranges alone, in an array of twice their size (compactShard, which
// installs it; it copies at most twice as many placements as the garbage
// it drops, each appended once). Else: the whole slab, offsets unchanged,
// in an array half as large again (set installs it; over its life a
// placement is copied about twice so, where append's growth by a quarter
// would copy it about four times).
func (sh *chunkShard) makeRoom(n int) []placement {
	live := len(sh.slab) - int(sh.garbage)
	if sh.garbage > 0 && 2*int(sh.garbage) >= live {
		sh.compactShard(2 * (live + n))
		return sh.slab
	}
	slab := make([]placement, len(sh.slab), len(sh.slab)+len(sh.slab)/2+2*n)
	copy(slab, sh.slab)
	return slab
}

// compactShard replaces the slab by a new array of capacity size holding
// only the live ranges, and the table by one pointing into it, both built
// off the lock; the writer only (see the top of this file). A shard left
// without chunks and without room to keep gets neither.
func (sh *chunkShard) compactShard(size int) {
	var t *chunkTable
	var slab []placement
	if old := sh.t; old != nil && old.live > 0 || size > 0 {
		n := 0
		if old != nil {
			n = old.live
		}
		t = newChunkTable(n, old)
		slab = make([]placement, 0, size)
		if old != nil {
			for i := range old.slots {
				if e := old.slots[i]; e.state == slotFull {
					s := sh.at(e.chunkSlot)
					e.off = uint32(len(slab))
					slab = append(slab, s...)
					t.add(e)
				}
			}
		}
	}
	sh.mu.Lock()
	sh.t, sh.slab = t, slab
	sh.mu.Unlock()
	sh.garbage = 0
	sh.gen++
}

// checkSlabs checks every shard's garbage count against its table (what
// decides compactions) and the table itself: its counts, and that every
// entry is where a probe for its chunk finds it (Verify-time: O(chunks)).
func (cm *chunkMap) checkSlabs(pr *problems, ns dcp.Namespace) {
	for i := range cm.sh {
		sh := &cm.sh[i]
		var live uint64
		var full, dead int
		if t := sh.t; t != nil {
			for j := range t.slots {
				e := &t.slots[j]
				switch e.state {
				case slotDead:
					dead++
					continue
				case slotEmpty:
					continue
				}
				full++
				live += uint64(e.n)
				if uint64(e.off)+uint64(e.n) > uint64(len(sh.slab)) {
					pr.add("namespace %s shard %d: a chunk's placements [%d, %d) lie past its slab of %d", ns, i, e.off, e.off+e.n, len(sh.slab))
				}
				if c := e.key(); c[0] != byte(i) {
					pr.add("namespace %s shard %d: holds chunk %x of shard %d", ns, i, c, c[0])
				} else if k, found, _ := t.slotFor(e.k0, e.k1); !found || k != uint64(j) {
					pr.add("namespace %s shard %d: chunk %x in slot %d is not where a probe for it ends (%d, %v)", ns, i, c, j, k, found)
				}
			}
			if full != t.live || dead != t.dead {
				pr.add("namespace %s shard %d: table of %d slots holds %d live and %d dead entries, counts %d and %d", ns, i, len(t.slots), full, dead, t.live, t.dead)
			}
		}
		if live+uint64(sh.garbage) != uint64(len(sh.slab)) {
			pr.add("namespace %s shard %d: slab of %d placements holds %d live and counts %d garbage", ns, i, len(sh.slab), live, sh.garbage)
		}
	}
}

// len counts the chunks: O(chunkShards); as get.
func (cm *chunkMap) len() int {
	n := 0
	for i := range cm.sh {
		if t := cm.sh[i].t; t != nil {
			n += t.live
		}
	}
	return n
}

// all iterates over the chunks, shard by shard; as get, for each step (a
// caller may release Index.mu between two). A chunk neither set nor
// deleted during the walk is produced exactly once; one set or deleted
// during it may be produced or not (more than once, if deleted and set
// again). A shard's walk goes over the slots of the table it had when the
// walk began: while that table stays the shard's, its entries do not
// move (chunktable.go). Once it is replaced (grown, rebuilt under a new
// seed, or its slab compacted) nothing writes it any more, and each of
// its chunks' values is read from the current table (the old one's
// offsets may point into an old array); a chunk deleted since is
// skipped.
func (cm *chunkMap) all() iter.Seq2[dcp.ChunkHash, chunkVal] {
	return func(yield func(dcp.ChunkHash, chunkVal) bool) {
		for i := range cm.sh {
			sh := &cm.sh[i]
			t := sh.t
			if t == nil {
				continue
			}
			for j := range t.slots {
				e := t.slots[j]
				if e.state != slotFull {
					continue
				}
				// While t is the shard's, e, read now, is a range of the
				// current slab.
				c, v := e.key(), e.chunkSlot
				if sh.t != t {
					var ok bool
					if v, ok = sh.t.find(&c); !ok {
						continue
					}
				}
				if !yield(c, chunkVal{s: sh.at(v), epoch: v.epoch}) {
					return
				}
			}
		}
	}
}

// clone copies the tables, sharing the slabs' arrays capped at their
// lengths (so the first append of either copy moves it to an array of
// its own); as get.
func (cm *chunkMap) clone() *chunkMap {
	c := newChunkMap()
	for i := range cm.sh {
		sh, csh := &cm.sh[i], &c.sh[i]
		if sh.t != nil {
			csh.t = sh.t.clone()
			csh.slab = sh.slab[:len(sh.slab):len(sh.slab)]
			csh.garbage = sh.garbage
		}
	}
	return c
}

// lookupView is what a lookup reads besides the chunks; immutable once
// stored in Index.view (see the top of this file).
type lookupView struct {
	ns      map[dcp.Namespace]nsView // registered namespaces only
	rankIDs map[wire.Rank]uint32
	insts   map[string]uint32
	ranks   []rankView // by rank id; ranks[0] is unused
	// hiding counts the ranks with all set: while it is 0, Lookup reads
	// every placement as it is.
	hiding int
	// instances lists the instance names, sorted (Index.Instances).
	instances []string
	// minObject is the smallest object size of any registered namespace's
	// groups (Index.MinObjectSize); 0 while none is registered.
	minObject uint64
}

type nsView struct {
	plan   *lookupPlan
	chunks *chunkMap
}

// rankView is a rank's fence state as lookups apply it: its L1 copies are
// usable only when noL1 is false (not fenced, no sliced fence in
// progress) and only those stored by incarnation inc or a later one.
type rankView struct {
	inc    uint64
	noL1   bool
	fenced bool // RankFence
	// all: none of its copies is usable (a sliced inventory in progress
	// or interrupted by a crash: rankState.allHidden).
	all bool
}

// buildView derives the lookup view of st. With prev, the view is merged
// with prev so that it only restricts: a rank's noL1 is prev's or st's,
// its incarnation the higher of the two (see the ordering above).
func (st *state) buildView(prev *lookupView) *lookupView {
	v := &lookupView{ns: make(map[dcp.Namespace]nsView, len(st.ns)), rankIDs: maps.Clone(st.rankIDs),
		insts: maps.Clone(st.insts), ranks: make([]rankView, len(st.ranks))}
	for ns, n := range st.ns {
		if n.spec != nil {
			v.ns[ns] = nsView{plan: n.plan, chunks: n.chunks}
			for gi := range n.spec.Groups {
				if sz := n.spec.ObjectSize(gi); sz > 0 && (v.minObject == 0 || sz < v.minObject) {
					v.minObject = sz
				}
			}
		}
	}
	for id := 1; id < len(st.ranks); id++ {
		r := st.ranks[id]
		rv := rankView{inc: r.inc, noL1: r.fenced || r.l1Hidden, fenced: r.fenced, all: r.allHidden}
		if prev != nil && id < len(prev.ranks) {
			p := prev.ranks[id]
			rv.inc = max(rv.inc, p.inc)
			rv.noL1 = rv.noL1 || p.noL1
			rv.fenced = rv.fenced || p.fenced
			rv.all = rv.all || p.all
		}
		if rv.all {
			v.hiding++
		}
		v.ranks[id] = rv
	}
	for name := range st.insts {
		v.instances = append(v.instances, name)
	}
	slices.Sort(v.instances)
	return v
}

// visible returns s without the placements of ranks the view hides whole
// (rankView.all), in buf when it must filter. A placement of a rank newer
// than the view is kept: its rank was not hidden when the view was built,
// and a sliced inventory that starts later restricts through a later view.
func (v *lookupView) visible(s []placement, buf *[]placement) []placement {
	hid := func(p *placement) bool { return int(p.rank) < len(v.ranks) && v.ranks[p.rank].all }
	for i := range s {
		if hid(&s[i]) {
			out := append((*buf)[:0], s[:i]...)
			for j := i + 1; j < len(s); j++ {
				if !hid(&s[j]) {
					out = append(out, s[j])
				}
			}
			*buf = out
			return out
		}
	}
	return s
}

// chunkInstall is a chunk's new value (or its removal, del) for its map,
// collected by state.install.
type chunkInstall struct {
	cm  *chunkMap
	c   dcp.ChunkHash
	v   chunkVal
	del bool
}

// installAll makes ins with parts goroutines of g (fanOut): part p installs the
// chunks of the shards s with s % parts == p, so no two parts write one
// shard, and each holds one shard's lock at a time, for one entry, as
// set does (a lookup waits for at most one). A chunk appears at most once
// in ins (a txn stages each chunk once), so the order between parts does
// not matter. The caller is the committer, holding Index.mu for writing.
func installAll(g *group.Group, ins []chunkInstall, parts int) {
	parts = max(1, min(parts, len(ins)/installMinPerPart))
	fanOut(g, "publish-fan", parts, func(p int) {
		for i := range ins {
			in := &ins[i]
			if int(in.c[0])%parts != p {
				continue
			}
			if in.del {
				in.cm.del(in.c)
			} else {
				in.cm.set(in.c, in.v)
			}
		}
	})
}

// installMinPerPart: below this many installs per part a goroutine costs
// more than it saves.
const installMinPerPart = 64

// fanOut runs f(0), ..., f(parts-1) at once, f(0) on the caller and the
// others on goroutines of g (STYLE 21), and returns when every one has. A
// part g refuses (no group: Open's replay; a closed one: Close's final
// drain) runs on the caller, as the index's other hand-offs do.
func fanOut(g *group.Group, name string, parts int, f func(part int)) {
	if parts <= 1 {
		f(0)
		return
	}
	var wg sync.WaitGroup
	for p := 1; p < parts; p++ {
		wg.Add(1)
		run := func() {
			defer wg.Done()
			f(p)
		}
		if g == nil || !g.Go(name, run) {
			run()
		}
	}
	f(0)
	wg.Wait()
}
