package index

import (
	"context"
	"fmt"

	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// Streamed inventories (issue 28.3). ApplyInventory takes a whole
// inventory: the coordinator had to hold up to its 16 Mi objects
// (~2.4 GB while applied) before handing them over, and a replicated
// index put them in one raft entry. A streamed inventory instead arrives
// as steps, each its own request (and, replicated, its own raft entry of
// at most one page), so the caller holds one page at a time:
//
//   - Begin carries the inventory's header (rank, incarnation, sequence,
//     the fence generation it was requested under) and gets the C7
//     verdict of ApplyInventoryAt. If it is applied, Begin drops every
//     placement of the rank (in InventorySlice slices, as a sliced
//     reset does, when the rank holds many chunks; Begin returns after
//     the last one), stages the rank's meta as the inventory's
//     (incarnation, sequence, the fence generation kept) with the durable
//     partial flag, and hides the rank from lookups (rankState.allHidden).
//     The Replaced and Fenced counts of the outcome are Begin's.
//   - Page puts one page of objects (checked like an inventory's, so a
//     slot listed twice within a page is refused; one listed in two pages
//     is put twice, the later page winning). FenceGen must be the one
//     Begin returned.
//   - End clears the partial flag and unhides the rank once its txn is
//     published: lookups then see exactly the pages' placements.
//
// Page and End apply only to the stream Begin started: the rank's meta
// must still be partial with the inventory's incarnation, sequence and
// Begin's fence generation, and not fenced. A fence or reset of the rank
// moves its generation, another Begin restarts the stream, a one-shot
// inventory clears the partial flag; each ends the stream, and its later
// steps are dropped (inventory_gone) on every replica alike, since what
// they check is durable state, never something in memory.
//
// Which reads are safe meanwhile: all of them. From Begin's first txn on,
// lookups, Get and ListRank see none of the rank's placements (neither
// the old ones, which may name copies the rank no longer has, nor the
// pages', which are a part of what it holds) until End's txn is
// published; a restore never plans a copy of the rank from a
// half-applied inventory. The rank's batches are refused meanwhile
// (partial_rank, asking for a resync, as after a crash inside a sliced
// inventory): the events after the inventory's sequence are read again
// from the rank's next inventory. A stream that is never ended (the
// caller gave up: the rank died or restarted mid-inventory, a page
// failed, the coordinator lost leadership or crashed) leaves the rank
// exactly so, hidden and refusing batches, until a new inventory is
// applied whole; the next Begin supersedes it. No state of the stream is
// kept in memory between steps, so a crash, a restart replaying raft
// entries, or a raft snapshot taken between two steps need nothing
// special: the partial flag and the puts are logged like any other change.

// StepKind is what a step of a streamed inventory does.
type StepKind uint8

// The steps of a streamed inventory, in order: one Begin, any number of
// Page, one End.
const (
	StepBegin StepKind = iota + 1
	StepPage
	StepEnd
)

// DropInventoryGone: a Page or End step of a streamed inventory that is no
// longer running (superseded, ended, or its rank fenced or reset since
// Begin). Counts steps.
const DropInventoryGone DropReason = "inventory_gone"

// InventoryStep is one step of a streamed inventory (see the comment
// above). Rank, Incarnation and Seq are the inventory's header, the same
// in every step of one stream.
type InventoryStep struct {
	Kind        StepKind  `json:"kind"`
	Rank        wire.Rank `json:"rank"`
	Incarnation uint64    `json:"incarnation"`
	Seq         uint64    `json:"seq"`
	// FenceGen: for Begin, the rank's fence generation the inventory was
	// requested under (checked as ApplyInventoryAt checks it when Checked
	// is set); for Page and End, the generation Begin returned.
	FenceGen uint64 `json:"fence_gen"`
	Checked  bool   `json:"checked,omitempty"`
	// Objects are a page's objects (Page only); sorted in place when
	// checked.
	Objects []wire.Placement `json:"objects,omitempty"`
	// Placements is the number of objects the stream's pages carried (End
	// only; reported as the outcome's Placements).
	Placements int `json:"placements,omitempty"`
}

// ApplyInventoryStep applies one step of a streamed inventory and returns
// once it is committed and published (Begin: once its last slice is).
// The outcome's Applied is set by an applied End; a dropped step says why
// in Reason (Begin: as ApplyInventoryAt; Page and End: inventory_gone).
// Errors: ErrInvalid, ErrZeroSum (a page object of sum 0), ErrClosed,
// ErrFailed, ErrStore, or ctx's error.
func (ix *Index) ApplyInventoryStep(ctx context.Context, s InventoryStep) (InventoryOutcome, error) {
	if err := validateStep(&s); err != nil {
		return InventoryOutcome{}, err
	}
	r := &request{kind: reqInvStep, step: &s, n: len(s.Objects) + 1}
	err := ix.submit(ctx, r)
	return r.invOut, err
}

// ApplyInventoryStepAsync queues a step like ApplyInventoryStep but
// returns as soon as it is queued, so a caller can stage the next page
// while one commits: steps queued by successive calls are applied in that
// order. Pending.Result gives the outcome (Result.Inventory, Result.Err).
// The step's objects must not be modified until then. A caller waits for
// Begin before queueing the first page: a page finds Begin's sliced drop
// still running and would finish it in one piece.
func (ix *Index) ApplyInventoryStepAsync(ctx context.Context, s InventoryStep) (*Pending, error) {
	if err := validateStep(&s); err != nil {
		return nil, err
	}
	r := &request{kind: reqInvStep, step: &s, n: len(s.Objects) + 1}
	if err := ix.enqueue(ctx, r); err != nil {
		return nil, err
	}
	return &Pending{r: r}, nil
}

// ValidateInventoryStep checks a step as ApplyInventoryStep does (a
// replicated coordinator checks before proposing it); a page's objects are
// sorted in place.
func ValidateInventoryStep(s *InventoryStep) error { return validateStep(s) }

func validateStep(s *InventoryStep) error {
	switch s.Kind {
	case StepBegin, StepEnd:
		if len(s.Objects) > 0 {
			return fmt.Errorf("inventory step %d of %s carries %d objects: %w", s.Kind, s.Rank, len(s.Objects), ErrInvalid)
		}
	case StepPage:
		if len(s.Objects) > wire.MaxInventoryPageSize {
			return fmt.Errorf("inventory page of %s: %d objects, limit %d: %w", s.Rank, len(s.Objects), wire.MaxInventoryPageSize, ErrInvalid)
		}
	default:
		return fmt.Errorf("inventory step of %s has kind %d, want 1 (begin), 2 (page) or 3 (end): %w", s.Rank, s.Kind, ErrInvalid)
	}
	if s.Placements < 0 {
		return fmt.Errorf("inventory step of %s counts %d placements: %w", s.Rank, s.Placements, ErrInvalid)
	}
	inv := wire.Inventory{Rank: s.Rank, Incarnation: s.Incarnation, Seq: s.Seq, Objects: s.Objects}
	return validateInventory(&inv)
}

// stageStep stages a step of a streamed inventory in t and reports whether
// r is answered later (a Begin dropping the rank's placements in slices).
func (ix *Index) stageStep(t *txn, r *request) bool {
	s := r.step
	if s.Kind == StepBegin {
		// Whatever sliced job of the rank runs ends first: a one-shot
		// inventory's, a reset's or a previous Begin's drop.
		ix.finishResetOf(t, s.Rank)
		ix.finishInventoryOf(t, s.Rank)
		return ix.beginStream(t, r)
	}
	id, known := t.rankID(s.Rank)
	var m rankMeta
	if known {
		m = t.meta(id)
	}
	r.invOut = InventoryOutcome{Incarnation: m.inc, LastSeq: m.last, FenceGen: m.fenceGen}
	if !known || !m.partial || m.fenced || m.inc != s.Incarnation || m.last != s.Seq || m.fenceGen != s.FenceGen {
		// A reset of the rank in slices stays sliced: it moved the
		// generation, so nothing of this stream is applied after it.
		r.invOut.Reason = DropInventoryGone
		return false
	}
	// Begin's own drop may still run in slices (a follower gets the
	// stream's first Page as soon as the leader's Begin is committed):
	// it ends first. Nothing else of the rank can be running: a fence or
	// reset would have moved the generation, a one-shot inventory cleared
	// the partial flag.
	ix.finishResetOf(t, s.Rank)
	if s.Kind == StepPage {
		for i := range s.Objects {
			ob := &s.Objects[i]
			t.put(chunkRef{ob.Key.NS, ob.Key.Chunk}, placement{size: ob.Size, sum: ob.Sum, seq: s.Seq,
				inc: s.Incarnation, rank: id, shard: ob.Key.Shard, group: ob.Key.Group, tier: ob.Tier})
		}
		t.events += len(s.Objects)
		r.invOut.Placements = len(s.Objects)
		return false
	}
	m.partial = false
	t.setMeta(id, m)
	t.unhide = append(t.unhide, id)
	r.invOut.Applied, r.invOut.Placements = true, s.Placements
	return false
}

// beginStream stages Begin (see stageStep).
func (ix *Index) beginStream(t *txn, r *request) bool {
	s := r.step
	id, known := t.rankID(s.Rank)
	var m rankMeta
	if known {
		m = t.meta(id)
		head := wire.Inventory{Rank: s.Rank, Incarnation: s.Incarnation, Seq: s.Seq}
		if why := invDrop(&head, m, s.FenceGen, s.Checked); why != "" {
			r.invOut = InventoryOutcome{Reason: why, Incarnation: m.inc, LastSeq: m.last, FenceGen: m.fenceGen}
			return false
		}
	} else {
		id = t.createRank(s.Rank, s.Incarnation)
	}
	var below uint64 // L1 placements of older incarnations are counted as fenced
	if known && s.Incarnation > m.inc {
		below = s.Incarnation
	}
	t.setMeta(id, rankMeta{inc: s.Incarnation, last: s.Seq, partial: true, fenceGen: m.fenceGen})
	t.hideAll = append(t.hideAll, id)
	r.invOut = InventoryOutcome{Incarnation: s.Incarnation, LastSeq: s.Seq, FenceGen: m.fenceGen}
	if known && int(id) < len(ix.st.ranks) && ix.fenceOf(id) == nil {
		rs := ix.st.ranks[id]
		if rs.chunks.len() > ix.cfg.InventorySlice && !rs.fencing && t.mayHold(id, 0) {
			// A sliced drop (fence.go): a reset's, which keeps the
			// rank hidden at its end since the rank is partial
			// (publishUnhide), and counts old L1 copies as fenced.
			j := &fenceJob{id: id, reset: true, stream: true, below: below, reqs: []*request{r}}
			r.slice = true
			ix.fencing++
			rs.fencing = true
			ix.fences = append(ix.fences, j)
			ix.fenceSlice(t, j, j.slice(&ix.cfg))
			return true
		}
	}
	if below > 0 {
		r.invOut.Fenced = t.fenceL1(id, below)
	}
	r.invOut.Replaced = t.dropRank(id)
	// A sliced fence of the rank ends here: the rank holds nothing. Its
	// end unhides the rank's L1 copies; the rank stays hidden all the
	// same while it is partial (publishUnhide).
	ix.endFence(t, s.Rank)
	return false
}

// accountStep counts and logs a step once it is committed.
func (ix *Index) accountStep(r *request) {
	s, o := r.step, &r.invOut
	switch {
	case o.Reason != "":
		ix.met.dropped.WithLabelValues(string(o.Reason)).Inc()
		ix.log.Warn("inventory step dropped", zap.Stringer("rank", s.Rank), zap.Uint8("step", uint8(s.Kind)),
			zap.Uint64("incarnation", s.Incarnation), zap.Uint64("seq", s.Seq), zap.String("reason", string(o.Reason)),
			zap.Uint64("rank_incarnation", o.Incarnation), zap.Uint64("last_seq", o.LastSeq), zap.Uint64("fence_gen", o.FenceGen))
	case s.Kind == StepBegin:
		if o.Fenced > 0 {
			ix.met.fenced.WithLabelValues(string(FenceNewIncarnation)).Add(float64(o.Fenced))
		}
		ix.log.Info("streamed inventory begun: the rank's placements dropped, the rank hidden until it ends",
			zap.Stringer("rank", s.Rank), zap.Uint64("incarnation", s.Incarnation), zap.Uint64("seq", s.Seq),
			zap.Int("replaced", o.Replaced), zap.Int("fenced", o.Fenced))
	case s.Kind == StepEnd:
		ix.met.inventories.Inc()
		ix.log.Info("inventory applied", zap.Stringer("rank", s.Rank), zap.Uint64("incarnation", s.Incarnation),
			zap.Uint64("seq", s.Seq), zap.Int("placements", o.Placements), zap.Bool("streamed", true))
	}
}
