package index

import (
	"cmp"
	"encoding/binary"
	"maps"
	"slices"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/group"
	"github.com/kvtier/kvtier/wire"
)

// placement is one holder of one object: the (shard, group) object of a
// chunk, held by a rank in a tier. The chunk and namespace are the map keys
// above it. 48 bytes, no pointers (the garbage collector never scans the
// placement arrays).
type placement struct {
	size uint64
	sum  uint64 // kvsum64 recorded at store time
	seq  uint64 // event sequence that put it here (inventory: the inventory's)
	inc  uint64 // holder incarnation that stored it
	rank uint32 // rank id (state.ranks)
	// inst and tp copy the holder's instance id and TP rank (derived, in
	// memory only, set by setChunk) so Lookup never leaves the array.
	inst uint32
	tp   uint16
	// object
	shard uint16
	group uint16
	tier  wire.Tier
}

// cmpSlot orders placements within a chunk: shard, group, tier, rank. The
// order makes L1 copies come before L2 copies of the same object and makes
// the slices of two states comparable element by element.
func cmpSlot(shard, group uint16, tier wire.Tier, rank uint32, q *placement) int {
	switch {
	case shard != q.shard:
		return int(shard) - int(q.shard)
	case group != q.group:
		return int(group) - int(q.group)
	case tier != q.tier:
		return int(tier) - int(q.tier)
	case rank < q.rank:
		return -1
	case rank > q.rank:
		return 1
	}
	return 0
}

// upsert inserts p in s in slot order, replacing a placement of the same
// slot. It modifies s in place; s must be owned by the caller.
func upsert(s []placement, p placement) []placement {
	i := 0
	for ; i < len(s); i++ {
		c := cmpSlot(p.shard, p.group, p.tier, p.rank, &s[i])
		if c == 0 {
			s[i] = p
			return s
		}
		if c < 0 {
			break
		}
	}
	s = append(s, placement{})
	copy(s[i+1:], s[i:])
	s[i] = p
	return s
}

// remove deletes the placement of one slot from s (in place) and returns it.
func remove(s []placement, shard, group uint16, tier wire.Tier, rank uint32) ([]placement, placement, bool) {
	for i := range s {
		if cmpSlot(shard, group, tier, rank, &s[i]) == 0 {
			p := s[i]
			return append(s[:i], s[i+1:]...), p, true
		}
	}
	return s, placement{}, false
}

// countObjects returns the distinct (shard, group) objects in a sorted slice.
func countObjects(s []placement) int64 {
	var n int64
	for i := range s {
		if i == 0 || s[i].shard != s[i-1].shard || s[i].group != s[i-1].group {
			n++
		}
	}
	return n
}

// tally counts placements and their bytes by tier (index = wire.Tier).
type tally struct {
	placements [4]int64
	bytes      [4]uint64
}

func (t *tally) add(p *placement, sign int64) {
	t.placements[p.tier] += sign
	t.bytes[p.tier] += uint64(sign) * p.size
}

// nsState is one namespace: its registered spec (nil until RegisterNamespace)
// and its chunks.
type nsState struct {
	spec     *dcp.Resolved
	specJSON []byte
	plan     *lookupPlan // derived from spec for Lookup
	chunks   *chunkMap
	objects  int64
	tally
}

// chunkVal is a chunk's placements (never empty: a chunk without
// placements is not in the map) and the checkpoint epoch in which it last
// changed (state.dirty). In its map a chunk is a chunkSlot, a range of its
// shard's slab (chunkmap.go); s, read from there, is a slice of the slab,
// never written again, and may be held across any later change.
type chunkVal struct {
	s     []placement
	epoch uint32
}

