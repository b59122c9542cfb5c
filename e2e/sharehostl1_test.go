package e2e

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestShareGroupHostL1 (issue 26.1): engine0 and engine1 are one share
// group on one host with host-shared L1 (coordinator --host-shared-l1
// --share-host-l1, every rankd on one --host-l1-dir), TP4/DCP4 each under
// write-back, so what engine0 stores stays in its L1 segments. engine1's
// rankds, given --host-l1-shared-with engine0, restore engine0's prompt
// COMPLETE and byte-exact straight from engine0's segments: every item a
// peer L1 read, no L2 read, nothing held in engine1's own L1. Seen red
// without --share-host-l1 (nothing planned: prefix 0) and with rankd not
// handing --host-l1-shared-with to the engine (every item missing).
func TestShareGroupHostL1(t *testing.T) {
	c := newKV(t, 4)
	c.addInstanceCreds("engine1")
	shm := filepath.Join(c.dir, "l1shm")
	if err := os.Mkdir(shm, 0o700); err != nil {
		t.Fatal(err)
	}
	c.coordArgs = append(c.coordArgs, "--host-shared-l1", "--share-group", "chat=engine0,engine1", "--share-host-l1")
	c.rankArgs = []string{"--l2-policy", "write-back", "--host-l1-dir", shm}
	c.startAll()
	const seed = "45"
	store := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", seed)

	c.rankArgs = []string{"--l2-policy", "write-back", "--host-l1-dir", shm, "--host-l1-shared-with", "engine0"}
	b := startInstance(c, "engine1")
	res, out, err := c.sim("--scenario", "tp4dcp4", "--phase", "restore", "--seed", seed, "--instance", "engine1")
	if err != nil || res == nil || res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("engine1 restoring engine0's prompt from its L1: %v %+v\n%s", err, res, tail(out, 30))
	}
	exact(t, "engine1", res)
	t.Logf("engine1 restores from engine0's L1 segments:\n%s", tableOf(out))
	var peer float64
	for r, p := range b {
		m := metricsOf(t, "engine1 rankd "+strconv.Itoa(r), p.output())
		peer += testutil.MetricSum(t, m, "kvtier_transfer_peer_l1_reads_total")
		if v := testutil.MetricSum(t, m, "kvtier_transfer_l2_reads_total"); v != 0 {
			t.Fatalf("engine1's rank %d read %v objects from L2", r, v)
		}
		if res.Ranks[r].Tier != "L1" {
			t.Fatalf("engine1's rank %d: %+v, want every item from L1", r, res.Ranks[r])
		}
	}
	if peer != float64(store.Stored) {
		t.Fatalf("engine1's rankds read %v objects from a peer's L1, want the %d engine0 stored", peer, store.Stored)
	}
	rep, err := admin[wire.AdminRanksReply](c, wire.AdminRanks, struct{}{})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range rep.Ranks {
		if k.Rank.Instance == "engine1" && k.L1Objects != 0 {
			t.Fatalf("engine1's rank %d holds %d L1 objects: the host holds each object once, in engine0's L1", k.Rank.TPRank, k.L1Objects)
		}
	}
}
