package index

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/kvtier/kvtier/wire"
)

// Sliced fences (issue 12, STYLE 24). FenceRank of a rank holding many
// chunks would drop them all in one group commit, and every other rank's
// acknowledgement would wait for it. Instead the committer drops them a
// slice (Config.FenceSliceChunks of the rank's chunks) per group commit:
//
//   - the first slice's txn marks the rank fenced (its batches are refused
//     from then on) and hides its L1 copies: when it is published, before
//     its chunks, lookups stop counting them (rankState.l1Hidden), so the
//     fence is visible as early as it was, and certainly once FenceRank
//     returns, which it does once the last slice is committed and
//     published;
//   - every slice's txn logs the fence op (opFence, rank, below), so a
//     crash at any point replays the whole fence; no fold is cut while a
//     fence is unfinished (Index.fencing), so that record is never folded
//     away before the last slice is committed;
//   - the rank's chunk list is not compacted meanwhile (rankState.fencing),
//     so the cursor into it stays valid; nothing is appended to it either,
//     since the fenced rank's batches are refused;
//   - anything that puts placements of the rank back ends the fence at
//     once (endFence): a new incarnation's first batch and an applied
//     inventory drop the old L1 copies themselves in full, a reset drops
//     every placement; the fence's request is answered with that txn;
//   - Verify, Checkpoint and Close finish every fence first
//     (finishFences), so they never see a half-fenced rank.

// fenceJob is one sliced fence, or sliced reset (reset.go), in progress.
type fenceJob struct {
	id    uint32
	below uint64 // L1 placements with incarnation < below are dropped
	// reset: every placement of the rank is dropped, whatever its tier
	// (a sliced ResetRank); below is unused.
	reset bool
	// stream: the drop of a streamed inventory's Begin (stream.go), a
	// reset whose first request is the Begin: old L1 copies of
	// incarnations < below are counted apart (as fenced), and the rank
	// stays hidden at the end (it is partial).
	stream   bool
	fencedL1 int
	pos      int        // next index into the rank's chunk list
	n        int        // placements dropped so far
	reqs     []*request // FenceRank (or ResetRank) calls answered when it ends
}

// startFence starts a sliced fence of r's rank when the rank's chunk list
// is longer than one slice, staging its first slice in t, and reports
// whether it did; otherwise the caller fences in full. A FenceRank of a
// rank already being fenced joins that fence (0 placements of its own).
func (ix *Index) startFence(t *txn, r *request) bool {
	id, known := t.rankID(r.rank)
	if !known || int(id) >= len(ix.st.ranks) {
		return false // never seen, or new in this group: nothing published
	}
	m := t.meta(id)
	if m.inc > r.upTo {
		return false // superseded: the full path answers it
	}
	if j := ix.fenceOf(id); j != nil {
		m.fenceGen++ // every fence moves the generation (txn.fenceRank)
		t.setMeta(id, m)
		r.slice = true
		ix.fencing++
		j.reqs = append(j.reqs, r)
		return true
	}
	rs := ix.st.ranks[id]
	if rs.chunks.len() <= ix.cfg.FenceSliceChunks || !t.mayHold(id, wire.L1) ||
		rs.fencing || slices.Contains(t.unhide, id) { // a sliced fence or inventory of the rank ends in flight or in t
		return false
	}
	m.fenced = true
	m.fenceGen++
	t.setMeta(id, m)
	j := &fenceJob{id: id, below: math.MaxUint64, reqs: []*request{r}}
	r.slice = true
	ix.fencing++
	rs.fencing = true
	t.hide = append(t.hide, id)
	ix.fences = append(ix.fences, j)
	ix.fenceSlice(t, j, ix.cfg.FenceSliceChunks)
	return true
}

// slice is the chunks j drops per group commit: a streamed inventory's
// Begin works as much as a sliced inventory does (InventorySlice), a fence
// or reset FenceSliceChunks.
func (j *fenceJob) slice(cfg *Config) int {
	if j.stream {
		return cfg.InventorySlice
	}
	return cfg.FenceSliceChunks
}