// rankMeta is the C7 state of a rank.
type rankMeta struct {
	inc    uint64 // current incarnation
	last   uint64 // last applied sequence of that incarnation
	fenced bool   // declared dead by FenceRank; cleared by an inventory or a new incarnation
	// partial: a sliced inventory is being applied (index/inventory.go);
	// durable, so a crash before its last slice leaves the rank partial:
	// hidden, its batches refused until an inventory is applied whole.
	partial bool
	// fenceGen: the rank's fence generation, advanced by every FenceRank
	// that applies to the rank (and by ResetRank), never by anything else,
	// and never going back. A caller that asks a rank for its inventory
	// reads it first (RankInfo.FenceGen) and passes it with the inventory
	// (ApplyInventoryAt, Op.FenceGen): if it moved in between, the rank was
	// fenced after the inventory was taken and the inventory is dropped
	// (fenced_since), deterministically on every replica. Durable (rank
	// record), so it is part of every raft snapshot.
	fenceGen uint64
}

type rankState struct {
	id   uint32
	rank wire.Rank
	inst uint32 // instance id (state.insts), in memory only
	rankMeta
	tally
	// chunks lists every chunk with at least one placement of this rank
	// (kept by setChunk), so fences and inventories visit the rank's
	// chunks, not the whole index (STYLE 24). It may also list chunks the
	// rank has left, and a chunk more than once (left and entered again):
	// readers check the chunk. live counts the chunks the rank is in now;
	// when the list grows past twice that, it is compacted. A list of refs
	// (32 B each) rather than a set: a map costs ~80 B per entry, as much
	// as the placement itself. In blocks (refList): appends never copy it.
	chunks refList
	live   int
	// l1Hidden: a sliced FenceRank of this rank is in progress (Index,
	// fenceJob): its L1 placements still in the chunks are not usable and
	// queries skip them. Written by the committer under Index.mu.
	l1Hidden bool
	// allHidden: a sliced inventory of this rank is in progress, or was
	// interrupted by a crash (rankMeta.partial): none of its placements is
	// usable. Written by the committer under Index.mu; state.hiding counts
	// the ranks with it set.
	allHidden bool
	// fencing: the same, for the committer only (queries never read it):
	// the chunk list is not compacted meanwhile, so the fence's cursor
	// into it stays valid.
	fencing bool
	// compact is the compaction of chunks in flight (nil: none); listGen
	// counts the times chunks was replaced rather than appended to, so a
	// compaction of a list since replaced is dropped. Committer only.
	compact *compaction
	listGen uint32
}

// state is the whole index in memory: what Lookup reads. The committer is
// its only writer (through txn and publish); see Index for the locking.
type state struct {
	ns      map[dcp.Namespace]*nsState
	ranks   []*rankState // by id; ranks[0] is nil
	rankIDs map[wire.Rank]uint32
	insts   map[string]uint32
	objects int64
	chunks  int64
	tally
	// hiding counts the ranks with allHidden set: while it is 0, Lookup
	// reads every placement as it is.
	hiding int

	// Checkpoint bookkeeping, used by the committer only (queries never
	// read it): dirty lists the chunks changed since the last checkpoint,
	// each once per epoch (a chunk deleted and re-created may appear
	// twice); epoch is the current checkpoint epoch, which is also the
	// generation the next fold writes its records under (codec.go,
	// snapshot keys): above every generation in the file.
	dirty dirtyList
	epoch uint32
	// folding is the generation of the automatic fold in progress (0:
	// none). Its slices write chunks as they are when taken, so a chunk
	// it lists as deleted may be written again if it is re-created
	// meanwhile: a chunk created while it runs names its generation as
	// the record to delete (see setChunkVal).
	folding uint32
	// compactQ: ranks whose chunk lists are due for compaction once the
	// chunk being set is in place (setChunk).
	compactQ []uint32
	// bg, set on the committer's state (nil while Open replays and in
	// the model tests): compactions run on goroutines of their own,
	// started by bg (Index.goroutines); compacting lists those in flight
	// (compaction).
	bg         *group.Group
	compacting []*compaction
	// fan, set on the committer's state (0 while Open replays and in the
	// model tests): how many goroutines publishChunks installs a slice's
	// chunks with and warmBatch reads a batch's chunks with (fanOut);
	// <= 1 does both on the committer alone. While publishChunks collects
	// a slice's installs (collecting, with fan > 1) install queues them in
	// installs; otherwise it makes each at once.
	fan        int
	collecting bool
	installs   []chunkInstall
	// undo, while a Verify copies the chunks off the committer
	// (Index.copyChunks): for every chunk changed since Verify's barrier,
	// its value at the barrier, recorded by setChunkVal at its first
	// change. nil otherwise. Set by the committer, filled by it while it
	// publishes, set back to nil by the copying goroutine: always under
	// Index.mu.
	undo map[chunkRef]undoVal
}

