package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestIndexLostRebuiltFromRanks (issue 29.2): the coordinator is killed
// (kill -9) and its data directory deleted (a lost disk); restarted on the
// empty directory it creates a new index (a new index id, gossiped) and
// asks every live rankd for its inventory, without --rebuild-index: within
// seconds the index agrees with every rank again and the stored prompt
// restores COMPLETE. Seen red before the fix: "ranks":0, no resync, the
// restore's plan covered 0 of the prompt's chunks until the deadline.
func TestIndexLostRebuiltFromRanks(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	c.mustSim("--scenario", "tp4dcp1", "--phase", "store")
	c.waitL2([]int64{16, 8, 8, 8})
	c.eventually(60*time.Second, "index agrees with the inventories", c.agree)
	before, err := c.placementsByKey()
	if err != nil {
		t.Fatal(err)
	}

	c.coord.kill()
	dir := filepath.Join(c.dir, "index")
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	c.startCoordinator()

	// Every prompt the ranks hold is restorable again within seconds.
	const within = 30 * time.Second
	var res string
	c.eventually(within, "the stored prompt restores COMPLETE from the rebuilt index", func() error {
		r, out, err := c.sim("--scenario", "tp4dcp1", "--phase", "restore")
		if err != nil || r == nil {
			return fmt.Errorf("enginesim restore: %v\n%s", err, tail(out, 5))
		}
		if r.Verdict != wire.VerdictComplete || r.Prefix != r.Chunks {
			return fmt.Errorf("restore: verdict %s, prefix %d of %d chunks", r.Verdict, r.Prefix, r.Chunks)
		}
		res = r.Verdict
		return nil
	})
	t.Logf("restorable again %v after the restart on an empty data directory (%s)", time.Since(t0).Round(time.Millisecond), res)
	// The restores put copies in other ranks' L1 since: the index agrees
	// with every rank's inventory as it is now.
	c.eventually(within, "the new index agrees with every inventory", c.agree)
	after, err := c.placementsByKey()
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Fatalf("%d objects after the rebuild, %d before the loss", len(after), len(before))
	}
	v, err := admin[wire.AdminVerifyReply](c, wire.AdminVerify, struct{}{})
	if err != nil || !v.OK {
		t.Fatalf("verify after the rebuild: %+v %v", v, err)
	}
	// Each rank was resynced once: the start-up request names the new
	// index (wire.HeaderIndex), so a rank it reached offers nothing when
	// gossip shows it the id (a rank it missed offers, and is resynced
	// then). Waited for past the rankds' watch tick and heartbeat (2 s).
	// Seen red without the header: 8 resyncs, each rank twice.
	time.Sleep(6 * time.Second)
	m := c.coordMetrics()
	if n := testutil.Metric(t, m, "kvtier_coord_resyncs_total", "outcome", "ok"); n != 4 {
		t.Fatalf("%v resyncs after the restart, want one per rank (4); offers that asked one: %v", n,
			testutil.Metric(t, m, "kvtier_coord_index_offers_total", "outcome", "resync"))
	}
}
