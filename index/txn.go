package index

import (
	"fmt"
	"math"
	"slices"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// This file is the pure core of the index: the C7 rules as transitions of a
// state, with no I/O and no goroutines. A txn stages the effect of a group
// of requests on top of a state without modifying it (copy-on-write per
// chunk and per rank), records the change as log ops for bbolt, and is
// published into the state only after bbolt has committed it. Replaying a
// change log at Open runs the same put/del/fence/drop code.

// Outcome is what Apply did with one batch. Its counts add up to the
// batch's events: Applied + Duplicates + Dropped == len(batch.Events).
type Outcome struct {
	// Applied events were committed, in sequence order.
	Applied int
	// Duplicates had a sequence <= the rank's last applied one: ignored.
	Duplicates int
	// Dropped events were not applied for Reason (gap, stale_incarnation
	// or fenced_rank).
	Dropped int
	Reason  DropReason
	// NewIncarnation: the batch came from a newer incarnation of a known
	// rank; the old incarnation's L1 placements were fenced (Fenced of
	// them), its L2 placements stay attributed to the rank.
	NewIncarnation bool
	Fenced         int
	// Resync: the index is missing events of this rank and will not apply
	// later ones until the rank sends an inventory (ApplyInventory).
	// ResyncFrom is the first sequence it is missing.
	Resync     bool
	ResyncFrom uint64
	// RemovedUnknown counts applied Removed events for placements the index
	// did not hold (counted, harmless).
	RemovedUnknown int
	// Incarnation and LastSeq are the rank's state after the batch.
	Incarnation uint64
	LastSeq     uint64
}

// InventoryOutcome is what ApplyInventory did.
type InventoryOutcome struct {
	// Applied: the inventory replaced all of the rank's placements.
	// Otherwise Reason says why it was dropped (stale_incarnation,
	// stale_inventory, fenced_since) and nothing changed.
	Applied bool
	Reason  DropReason
	// Replaced is the number of placements the rank had before; Placements
	// the number it has now.
	Replaced   int
	Placements int
	// Fenced counts L1 placements of an older incarnation fenced first.
	Fenced      int
	Incarnation uint64
	LastSeq     uint64
	// FenceGen is the rank's fence generation (after the inventory when
	// applied; the one that dropped it for fenced_since).
	FenceGen uint64
}

type stagedChunk struct {
	ref chunkRef
	s   []placement // owned by the txn; empty means the chunk goes away
	n   *nsState    // the chunk's namespace, nil if it did not exist yet
	old chunkVal    // the live value when staged
	had bool        // whether there was one
}

type nsReg struct {
	ns   dcp.Namespace
	spec *dcp.Resolved
	json []byte
}

// txn stages changes on top of st, and of its parent when it has one: the
// txn committed by bbolt at the same moment (pipelining: the committer
// stages the next group while the previous one is written). st and the
// parent are only read. When the parent has been published, detach clears
// the link: what the txn saw through it is in st by then.
type txn struct {
	st       *state
	parent   *txn
	idx      map[chunkRef]int
	staged   []stagedChunk
	metas    map[uint32]rankMeta // staged rank metas
	newRanks []wire.Rank         // ids base+i, base = len(st.ranks) + len(parent.newRanks)
	newIDs   map[wire.Rank]uint32
	putRank  []bool     // by id: a placement was put in this txn
	regs     []nsReg    // staged namespace registrations
	enc      *opEncoder // nil while replaying
	events   int        // events and inventory objects applied
	// raftIndex is the highest raft index staged in the txn (0: none),
	// recorded in the meta bucket with it (replicate.go).
	raftIndex uint64
	// hide and unhide: ranks whose sliced fence starts (their L1 copies
	// become unusable when the txn is published, before its chunks) and
	// ends (usable again once its chunks are published) in this txn.
	hide, unhide []uint32
	// hideAll: ranks whose sliced inventory starts in this txn (every
	// placement of theirs unusable once it is published, before its
	// chunks); unhide ends it too. invLive reports whether a rank's
	// inventory is being applied in slices (nil while replaying).
	hideAll []uint32
	invLive func(uint32) bool

	lastNS dcp.Namespace // cache of the last namespace looked up
	lastN  *nsState
	warm   []warmVal // warmBatch's buffer
}

func newTxn(st *state, enc *opEncoder) *txn {
	return &txn{
		st:     st,
		idx:    make(map[chunkRef]int),
		metas:  make(map[uint32]rankMeta),
		newIDs: make(map[wire.Rank]uint32),
		enc:    enc,
	}
}

// reset empties the txn for reuse on st (and parent, which may be nil),
// keeping its allocations.
func (t *txn) reset(st *state, parent *txn, enc *opEncoder) {
	clear(t.idx)
	clear(t.staged)
	clear(t.metas)
	clear(t.newIDs)
	clear(t.putRank)
	clear(t.regs)
	*t = txn{st: st, parent: parent, idx: t.idx, staged: t.staged[:0], metas: t.metas, newRanks: t.newRanks[:0],
		newIDs: t.newIDs, putRank: t.putRank[:0], regs: t.regs[:0], enc: enc, hide: t.hide[:0], unhide: t.unhide[:0],
		hideAll: t.hideAll[:0], warm: t.warm[:0]}
}

// detach drops the link to the parent once the parent is published.
func (t *txn) detach() {
	t.parent = nil
	t.lastN = nil
}

// changed reports whether the txn has anything to commit.
func (t *txn) changed() bool {
	return len(t.staged) > 0 || len(t.metas) > 0 || len(t.newRanks) > 0 || len(t.regs) > 0 || t.raftIndex != 0 ||
		len(t.hide) > 0 || len(t.unhide) > 0 || len(t.hideAll) > 0 // a sliced fence or inventory starts or ends: it must be published
}

func (t *txn) rankID(r wire.Rank) (uint32, bool) {
	if id, ok := t.st.rankIDs[r]; ok {
		return id, true
	}
	if t.parent != nil {
		if id, ok := t.parent.newIDs[r]; ok {
			return id, true
		}
	}
	id, ok := t.newIDs[r]
	return id, ok
}

// base is the id of the txn's first new rank.
func (t *txn) base() int {
	b := len(t.st.ranks)
	if t.parent != nil {
		b += len(t.parent.newRanks)
	}
	return b
}

func (t *txn) createRank(r wire.Rank, inc uint64) uint32 {
	id := uint32(t.base() + len(t.newRanks))
	t.newRanks = append(t.newRanks, r)
	t.newIDs[r] = id
	t.metas[id] = rankMeta{inc: inc}
	return id
}

// meta returns the rank's current meta: staged here, in the parent, or live.
func (t *txn) meta(id uint32) rankMeta {
	if m, ok := t.metas[id]; ok {
		return m
	}
	if t.parent != nil {
		if m, ok := t.parent.metas[id]; ok {
			return m
		}
	}
	return t.st.ranks[id].rankMeta
}

func (t *txn) setMeta(id uint32, m rankMeta) { t.metas[id] = m }

// rankName returns the wire.Rank of a live or staged id.
func (t *txn) rankName(id uint32) wire.Rank {
	if int(id) < len(t.st.ranks) {
		return t.st.ranks[id].rank
	}
	if t.parent != nil {
		if i := int(id) - len(t.st.ranks); i < len(t.parent.newRanks) {
			return t.parent.newRanks[i]
		}
	}
	return t.newRanks[int(id)-t.base()]
}

// nsOf returns the live namespace state (nil if none), caching the last.
func (t *txn) nsOf(ns dcp.Namespace) *nsState {
	if t.lastN == nil || t.lastNS != ns {
		t.lastNS, t.lastN = ns, t.st.ns[ns]
	}
	return t.lastN
}

// mut returns the index of the staged copy of a chunk, staging it first
// from the parent's staged copy or the live one.
func (t *txn) mut(ref chunkRef) int { return t.mutWarm(ref, nil) }

// mutWarm is mut with the chunk's live value already read (w, may be nil:
// read it here); see warmBatch.
func (t *txn) mutWarm(ref chunkRef, w *warmVal) int {
	if i, ok := t.idx[ref]; ok {
		return i
	}
	var sc stagedChunk
	found := false
	if p := t.parent; p != nil {
		if j, ok := p.idx[ref]; ok {
			ps := &p.staged[j]
			// Once the parent is published, its copy is the live value.
			sc = stagedChunk{ref: ref, n: ps.n, old: chunkVal{s: ps.s, epoch: t.st.epoch}, had: len(ps.s) > 0}
			found = true
		}
	}
	if !found {
		sc = stagedChunk{ref: ref, n: t.nsOf(ref.ns)}
		switch {
		case w != nil:
			sc.old, sc.had = w.v, w.had
		case sc.n != nil:
			sc.old, sc.had = sc.n.chunks.get(ref.chunk)
		}
	}
	sc.s = make([]placement, len(sc.old.s), len(sc.old.s)+2)
	copy(sc.s, sc.old.s)
	t.staged = append(t.staged, sc)
	i := len(t.staged) - 1
	t.idx[ref] = i
	return i
}

// view returns a chunk's placements as the txn sees them (read only).
func (t *txn) view(ref chunkRef) []placement {
	if i, ok := t.idx[ref]; ok {
		return t.staged[i].s
	}
	if p := t.parent; p != nil {
		if i, ok := p.idx[ref]; ok {
			return p.staged[i].s
		}
	}
	if n := t.nsOf(ref.ns); n != nil {
		v, _ := n.chunks.get(ref.chunk)
		return v.s
	}
	return nil
}

func (t *txn) markPut(id uint32) {
	for int(id) >= len(t.putRank) {
		t.putRank = append(t.putRank, false)
	}
	t.putRank[id] = true
}

// put stores a placement (rank and inc in p) in a chunk.
func (t *txn) put(ref chunkRef, p placement) { t.putWarm(ref, p, nil) }

func (t *txn) putWarm(ref chunkRef, p placement, w *warmVal) {
	i := t.mutWarm(ref, w)
	t.staged[i].s = upsert(t.staged[i].s, p)
	t.markPut(p.rank)
	if t.enc != nil {
		t.enc.put(ref, &p)
	}
}

// del removes one placement; false if there was none.
func (t *txn) del(ref chunkRef, shard, group uint16, tier wire.Tier, rank uint32, inc uint64) bool {
	s := t.view(ref)
	found := false
	for j := range s {
		if cmpSlot(shard, group, tier, rank, &s[j]) == 0 {
			found = true
			break
		}
	}
	if !found {
		return false
	}
	i := t.mut(ref)
	t.staged[i].s, _, _ = remove(t.staged[i].s, shard, group, tier, rank)
	if t.enc != nil {
		t.enc.del(ref, shard, group, tier, rank, inc)
	}
	return true
}

// mayHold reports whether rank id may hold placements of the given tier
// (0: any) in the txn's view, so scans can be skipped for ranks with none.
func (t *txn) mayHold(id uint32, tier wire.Tier) bool {
	if int(id) < len(t.putRank) && t.putRank[id] {
		return true
	}
	if p := t.parent; p != nil && int(id) < len(p.putRank) && p.putRank[id] {
		return true
	}
	if int(id) >= len(t.st.ranks) {
		return false
	}
	tl := &t.st.ranks[id].tally
	if tier == 0 {
		return tl.placements[wire.L1]+tl.placements[wire.L2]+tl.placements[wire.L3] > 0
	}
	return tl.placements[tier] > 0
}

// filter removes every placement of rank id for which drop is true and
// returns how many it removed. It visits only the chunks that may hold
// the rank: those of its chunk list in the published state (rankState.chunks)
// and those staged in this txn and its parent, so a fence or an inventory
// costs the rank's own placements, never a scan of the index (STYLE 24).
// The price is a set update whenever a rank first or last appears in a
// chunk.
func (t *txn) filter(id uint32, drop func(*placement) bool) int {
	var published [][]chunkRef
	if int(id) < len(t.st.ranks) {
		l := &t.st.ranks[id].chunks
		published = l.segments(0, l.len())
	}
	return t.filterRefs(id, published, drop)
}

// filterRefs is filter over the published chunks listed in published (a
// range of the rank's chunk list: a slice of a fence) and every chunk
// staged in the txn and its parent.
func (t *txn) filterRefs(id uint32, published [][]chunkRef, drop func(*placement) bool) int {
	hit := func(s []placement) bool {
		for j := range s {
			if drop(&s[j]) {
				return true
			}
		}
		return false
	}
	p := t.parent
	for _, seg := range published {
		for _, ref := range seg { // repeats: the second visit finds it staged
			if _, ok := t.idx[ref]; ok {
				continue // staged here: handled below
			}
			if p != nil {
				if _, ok := p.idx[ref]; ok {
					continue // the parent's copy is the current one: next loop
				}
			}
			if hit(t.st.chunk(ref)) {
				t.mut(ref)
			}
		}
	}
	if p != nil {
		for j := range p.staged {
			ref := p.staged[j].ref
			if _, ok := t.idx[ref]; !ok && hit(p.staged[j].s) {
				t.mut(ref)
			}
		}
	}
	n := 0
	for i := range t.staged {
		s := t.staged[i].s
		k := 0
		for j := range s {
			if drop(&s[j]) {
				n++
				continue
			}
			s[k] = s[j]
			k++
		}
		t.staged[i].s = s[:k]
	}
	return n
}

// fenceL1 removes the rank's L1 placements stored by incarnations < below.
func (t *txn) fenceL1(id uint32, below uint64) int {
	if !t.mayHold(id, wire.L1) {
		return 0
	}
	n := t.filter(id, func(p *placement) bool { return p.rank == id && p.tier == wire.L1 && p.inc < below })
	if n > 0 && t.enc != nil {
		t.enc.fence(id, below)
	}
	return n
}

// dropRank removes every placement of the rank.
func (t *txn) dropRank(id uint32) int {
	if !t.mayHold(id, 0) {
		return 0
	}
	n := t.filter(id, func(p *placement) bool { return p.rank == id })
	if n > 0 && t.enc != nil {
		t.enc.drop(id)
	}
	return n
}

// applyBatch applies the C7 rules to one batch, per (rank, incarnation):
//   - a batch from an incarnation older than the rank's current one is
//     dropped (stale_incarnation);
//   - a batch from a newer incarnation fences the old incarnation's L1
//     placements (L2 placements stay, attributed to the rank), resets the
//     rank to that incarnation with last sequence 0, then applies;
//   - a batch from the current incarnation of a rank fenced by FenceRank is
//     dropped (fenced_rank) and asks for a resync;
//   - then per event: seq <= last is a duplicate; seq == last+1 is
//     applied; anything else is a gap: it and every later event are
//     dropped and the outcome asks for a resync from last+1.
//
// The batch must have passed validateBatch.
func (t *txn) applyBatch(b *wire.Batch) Outcome {
	var o Outcome
	id, known := t.rankID(b.Rank)
	if !known {
		id = t.createRank(b.Rank, b.Incarnation)
	}
	m := t.meta(id)
	switch {
	case b.Incarnation < m.inc:
		o.Dropped, o.Reason = len(b.Events), DropStaleIncarnation
		o.Incarnation, o.LastSeq = m.inc, m.last
		return o
	case m.partial && (t.invLive == nil || !t.invLive(id)):
		// A crash interrupted a sliced inventory: only a whole one makes
		// the rank's placements usable again.
		o.Dropped, o.Reason = len(b.Events), DropPartialRank
		o.Resync, o.ResyncFrom = true, m.last+1
		o.Incarnation, o.LastSeq = m.inc, m.last
		return o
	case b.Incarnation > m.inc:
		o.NewIncarnation = true
		o.Fenced = t.fenceL1(id, b.Incarnation)
		m = rankMeta{inc: b.Incarnation, fenceGen: m.fenceGen}
		t.setMeta(id, m)
	case m.fenced:
		o.Dropped, o.Reason = len(b.Events), DropFencedRank
		o.Resync, o.ResyncFrom = true, m.last+1
		o.Incarnation, o.LastSeq = m.inc, m.last
		return o
	}
	last := m.last
	warm := t.warmBatch(b.Events)
	for i := range b.Events {
		e := &b.Events[i]
		if e.Seq <= last {
			o.Duplicates++
			continue
		}
		if e.Seq != last+1 {
			o.Dropped, o.Reason = len(b.Events)-i, DropGap
			o.Resync, o.ResyncFrom = true, last+1
			break
		}
		ref := chunkRef{e.Key.NS, e.Key.Chunk}
		switch e.Kind {
		case wire.Stored:
			var w *warmVal
			if warm != nil && warm[i].read {
				w = &warm[i]
			}
			t.putWarm(ref, placement{size: e.Size, sum: e.Sum, seq: e.Seq, inc: m.inc, rank: id,
				shard: e.Key.Shard, group: e.Key.Group, tier: e.Tier}, w)
		case wire.Removed:
			if !t.del(ref, e.Key.Shard, e.Key.Group, e.Tier, id, m.inc) {
				o.RemovedUnknown++
			}
		}
		last = e.Seq
		o.Applied++
	}
	clear(warm) // its values are slices of slab arrays: not kept alive until the next batch
	t.events += o.Applied
	if last != m.last {
		m.last = last
		t.setMeta(id, m)
	}
	o.Incarnation, o.LastSeq = m.inc, m.last
	return o
}

// applyInventory replaces all of a rank's placements with the inventory,
// sets its incarnation and last sequence to the inventory's and clears its
// fence. An inventory from an older incarnation, or from the current one
// but older than the last applied event, is dropped; so is one requested
// under an older fence generation (gen, when checked; see invDrop).
func (t *txn) applyInventory(inv *wire.Inventory, gen uint64, checked bool) InventoryOutcome {
	var o InventoryOutcome
	id, known := t.rankID(inv.Rank)
	var gen0 uint64
	if known {
		m := t.meta(id)
		gen0 = m.fenceGen
		if why := invDrop(inv, m, gen, checked); why != "" {
			o.Reason, o.Incarnation, o.LastSeq, o.FenceGen = why, m.inc, m.last, m.fenceGen
			return o
		}
		if inv.Incarnation > m.inc {
			o.Fenced = t.fenceL1(id, inv.Incarnation)
		}
	} else {
		id = t.createRank(inv.Rank, inv.Incarnation)
	}
	o.Replaced = t.dropRank(id)
	for i := range inv.Objects {
		ob := &inv.Objects[i]
		t.put(chunkRef{ob.Key.NS, ob.Key.Chunk}, placement{size: ob.Size, sum: ob.Sum, seq: inv.Seq,
			inc: inv.Incarnation, rank: id, shard: ob.Key.Shard, group: ob.Key.Group, tier: ob.Tier})
	}
	t.events += len(inv.Objects)
	t.setMeta(id, rankMeta{inc: inv.Incarnation, last: inv.Seq, fenceGen: gen0})
	o.Applied, o.Placements = true, len(inv.Objects)
	o.Incarnation, o.LastSeq, o.FenceGen = inv.Incarnation, inv.Seq, gen0
	return o
}

// invDrop is the C7 verdict on an inventory of a known rank whose meta is
// m: "" to apply it, else why it is dropped. gen is the rank's fence
// generation the inventory was requested under; checked says whether the
// caller gave one (ApplyInventoryAt, Op.FenceGen; ApplyInventory does not).
//
//   - an older incarnation's inventory is stale (stale_incarnation);
//   - a newer incarnation's is the truth (a restarted rankd answered): it
//     supersedes any fence, whatever the generation;
//   - the current incarnation's, requested before a fence that has been
//     committed since (gen moved), was taken before the rank died: applying
//     it would bring back the L1 copies the fence dropped and clear the
//     fence (fenced_since, issue 29.1);
//   - the current incarnation's behind its last applied event would roll
//     it back (stale_inventory).
func invDrop(inv *wire.Inventory, m rankMeta, gen uint64, checked bool) DropReason {
	switch {
	case inv.Incarnation < m.inc:
		return DropStaleIncarnation
	case inv.Incarnation > m.inc:
		return ""
	case checked && gen != m.fenceGen:
		return DropFencedSince
	case inv.Seq < m.last:
		return DropStaleInventory
	}
	return ""
}

// Results of fenceRank that fenced nothing.
const (
	fenceUnknown    = -1 // the rank was never seen
	fenceSuperseded = -2 // its current incarnation is newer than the one that died
)

// fenceRank drops the rank's L1 placements and marks it fenced until it
// resyncs, if its current incarnation is <= upTo, and advances its fence
// generation (every fence does, even of a rank fenced already: an
// inventory requested before it is dropped).
func (t *txn) fenceRank(r wire.Rank, upTo uint64) int {
	id, known := t.rankID(r)
	if !known {
		return fenceUnknown
	}
	m := t.meta(id)
	if m.inc > upTo {
		return fenceSuperseded
	}
	n := t.fenceL1(id, math.MaxUint64)
	m.fenced = true
	m.fenceGen++
	t.setMeta(id, m)
	return n
}

// register stages a namespace spec. Registering a namespace again is
// idempotent: the namespace pins the geometry and TP size (only group names
// are outside it), so a disagreement here is a defect, refused as a conflict.
func (t *txn) register(r *dcp.Resolved, js []byte) error {
	var have *dcp.Resolved
	regs := t.regs
	if t.parent != nil {
		regs = append(slices.Clip(t.parent.regs), regs...)
	}
	for i := range regs {
		if regs[i].ns == r.Namespace {
			have = regs[i].spec
		}
	}
	if have == nil {
		if n := t.st.ns[r.Namespace]; n != nil {
			have = n.spec
		}
	}
	if have != nil {
		if have.Layout.TP != r.Layout.TP || len(have.Groups) != len(r.Groups) {
			return fmt.Errorf("namespace %s is registered for TP %d with %d groups, not TP %d with %d groups: %w",
				r.Namespace, have.Layout.TP, len(have.Groups), r.Layout.TP, len(r.Groups), ErrNamespaceConflict)
		}
		return nil
	}
	t.regs = append(t.regs, nsReg{ns: r.Namespace, spec: r, json: js})
	return nil
}

// publishRanks and publishChunks install a committed txn into st, ranks
// first. Only the committer calls them, with Index.mu held for writing;
// from, to select a range of staged chunks so a large group can be
// published in slices (see Index.publish).
//
// publishRanks reports whether it changed anything of the lookup view
// (chunkmap.go): a new rank or instance, a registration, a rank's
// incarnation or fence, a sliced fence's or inventory's start.
func (st *state) publishRanks(t *txn) bool {
	viewed := len(t.newRanks) > 0 || len(t.regs) > 0 || len(t.hide) > 0 || len(t.hideAll) > 0
	for _, r := range t.newRanks {
		st.addRank(r, rankMeta{})
	}
	for id, m := range t.metas {
		r := st.ranks[id]
		if r.inc != m.inc || r.fenced != m.fenced {
			viewed = true
		}
		r.rankMeta = m
	}
	for _, g := range t.regs {
		n := st.namespace(g.ns)
		n.spec, n.specJSON, n.plan = g.spec, g.json, newPlan(g.spec)
	}
	for _, id := range t.hide {
		st.ranks[id].l1Hidden = true
	}
	for _, id := range t.hideAll {
		if r := st.ranks[id]; !r.allHidden {
			r.allHidden = true
			st.hiding++
		}
	}
	return viewed
}

// publishUnhide ends the sliced fences that ended in t, once its chunks are
// published: the rank's chunk list, left alone during the fence, is emptied
// when the rank holds nothing any more, else compacted.
func (st *state) publishUnhide(t *txn) {
	for _, id := range t.unhide {
		r := st.ranks[id]
		// A rank still partial stays hidden: a sliced job's end never
		// makes a streamed inventory's pages (stream.go), or what a crash
		// left of a sliced one, usable before an inventory is whole.
		hidden := r.allHidden && r.partial
		if r.allHidden && !hidden {
			st.hiding--
		}
		r.l1Hidden, r.allHidden, r.fencing = false, hidden, false
		if r.live == 0 {
			r.chunks = refList{}
			r.listGen++
		} else if r.chunks.len() >= 2*r.live+compactSlack {
			st.compact(r)
		}
	}
	if len(st.compacting) > 0 {
		st.installCompactions() // those that waited for a fence's end
	}
}

// With st.fan > 1 the slice's map installs are collected while its
// bookkeeping runs and then made by fan goroutines at once, each on the
// shards of its own (installAll); the compactions the slice makes due
// start after them, since a compaction reads the maps.
func (st *state) publishChunks(t *txn, from, to int) {
	st.collecting = st.fan > 1
	for i := from; i < to; i++ {
		sc := &t.staged[i]
		n := sc.n
		if n == nil {
			n = st.namespace(sc.ref.ns)
		}
		if st.collecting {
			st.setChunkVal(n, sc.ref, sc.old, sc.had, sc.s)
		} else {
			st.setChunk(n, sc.ref, sc.old, sc.had, sc.s)
		}
		// The map holds its own copy now, and no child reads a published
		// txn (detach comes first): dropping the txn's slices lets the
		// collector take them, and the slab arrays old points into,
		// while a large group is still being published.
		sc.s, sc.old = nil, chunkVal{}
	}
	if st.collecting {
		st.collecting = false
		installAll(st.bg, st.installs, st.fan)
		clear(st.installs)
		st.installs = st.installs[:0]
		for _, id := range st.compactQ {
			st.compact(st.ranks[id])
		}
		st.compactQ = st.compactQ[:0]
	}
	if len(st.compacting) > 0 {
		st.installCompactions() // once per slice of the publish
	}
}

// warmVal is a chunk's live value as warmBatch read it (read: it did;
// not for an event that mut will not read the live value of).
type warmVal struct {
	v    chunkVal
	had  bool
	read bool
}

// staged1 reports whether the txn or its parent has staged ref already,
// so that mut takes it from there and not from the live state. Only reads:
// safe on warmBatch's goroutines while the committer waits.
func (t *txn) staged1(ref chunkRef) bool {
	if _, ok := t.idx[ref]; ok {
		return true
	}
	if p := t.parent; p != nil {
		if _, ok := p.idx[ref]; ok {
			return true
		}
	}
	return false
}

// warmMin is the batch size from which warmBatch reads ahead.
const warmMin = 16

// warmBatch reads the live values of a batch's chunks in one loop of
// independent map reads before the batch is staged: the reads of a large
// map miss the cache, and a loop whose reads depend on nothing lets the
// processor overlap their misses, where mut, reading one chunk between
// the stagings of others, waits for each; with st.fan > 1, fan goroutines
// read parts of the batch at once. The live state does not change while a
// txn stages (only the committer publishes, between stagings, and it
// waits here), so a value read here is the one mut would read. Nil for
// small batches.
func (t *txn) warmBatch(evs []wire.Event) []warmVal {
	if len(evs) < warmMin {
		return nil
	}
	t.warm = slices.Grow(t.warm[:0], len(evs))[:len(evs)]
	warm := t.warm
	parts := 1
	if f := t.st.fan; f > 1 {
		parts = min(f, len(evs)/warmMin)
	}
	fanOut(t.st.bg, "stage-fan", parts, func(p int) {
		var lastNS dcp.Namespace
		var lastN *nsState
		for i := p * len(evs) / parts; i < (p+1)*len(evs)/parts; i++ {
			warm[i] = warmVal{}
			k := &evs[i].Key
			if evs[i].Kind != wire.Stored || t.staged1(chunkRef{k.NS, k.Chunk}) {
				continue // mut reads no live value for it (the other ranks of a TP group: most events)
			}
			if lastN == nil || lastNS != k.NS {
				lastNS, lastN = k.NS, t.st.ns[k.NS]
			}
			if lastN != nil {
				warm[i].v, warm[i].had = lastN.chunks.get(k.Chunk)
			}
			warm[i].read = true
		}
	})
	return warm
}