// undoVal is a chunk's value at a Verify barrier: had false, no chunk.
type undoVal struct {
	v   chunkVal
	had bool
}

func newState() *state {
	return &state{
		ns:      make(map[dcp.Namespace]*nsState),
		ranks:   []*rankState{nil},
		rankIDs: make(map[wire.Rank]uint32),
		insts:   make(map[string]uint32),
		epoch:   1,
	}
}

func (st *state) namespace(ns dcp.Namespace) *nsState {
	n := st.ns[ns]
	if n == nil {
		n = &nsState{chunks: newChunkMap()}
		st.ns[ns] = n
	}
	return n
}

func (st *state) chunk(ref chunkRef) []placement {
	if n := st.ns[ref.ns]; n != nil {
		v, _ := n.chunks.get(ref.chunk)
		return v.s
	}
	return nil
}

// addRank appends a rank with the next id.
func (st *state) addRank(r wire.Rank, m rankMeta) *rankState {
	inst, ok := st.insts[r.Instance]
	if !ok {
		inst = uint32(len(st.insts) + 1)
		st.insts[r.Instance] = inst
	}
	rs := &rankState{id: uint32(len(st.ranks)), rank: r, inst: inst, rankMeta: m, allHidden: m.partial}
	if m.partial {
		st.hiding++
	}
	st.ranks = append(st.ranks, rs)
	st.rankIDs[r] = rs.id
	return rs
}

// setChunk replaces a chunk's placements, keeping every count in step and
// the chunk on the dirty list. old and had are the chunk's current value
// (the caller looked it up when it staged the change; only the committer
// changes chunks, so it is still current). setChunk owns s from now on and
// fills in each placement's inst and tp.
func (st *state) setChunk(n *nsState, ref chunkRef, old chunkVal, had bool, s []placement) {
	st.setChunkVal(n, ref, old, had, s)
	for _, id := range st.compactQ {
		st.compact(st.ranks[id])
	}
	st.compactQ = st.compactQ[:0]
}

func (st *state) setChunkVal(n *nsState, ref chunkRef, old chunkVal, had bool, s []placement) {
	if st.undo != nil {
		if _, ok := st.undo[ref]; !ok {
			st.undo[ref] = undoVal{old, had}
		}
	}
	for i := range old.s {
		p := &old.s[i]
		n.add(p, -1)
		st.add(p, -1)
		st.ranks[p.rank].add(p, -1)
	}
	st.trackRanks(ref, old.s, s)
	o := countObjects(old.s)
	n.objects -= o
	st.objects -= o
	switch {
	case !had:
		// No record, unless the fold in progress writes one of the
		// chunk re-created after the cut (deleting a key that is not
		// there is a no-op).
		prev := noRecord
		if st.folding != 0 {
			prev = st.folding
		}
		st.dirty.add(dirtyRef{ref, prev})
	case old.epoch != st.epoch:
		// Its first change this epoch: its record on disk is the one
		// the fold of its last epoch wrote (folds land in order).
		st.dirty.add(dirtyRef{ref, old.epoch})
	}
	if len(s) == 0 {
		if had {
			st.install(n.chunks, ref.chunk, chunkVal{}, true)
			st.chunks--
		}
		return
	}
	if !had {
		st.chunks++
	}
	for i := range s {
		p := &s[i]
		r := st.ranks[p.rank]
		p.inst, p.tp = r.inst, uint16(r.rank.TPRank)
		n.add(p, 1)
		st.add(p, 1)
		r.add(p, 1)
	}
	// Last: lookups read the chunk from now on, without Index.mu
	// (chunkmap.go); the map takes a copy of s, which stays the txn's.
	st.install(n.chunks, ref.chunk, chunkVal{s: s, epoch: st.epoch}, false)
	o = countObjects(s)
	n.objects += o
	st.objects += o
}

