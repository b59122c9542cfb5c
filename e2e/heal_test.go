package e2e

import (
	"os"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// TestReStoreHealsCorruptL2 (issue 11.12): TP4/DCP1, the MLA shard rank 0
// wrote is read by every rank through L2. Four of its L2 objects are
// truncated while rank 0 still holds them in L1: the restore fails naming
// them; after the engine stores the same prompt again, the next restore is
// COMPLETE and byte-exact.
func TestReStoreHealsCorruptL2(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	c.mustSim("--scenario", "tp4dcp1", "--phase", "store")

	sc, err := enginesim.LookupScenario("tp4dcp1")
	if err != nil {
		t.Fatal(err)
	}
	plan, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		t.Fatal(err)
	}
	tier, err := transfer.OpenFileTier(c.l2D, nil)
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for ch := range 4 {
		paths = append(paths, tier.Path(dcp.Key{NS: plan.R.Namespace, Chunk: plan.Hashes[ch], Shard: 0, Group: 0}))
	}
	c.eventually(60*time.Second, "rank 0's MLA objects in L2", func() error {
		for _, p := range paths {
			if _, err := os.Stat(p); err != nil {
				return err
			}
		}
		return nil
	})
	for _, p := range paths {
		if err := os.Truncate(p, 300); err != nil {
			t.Fatal(err)
		}
	}
	res, out, err := c.sim("--scenario", "tp4dcp1", "--phase", "restore", "--expect-fail")
	if err != nil || res == nil || !res.OK || res.Verdict != wire.VerdictFailed || !equalInts(res.Failed, []int{0, 1, 2, 3}) {
		t.Fatalf("restore with four truncated objects: %+v %v\n%s", res, err, tail(out, 40))
	}

	c.mustSim("--scenario", "tp4dcp1", "--phase", "store") // the engine recomputed and stores again
	res = c.mustSim("--scenario", "tp4dcp1", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("restore after the re-store: %+v", res)
	}
	for _, r := range res.Ranks {
		if r.Placed != r.Items || r.Mismatch != 0 || r.Outside != 0 {
			t.Fatalf("rank %d: %+v", r.Rank, r)
		}
	}
}
