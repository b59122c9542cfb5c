package index

import (
	"bytes"
	"fmt"
	"math"
	"slices"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// Queries read the in-memory state under the read lock (Lookup: without
// it, see chunkmap.go); none touches bbolt.

// Source is where one reader takes one expected object from. A usable copy
// is held within the reader's instance (L1: by the reader itself or, with
// HostSharedL1, a rank of its instance; L2: under the instance's shared L2
// root; L3: under the instance's bucket prefix) or, for LookupSharedInto,
// in the L2 directory (with Config.SharedL3, also the bucket prefix) of
// another instance of the reader's share group, so
// the holder is wire.Rank{Instance: LookupResult.Instance, or the member
// LookupResult.Members names, TPRank: HolderTP}; see LookupResult.Holder.
// Source has no pointers, so a lookup result costs the garbage collector
// nothing to scan, and four fields, so the compiler keeps one in
// registers (a fifth made lookups ~20% slower).
type Source struct {
	Size     uint64
	Sum      uint64 // kvsum64 recorded at store time: what the reader must confirm
	HolderTP int32
	Tier     wire.Tier
}

// LookupResult is the answer to Lookup.
type LookupResult struct {
	Namespace dcp.Namespace
	Instance  string
	// Shared are the other instances of the reader's share group whose L2
	// (and, with Config.SharedL3, L3) copies the lookup could use
	// (LookupSharedInto's shared; nil for LookupInto). Shared with the
	// caller: do not modify.
	Shared []string
	// Prefix is the number of leading chunks for which every expectation
	// has a usable copy.
	Prefix int
	// ChunkTokens is the namespace spec's chunk size in tokens (0 when
	// the namespace is unknown): Prefix*ChunkTokens tokens were found.
	ChunkTokens int
	// Expectations are the namespace spec's (rank, shard, group) triples
	// (dcp.Resolved.Expectations), ordered by rank then group.
	Expectations []dcp.Expectation
	// Recurrent holds, by group, whether the group keeps a state per
	// chunk (dcp.Recurrent); mixed: some groups do and some do not (see
	// Needed). Shared with the index: do not modify.
	Recurrent []bool
	mixed     bool
	// Members, for LookupSharedInto with shared instances the index knows,
	// holds an entry per source: 0 when its holder is of the reader's
	// instance, k when it is of Shared[k-1]. Empty otherwise.
	Members []uint8
	// Sources holds Prefix*len(Expectations) entries:
	// Sources[i*len(Expectations)+j] is where the reader of Expectations[j]
	// takes chunk i from.
	Sources []Source

	touch uint32 // sink of Lookup's prefetching loads
}

// Needed reports whether a restore of the first n chunks of the prefix
// needs expectation j of chunk i. Every one is, except with stateAtEnd
// (wire.RestoreBeginRequest.StateAtEnd) in a namespace of recurrent and
// other groups, where a recurrent group's object is needed for the last
// chunk (n-1) only: the engine resumes from the state at the prefix's
// end. Every chunk keeps an expectation (a non-recurrent group's).
func (r *LookupResult) Needed(i, j, n int, stateAtEnd bool) bool {
	return !stateAtEnd || !r.mixed || i == n-1 || !r.Recurrent[r.Expectations[j].Group]
}

// Source returns where the reader of expectation j takes chunk i from.
func (r *LookupResult) Source(i, j int) Source { return r.Sources[i*len(r.Expectations)+j] }

// Holder returns the rank holding the copy the reader of expectation j
// reads for chunk i.
func (r *LookupResult) Holder(i, j int) wire.Rank {
	inst := r.Instance
	if k := r.member(i, j); k > 0 {
		inst = r.Shared[k-1]
	}
	return wire.Rank{Instance: inst, TPRank: int(r.Source(i, j).HolderTP)}
}

// member is Members' entry of the source of chunk i, expectation j.
func (r *LookupResult) member(i, j int) uint8 {
	if len(r.Members) == 0 {
		return 0
	}
	return r.Members[i*len(r.Expectations)+j]
}

// FromShared reports whether the reader of expectation j reads chunk i
// from a copy of another instance of its share group.
func (r *LookupResult) FromShared(i, j int) bool { return r.member(i, j) > 0 }

// SharedSources counts the sources of the first n chunks of the prefix
// held by another instance of the share group (with stateAtEnd, those a
// restore needs: Needed).
func (r *LookupResult) SharedSources(n int, stateAtEnd bool) int {
	if len(r.Members) == 0 {
		return 0
	}
	n = min(n, r.Prefix)
	ne, c := len(r.Expectations), 0
	for k, m := range r.Members[:n*ne] {
		if m > 0 && r.Needed(k/ne, k%ne, n, stateAtEnd) {
			c++
		}
	}
	return c
}

// MaxShared bounds LookupSharedInto's shared instances (Source.Member is
// one byte).
const MaxShared = 255

// Lookup returns the longest prefix of chunks that engine instance can
// restore in namespace ns: the largest k such that for every chunk i < k
// and every expectation (rank, shard, group) of the namespace's spec, the
// object (ns, chunk i, shard, group) has a copy usable by the reader
// wire.Rank{instance, rank}; and, for each such chunk and expectation,
// which copy to read.
//
// Usability: an L1 copy (pinned memory of its holder's rankd) is usable
// only by its holder itself (with Config.HostSharedL1, by every rank of
// its instance, after the reader's own L1 and before any L2 copy); an L2 copy (a file under the instance's L2
// root, shared by the instance's rankds) is usable by any reader of the
// holder's instance, even while the holder is fenced (the file outlives
// it). Fenced L1 copies are never usable: the index does not keep them.
// Preference: the reader's own L1, then its own L2, then the L2 copy of
// the instance's lowest TP rank.
//
// An unregistered namespace is an error wrapping ErrUnknownNamespace.
// Lookup allocates the result; a server answering many lookups should keep
// results in a pool and use LookupInto.
func (ix *Index) Lookup(instance string, ns dcp.Namespace, chunks []dcp.ChunkHash) (LookupResult, error) {
	var res LookupResult
	err := ix.LookupInto(&res, instance, ns, chunks)
	return res, err
}

// LookupInto is Lookup writing into res, reusing res.Sources' capacity: a
// caller that keeps one result per goroutine looks up without allocating.
// res.Expectations is shared with the index and must not be modified.
func (ix *Index) LookupInto(res *LookupResult, instance string, ns dcp.Namespace, chunks []dcp.ChunkHash) error {
	return ix.LookupSharedInto(res, instance, nil, ns, chunks)
}

// LookupSharedInto is LookupInto for a reader instance in a share group:
// besides its own instance's copies, the L2 copies held by the ranks of
// the instances in shared (the group's other members, whose rankds write
// the same shared L2 directory) are usable by every reader of instance,
// even while their holder is fenced (the file outlives it), after the
// reader instance's own L2 copies and before its L3 copies. With
// Config.SharedL3 their L3 copies are usable too, last of all (after the
// reader instance's own L3 copies): its rankds read the members' bucket
// prefixes (rankd --l3-shared-with). With Config.SharedL1 (and
// HostSharedL1) their L1 copies are usable after the L1 copies of the
// reader's own instance and before any L2 copy, under the same fence
// rule: its rankds map the members' host-shared L1 segments (rankd
// --host-l1-shared-with). The namespace
// still decides everything else (C4): a member storing under another
// layout stores under another namespace. At most MaxShared instances;
// names the index does not know, and instance itself, are ignored.
func (ix *Index) LookupSharedInto(res *LookupResult, instance string, shared []string, ns dcp.Namespace, chunks []dcp.ChunkHash) error {
	return ix.LookupOptsInto(res, instance, shared, ns, chunks, LookupOpts{})
}

// LookupOpts are the variants of a lookup.
type LookupOpts struct {
	// StateAtEnd: in a namespace of recurrent and other groups, a chunk
	// needs its recurrent groups' objects only to end the prefix
	// (wire.LookupRequest.StateAtEnd): the prefix is the longest run of
	// chunks holding every non-recurrent object that ends on a chunk
	// holding every object. The inner chunks' missing recurrent sources
	// are zero Sources, never needed (LookupResult.Needed with
	// stateAtEnd); a result is then only for a restore with StateAtEnd.
	StateAtEnd bool
}

// LookupOptsInto is LookupSharedInto with opts.
func (ix *Index) LookupOptsInto(res *LookupResult, instance string, shared []string, ns dcp.Namespace, chunks []dcp.ChunkHash,
	opts LookupOpts) error {
	*res = LookupResult{Namespace: ns, Instance: instance, Shared: shared, Sources: res.Sources[:0], Members: res.Members[:0]}
	if len(shared) > MaxShared {
		return fmt.Errorf("lookup shared with %d instances, limit %d: %w", len(shared), MaxShared, ErrInvalid)
	}
	// No Index.mu: the view, then one shard read lock per chunk
	// (chunkmap.go), so a publish never holds a lookup up.
	v := ix.view.Load()
	nv, ok := v.ns[ns]
	if !ok {
		return fmt.Errorf("lookup in namespace %s: %w", ns, ErrUnknownNamespace)
	}
	pl := nv.plan
	ne := len(pl.exps)
	res.Expectations, res.ChunkTokens, res.Recurrent, res.mixed = pl.exps, pl.chunkTokens, pl.recurrent, pl.mixed
	inst := v.insts[instance] // 0: unknown instance, nothing of it is usable
	// members[k] is the id of shared[k] (0: unknown, or the reader's own).
	var mbuf [8]uint32
	var members []uint32
	for k, name := range shared {
		if id := v.insts[name]; id != 0 && id != inst {
			if members == nil {
				members = mbuf[:0]
				if len(shared) > len(mbuf) {
					members = make([]uint32, 0, len(shared))
				}
				members = members[:len(shared)]
			}
			members[k] = id
		}
	}
	if (inst == 0 && members == nil) || len(chunks) == 0 {
		return nil
	}
	// Per expectation: the reader (rank id, 0 if unknown: no L1 of its
	// own, and the oldest incarnation whose L1 copies it may read), and
	// while scanning a chunk the best copy and its score.
	var rbuf [32]reader
	var sbuf [2 * 32]int32
	var readers []reader
	var scratch []int32
	if ne <= len(rbuf) {
		readers, scratch = rbuf[:ne], sbuf[:2*ne]
	} else {
		readers, scratch = make([]reader, ne), make([]int32, 2*ne)
	}
	best, score := scratch[:ne], scratch[ne:]
	for j, e := range pl.exps {
		id := v.rankIDs[wire.Rank{Instance: instance, TPRank: e.Rank}]
		readers[j] = reader{id: int32(id)}
		if id != 0 {
			rv := v.ranks[id]
			readers[j].inc = rv.inc
			if rv.noL1 {
				readers[j].inc = math.MaxUint64 // fenced or being fenced: its own L1 is not usable
			}
		}
	}
	var ranks []rankView // with HostSharedL1: every holder's fence state, checked per copy
	if ix.cfg.HostSharedL1 {
		ranks = v.ranks
	}
	if cap(res.Sources) < len(chunks)*ne {
		res.Sources = make([]Source, 0, len(chunks)*ne)
	}
	atEnd := opts.StateAtEnd && pl.mixed
	if members != nil {
		v.lookupShared(res, nv, chunks, readers, inst, members, ix.cfg.SharedL1 && ranks != nil, ix.cfg.SharedL3, ranks, best, score, atEnd)
		return nil
	}
	full := 0 // with atEnd: the chunks up to the last holding every object
	// Chunks go in windows: first the map lookups of a window and a load
	// from every placement (independent loads the CPU overlaps: a cold
	// chain costs about half as much), then the scans, from cache.
	const window = 16
	var ss [window][]placement
	var vis []placement
	cm := nv.chunks
	for base := 0; base < len(chunks); base += window {
		w := min(window, len(chunks)-base)
		cm.loadAll(chunks[base:base+w], ss[:w])
		var touch uint32
		for i := range w {
			s := ss[i]
			for k := range s {
				touch += uint32(s[k].shard)
			}
		}
		res.touch += touch
		for i := range w {
			s := ss[i]
			if v.hiding > 0 {
				s = v.visible(s, &vis) // a sliced inventory is being applied
			}
			if !pl.pick(s, readers, inst, ranks, best, score) {
				if atEnd && pl.statesOnlyMissing(s, score) {
					for j := range ne {
						src := Source{}
						if score[j] != 0 {
							p := &s[best[j]]
							src = Source{HolderTP: int32(p.tp), Tier: p.tier, Size: p.size, Sum: p.sum}
						}
						res.Sources = append(res.Sources, src)
					}
					res.Prefix++
					continue
				}
				res.cutToFull(full, atEnd)
				return nil
			}
			for j := range ne {
				p := &s[best[j]]
				res.Sources = append(res.Sources, Source{HolderTP: int32(p.tp), Tier: p.tier, Size: p.size, Sum: p.sum})
			}
			res.Prefix++
			full = res.Prefix
		}
	}
	res.cutToFull(full, atEnd)
	return nil
}

// statesOnlyMissing reports, after pick found a chunk incomplete (its
// placements s non-empty, score filled), whether only recurrent groups'
// objects are missing.
func (pl *lookupPlan) statesOnlyMissing(s []placement, score []int32) bool {
	if len(s) == 0 {
		return false // pick returned before scoring
	}
	for j, sc := range score {
		if sc == 0 && !pl.recurrent[pl.exps[j].Group] {
			return false
		}
	}
	return true
}

// cutToFull ends a StateAtEnd lookup's prefix at its last chunk holding
// every object (full chunks): chunks past it lack a state to end on.
func (r *LookupResult) cutToFull(full int, atEnd bool) {
	if !atEnd || full == r.Prefix {
		return
	}
	ne := len(r.Expectations)
	r.Prefix, r.Sources = full, r.Sources[:full*ne]
	if len(r.Members) > 0 {
		r.Members = r.Members[:full*ne]
	}
}

// lookupShared is LookupSharedInto's scan for a reader with share-group
// members (their ids): the same windows, pickShared, and each source's
// Member. A copy of the loop above rather than a branch in it, so that
// the lookups of instances in no group (the hot path) keep their loop as
// it was.
func (v *lookupView) lookupShared(res *LookupResult, nv nsView, chunks []dcp.ChunkHash, readers []reader, inst uint32,
	members []uint32, l1, l3 bool, ranks []rankView, best, score []int32, atEnd bool) {
	pl, ne := nv.plan, len(readers)
	full := 0 // with atEnd: the chunks up to the last holding every object
	defer func() { res.cutToFull(full, atEnd) }()
	const window = 16
	var ss [window][]placement
	var vis []placement
	for base := 0; base < len(chunks); base += window {
		w := min(window, len(chunks)-base)
		nv.chunks.loadAll(chunks[base:base+w], ss[:w])
		for i := range w {
			s := ss[i]
			if v.hiding > 0 {
				s = v.visible(s, &vis)
			}
			complete := pl.pickShared(s, readers, inst, members, l1, l3, ranks, best, score)
			if !complete && (!atEnd || !pl.statesOnlyMissing(s, score)) {
				return
			}
			for j := range ne {
				if score[j] == 0 { // a state inside the prefix (atEnd), not stored
					res.Sources, res.Members = append(res.Sources, Source{}), append(res.Members, 0)
					continue
				}
				p := &s[best[j]]
				res.Sources = append(res.Sources, Source{HolderTP: int32(p.tp), Tier: p.tier, Size: p.size, Sum: p.sum})
				var k uint8
				if p.inst != inst {
					k = memberOf(members, p.inst)
				}
				res.Members = append(res.Members, k)
			}
			res.Prefix++
			if complete {
				full = res.Prefix
			}
		}
	}
}

// memberOf returns k+1 for the k with members[k] == id (0: none).
func memberOf(members []uint32, id uint32) uint8 {
	for k, m := range members {
		if m == id {
			return uint8(k + 1)
		}
	}
	return 0
}

// reader is one expectation's reader as Lookup scores copies for it: its
// rank id (0: unknown) and the oldest incarnation whose L1 copies of its
// own it may read (the lookup view's; math.MaxUint64 while it is fenced or
// being fenced: none).
type reader struct {
	inc uint64
	id  int32
}

// Instances returns the names of the instances the index has heard from,
// sorted, without taking Index.mu (the lookup view's list: do not modify).
func (ix *Index) Instances() []string { return ix.view.Load().instances }

// lookupPlan is a namespace spec arranged for Lookup: for every object
// (shard, group) of a chunk, the expectations that read it.
type lookupPlan struct {
	chunkTokens int
	exps        []dcp.Expectation
	recurrent   []bool // by group: dcp.Recurrent
	mixed       bool   // some groups are recurrent, some are not
	groups      int
	shards      int
	readers     [][]int32 // by shard*groups+group: indexes into exps
	one         []int32   // by shard*groups+group: the only reader, or -1 (see readers)
}

func newPlan(r *dcp.Resolved) *lookupPlan {
	pl := &lookupPlan{chunkTokens: r.ChunkTokens, exps: r.Expectations(), groups: len(r.Groups),
		recurrent: make([]bool, len(r.Groups))}
	states := 0
	for gi, g := range r.Groups {
		if g.Kind == dcp.Recurrent {
			pl.recurrent[gi] = true
			states++
		}
	}
	pl.mixed = states > 0 && states < len(r.Groups)
	for _, e := range pl.exps {
		pl.shards = max(pl.shards, e.Shard+1)
	}
	pl.readers = make([][]int32, pl.shards*pl.groups)
	for j, e := range pl.exps {
		o := e.Shard*pl.groups + e.Group
		pl.readers[o] = append(pl.readers[o], int32(j))
	}
	pl.one = make([]int32, len(pl.readers))
	for o, rs := range pl.readers {
		pl.one[o] = -1
		if len(rs) == 1 {
			pl.one[o] = rs[0]
		}
	}
	return pl
}

// pick chooses, in one pass over a chunk's placements, the copy each
// expectation's reader should read (best[j], an index into s) and reports
// whether every expectation has one. Scores (placement.score): the
// reader's own L1, with ranks another rank's L1 of the same instance,
// the reader's own L2, another rank's L2 of the same instance, an L3 copy
// of the same instance (among other ranks' copies of one tier, the lowest
// TP rank first); anything else is unusable (0). pickShared is pick for a
// reader in a share group; they are two so that the lookups of instances
// in no group (the common case, and the hot path) pay nothing for it.
func (pl *lookupPlan) pick(s []placement, readers []reader, inst uint32, ranks []rankView, best, score []int32) bool {
	if len(s) == 0 {
		return false
	}
	clear(score)
	shards, groups, one := pl.shards, pl.groups, pl.one
	for k := range s {
		p := &s[k]
		sh, g := int(p.shard), int(p.group)
		if sh >= shards || g >= groups {
			continue
		}
		o := sh*groups + g
		if j := one[o]; j >= 0 { // the common case: one reader per object
			sc := p.score(&readers[j], inst)
			if sc == scorePeerL1 && !p.peerL1(ranks) {
				sc = 0
			}
			if sc > score[j] || (sc == score[j] && sc != 0 && p.tp < s[best[j]].tp) {
				score[j], best[j] = sc, int32(k)
			}
			continue
		}
		for _, j := range pl.readers[o] {
			sc := p.score(&readers[j], inst)
			if sc == scorePeerL1 && !p.peerL1(ranks) {
				sc = 0
			}
			if sc > score[j] || (sc == score[j] && sc != 0 && p.tp < s[best[j]].tp) {
				score[j], best[j] = sc, int32(k)
			}
		}
	}
	for _, sc := range score {
		if sc == 0 {
			return false
		}
	}
	return true
}

// pickShared is pick for a reader whose share group's other instances
// are members (their ids, non-nil): an L2 copy of a member (sharedCopy)
// ranks after another rank's L2 of the reader's instance and before an
// L3 copy of it; with l3, an L3 copy of a member ranks last, after the
// reader instance's own L3 copies; with l1 (and ranks), an L1 copy of a
// member whose holder's fence state allows it ranks after the L1 copies
// of the reader's instance and before its own L2.
func (pl *lookupPlan) pickShared(s []placement, readers []reader, inst uint32, members []uint32, l1, l3 bool, ranks []rankView,
	best, score []int32) bool {
	if len(s) == 0 {
		return false
	}
	clear(score)
	shards, groups, one := pl.shards, pl.groups, pl.one
	for k := range s {
		p := &s[k]
		sh, g := int(p.shard), int(p.group)
		if sh >= shards || g >= groups {
			continue
		}
		o := sh*groups + g
		if j := one[o]; j >= 0 { // the common case: one reader per object
			sc := p.score(&readers[j], inst)
			if sc == scorePeerL1 && !p.peerL1(ranks) {
				sc = 0
			} else if sc == 0 {
				sc = p.sharedCopy(members, l1, l3, ranks)
			}
			if sc > score[j] || (sc == score[j] && sc != 0 && p.tp < s[best[j]].tp) {
				score[j], best[j] = sc, int32(k)
			}
			continue
		}
		for _, j := range pl.readers[o] {
			sc := p.score(&readers[j], inst)
			if sc == scorePeerL1 && !p.peerL1(ranks) {
				sc = 0
			} else if sc == 0 {
				sc = p.sharedCopy(members, l1, l3, ranks)
			}
			if sc > score[j] || (sc == score[j] && sc != 0 && p.tp < s[best[j]].tp) {
				score[j], best[j] = sc, int32(k)
			}
		}
	}
	for _, sc := range score {
		if sc == 0 {
			return false
		}
	}
	return true
}

// Scores of a copy for one reader (placement.score, sharedCopy), best
// first; 0 is unusable.
const (
	scoreOwnL1    = 8 // the reader's own L1 (not of an older incarnation)
	scorePeerL1   = 7 // another rank's L1 of the same instance: pick asks peerL1
	scoreSharedL1 = 6 // with Config.SharedL1, an L1 copy of another instance of the share group
	scoreOwnL2    = 5 // the reader's own L2
	scoreL2       = 4 // another rank's L2 of the same instance
	scoreSharedL2 = 3 // an L2 copy of another instance of the share group
	scoreL3       = 2 // an L3 copy of any rank of the same instance
	scoreSharedL3 = 1 // with Config.SharedL3, an L3 copy of another instance of the share group
)

// score rates p for a reader r of instance inst: scoreOwnL1 the reader's
// own L1 (0 when stored by an incarnation older than r.inc: while the
// reader is fenced or being fenced, every one), scorePeerL1 another rank's
// L1 of the same instance (usable only when L1 is host-shared and its
// holder's fence state allows it: pick asks peerL1), scoreOwnL2 the
// reader's own L2, scoreL2 another rank's L2 of the same instance, scoreL3
// an L3 copy of any rank of the same instance (its bucket prefix is the
// instance's: the plan prefers L1 > L2 > L3), 0 anything of another
// instance (pickShared asks sharedCopy). Only one copy per (rank, tier) exists,
// so equal scores below scoreOwnL1 and scoreOwnL2 compare copies of other
// ranks.
func (p *placement) score(r *reader, inst uint32) int32 {
	if p.tier == wire.L3 {
		if p.inst == inst {
			return scoreL3
		}
		return 0
	}
	if int32(p.rank) == r.id {
		if p.tier != wire.L1 {
			return scoreOwnL2
		}
		if p.inc < r.inc {
			return 0
		}
		return scoreOwnL1
	}
	if p.inst != inst {
		return 0
	}
	if p.tier == wire.L2 {
		return scoreL2
	}
	return scorePeerL1 // another rank's L1: pick checks it (peerL1)
}

// sharedCopy rates p, a copy of another instance than the reader's, held
// by a rank of one of members (the reader's share group): scoreSharedL2
// for an L2 copy (their rankds write the L2 directory the reader's rankds
// read), scoreSharedL3 for an L3 copy when l3 (Config.SharedL3: the
// reader's rankds read the members' bucket prefixes), scoreSharedL1 for
// an L1 copy when l1 (Config.SharedL1: the reader's rankds map the
// members' host-shared L1 segments) and its holder's fence state in
// ranks allows it (peerL1), else 0. Out of score so that score stays
// inlined in pick's loop.
func (p *placement) sharedCopy(members []uint32, l1, l3 bool, ranks []rankView) int32 {
	var sc int32
	switch {
	case p.tier == wire.L2:
		sc = scoreSharedL2
	case p.tier == wire.L3 && l3:
		sc = scoreSharedL3
	case p.tier == wire.L1 && l1 && p.peerL1(ranks):
		sc = scoreSharedL1
	default:
		return 0
	}
	for _, m := range members {
		if m == p.inst {
			return sc
		}
	}
	return 0
}

// peerL1 reports whether p, another rank's L1 copy of the reader's
// instance (scorePeerL1) or of a share-group member (scoreSharedL1), is
// usable: only with HostSharedL1 (ranks non-nil),
// and only when its holder's fence state in the lookup view allows it.
// Out of score so that score stays inlined in pick's loop.
func (p *placement) peerL1(ranks []rankView) bool {
	return ranks != nil && int(p.rank) < len(ranks) && !ranks[p.rank].noL1 && p.inc >= ranks[p.rank].inc
}

// Holder is one copy of an object.
type Holder struct {
	Rank        wire.Rank
	Tier        wire.Tier
	Size        uint64
	Sum         uint64
	Incarnation uint64 // of the holder that stored it
	Seq         uint64 // event (or inventory) sequence that put it there
}

// Get returns every copy of one object, L1 copies first, nil if none.
func (ix *Index) Get(k dcp.Key) []Holder {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var out []Holder
	for _, p := range ix.st.chunk(chunkRef{k.NS, k.Chunk}) {
		if p.shard == k.Shard && p.group == k.Group && !ix.st.hidden(&p) {
			out = append(out, ix.st.holder(&p))
		}
	}
	slices.SortStableFunc(out, func(a, b Holder) int { return int(a.Tier) - int(b.Tier) })
	return out
}

// hidden reports whether p is still in its chunk but no longer usable: an
// L1 copy of a rank being fenced in slices (index/fence.go), or any copy
// of a rank whose inventory is being applied in slices or was interrupted
// by a crash (index/inventory.go).
func (st *state) hidden(p *placement) bool {
	r := st.ranks[p.rank]
	return r.allHidden || (p.tier == wire.L1 && r.l1Hidden)
}

// visible returns s without the placements of ranks whose inventory is
// being applied in slices, in buf when it must filter.
func (st *state) visible(s []placement, buf *[]placement) []placement {
	for i := range s {
		if st.ranks[s[i].rank].allHidden {
			out := append((*buf)[:0], s[:i]...)
			for j := i + 1; j < len(s); j++ {
				if !st.ranks[s[j].rank].allHidden {
					out = append(out, s[j])
				}
			}
			*buf = out
			return out
		}
	}
	return s
}

func (st *state) holder(p *placement) Holder {
	return Holder{Rank: st.ranks[p.rank].rank, Tier: p.tier, Size: p.size, Sum: p.sum, Incarnation: p.inc, Seq: p.seq}
}

// RankInfo is a rank's C7 state and what it holds.
type RankInfo struct {
	Rank        wire.Rank
	Incarnation uint64
	LastSeq     uint64
	// Fenced: declared dead (FenceRank); its batches are refused until it
	// sends an inventory or a new incarnation starts.
	Fenced bool
	// Partial: a sliced inventory of the rank is being applied, or was
	// interrupted by a crash; none of its placements is usable until one
	// is applied whole (index/inventory.go).
	Partial bool
	// FenceGen is the rank's fence generation: every FenceRank of it (and
	// ResetRank) advances it. Read it before asking the rank for its
	// inventory and pass it to ApplyInventoryAt.
	FenceGen     uint64
	L1Placements int64
	L1Bytes      uint64
	L2Placements int64
	L2Bytes      uint64
	// L3Placements and L3Bytes count the objects this rank wrote to the
	// object store (L3) and reported.
	L3Placements int64
	L3Bytes      uint64
	// Placements is filled by ListRank only, sorted by key then tier;
	// Seq/Incarnation of each copy are in Holder form via Get.
	Placements []wire.Placement
}

func (r *rankState) info() RankInfo {
	return RankInfo{Rank: r.rank, Incarnation: r.inc, LastSeq: r.last, Fenced: r.fenced, Partial: r.partial,
		FenceGen: r.fenceGen, L1Placements: r.placements[wire.L1], L1Bytes: r.bytes[wire.L1],
		L2Placements: r.placements[wire.L2], L2Bytes: r.bytes[wire.L2],
		L3Placements: r.placements[wire.L3], L3Bytes: r.bytes[wire.L3]}
}

// Ranks returns every known rank's state and counts (no placement lists),
// ordered by instance then TP rank.
func (ix *Index) Ranks() []RankInfo {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make([]RankInfo, 0, len(ix.st.ranks)-1)
	for _, r := range ix.st.ranks[1:] {
		out = append(out, r.info())
	}
	slices.SortFunc(out, func(a, b RankInfo) int {
		if a.Rank.Instance != b.Rank.Instance {
			if a.Rank.Instance < b.Rank.Instance {
				return -1
			}
			return 1
		}
		return a.Rank.TPRank - b.Rank.TPRank
	})
	return out
}

// Rank returns one rank's state and counts without its placements, in
// constant time, and false for a rank the index has never seen.
func (ix *Index) Rank(r wire.Rank) (RankInfo, bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	id, ok := ix.st.rankIDs[r]
	if !ok {
		return RankInfo{}, false
	}
	return ix.st.ranks[id].info(), true
}

// RankFence returns a rank's incarnation and whether it is fenced as
// lookups apply them (chunkmap.go), without taking Index.mu: the lookup
// path calls it per reader, and it never waits for a publish. While a
// group that changes them is being published it reports the higher of
// the old and new incarnations and fenced if either is; Rank is exact.
// known is false for a rank the index has never seen.
func (ix *Index) RankFence(r wire.Rank) (inc uint64, fenced, known bool) {
	v := ix.view.Load()
	id, ok := v.rankIDs[r]
	if !ok {
		return 0, false, false
	}
	rv := v.ranks[id]
	return rv.inc, rv.fenced, true
}

// ListRank returns a rank's state and every placement it holds. It visits
// the rank's own chunks (its chunk set), not the whole index. An unknown
// rank is an error wrapping ErrUnknownRank.
func (ix *Index) ListRank(r wire.Rank) (RankInfo, error) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	id, ok := ix.st.rankIDs[r]
	if !ok {
		return RankInfo{}, fmt.Errorf("rank %s: %w", r, ErrUnknownRank)
	}
	rs := ix.st.ranks[id]
	info := rs.info()
	seen := make(map[chunkRef]bool, rs.live)
	for ref := range rs.chunks.all {
		if seen[ref] {
			continue // listed twice (left and entered again)
		}
		seen[ref] = true
		for _, p := range ix.st.chunk(ref) {
			if p.rank == id && !ix.st.hidden(&p) {
				info.Placements = append(info.Placements, wire.Placement{
					Key:  dcp.Key{NS: ref.ns, Chunk: ref.chunk, Shard: p.shard, Group: p.group},
					Tier: p.tier, Size: p.size, Sum: p.sum})
			}
		}
	}
	SortPlacements(info.Placements)
	return info, nil
}