// install puts a chunk's new value (or its removal) into its map, or
// queues it while publishChunks collects a slice's installs.
func (st *state) install(cm *chunkMap, c dcp.ChunkHash, v chunkVal, del bool) {
	switch {
	case st.collecting:
		st.installs = append(st.installs, chunkInstall{cm: cm, c: c, v: v, del: del})
	case del:
		cm.del(c)
	default:
		cm.set(c, v)
	}
}

// trackRanks keeps the per-rank chunk sets in step when a chunk's
// placements change from old to cur: only the ranks that appear in one and
// not the other touch their set (a chunk holds a handful of placements, so
// the scans are short).
func (st *state) trackRanks(ref chunkRef, old, cur []placement) {
	for i := range old {
		id := old[i].rank
		if !holdsRank(old[:i], id) && !holdsRank(cur, id) {
			r := st.ranks[id]
			r.live--
			if !r.fencing && r.compact == nil && r.chunks.len() >= 2*r.live+compactSlack && !slices.Contains(st.compactQ, id) {
				st.compactQ = append(st.compactQ, id)
			}
		}
	}
	for i := range cur {
		id := cur[i].rank
		if !holdsRank(cur[:i], id) && !holdsRank(old, id) {
			r := st.ranks[id]
			r.chunks.add(ref)
			r.live++
		}
	}
}

// compactSlack is how many stale entries a rank's chunk list may hold
// beyond its live chunks before it is compacted (a variable for tests).
var compactSlack = 1024

// compactChunks drops from r's chunk list the chunks it is no longer in,
// and repeats. Called once the chunk just changed is in place; amortized
// O(1) per change (the list is at least twice its live size). In one
// piece: Open's replay and the model tests; the committer uses compact.
func (st *state) compactChunks(r *rankState) {
	cs := r.chunks.flat()
	slices.SortFunc(cs, compareRef)
	cs = slices.CompactFunc(cs, func(a, b chunkRef) bool { return a == b })
	k := 0
	for _, ref := range cs {
		if holdsRank(st.chunk(ref), r.id) {
			cs[k] = ref
			k++
		}
	}
	r.chunks = fromRefs(slices.Clip(cs[:k]))
	r.listGen++
}

// compact compacts r's chunk list: in place without st.bg, else on a
// goroutine of its own, so the committer stays O(batch) (STYLE 24): the
// sort of a resynced rank's million entries took 1.65 s of one commit on
// the H200 host, every rank's acks waiting behind it.
func (st *state) compact(r *rankState) {
	switch {
	case st.bg == nil:
		st.compactChunks(r)
	case r.compact == nil:
		st.startCompaction(r)
	}
}

// compaction is a chunk list being compacted off the committer. The
// goroutine reads entries [0, n) of the list, which the committer only
// appends after (nothing rewrites a list's entries in place while its
// compaction runs: compactChunks is not called on it), and the chunks
// through their maps' read locks, as lookups do. Its result, kept, holds
// every entry whose chunk held the rank when read, sorted and once each.
//
// Why installing kept plus the entries appended since loses no chunk the
// rank holds at the install: such a chunk was entered by the rank after
// the launch (then appended since), or held by it from before the launch
// until the install without a break (a break ends with an append), so
// it was listed in [0, n) and held when the goroutine read it.
type compaction struct {
	r    *rankState
	gen  uint32 // r.listGen at the launch
	n    int
	kept []chunkRef
	done chan struct{} // closed when kept is set
}

