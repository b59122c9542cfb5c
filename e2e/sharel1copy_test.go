package e2e

import (
	"fmt"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestShareGroupDedupKeepsL1Copy (issue 26.3's exception): engine0 and
// engine1 are one share group on one L2 directory; engine1's rankds run
// with --l2-shared-with engine0 --keep-shared-in-l1. engine1 storing the
// prompt engine0 stored gathers a local L1 copy of every object (counted
// in dedupe_shared_l1_total and dedupe_shared_total), announced in L1
// only: the L2 directory still holds engine0's files alone, one per
// object. With engine0's rankds down engine1 restores COMPLETE and
// byte-exact from its own L1, reading nothing from L2. Seen red with
// rankd not handing --keep-shared-in-l1 to the engine (0 stored: every
// object deduplicated with no copy).
func TestShareGroupDedupKeepsL1Copy(t *testing.T) {
	c := newKV(t, 4)
	c.addInstanceCreds("engine1")
	c.coordArgs = append(c.coordArgs, "--share-group", "chat=engine0,engine1")
	c.startAll()
	const seed = "44"
	store := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", seed)
	want := make([]int64, c.tp)
	for r := range want {
		want[r] = int64(store.Stored / c.tp)
	}
	c.waitL2(want)
	files := func() int {
		t.Helper()
		n := 0
		if err := filepath.WalkDir(c.l2D, func(path string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() && strings.HasSuffix(path, ".kvo") {
				n++
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := files(); n != store.Stored {
		t.Fatalf("%d L2 files after engine0's store, want %d", n, store.Stored)
	}

	c.rankArgs = []string{"--l2-dir", c.l2D, "--l2-shared-with", "engine0", "--keep-shared-in-l1"}
	b := startInstance(c, "engine1")
	dup := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", seed, "--instance", "engine1")
	if dup.Stored != store.Stored {
		t.Fatalf("engine1's store of engine0's prompt: %d stored, %d deduplicated; want %d stored (local L1 copies)", dup.Stored, dup.Deduped, store.Stored)
	}
	sum := func(metric string) float64 {
		t.Helper()
		var v float64
		for r, p := range b {
			v += testutil.MetricSum(t, metricsOf(t, "engine1 rankd "+strconv.Itoa(r), p.output()), metric)
		}
		return v
	}
	for _, m := range []string{"kvtier_transfer_dedupe_shared_total", "kvtier_transfer_dedupe_shared_l1_total"} {
		if v := sum(m); v != float64(store.Stored) {
			t.Fatalf("engine1's rankds: %s = %v, want %d", m, v, store.Stored)
		}
	}
	c.eventually(30*time.Second, "engine1's L1 copies in the index", func() error {
		rep, err := admin[wire.AdminRanksReply](c, wire.AdminRanks, struct{}{})
		if err != nil {
			return err
		}
		var l1, l2 int64
		for _, k := range rep.Ranks {
			if k.Rank.Instance == "engine1" {
				l1, l2 = l1+k.L1Objects, l2+k.L2Objects
			}
		}
		if l1 != int64(store.Stored) || l2 != 0 {
			return fmt.Errorf("engine1 holds %d L1 and %d L2 objects, want %d and 0", l1, l2, store.Stored)
		}
		return nil
	})
	if n := files(); n != store.Stored {
		t.Fatalf("%d L2 files after engine1's store, want engine0's %d only", n, store.Stored)
	}

	c.stopRanks()
	res, out, err := c.sim("--scenario", "tp4dcp4", "--phase", "restore", "--seed", seed, "--instance", "engine1")
	if err != nil || res == nil || res.Verdict != wire.VerdictComplete || res.Prefix != len(want) {
		t.Fatalf("engine1 restoring the prompt: %v %+v\n%s", err, res, tail(out, 30))
	}
	exact(t, "engine1", res)
	if v := sum("kvtier_transfer_l2_reads_total"); v != 0 {
		t.Fatalf("engine1's rankds read %v objects from L2, want none (their L1 holds every one)", v)
	}
}
