package transfer

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer/tier"
)

// TestL2CollectsOldGarbage (issue 15.2): at start-up the engine removes,
// beneath its L2 root, quarantined files, temporary files and orphans
// older than L2CollectGrace, counted by kind; younger ones, objects (of
// any writer) and the root's own files stay.
func TestL2CollectsOldGarbage(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = root
	e := newEngine(t, cfg)
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e, r, "s", c)
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	obj := e.L2().(*FileTier).Path(keyOf(r, c, 0))
	closeEngine(t, e)

	nsDir := filepath.Dir(obj)
	old := time.Now().Add(-48 * time.Hour)
	write := func(p string, n int, mtime time.Time) {
		if err := os.WriteFile(p, make([]byte, n), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	gone := map[string]int{
		filepath.Join(root, tier.QuarantineDir, "x.kvo.1.ab"):     100,
		filepath.Join(root, tier.QuarantineDir, "x.kvo.1.ab.why"): 10,
		filepath.Join(nsDir, tier.TmpPrefix+"k.other-3.abcdef"):   1000,
		filepath.Join(nsDir, "stray.txt"):                         7,
		filepath.Join(nsDir, "not-a-key.kvo"):                     5,
	}
	kept := map[string]int{
		filepath.Join(root, tier.QuarantineDir, "y.kvo.2.cd"):  100, // young
		filepath.Join(nsDir, tier.TmpPrefix+"k.other-3.young"): 1000,
		filepath.Join(root, "operator-notes"):                  3, // the root's own files are left alone
	}
	var wantBytes uint64
	for p, n := range gone {
		write(p, n, old)
		wantBytes += uint64(n)
	}
	for p, n := range kept {
		write(p, n, time.Now())
	}
	if err := os.Chtimes(obj, old, old); err != nil { // an old object is not garbage
		t.Fatal(err)
	}

	e2 := newEngine(t, cfg)
	want := CollectResult{Quarantined: 2, Temp: 1, Orphans: 2, Bytes: wantBytes}
	deadline := time.Now().Add(20 * time.Second)
	for e2.Stats().L2Collected != want {
		if time.Now().After(deadline) {
			t.Fatalf("collected %+v, want %+v", e2.Stats().L2Collected, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
	for p := range gone {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Fatalf("%s not collected: %v", p, err)
		}
	}
	for p := range kept {
		if _, err := os.Lstat(p); err != nil {
			t.Fatalf("%s collected: %v", p, err)
		}
	}
	if _, err := os.Lstat(obj); err != nil {
		t.Fatalf("object collected: %v", err)
	}
	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_l2_collected_files_total", "kind", "orphan"); v != 2 {
		t.Fatalf("l2_collected_files_total{kind=orphan} = %v, want 2", v)
	}
	if e2.Stats().L2Objects != 1 {
		t.Fatalf("%d L2 objects after the restart, want 1", e2.Stats().L2Objects)
	}
}