func (ix *Index) fenceOf(id uint32) *fenceJob {
	for _, j := range ix.fences {
		if j.id == id {
			return j
		}
	}
	return nil
}

// fenceSlice stages the next slice of j in t: up to chunks (normally
// FenceSliceChunks) of the rank's published chunks, and every chunk staged
// in t and its parent. The slice is one more request of t's group
// (reqSlice), so t is committed even when nothing else arrives; after the
// last slice the fence's requests join t's group and are answered with it.
//
// Every slice logs the whole fence (or, for a reset, the drop of every
// placement of the rank): replaying any of them does all of it, so a crash
// after the first slice's commit replays the whole fence or reset.
func (ix *Index) fenceSlice(t *txn, j *fenceJob, chunks int) {
	list := &ix.st.ranks[j.id].chunks
	end := min(j.pos+chunks, list.len())
	id, below := j.id, j.below
	drop := func(p *placement) bool { return p.rank == id && p.tier == wire.L1 && p.inc < below }
	if j.reset {
		drop = func(p *placement) bool { return p.rank == id }
	}
	if j.stream && below > 0 {
		// Two passes, as invJob.dropOld: filterRefs's predicate may see a
		// placement more than once, its result counts each once.
		j.fencedL1 += t.filterRefs(id, list.segments(j.pos, end), func(p *placement) bool {
			return p.rank == id && p.tier == wire.L1 && p.inc < below
		})
	}
	n := t.filterRefs(id, list.segments(j.pos, end), drop)
	if t.enc != nil {
		if j.reset {
			t.enc.drop(id)
		} else {
			t.enc.fence(id, below)
		}
	}
	ix.pending = append(ix.pending, &request{kind: reqSlice, ctx: context.Background(), done: make(chan struct{})})
	ix.curN += end - j.pos + 1
	j.n += n
	j.pos = end
	if j.pos < list.len() {
		return
	}
	ix.dropFence(t, j)
}

// dropFence ends j in t: the rank's L1 copies are usable again once t is
// published (none is left), and j's requests are answered with t.
func (ix *Index) dropFence(t *txn, j *fenceJob) {
	ix.fences = slices.DeleteFunc(ix.fences, func(x *fenceJob) bool { return x == j })
	t.unhide = append(t.unhide, j.id)
	for i, r := range j.reqs {
		r.fenced = 0
		switch {
		case i == 0 && j.stream:
			r.invOut.Replaced, r.invOut.Fenced = j.n, j.fencedL1
		case i == 0:
			r.fenced = j.n
		}
		ix.pending = append(ix.pending, r)
	}
}

// endFence ends a sliced fence of rank r, if one runs, because the request
// just staged in t has dropped the rank's L1 copies itself (a new
// incarnation, an applied inventory, a reset).
func (ix *Index) endFence(t *txn, r wire.Rank) {
	if len(ix.fences) == 0 {
		return
	}
	id, ok := t.rankID(r)
	if !ok {
		return
	}
	if j := ix.fenceOf(id); j != nil {
		ix.dropFence(t, j)
	}
}

// finishFences runs every sliced fence and inventory to its end,
// committing each slice (Verify, Checkpoint and Close need them whole).
func (ix *Index) finishFences() {
	for (len(ix.fences) > 0 || len(ix.invs) > 0) && ix.failed == nil {
		ix.barrier()
		ix.staging()
	}
	ix.barrier()
}

// failFences answers every sliced fence's requests with err (the index
// has failed).
func (ix *Index) failFences(err error) {
	ix.failInventories(err)
	for _, j := range ix.fences {
		for _, r := range j.reqs {
			r.err = fmt.Errorf("%w: %w", ErrFailed, err)
			ix.fencing--
			close(r.done)
		}
		ix.st.ranks[j.id].fencing = false
	}
	ix.fences = nil
}
