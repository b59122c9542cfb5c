package index

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvtier/kvtier/wire"
)

// Sliced inventories (issue 12, STYLE 24). ApplyInventory of a rank holding
// a million objects would drop its placements and put the inventory's in
// one group commit, and every other rank's acknowledgement would wait for
// it. Instead, as a sliced fence does (fence.go), the committer applies it
// Config.InventorySlice units per group commit: first it drops the rank's
// placements (a unit is one chunk of the rank's chunk list as it was when
// the inventory started), then it puts the inventory's (a unit is one
// object). Lookups can tell no half-applied inventory from a whole one:
//
//   - the first slice's txn stages the rank's meta as the inventory's
//     (incarnation, sequence, not fenced) with the partial flag, and hides
//     every placement of the rank: once it is published, before its
//     chunks, queries skip them all (rankState.allHidden) until the last
//     slice's chunks are published, which clears the flag and unhides the
//     rank with exactly the inventory's placements (and the events below);
//   - the rank's batches arriving meanwhile are applied on top, as they
//     would be after a one-shot apply (C7 against the inventory's meta):
//     their placements carry a sequence above the inventory's, so the drop
//     phase keeps them, and the slots they touch are skipped by the put
//     phase (the later event wins). A batch of a newer incarnation, a
//     fence, a reset or another inventory of the rank first finishes the
//     inventory at once, in the current txn;
//   - durably, the first slice logs a drop of the whole rank (replay drops
//     at that point everything the slices drop one by one: all the rank
//     holds then), every put is logged, and the rank record carries the
//     partial flag until the last slice. A crash in between reopens the
//     rank hidden and partial: its placements (a subset of what it holds)
//     stay unusable and its batches are refused, asking for a resync,
//     until an inventory is applied whole. No fold is cut meanwhile
//     (Index.fencing), so the drop's record is never folded away first;
//   - Verify, Checkpoint and Close finish every inventory first.
//
// Replicated indexes (raft) apply inventories in one piece: every replica
// must commit the same transactions.

// invJob is one sliced inventory in progress.
type invJob struct {
	id  uint32
	r   *request // answered with the last slice
	inv *wire.Inventory
	// Drop phase: list (the rank's chunk list when the inventory started)
	// from pos to end; then the put phase from obj on.
	list     refList // a view (refList.view)
	pos, end int
	obj      int
	// below: L1 placements older than this incarnation are counted as
	// fenced (a newer incarnation's inventory), the rest as replaced.
	below            uint64
	replaced, fenced int
	// touched: slots the rank's events changed since the start; the put
	// phase leaves them as the events left them.
	touched map[slotKey]struct{}
}

// slotKey is one placement slot of one rank.
type slotKey struct {
	ref          chunkRef
	shard, group uint16
	tier         wire.Tier
}

func (ix *Index) invOf(id uint32) *invJob {
	for _, j := range ix.invs {
		if j.id == id {
			return j
		}
	}
	return nil
}

// invOfRank returns the sliced inventory of rank r in progress, if any.
func (ix *Index) invOfRank(t *txn, r wire.Rank) *invJob {
	if len(ix.invs) == 0 {
		return nil
	}
	id, ok := t.rankID(r)
	if !ok {
		return nil
	}
	return ix.invOf(id)
}

