package e2e

import (
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestWriteBackSIGTERMRestart (issue 18.2): under write-back, SIGTERM the
// rankds after a store and start them again: every stored chunk restores
// from L2, COMPLETE and byte-exact (the shutdown flushed L1 to L2).
func TestWriteBackSIGTERMRestart(t *testing.T) {
	c := newKV(t, 4)
	c.rankArgs = []string{"--l2-policy", "write-back"}
	c.startAll()
	c.mustSim("--scenario", "tp4dcp4", "--phase", "store")
	c.stopRanks() // SIGTERM
	for r := range c.tp {
		c.startRank(r)
	}
	res := c.mustSim("--scenario", "tp4dcp4", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("restore after SIGTERM + restart under write-back: %+v", res)
	}
	for _, r := range res.Ranks {
		if r.Tier != "L2" || r.Placed != r.Items || r.Mismatch != 0 || r.Outside != 0 {
			t.Fatalf("rank %d: %+v (want everything from L2)", r.Rank, r)
		}
	}
}
