package index

import (
	"iter"
	"maps"
	"math/bits"
	"slices"
	"sync"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/group"
	"github.com/kvtier/kvtier/wire"
)

// Lookups never wait for a publish (issue 12). Two structures make that so:
//
//   - A namespace's chunks are a chunkMap: chunkShards maps by the chunk
//     hash's first byte, each with its own lock. The committer holds a
//     shard's lock for one map assignment per published chunk (and
//     Index.mu for writing around its slice, for the admin queries); a
//     lookup holds a shard's read lock for one map read per chunk, so it
//     waits at most for one assignment, never for a slice of a publish.
//     A chunk's placement slice is never modified once published, so what
//     a lookup reads of a chunk is one whole published version of it.
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

// chunkMap is a namespace's chunks. Writers: the committer only, holding
// Index.mu for writing and the shard's lock (set, del); Open and snapshot
// installs build maps no reader can reach yet. Readers: the committer
// (without locks: it is the only writer), the admin queries under
// Index.mu (get, len, all), lookups under the shards' read locks (loadAll).
type chunkMap struct {
	sh [chunkShards]chunkShard
}

type chunkShard struct {
	mu sync.RWMutex               // guards m against lookups (see chunkMap)
	m  map[dcp.ChunkHash]chunkVal // nil until the shard's first chunk
	_  [64 - 32]byte              // one cache line per shard: lookups on several cores do not share reader counts
}

func newChunkMap() *chunkMap { return &chunkMap{} }

// get reads a chunk without locking: the committer, or a holder of
// Index.mu.
func (cm *chunkMap) get(c dcp.ChunkHash) (chunkVal, bool) {
	v, ok := cm.sh[c[0]].m[c]
	return v, ok
}

// loadAll reads the placements of cs into out (len(out) >= len(cs)) under
// the read locks of their shards, each taken once (a read lock taken twice
// would wait behind a writer queued on it) and all held until every map
// read is done: the reads of one window then overlap their cache misses,
// where a lock per read (an atomic read-modify-write, a full fence on
// x86) would wait for each read's misses before starting the next. A
// writer holds a shard's lock for one assignment and never waits for
// another shard while holding one, so this cannot deadlock with it.
func (cm *chunkMap) loadAll(cs []dcp.ChunkHash, out [][]placement) {
	var held [chunkShards / 64]uint64
	for _, c := range cs {
		if b := c[0]; held[b>>6]&(1<<(b&63)) == 0 {
			held[b>>6] |= 1 << (b & 63)
			cm.sh[b].mu.RLock()
		}
	}
	for i, c := range cs {
		out[i] = cm.sh[c[0]].m[c].s
	}
	for w, set := range held {
		for set != 0 {
			cm.sh[w<<6|bits.TrailingZeros64(set)].mu.RUnlock()
			set &= set - 1
		}
	}
}

// set installs a chunk's value; the committer, with Index.mu held for
// writing (or before the map is reachable).
func (cm *chunkMap) set(c dcp.ChunkHash, v chunkVal) {
	sh := &cm.sh[c[0]]
	sh.mu.Lock()
	if sh.m == nil {
		sh.m = make(map[dcp.ChunkHash]chunkVal)
	}
	sh.m[c] = v
	sh.mu.Unlock()
}

// del removes a chunk; as set.
func (cm *chunkMap) del(c dcp.ChunkHash) {
	sh := &cm.sh[c[0]]
	sh.mu.Lock()
	delete(sh.m, c)
	sh.mu.Unlock()
}

// len counts the chunks: O(chunkShards); as get.
func (cm *chunkMap) len() int {
	n := 0
	for i := range cm.sh {
		n += len(cm.sh[i].m)
	}
	return n
}

// all iterates over the chunks, shard by shard; as get. The iteration
// guarantees of a Go map hold per shard: a chunk neither set nor deleted
// during the walk is produced exactly once.
func (cm *chunkMap) all() iter.Seq2[dcp.ChunkHash, chunkVal] {
	return func(yield func(dcp.ChunkHash, chunkVal) bool) {
		for i := range cm.sh {
			for c, v := range cm.sh[i].m {
				if !yield(c, v) {
					return
				}
			}
		}
	}
}

// clone copies the maps (sharing the placement slices); as get.
func (cm *chunkMap) clone() *chunkMap {
	c := newChunkMap()
	for i := range cm.sh {
		if m := cm.sh[i].m; m != nil {
			c.sh[i].m = maps.Clone(m)
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
// map, and each holds one shard's lock at a time, for one assignment, as
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
