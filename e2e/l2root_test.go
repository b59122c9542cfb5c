package e2e

import (
	"os"
	"testing"

	"github.com/kvtier/kvtier/enginesim"
)

// TestL2RootRemovedUnderRankds (issue 11.13): the L2 directory is removed
// under running rankds (write-through) and a prompt is stored meanwhile;
// once the directory is back, without a restart, every rank's L2 holds
// every object it stored: the namespace directories are recreated and the
// failed writes retried.
func TestL2RootRemovedUnderRankds(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	sc, err := enginesim.LookupScenario("tp4dcp4")
	if err != nil {
		t.Fatal(err)
	}
	plan, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		t.Fatal(err)
	}
	want := func(chunks int) []int64 {
		out := make([]int64, c.tp)
		for r := range c.tp {
			for gi := range plan.R.Groups {
				if _, ok := plan.R.StoreShard(gi, r); ok {
					out[r] += int64(chunks)
				}
			}
		}
		return out
	}
	c.mustSim("--scenario", "tp4dcp4", "--phase", "store")
	c.waitL2(want(4))

	if err := os.RemoveAll(c.l2D); err != nil {
		t.Fatal(err)
	}
	c.mustSim("--scenario", "tp4dcp4", "--chunks", "6", "--phase", "store") // chunks 4 and 5 are new
	if err := os.Mkdir(c.l2D, 0o700); err != nil {
		t.Fatal(err)
	}
	c.waitL2(want(6)) // chunks 0..3 were lost with the directory; the rankds' inventories still list them
	for r := range c.tp {
		k, err := c.rankInfo(r)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("rank %d: %d L2 objects", r, k.L2Objects)
	}
}
