package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestFullL2FilesystemDegrades (issue 15.2): TP4/DCP4 with rank 1's L2 on
// a 2 MiB tmpfs. A long stream of stores fills it: every store still
// succeeds (to L1), rank 1 counts its failed L2 writes and degrades its
// L2, nothing hangs, the latest prompt restores COMPLETE (L1 service
// unaffected), and the index agrees with every rank's inventory.
func TestFullL2FilesystemDegrades(t *testing.T) {
	mnt := filepath.Join(t.TempDir(), "l2small")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", mnt).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a 2 MiB tmpfs (needs root): %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", mnt, err, out)
		}
	})
	c := newKV(t, 4)
	c.rankArgsFor = func(r int) []string {
		if r == 1 {
			// Under DCP4 rank 1 stores and reads only its own shards. No
			// free-space floor: this test fills the file system (ENOSPC).
			return []string{"--l2-dir", mnt, "--l2-free-floor", "0"}
		}
		return nil
	}
	c.startAll()
	const prompts = 6 // about 1.8 MB of rank 1 objects each: 5x the file system
	for seed := 1; seed <= prompts; seed++ {
		res := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", strconv.Itoa(seed))
		if res.Stored == 0 {
			t.Fatalf("prompt %d: nothing stored: %+v", seed, res)
		}
	}
	if v := testutil.MetricSum(t, c.rankMetrics(1), "kvtier_transfer_l2_write_errors_total"); v == 0 {
		t.Fatal("rank 1 counted no failed L2 write on a full file system")
	}
	if v := testutil.MetricSum(t, c.rankMetrics(1), "kvtier_transfer_store_failures_total"); v != 0 {
		t.Fatalf("rank 1: %v failed stores, want 0 (stores go to L1)", v)
	}
	// L1 keeps serving: the latest prompt restores on every rank.
	res := c.mustSim("--scenario", "tp4dcp4", "--phase", "restore", "--seed", strconv.Itoa(prompts))
	if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("restore with rank 1's L2 full: %+v", res)
	}
	for _, r := range res.Ranks {
		if r.Placed != r.Items || r.Mismatch != 0 {
			t.Fatalf("rank %d: %+v", r.Rank, r)
		}
	}
	c.eventually(60*time.Second, "index agrees with the inventories", c.agree)
}
