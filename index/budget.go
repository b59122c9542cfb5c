package index

import (
	"github.com/kvtier/kvtier/wire"
)

// What the coordinator's per-rank budgets (issue 28.3) need of the index:
// the smallest object a registered namespace stores, and what a batch
// would do to its rank's placement count, both read without the
// committer.

// MinObjectSize returns the smallest object size, in bytes, of any group
// of any registered namespace (dcp.Resolved.ObjectSize), or 0 while no
// namespace is registered. It reads the lookup view: no lock.
func (ix *Index) MinObjectSize() uint64 { return ix.view.Load().minObject }

// BatchGrowth reports, against the published state, how many placements
// the batch's rank holds (held, every tier) and what the batch's events,
// taken in order, would leave of the slots they name: added counts the
// slots left holding a copy that the rank does not hold now, removed the
// slots it holds now that are left without one (a slot stored and removed
// again within the batch counts in neither). Sequences and incarnations
// are not looked at, so held+added-removed is what the rank holds once
// the batch is applied on the published state, or more when the index
// applies less (duplicates, a gap, a superseded incarnation, L1 copies a
// new incarnation fences). A rank the index does not know holds nothing.
// It takes the read lock once and reads one chunk per slot.
func (ix *Index) BatchGrowth(b *wire.Batch) (held int64, added, removed int) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	st := ix.st
	id, known := st.rankIDs[b.Rank]
	if known {
		tl := &st.ranks[id].tally
		held = tl.placements[wire.L1] + tl.placements[wire.L2] + tl.placements[wire.L3]
	}
	type slot struct {
		ref          chunkRef
		shard, group uint16
		tier         wire.Tier
	}
	// present: the slots the batch touched, as the batch leaves them;
	// had: whether the published state holds them.
	type seen struct{ had, present bool }
	slots := make(map[slot]seen, len(b.Events))
	for i := range b.Events {
		e := &b.Events[i]
		ref := chunkRef{e.Key.NS, e.Key.Chunk}
		k := slot{ref, e.Key.Shard, e.Key.Group, e.Tier}
		s, ok := slots[k]
		if !ok {
			if known {
				for _, p := range st.chunk(ref) {
					if cmpSlot(k.shard, k.group, k.tier, id, &p) == 0 {
						s.had = true
						break
					}
				}
			}
			s.present = s.had
		}
		s.present = e.Kind == wire.Stored
		slots[k] = s
	}
	for _, s := range slots {
		switch {
		case s.present && !s.had:
			added++
		case !s.present && s.had:
			removed++
		}
	}
	return held, added, removed
}