// SortPlacements sorts placements by binary key, then tier: the order of
// ListRank, handy for comparing with an inventory.
func SortPlacements(ps []wire.Placement) {
	slices.SortFunc(ps, func(a, b wire.Placement) int {
		if c := bytes.Compare(a.Key.Bytes(), b.Key.Bytes()); c != 0 {
			return c
		}
		return int(a.Tier) - int(b.Tier)
	})
}

// NamespaceInfo is one namespace's spec and counts.
type NamespaceInfo struct {
	Namespace dcp.Namespace
	// Spec is nil while the namespace is unregistered (events may arrive
	// before the engine registers it).
	Spec         *dcp.Resolved
	Chunks       int64
	Objects      int64 // distinct (chunk, shard, group) with a copy
	L1Placements int64
	L1Bytes      uint64
	L2Placements int64
	L2Bytes      uint64
}

func (n *nsState) info(ns dcp.Namespace) NamespaceInfo {
	return NamespaceInfo{Namespace: ns, Spec: n.spec, Chunks: int64(n.chunks.len()), Objects: n.objects,
		L1Placements: n.placements[wire.L1], L1Bytes: n.bytes[wire.L1],
		L2Placements: n.placements[wire.L2], L2Bytes: n.bytes[wire.L2]}
}

// ListNamespace returns a namespace's spec and counts. A namespace with
// neither a registered spec nor any object is an error wrapping
// ErrUnknownNamespace.
func (ix *Index) ListNamespace(ns dcp.Namespace) (NamespaceInfo, error) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	n := ix.st.ns[ns]
	if n == nil || (n.spec == nil && n.chunks.len() == 0) {
		return NamespaceInfo{}, fmt.Errorf("namespace %s: %w", ns, ErrUnknownNamespace)
	}
	return n.info(ns), nil
}

