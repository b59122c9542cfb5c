package index

import (
	"context"
	"fmt"

	"github.com/kvtier/kvtier/wire"
)

// ResetRank forgets what the index knows of rank r's incarnations: every
// placement of r is dropped and its record goes back to incarnation 0,
// sequence 0, not fenced, so the next batch or inventory of whichever
// incarnation is real is accepted as a new incarnation (and its sequence
// gap asks for a resync, which brings its placements back). It undoes an
// implausible incarnation that got into the index (issue 10.5); it is an
// operator's tool, never called on its own. It returns the placements
// dropped; the error wraps ErrUnknownRank when the index never heard from
// r.
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
