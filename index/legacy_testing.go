package index

import (
	"context"

	"github.com/kvtier/kvtier/wire"
)

// ApplyLegacyBatchForTest applies b as Apply does, except that it lets a
// Stored event of sum 0 through (ErrZeroSum): it writes what a coordinator
// older than issue 11.8 wrote, when nothing refused such a batch, through
// the same committer and bbolt layout. Tests of other packages use it to
// prove that placements of sum 0 already on disk are never planned
// (coordinator.TestZeroSumNeverPlanned). Nothing but a test may call it.
func ApplyLegacyBatchForTest(ctx context.Context, ix *Index, b wire.Batch) (Outcome, error) {
	if err := checkBatch(&b, false); err != nil {
		return Outcome{}, err
	}
	r := &request{kind: reqBatch, batch: &b, n: len(b.Events)}
	err := ix.submit(ctx, r)
	return r.out, err
}
