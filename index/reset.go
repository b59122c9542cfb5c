package index

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvtier/kvtier/wire"
)

// ResetRank forgets what the index knows of rank r's incarnations: every
// placement of r is dropped and its record goes back to incarnation 0,
// sequence 0, not fenced, so the next batch or inventory of whichever
// incarnation is real is accepted as a new incarnation (and its sequence
// gap asks for a resync, which brings its placements back). It undoes an
// implausible incarnation that got into the index (issue 10.5), or a
// rank that flooded the index with invented placements (issue 28.3); it
// is an operator's tool, never called on its own. It returns the
// placements dropped; the error wraps ErrUnknownRank when the index never
// heard from r.
//
// A rank whose chunk list is longer than Config.FenceSliceChunks is reset
// in slices, as a sliced fence is (fence.go), so a reset of millions of
// placements holds one slice's staging at a time, never all of them (issue
// 28.3: a one-shot reset of 2 M placements took the coordinator to 2.1 GB),
// and other ranks' acknowledgements wait for one slice:
//
//   - the first slice's txn stages the rank's meta as reset (incarnation
//     0, sequence 0, not fenced, the fence generation moved) and hides
//     every placement of the rank (rankState.allHidden), so lookups see
//     the reset from the first slice on; ResetRank returns once the last
//     slice is committed and published;
//   - every slice logs the drop of every placement of the rank, so a crash
//     after the first slice's commit replays the whole reset (no fold is
//     cut meanwhile: Index.fencing);
//   - a batch or an inventory of the rank finishes the reset at once, in
//     its own txn, before it is applied (the result is that of a one-shot
//     reset followed by it, on every replica alike); a fence of the rank
//     marks it fenced and moves its generation without touching its
//     placements (the reset drops them all); another reset joins;
//   - Verify, Checkpoint, snapshots and Close finish it first
//     (finishFences).
func (ix *Index) ResetRank(ctx context.Context, r wire.Rank) (int, error) {
	if err := validateRank(r); err != nil {
		return 0, fmt.Errorf("reset: %w", err)
	}
	req := &request{kind: reqReset, rank: r, n: 1}
	if err := ix.submit(ctx, req); err != nil {
		return 0, err
	}
	if req.fenced == fenceUnknown {
		return 0, fmt.Errorf("reset rank %s: %w", r, ErrUnknownRank)
	}
	return req.fenced, nil
}

// resetRank stages ResetRank; fenceUnknown for a rank never seen.
func (t *txn) resetRank(r wire.Rank) int {
	id, known := t.rankID(r)
	if !known {
		return fenceUnknown
	}
	n := t.dropRank(id)
	// The fence generation survives and moves: an inventory requested
	// before the reset is not applied on top of it as the current one.
	t.setMeta(id, rankMeta{fenceGen: t.meta(id).fenceGen + 1})
	return n
}

// startReset starts a sliced reset of r's rank when its chunk list is
// longer than one slice, staging its first slice in t, and reports whether
// it did; otherwise the caller resets in one piece. A reset of a rank
// being reset in slices joins it (0 placements of its own).
func (ix *Index) startReset(t *txn, r *request) bool {
	id, known := t.rankID(r.rank)
	if !known || int(id) >= len(ix.st.ranks) {
		return false // never seen, or new in this group: nothing published
	}
	if j := ix.fenceOf(id); j != nil {
		if !j.reset {
			return false // a sliced fence: the one-shot path ends it (endFence)
		}
		t.setMeta(id, rankMeta{fenceGen: t.meta(id).fenceGen + 1})
		r.slice = true
		ix.fencing++
		j.reqs = append(j.reqs, r)
		return true
	}
	rs := ix.st.ranks[id]
	if rs.chunks.len() <= ix.cfg.FenceSliceChunks || !t.mayHold(id, 0) ||
		rs.fencing || slices.Contains(t.unhide, id) { // a sliced fence or inventory of the rank ends in flight or in t
		return false
	}
	t.setMeta(id, rankMeta{fenceGen: t.meta(id).fenceGen + 1})
	j := &fenceJob{id: id, reset: true, reqs: []*request{r}}
	r.slice = true
	ix.fencing++
	rs.fencing = true
	t.hideAll = append(t.hideAll, id)
	ix.fences = append(ix.fences, j)
	ix.fenceSlice(t, j, ix.cfg.FenceSliceChunks)
	return true
}

// resetOf returns the sliced reset of rank r in progress, if any.
func (ix *Index) resetOf(t *txn, r wire.Rank) *fenceJob {
	if len(ix.fences) == 0 {
		return nil
	}
	id, ok := t.rankID(r)
	if !ok {
		return nil
	}
	if j := ix.fenceOf(id); j != nil && j.reset {
		return j
	}
	return nil
}

// finishResetOf stages every remaining slice of rank r's sliced reset in
// t, if one runs: a batch or inventory of the rank is applied after the
// whole reset.
func (ix *Index) finishResetOf(t *txn, r wire.Rank) {
	if j := ix.resetOf(t, r); j != nil {
		ix.fenceSlice(t, j, ix.st.ranks[j.id].chunks.len()-j.pos)
	}
}

// fenceDuringReset stages a FenceRank of a rank being reset in slices and
// reports whether there was one: the rank is marked fenced and its fence
// generation moves, as a one-shot reset followed by the fence would leave
// it (the reset's incarnation 0 is never above upTo), and the fence drops
// nothing (the reset drops every placement).
func (ix *Index) fenceDuringReset(t *txn, r *request) bool {
	j := ix.resetOf(t, r.rank)
	if j == nil {
		return false
	}
	m := t.meta(j.id)
	m.fenced = true
	m.fenceGen++
	t.setMeta(j.id, m)
	r.fenced = 0
	return true
}