// Namespaces lists every namespace with a spec or an object, in key order.
func (ix *Index) Namespaces() []NamespaceInfo {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var out []NamespaceInfo
	for ns, n := range ix.st.ns {
		if n.spec != nil || n.chunks.len() > 0 {
			out = append(out, n.info(ns))
		}
	}
	slices.SortFunc(out, func(a, b NamespaceInfo) int { return bytes.Compare(a.Namespace[:], b.Namespace[:]) })
	return out
}

// Stats are the index's totals.
type Stats struct {
	Namespaces   int
	Ranks        int
	Chunks       int64
	Objects      int64
	L1Placements int64
	L1Bytes      uint64
	L2Placements int64
	L2Bytes      uint64
}

// Stats returns the totals in O(namespaces).
func (ix *Index) Stats() Stats {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	st := ix.st
	s := Stats{Ranks: len(st.ranks) - 1, Chunks: st.chunks, Objects: st.objects,
		L1Placements: st.placements[wire.L1], L1Bytes: st.bytes[wire.L1],
		L2Placements: st.placements[wire.L2], L2Bytes: st.bytes[wire.L2]}
	for _, n := range st.ns {
		if n.spec != nil || n.chunks.len() > 0 {
			s.Namespaces++
		}
	}
	return s
}

// Ack is the wire acknowledgement of an applied batch.
func (o Outcome) Ack() wire.EventAck {
	return wire.EventAck{AppliedThrough: o.LastSeq, Resync: o.Resync, Fenced: o.Reason == DropStaleIncarnation}
}