func (st *state) startCompaction(r *rankState) {
	c := &compaction{r: r, gen: r.listGen, n: r.chunks.len(), done: make(chan struct{})}
	src := r.chunks.view()
	cms := make(map[dcp.Namespace]*chunkMap, len(st.ns))
	for ns, n := range st.ns {
		cms[ns] = n.chunks
	}
	r.compact = c
	st.compacting = append(st.compacting, c)
	work := func() {
		kept := compactRefs(src.flat(), r.id, cms)
		if h := testHookCompact; h != nil {
			h(r.rank)
		}
		c.kept = kept
		close(c.done)
	}
	if !st.bg.Go("compaction", work) {
		work() // the index is closing: on the committer, installed as if it had run apart
	}
}

// testHookCompact, when set (tests), runs on a compaction's goroutine
// once it has read the chunks, before it hands its result over.
var testHookCompact func(wire.Rank)

// compactRefs sorts cs, drops repeats and the chunks that do not hold
// rank id, reading them from cms in windows of one namespace under the
// shards' read locks (chunkMap.loadAll). The result keeps cs's capacity,
// room for the entries appended while it ran.
func compactRefs(cs []chunkRef, id uint32, cms map[dcp.Namespace]*chunkMap) []chunkRef {
	slices.SortFunc(cs, compareRef)
	cs = slices.CompactFunc(cs, func(a, b chunkRef) bool { return a == b })
	const window = 256
	hashes := make([]dcp.ChunkHash, 0, window)
	out := make([][]placement, window)
	k := 0
	for i := 0; i < len(cs); {
		ns := cs[i].ns
		j := i
		for j < len(cs) && j-i < window && cs[j].ns == ns {
			j++
		}
		if cm := cms[ns]; cm != nil {
			hashes = hashes[:0]
			for _, ref := range cs[i:j] {
				hashes = append(hashes, ref.chunk)
			}
			cm.loadAll(hashes, out)
			for x, ref := range cs[i:j] {
				if holdsRank(out[x], id) {
					cs[k] = ref
					k++
				}
			}
		}
		i = j
	}
	return cs[:k]
}

// installCompactions installs the compactions that are done, except those
// of ranks under a sliced fence or inventory, whose cursor into the list
// must stay valid: they wait for its end. A compaction of a list replaced
// meanwhile (or of a state replaced by a snapshot) is dropped.
func (st *state) installCompactions() {
	for i := 0; i < len(st.compacting); {
		c := st.compacting[i]
		select {
		case <-c.done:
		default:
			i++
			continue
		}
		r := c.r
		if r.fencing {
			i++
			continue
		}
		st.compacting = slices.Delete(st.compacting, i, i+1)
		r.compact = nil
		if int(r.id) >= len(st.ranks) || st.ranks[r.id] != r || r.listGen != c.gen {
			continue
		}
		nl := fromRefs(c.kept) // its spare capacity takes the tail without a copy of kept
		for _, seg := range r.chunks.segments(c.n, r.chunks.len()) {
			for _, ref := range seg {
				nl.add(ref)
			}
		}
		r.chunks = nl
		r.listGen++
		if r.chunks.len() >= 2*r.live+compactSlack {
			st.startCompaction(r) // the rank churned faster than the goroutine
		}
	}
}

func holdsRank(s []placement, id uint32) bool {
	for i := range s {
		if s[i].rank == id {
			return true
		}
	}
	return false
}

// dirtyRef is a chunk on the dirty list and the generation of its record
// on disk when it first changed this epoch (noRecord: none).
type dirtyRef struct {
	ref  chunkRef
	prev uint32
}

// dirtyList is the dirty list in blocks of dirtyBlock entries, so that an
// append on the committer never copies more than a block: as one slice of
// millions of entries, each doubling copied all of them inside a publish
// (growslice was 3.4 s of a 1 M-object resync's committer profile on the
// 2-core VM, its longest publishes 0.5-0.8 s).
type dirtyList struct {
	blocks [][]dirtyRef
	n      int
}

const dirtyBlock = 1 << 15

func (l *dirtyList) add(d dirtyRef) {
	if k := len(l.blocks); k == 0 || len(l.blocks[k-1]) == dirtyBlock {
		l.blocks = append(l.blocks, make([]dirtyRef, 0, dirtyBlock))
	}
	b := &l.blocks[len(l.blocks)-1]
	*b = append(*b, d)
	l.n++
}

