package transfer

import (
	"os"
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
)

// TestL2RootRemovedHeals (issue 11.13): the L2 directory is removed under
// a running engine. Write-through stores still succeed on L1 but their
// result says they are not durable (and count it); once the directory is
// back, the tier recreates its namespace directory beneath it, the
// objects reach L2 and later stores are durable again.
func TestL2RootRemovedHeals(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = root
	e := newEngine(t, cfg)
	r.register(e)
	c0 := r.newChunk(0, r.consecutiveN(0))
	if res := storeAll(t, e, r, "a", c0); res.NotDurable != "" {
		t.Fatalf("store onto a healthy L2 says %q", res.NotDurable)
	}
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}

	if err := os.RemoveAll(root); err != nil {
		t.Fatal(err)
	}
	c1 := r.newChunk(1, r.consecutiveN(1))
	res := storeAll(t, e, r, "b", c1)
	if res.Objects[0].Status != Stored || res.NotDurable == "" || res.Wire().NotDurable == "" {
		t.Fatalf("write-through store with the L2 root gone: %+v, want stored and not durable", res)
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_stores_not_durable_total"); v != 1 {
		t.Fatalf("stores_not_durable_total = %v, want 1", v)
	}
	if err := e.Flush(testCtx(t)); err == nil {
		t.Fatal("Flush with the L2 root gone succeeded")
	}

	// The operator puts the directory back: the tier heals by itself.
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatalf("Flush once the L2 root is back: %v", err)
	}
	key := keyOf(r, c1, 0)
	if _, err := e.L2().Stat(testCtx(t), key); err != nil {
		t.Fatalf("the object stored while the root was gone is not in L2 after it came back: %v", err)
	}
	c2 := r.newChunk(2, r.consecutiveN(2))
	if res := storeAll(t, e, r, "c", c2); res.NotDurable != "" {
		t.Fatalf("store after the tier healed says %q", res.NotDurable)
	}
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.L2().Stat(testCtx(t), keyOf(r, c2, 0)); err != nil {
		t.Fatalf("a store after the heal did not reach L2: %v", err)
	}
}

// TestFileTierRecreatesNamespaceDir: Put recreates a namespace directory
// (and the quarantine one) removed with the whole root, once the root is
// back; the previous FileTier cached the directories and failed every
// write until restarted.
func TestFileTierRecreatesNamespaceDir(t *testing.T) {
	root := t.TempDir()
	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	o, p := safetyObj(10)
	if err := ft.Put(testCtx(t), o, p); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(root); err != nil {
		t.Fatal(err)
	}
	if err := ft.Put(testCtx(t), o, p); err == nil {
		t.Fatal("Put with the root gone succeeded")
	}
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := ft.Put(testCtx(t), o, p); err != nil {
		t.Fatalf("Put once the root is back: %v", err)
	}
	if err := ft.Quarantine(testCtx(t), o.Key, "test"); err != nil {
		t.Fatalf("Quarantine once the root is back: %v", err)
	}
}
