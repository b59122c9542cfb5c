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
	c.mustSim("--scenario", "tp4dcp4", "--chunks", "8", "--phase", "store") // the filed prompt: 8 chunks
	c.stopRanks()                                                           // SIGTERM
	for r := range c.tp {
		c.startRank(r)
	}
	res := c.mustSim("--scenario", "tp4dcp4", "--chunks", "8", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("restore after SIGTERM + restart under write-back: %+v", res)
	}
	for _, r := range res.Ranks {
		if r.Tier != "L2" || r.Placed != r.Items || r.Mismatch != 0 || r.Outside != 0 {
			t.Fatalf("rank %d: %+v (want everything from L2)", r.Rank, r)
		}
	}
}

// TestWriteBackSmallL1 (issue 18.1): rankds with a 64 MiB write-back L1.
// A 13-chunk TP4/DCP4 prompt (31 MiB per rank) stores and restores
// COMPLETE byte-exact, and so does a prompt larger than L1 (30 chunks),
// whose restore streams from L2.
func TestWriteBackSmallL1(t *testing.T) {
	c := newKV(t, 4)
	c.l1 = "64MiB"
	c.rankArgs = []string{"--l2-policy", "write-back"}
	c.startAll()
	for _, n := range []string{"13", "30"} {
		t.Run(n+"_chunks", func(t *testing.T) {
			res := c.mustSim("--scenario", "tp4dcp4", "--chunks", n, "--phase", "all")
			if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
				t.Fatalf("result %+v", res)
			}
			for _, r := range res.Ranks {
				if r.Placed != r.Items || r.Mismatch != 0 || r.Outside != 0 {
					t.Fatalf("rank %d: %+v", r.Rank, r)
				}
			}
		})
	}
}
