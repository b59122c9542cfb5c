package index

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// The calls that change the index, and Checkpoint and Verify: each is a
// request to the committer (committer.go); what it carries is validated
// here, before it is queued.

// Apply applies one event batch with the C7 rules (see Outcome and
// txn.applyBatch) and returns once the change is committed to bbolt and
// visible to lookups. Duplicates, gaps, stale incarnations and fenced
// ranks are not errors: the Outcome says what happened. Errors: ErrInvalid
// (nothing applied), ErrClosed, ErrFailed, ErrStore, or ctx's error (not
// applied). The batch is not retained.
func (ix *Index) Apply(ctx context.Context, b wire.Batch) (Outcome, error) {
	if err := validateBatch(&b); err != nil {
		return Outcome{}, err
	}
	r := &request{kind: reqBatch, batch: &b, n: len(b.Events)}
	err := ix.submit(ctx, r)
	return r.out, err
}

// Pending is a batch queued by ApplyAsync.
type Pending struct{ r *request }

// ApplyAsync queues a batch like Apply but returns as soon as it is queued,
// so one producer can keep several batches in flight: batches queued by
// successive ApplyAsync calls are applied in that order (a rank's events
// stay in sequence). Wait returns the outcome once the batch is committed.
// The batch must not be modified until then.
func (ix *Index) ApplyAsync(ctx context.Context, b wire.Batch) (*Pending, error) {
	if err := validateBatch(&b); err != nil {
		return nil, err
	}
	r := &request{kind: reqBatch, batch: &b, n: len(b.Events)}
	if err := ix.enqueue(ctx, r); err != nil {
		return nil, err
	}
	return &Pending{r: r}, nil
}

// Done is closed when the batch's outcome is known.
func (p *Pending) Done() <-chan struct{} { return p.r.done }

// Wait waits for the batch to be committed (or refused) and returns what
// Apply would have.
func (p *Pending) Wait() (Outcome, error) {
	<-p.r.done
	return p.r.out, p.r.err
}

// ApplyInventory replaces every placement of the inventory's rank with the
// inventory, atomically, and sets the rank's incarnation and last sequence
// to the inventory's (clearing a fence). An inventory from an older
// incarnation, or from the current one but behind the last applied event,
// is dropped (the outcome says so). The inventory is not retained, but
// its objects are sorted in place (by key, then tier) when it is checked.
//
// It applies the inventory whatever fences the rank had since it was
// taken; a caller that asked the rank for it uses ApplyInventoryAt.
func (ix *Index) ApplyInventory(ctx context.Context, inv wire.Inventory) (InventoryOutcome, error) {
	return ix.applyInventory(ctx, inv, 0, false)
}

// ApplyInventoryAt is ApplyInventory for an inventory requested while the
// rank's fence generation was gen (RankInfo.FenceGen, read before the
// request): if a fence of the rank has been committed since, the
// inventory is dropped (fenced_since; the outcome's FenceGen is the
// current generation), unless it comes from a newer incarnation than the
// index knows. A rank the index does not know has generation 0.
func (ix *Index) ApplyInventoryAt(ctx context.Context, inv wire.Inventory, gen uint64) (InventoryOutcome, error) {
	return ix.applyInventory(ctx, inv, gen, true)
}

func (ix *Index) applyInventory(ctx context.Context, inv wire.Inventory, gen uint64, checked bool) (InventoryOutcome, error) {
	if err := validateInventory(&inv); err != nil {
		return InventoryOutcome{}, err
	}
	r := &request{kind: reqInventory, inv: &inv, n: len(inv.Objects) + 1, fenceGen: gen, genChecked: checked}
	err := ix.submit(ctx, r)
	return r.invOut, err
}

// FenceRank is called when memberlist declares a rank dead: its L1
// placements are dropped at once (its L2 placements stay: the files
// survive it) and its batches are refused until it resyncs with an
// inventory or comes back as a new incarnation. It returns the number of
// placements fenced; an unknown rank is not an error (0).
//
// upTo is the incarnation that died: the fence applies only while the
// index's current incarnation of r is <= upTo, so a late death notice of an
// old incarnation never fences its successor (0 placements). Pass
// math.MaxUint64 to fence whatever incarnation is current.
func (ix *Index) FenceRank(ctx context.Context, r wire.Rank, upTo uint64) (int, error) {
	if err := validateRank(r); err != nil {
		return 0, fmt.Errorf("fence: %w", err)
	}
	req := &request{kind: reqFence, rank: r, upTo: upTo, n: 1}
	if err := ix.submit(ctx, req); err != nil {
		return 0, err
	}
	return max(req.fenced, 0), nil
}

// RegisterNamespace resolves spec and records it as its namespace's spec,
// durably, so lookups know the namespace's expected shards. Registering a
// namespace again is idempotent when the spec's restore expectations agree
// with the registered one (the first spec is kept); otherwise the error
// wraps ErrNamespaceConflict.
func (ix *Index) RegisterNamespace(ctx context.Context, spec dcp.Spec) (*dcp.Resolved, error) {
	res, err := spec.Resolve()
	if err != nil {
		return nil, fmt.Errorf("register namespace: %w: %w", ErrInvalid, err)
	}
	js, err := json.Marshal(spec)
	if err != nil {
		return nil, fmt.Errorf("register namespace: encode spec: %w: %w", ErrInvalid, err)
	}
	r := &request{kind: reqRegister, spec: res, json: js, n: 1}
	if err := ix.submit(ctx, r); err != nil {
		return nil, err
	}
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.st.ns[res.Namespace].spec, nil
}

// Checkpoint folds the change log into the snapshot bucket now (the
// committer also does it when the log reaches Config.CheckpointBytes, and
// Close does it).
func (ix *Index) Checkpoint(ctx context.Context) error {
	return ix.submit(ctx, &request{kind: reqCheckpoint, n: 1})
}

// Verify re-derives the whole state from bbolt, from scratch, and compares
// it with the live in-memory state; it also checks the invariants (see
// VerifyReport). The committer takes both at a barrier between two group
// commits (a bbolt read transaction, and the state's shell whose chunk
// maps a goroutine of Verify's own copies while the committer records the
// barrier value of every chunk it changes meanwhile; the placement slices
// are shared, they are never modified once published), so they describe
// the same moment, and compares them off the committer, which goes on
// committing (STYLE 24). The error wraps ErrInconsistent when the
// report lists problems.
func (ix *Index) Verify(ctx context.Context) (VerifyReport, error) {
	r := &request{kind: reqVerify, n: 1}
	if err := ix.submit(ctx, r); err != nil {
		return r.report, err
	}
	return r.report, r.report.Err()
}