func (l *dirtyList) len() int { return l.n }

// flat returns the entries as one slice (a copy: O(entries)).
func (l *dirtyList) flat() []dirtyRef {
	out := make([]dirtyRef, 0, l.n)
	for _, b := range l.blocks {
		out = append(out, b...)
	}
	return out
}

// sortDirty sorts a dirty list and returns one entry per chunk, as the
// chunks and the generations of their records on disk. A chunk listed
// twice was deleted and re-created in the epoch: its second entry says
// noRecord, its first names the record on disk, and noRecord sorts last,
// so the first entry of a chunk is the one kept. It may reorder dirty.
func sortDirty(dirty []dirtyRef) ([]chunkRef, []uint32) {
	order := keyOrder(dirty)
	if order == nil {
		slices.SortFunc(dirty, compareDirty)
		order = make([]uint32, len(dirty))
		for i := range order {
			order[i] = uint32(i)
		}
	}
	refs, prevs := make([]chunkRef, 0, len(dirty)), make([]uint32, 0, len(dirty))
	for k, i := range order {
		d := &dirty[i]
		if k > 0 && refs[len(refs)-1] == d.ref {
			continue
		}
		refs, prevs = append(refs, d.ref), append(prevs, d.prev)
	}
	return refs, prevs
}

func compareDirty(a, b dirtyRef) int {
	if c := compareRef(a.ref, b.ref); c != 0 {
		return c
	}
	return cmp.Compare(a.prev, b.prev)
}

// Key sort of a dirty list (keyOrder). A commit sorts its ~10,000 dirty
// chunks, a fold millions: with a comparison of two 40-byte entries per
// step that was 14 % of the coordinator's CPU at 930 k events/s. Each
// entry becomes one integer, its namespace's rank among the list's
// namespaces, the first bits of its chunk hash (a hash: nearly always
// distinct) and its index, and the integers sort as integers; runs that
// share rank and prefix (the same chunk twice, or a prefix collision)
// are then put in order by compareDirty.
const (
	keyIndexBits  = 24                            // entries: fewer than 16 M
	keyNSBits     = 6                             // namespaces: at most 64
	keyPrefixBits = 64 - keyIndexBits - keyNSBits // of the chunk hash
	keyIndexMask  = 1<<keyIndexBits - 1
)

// keyOrder returns the indexes of dirty in compareDirty's order, or nil
// when the list has too many entries or namespaces for the key (the
// caller sorts with compareDirty).
func keyOrder(dirty []dirtyRef) []uint32 {
	if len(dirty) == 0 {
		return []uint32{} // a checkpoint with nothing dirty (only log bytes, or a fold's rest)
	}
	if len(dirty) > keyIndexMask {
		return nil
	}
	var nss []dcp.Namespace
	for i := range dirty {
		if ns := dirty[i].ref.ns; !slices.Contains(nss, ns) {
			if len(nss) == 1<<keyNSBits {
				return nil
			}
			nss = append(nss, ns)
		}
	}
	slices.SortFunc(nss, func(a, b dcp.Namespace) int { return compare16((*[16]byte)(&a), (*[16]byte)(&b)) })
	keys := make([]uint64, len(dirty))
	last, rank := nss[0], uint64(0)
	for i := range dirty {
		r := &dirty[i].ref
		if r.ns != last {
			last = r.ns
			rank = uint64(slices.Index(nss, r.ns))
		}
		prefix := binary.BigEndian.Uint64(r.chunk[:8]) >> (64 - keyPrefixBits)
		keys[i] = rank<<(64-keyNSBits) | prefix<<keyIndexBits | uint64(i)
	}
	slices.Sort(keys)
	order := make([]uint32, len(keys))
	for i, k := range keys {
		order[i] = uint32(k & keyIndexMask)
	}
	for lo := 0; lo < len(keys); {
		hi := lo + 1
		for hi < len(keys) && keys[hi]>>keyIndexBits == keys[lo]>>keyIndexBits {
			hi++
		}
		if hi-lo > 1 {
			slices.SortFunc(order[lo:hi], func(a, b uint32) int { return compareDirty(dirty[a], dirty[b]) })
		}
		lo = hi
	}
	return order
}