// startInventory starts a sliced apply of r's inventory when it is larger
// than one slice and would be applied, staging its first slice in t, and
// reports whether it did; otherwise the caller applies it in full.
func (ix *Index) startInventory(t *txn, r *request) bool {
	inv := r.inv
	if r.raftIndex != 0 || ix.failed != nil {
		return false
	}
	id, known := t.rankID(inv.Rank)
	var m rankMeta
	units := len(inv.Objects)
	if known {
		m = t.meta(id)
		switch {
		case invDrop(inv, m, r.fenceGen, r.genChecked) != "":
			return false // dropped: the full path says why
		case ix.fenceOf(id) != nil:
			return false // a sliced fence runs: the full path ends it
		case slices.Contains(t.unhide, id):
			return false // a sliced fence or inventory ends in t: its end would unhide this one
		}
		if int(id) < len(ix.st.ranks) {
			units += ix.st.ranks[id].chunks.len()
		}
	}
	if units <= ix.cfg.InventorySlice {
		return false
	}
	if !known {
		id = t.createRank(inv.Rank, inv.Incarnation)
	}
	j := &invJob{id: id, r: r, inv: inv, below: 0, touched: make(map[slotKey]struct{})}
	if known && inv.Incarnation > m.inc {
		j.below = inv.Incarnation
	}
	if int(id) < len(ix.st.ranks) {
		rs := ix.st.ranks[id]
		// A view: appends leave its entries alone, and a compaction (of
		// a fence or inventory that has just ended in the txn in flight,
		// installed when it is published) builds a new list.
		j.list = rs.chunks.view()
		rs.fencing = true
		j.end = j.list.len()
	}
	t.setMeta(id, rankMeta{inc: inv.Incarnation, last: inv.Seq, partial: true, fenceGen: m.fenceGen})
	t.hideAll = append(t.hideAll, id)
	if t.enc != nil {
		t.enc.drop(id) // replay drops at once what the slices drop
	}
	// Everything of the rank staged so far in t and its parent is as old
	// as the published chunks: drop it now, as a one-shot apply would.
	j.dropOld(t, nil)
	r.slice = true
	ix.fencing++
	ix.invs = append(ix.invs, j)
	ix.invSlice(t, j, ix.cfg.InventorySlice)
	return true
}

// old reports whether p is a placement of the rank from before the
// inventory: the inventory's own placements and the events after it carry
// the inventory's incarnation and a sequence >= its sequence, and only the
// put phase, which comes after every drop, puts the former.
func (j *invJob) old(p *placement) bool {
	return p.rank == j.id && (p.inc < j.inv.Incarnation || p.seq <= j.inv.Seq)
}

// invSlice stages the next slice of j in t: up to budget chunks of the
// drop phase, then objects of the put phase. The slice is one more
// request of t's group (reqSlice), so t is committed even when nothing
// else arrives; after the last slice j's request joins t's group.
func (ix *Index) invSlice(t *txn, j *invJob, budget int) {
	if j.pos < j.end {
		end := min(j.pos+budget, j.end)
		j.dropOld(t, j.list.segments(j.pos, end))
		budget -= end - j.pos
		ix.curN += end - j.pos
		j.pos = end
	}
	if j.pos >= j.end {
		objs := j.inv.Objects
		end := min(j.obj+max(budget, 0), len(objs))
		for i := j.obj; i < end; i++ {
			ob := &objs[i]
			ref := chunkRef{ob.Key.NS, ob.Key.Chunk}
			if _, ok := j.touched[slotKey{ref, ob.Key.Shard, ob.Key.Group, ob.Tier}]; ok {
				continue // an event of the rank since the start has the last word
			}
			t.put(ref, placement{size: ob.Size, sum: ob.Sum, seq: j.inv.Seq, inc: j.inv.Incarnation, rank: j.id,
				shard: ob.Key.Shard, group: ob.Key.Group, tier: ob.Tier})
		}
		t.events += end - j.obj
		ix.curN += end - j.obj
		j.obj = end
	}
	ix.pending = append(ix.pending, &request{kind: reqSlice, ctx: context.Background(), done: make(chan struct{})})
	if j.pos >= j.end && j.obj >= len(j.inv.Objects) {
		ix.endInventory(t, j)
	}
}

// dropOld drops the rank's old placements from the published chunks refs
// (and whatever t and its parent staged), counting L1 copies of an older
// incarnation as fenced.
func (j *invJob) dropOld(t *txn, refs [][]chunkRef) {
	// Two passes: filterRefs calls its predicate more than once per
	// placement, so it cannot count; its result can.
	if j.below > 0 {
		j.fenced += t.filterRefs(j.id, refs, func(p *placement) bool {
			return p.tier == wire.L1 && p.inc < j.below && j.old(p)
		})
	}
	j.replaced += t.filterRefs(j.id, refs, j.old)
}

