package e2e

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestShareGroupMemberL2GoneFallsBackToL3 (issue 26, docs/sharing.md):
// engine0 and engine1 are one share group with --share-l3, TP4/DCP4 each
// on the host backend, on one L2 directory, with L3 on an S3 server in its
// own process (encrypted). engine0 stores a prompt, written to L2 and
// behind to its prefix of the bucket. With engine0's rankds down and every
// one of its L2 files deleted, engine1's restore is planned from engine0's
// L2 copies (the index still holds them, and a member's L2 copy beats its
// L3 copy); engine1's rankds, given --l3-shared-with engine0, find the
// files gone and read engine0's L3 copies instead: the prompt is restored
// COMPLETE and byte-exact, each rank confirming engine0's recorded sums.
// Seen red with the ranks falling back to their own instance's L3 prefix
// only (every item missing: verdict failed).
func TestShareGroupMemberL2GoneFallsBackToL3(t *testing.T) {
	c := newKV(t, 4)
	c.addInstanceCreds("engine1")
	endpoint, s3creds := c.startS3Node()
	l3 := []string{"--l3-endpoint", endpoint, "--l3-bucket", "kvtier", "--l3-prefix", "kv/",
		"--l3-credentials", s3creds, "--l3-insecure", "--l3-encrypt"}
	c.coordArgs = append(c.coordArgs, "--share-group", "chat=engine0,engine1", "--share-l3")
	c.rankArgs = append(append([]string{}, l3...), "--l2-shared-with", "engine1")
	c.startAll()
	const seed = "45"
	store := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", seed)
	per := store.Stored / c.tp
	c.eventually(60*time.Second, "engine0's L2 and L3 copies written and reported", func() error {
		for r := range c.tp {
			n, err := c.tierCounts(r)
			if err != nil {
				return err
			}
			if n[wire.L2] != per || n[wire.L3] != per {
				return fmt.Errorf("rank %d: %v placements, want %d in L2 and in L3", r, n, per)
			}
		}
		return c.agree()
	})
	c.stopRanks()

	// Every object file of the shared L2 directory deleted behind the
	// index's back: its placements stay (nothing of engine0 runs to see).
	removed := 0
	if err := filepath.WalkDir(c.l2D, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".kvo") {
			return err
		}
		removed++
		return os.Remove(path)
	}); err != nil {
		t.Fatal(err)
	}
	if removed != store.Stored {
		t.Fatalf("removed %d L2 files, want the %d engine0 stored", removed, store.Stored)
	}

	c.rankArgs = append(append([]string{}, l3...), "--l2-dir", c.l2D, "--l2-shared-with", "engine0", "--l3-shared-with", "engine0")
	b := startInstance(c, "engine1")
	res, out, err := c.sim("--scenario", "tp4dcp4", "--phase", "restore", "--seed", seed, "--instance", "engine1")
	if err != nil || res == nil || res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("engine1 restoring engine0's prompt with its L2 files gone: %v %+v\n%s", err, res, tail(out, 30))
	}
	exact(t, "engine1", res)
	t.Logf("engine1 restores engine0's prompt from its L3 copies:\n%s", tableOf(out))
	var fromL3 float64
	for r, p := range b {
		fromL3 += testutil.MetricSum(t, metricsOf(t, "engine1 rankd "+strconv.Itoa(r), p.output()), "kvtier_transfer_l3_shared_restored_objects_total")
	}
	if fromL3 != float64(store.Stored) {
		t.Fatalf("engine1's rankds read %v objects from engine0's L3, want the %d engine0 stored", fromL3, store.Stored)
	}
}
