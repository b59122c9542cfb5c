package transfer

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer/tier"
	"github.com/kvtier/kvtier/wire"
)

func safetyObj(i int) (L2Object, []byte) {
	key := dcp.Key{NS: dcp.Namespace{7}, Chunk: chunkHash(i)}
	p := testutil.RandomBytes(4096, uint64(i))
	return L2Object{Key: key, Writer: wire.Rank{Instance: "test", TPRank: 0}, Size: uint64(len(p)), Sum: checksum.Sum(p), Created: time.Unix(1, 0)}, p
}

func perm(t *testing.T, path string) os.FileMode {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode().Perm()
}

// TestL2FileModes (issue 10.4): directories the tier creates are 0700,
// objects 0600, whatever the umask.
func TestL2FileModes(t *testing.T) {
	root := filepath.Join(t.TempDir(), "l2")
	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	o, p := safetyObj(0)
	if err := ft.Put(testCtx(t), o, p); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{
		root:                                    0o700,
		filepath.Join(root, tier.QuarantineDir): 0o700,
		filepath.Dir(ft.Path(o.Key)):            0o700,
		ft.Path(o.Key):                          0o600,
	} {
		if got := perm(t, path); got != want {
			t.Errorf("%s has mode %#o, want %#o", path, got, want)
		}
	}
	if err := ft.Quarantine(testCtx(t), o.Key, "test"); err != nil {
		t.Fatal(err)
	}
	for _, q := range quarantined(t, root) {
		if got := perm(t, filepath.Join(root, tier.QuarantineDir, q)); got&0o077 != 0 {
			t.Errorf("quarantined %s has mode %#o, want nothing for group or others", q, got)
		}
	}
}

// TestL2RefusesUnsafeRoot: a root writable by group or others, owned by
// another uid, or a symlink is refused.
func TestL2RefusesUnsafeRoot(t *testing.T) {
	world := t.TempDir()
	if err := os.Chmod(world, 0o777); err != nil {
		t.Fatal(err)
	}
	group := t.TempDir()
	if err := os.Chmod(group, 0o770); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	roots := map[string]string{"world-writable": world, "group-writable": group, "symlink": link}
	if os.Geteuid() == 0 {
		foreign := t.TempDir()
		if err := os.Chown(foreign, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		roots["foreign"] = foreign
	}
	for what, root := range roots {
		if _, err := OpenFileTier(root, nil); !errors.Is(err, ErrUnsafe) {
			t.Errorf("OpenFileTier of a %s root: %v, want ErrUnsafe", what, err)
		}
	}
}

// TestL2SymlinkedNamespaceDirRefused: a namespace directory replaced by a
// symlink (to a directory of the attacker's choosing) is never written
// through, never read through, and skipped (counted) at the rescan.
func TestL2SymlinkedNamespaceDirRefused(t *testing.T) {
	root := t.TempDir()
	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	o, p := safetyObj(1)
	if err := ft.Put(testCtx(t), o, p); err != nil {
		t.Fatal(err)
	}
	// The attacker moves the real directory away and links it back.
	nsDir := filepath.Dir(ft.Path(o.Key))
	elsewhere := filepath.Join(t.TempDir(), "elsewhere")
	if err := os.Rename(nsDir, elsewhere); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(elsewhere, nsDir); err != nil {
		t.Fatal(err)
	}
	if _, err := ft.Get(testCtx(t), o.Key, o.Fingerprint, make([]byte, len(p))); err == nil {
		t.Fatal("Get read an object through a symlinked namespace directory")
	}
	if _, err := ft.Stat(testCtx(t), o.Key); err == nil {
		t.Fatal("Stat read an object through a symlinked namespace directory")
	}
	o2, p2 := safetyObj(2)
	if err := ft.Put(testCtx(t), o2, p2); !errors.Is(err, ErrUnsafe) {
		t.Fatalf("Put through a symlinked namespace directory: %v, want ErrUnsafe", err)
	}
	if ents, _ := os.ReadDir(elsewhere); len(ents) != 1 {
		t.Fatalf("the symlink's target holds %d entries, want only the original object", len(ents))
	}
	var skipped, found int
	if err := ft.Scan(testCtx(t), o.Writer, true, func(s ScanEntry) {
		if s.Skipped != "" {
			skipped++
		} else {
			found++
		}
	}); err != nil {
		t.Fatal(err)
	}
	if skipped != 1 || found != 0 {
		t.Fatalf("scan: %d skipped, %d found; want the symlinked directory skipped and nothing found", skipped, found)
	}
}

// TestL2ObjectSymlinkNotFollowed: an object file replaced by a symlink to
// a well-formed object elsewhere is not served; it is quarantined, and the
// target is left alone.
func TestL2ObjectSymlinkNotFollowed(t *testing.T) {
	root := t.TempDir()
	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	o, p := safetyObj(3)
	if err := ft.Put(testCtx(t), o, p); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(t.TempDir(), "planted.kvo")
	if err := os.Rename(ft.Path(o.Key), target); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, ft.Path(o.Key)); err != nil {
		t.Fatal(err)
	}
	_, err = ft.Get(testCtx(t), o.Key, o.Fingerprint, make([]byte, len(p)))
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Get of a symlinked object file: %v, want a refusal (ErrCorrupt)", err)
	}
	if _, err := os.Lstat(ft.Path(o.Key)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the symlink is still in place: %v", err)
	}
	if _, err := os.Stat(target); err != nil {
		t.Fatalf("the symlink's target was touched: %v", err)
	}
}

// TestL2RescanSkipsFIFO: a FIFO named like an object file (which would
// block a plain open forever) is skipped and counted at the rescan; the
// real objects beside it are found.
func TestL2RescanSkipsFIFO(t *testing.T) {
	root := t.TempDir()
	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	o, p := safetyObj(4)
	o.Writer = wire.Rank{Instance: "test", TPRank: 0}
	if err := ft.Put(testCtx(t), o, p); err != nil {
		t.Fatal(err)
	}
	fifo, _ := safetyObj(5)
	if err := syscall.Mkfifo(ft.Path(fifo.Key), 0o600); err != nil {
		t.Fatal(err)
	}
	dev := openDevice(t, "")
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = root
	done := make(chan *Engine, 1)
	go func() {
		e, err := New(cfg)
		if err != nil {
			t.Error(err)
		}
		done <- e
	}()
	var e *Engine
	select {
	case e = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("New hangs in the rescan of an L2 holding a FIFO")
	}
	if e == nil {
		return
	}
	defer closeEngine(t, e)
	if err := e.WaitRescan(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	st := e.Stats()
	if st.L2ScanSkipped != 1 || st.L2Objects != 1 {
		t.Fatalf("rescan: %d skipped, %d objects; want the FIFO skipped and the object found", st.L2ScanSkipped, st.L2Objects)
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l2_scan_skipped_total"); v != 1 {
		t.Fatalf("l2_scan_skipped_total = %v", v)
	}
}
