package index_test

import (
	"bytes"
	"fmt"
	"math"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// TestFoldInSlices: an automatic fold is written FoldSliceChunks chunks per
// commit, and its last slice deletes only the log records it covers (issue
// 12: the whole fold in one transaction held every acknowledgement). After
// every batch (ranks storing, replacing and removing, a fence and an
// inventory on the way), the file as that commit left it is copied and
// opened, as after a crash: it must hold exactly the live state (the same
// dump) and verify clean, whether the fold in progress had written none,
// some or all of its slices. Seen failing with the last slice deleting the
// whole log (the records after the cut lost: the crash copy differs).
func TestFoldInSlices(t *testing.T) {
	dir := t.TempDir()
	ix := openTest(t, dir, func(c *index.Config) {
		c.CheckpointBytes = 16 << 10
		c.FoldSliceChunks = 7
	})
	const ranks = 3
	var sims []*indextest.Rank
	for tp := range ranks {
		keys := indextest.Keys(testNS, 5, 400, ranks, 1)
		sims = append(sims, indextest.NewRank(wire.Rank{Instance: "fold", TPRank: tp}, 1, keys, uint64(40+tp)))
	}
	copies := 0
	check := func(step int) {
		t.Helper()
		want := mustDump(t, ix.Index)
		path := filepath.Join(dir, fmt.Sprintf("crash%d.db", step))
		if err := crashCopy(ix.Index, path); err != nil {
			t.Fatal(err)
		}
		c := openTest(t, t.TempDir(), func(cfg *index.Config) { cfg.Path = path; cfg.Logger = zap.NewNop() })
		got := mustDump(t, c.Index)
		if !bytes.Equal(got.Bytes, want.Bytes) {
			t.Fatalf("step %d: the file as the last commit left it opens to %d B of state, the live index holds %d B",
				step, len(got.Bytes), len(want.Bytes))
		}
		mustVerify(t, c.Index)
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		copies++
	}
	for step := range 120 {
		s := sims[step%ranks]
		if _, err := ix.Apply(ctx, s.Next(40)); err != nil {
			t.Fatal(err)
		}
		switch step {
		case 50: // a restart: the new incarnation's inventory drops the old L1
			sims[1].Restart()
			mustInventory(t, ix.Index, sims[1].Inventory())
		case 80: // a fence, then the restarted rank's inventory
			if _, err := ix.FenceRank(ctx, sims[2].Rank, math.MaxUint64); err != nil {
				t.Fatal(err)
			}
			sims[2].Restart()
			mustInventory(t, ix.Index, sims[2].Inventory())
		}
		check(step)
	}
	folds := counter(t, ix.reg, "kvtier_index_checkpoints_total")
	slices := counter(t, ix.reg, "kvtier_index_fold_slices_total")
	t.Logf("%d crash copies checked; %v folds in %v slices", copies, folds, slices)
	if folds < 2 || slices < 4*folds {
		t.Fatalf("%v folds in %v slices: the test did not exercise folds in several slices", folds, slices)
	}
	agree(t, ix.Index, sims...)
	mustVerify(t, ix.Index)
}