// chunkRef names one chunk of one namespace.
type chunkRef struct {
	ns    dcp.Namespace
	chunk dcp.ChunkHash
}

// compareRef orders refs as their snapshot keys sort: namespace, then
// chunk, each compared bytewise as two big-endian words.
func compareRef(a, b chunkRef) int {
	if c := compare16((*[16]byte)(&a.ns), (*[16]byte)(&b.ns)); c != 0 {
		return c
	}
	return compare16((*[16]byte)(&a.chunk), (*[16]byte)(&b.chunk))
}

// compare16 is bytes.Compare of two 16-byte arrays.
func compare16(a, b *[16]byte) int {
	if x, y := binary.BigEndian.Uint64(a[:8]), binary.BigEndian.Uint64(b[:8]); x != y {
		return cmp.Compare(x, y)
	}
	return cmp.Compare(binary.BigEndian.Uint64(a[8:]), binary.BigEndian.Uint64(b[8:]))
}

// checkRankChunks re-derives every rank's chunk set from the chunks and
// compares (STYLE 16). It reads the whole state: Verify-time only.
func checkRankChunks(pr *problems, st *state) {
	want := make([]map[chunkRef]struct{}, len(st.ranks))
	for ns, n := range st.ns {
		for c, v := range n.chunks.all() {
			for i := range v.s {
				id := v.s[i].rank
				if int(id) >= len(want) {
					pr.add("chunk %s/%s: placement of unknown rank id %d", ns, c, id)
					continue
				}
				if want[id] == nil {
					want[id] = make(map[chunkRef]struct{})
				}
				want[id][chunkRef{ns, c}] = struct{}{}
			}
		}
	}
	for id := 1; id < len(st.ranks); id++ {
		r := st.ranks[id]
		if r.live != len(want[id]) {
			pr.add("rank %s: live chunk count %d, its placements are in %d chunks", r.rank, r.live, len(want[id]))
		}
		if r.chunks.len() > 2*r.live+compactSlack && r.compact == nil {
			pr.add("rank %s: chunk list of %d entries for %d live chunks was never compacted", r.rank, r.chunks.len(), r.live)
		}
		listed := make(map[chunkRef]bool, r.chunks.len())
		for ref := range r.chunks.all {
			listed[ref] = true
		}
		for ref := range want[id] {
			if !listed[ref] {
				pr.add("rank %s: chunk %s/%s missing from its chunk list", r.rank, ref.ns, ref.chunk)
				break
			}
		}
	}
}

// snapshot copies the state for Verify and Dump: every map and rank
// record, sharing the slabs' published ranges (never modified; see
// chunkMap.clone) and the namespace specs. Not the per-rank chunk lists
// (64 MB at 2 M placements: the copy would stall the committer; the
// model tests check them) nor the checkpoint bookkeeping.
func (st *state) snapshot() *state {
	c := st.shell()
	for ns, n := range st.ns {
		c.ns[ns].chunks = n.chunks.clone()
	}
	return c
}

// shell is snapshot without the chunk maps (nil): O(namespaces + ranks).
func (st *state) shell() *state {
	c := &state{ns: make(map[dcp.Namespace]*nsState, len(st.ns)), ranks: make([]*rankState, len(st.ranks)),
		rankIDs: maps.Clone(st.rankIDs), insts: maps.Clone(st.insts), objects: st.objects, chunks: st.chunks,
		tally: st.tally, epoch: st.epoch, hiding: st.hiding}
	for ns, n := range st.ns {
		cn := *n
		cn.chunks = nil
		c.ns[ns] = &cn
	}
	for i, r := range st.ranks {
		if r != nil {
			cr := *r
			cr.chunks, cr.compact = refList{}, nil
			c.ranks[i] = &cr
		}
	}
	return c
}