// endInventory ends j in t: the rank's meta loses the partial flag, its
// placements are usable again once t's chunks are published, and j's
// request is answered with t.
func (ix *Index) endInventory(t *txn, j *invJob) {
	ix.invs = slices.DeleteFunc(ix.invs, func(x *invJob) bool { return x == j })
	m := t.meta(j.id)
	m.partial = false
	t.setMeta(j.id, m)
	t.unhide = append(t.unhide, j.id)
	inv := j.inv
	j.r.invOut = InventoryOutcome{Applied: true, Replaced: j.replaced, Placements: len(inv.Objects), Fenced: j.fenced,
		Incarnation: inv.Incarnation, LastSeq: inv.Seq, FenceGen: m.fenceGen}
	ix.pending = append(ix.pending, j.r)
}

// finishInventory stages every remaining slice of j in t at once (a
// request that must see the rank whole arrived).
func (ix *Index) finishInventory(t *txn, j *invJob) {
	ix.invSlice(t, j, j.end-j.pos+len(j.inv.Objects)-j.obj)
}

// finishInventoryOf finishes the sliced inventory of rank r in t, if one
// runs, and reports whether it did: the request after it then takes the
// one-shot path (a sliced fence or inventory starting in the txn that
// ends this one would be unhidden by its end).
func (ix *Index) finishInventoryOf(t *txn, r wire.Rank) bool {
	if j := ix.invOfRank(t, r); j != nil {
		ix.finishInventory(t, j)
		return true
	}
	return false
}

// touch runs before a batch of the rank is applied during its sliced
// inventory: it records the slots of the events the batch will apply
// (the put phase leaves them alone), and counts the old placements those
// events replace or remove before the drop phase reaches them as the
// inventory's (a one-shot apply would have dropped them first).
func (j *invJob) touch(t *txn, b *wire.Batch) {
	m := t.meta(j.id)
	if b.Incarnation != m.inc || m.fenced {
		return // applyBatch applies nothing of it
	}
	last := m.last
	for i := range b.Events {
		e := &b.Events[i]
		if e.Seq <= last {
			continue
		}
		if e.Seq != last+1 {
			break // a gap: nothing more is applied
		}
		last = e.Seq
		ref := chunkRef{e.Key.NS, e.Key.Chunk}
		sk := slotKey{ref, e.Key.Shard, e.Key.Group, e.Tier}
		if _, done := j.touched[sk]; done {
			continue
		}
		j.touched[sk] = struct{}{}
		if j.pos >= j.end {
			continue // the drop phase is over: nothing old is left
		}
		for _, p := range t.view(ref) {
			if cmpSlot(e.Key.Shard, e.Key.Group, e.Tier, j.id, &p) == 0 && j.old(&p) {
				if p.tier == wire.L1 && p.inc < j.below {
					j.fenced++
				} else {
					j.replaced++
				}
			}
		}
	}
}

// failInventories answers every sliced inventory's request with err (the
// index has failed).
func (ix *Index) failInventories(err error) {
	for _, j := range ix.invs {
		j.r.err = fmt.Errorf("%w: %w", ErrFailed, err)
		ix.fencing--
		close(j.r.done)
		if int(j.id) < len(ix.st.ranks) {
			ix.st.ranks[j.id].fencing = false
		}
	}
	ix.invs = nil
}

// unhidePartial makes a rank left partial by a crash in a sliced
// inventory usable again once t is published: a one-shot inventory or a
// reset staged in t has replaced its placements.
func (ix *Index) unhidePartial(t *txn, r wire.Rank) {
	id, ok := t.rankID(r)
	if ok && (int(id) < len(ix.st.ranks) && ix.st.ranks[id].allHidden || slices.Contains(t.hideAll, id)) && !slices.Contains(t.unhide, id) {
		t.unhide = append(t.unhide, id)
	}
}

// invLive reports whether rank id's inventory is being applied in slices.
func (ix *Index) invLive(id uint32) bool { return ix.invOf(id) != nil }
