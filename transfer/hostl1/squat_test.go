package hostl1

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestSegDirSquat (issue 28.5): a local user who creates the host L1
// directory before rankd never gets rankd to use it, and the refusal names
// the owner and what to do; rankd creates a missing directory itself
// (0700), and refuses a parent that would let others replace the
// directory once made. A segment file of another uid planted in the
// directory is replaced, never used.
func TestSegDirSquat(t *testing.T) {
	r0 := wire.Rank{Instance: "inst", TPRank: 0}
	geo := NewGeometry(4, 4096)
	refused := func(dir string, want ...string) {
		t.Helper()
		s, _, err := Create(dir, r0, geo, 1)
		if err == nil {
			s.Close()
			t.Fatalf("Create(%s) succeeded; want a refusal", dir)
		}
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), dir) {
			t.Fatalf("Create(%s): %v; want ErrConfig naming the directory", dir, err)
		}
		for _, w := range append(want, dir) {
			if !strings.Contains(err.Error(), w) {
				t.Fatalf("Create(%s): %q does not say %q", dir, err, w)
			}
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 0 {
			t.Fatalf("a refused %s got %d entries", dir, len(ents))
		}
	}
	ok := func(dir string) {
		t.Helper()
		s, _, err := Create(dir, r0, geo, 1)
		if err != nil {
			t.Fatalf("Create(%s): %v", dir, err)
		}
		fi, err := os.Lstat(dir)
		if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 || int(fi.Sys().(*syscall.Stat_t).Uid) != os.Geteuid() {
			t.Fatalf("%s after Create: %v, %v; want a 0700 directory of uid %d", dir, fi.Mode(), err, os.Geteuid())
		}
		s.Close()
	}
	mkdir := func(p string, mode os.FileMode) string {
		t.Helper()
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil { // past the umask; sticky bit too
			t.Fatal(err)
		}
		return p
	}

	// Missing: created 0700 under a private parent, and under a
	// world-writable sticky parent (/dev/shm's mode), where no one else can
	// rename or remove it once it exists.
	ok(filepath.Join(t.TempDir(), "l1"))
	sticky := mkdir(filepath.Join(t.TempDir(), "shm"), 0o777|os.ModeSticky)
	ok(filepath.Join(sticky, "l1"))

	// Ours but open to others: refused and left alone (others may have
	// put files in it; rankd does not chmod it silently).
	open := mkdir(filepath.Join(t.TempDir(), "l1"), 0o777)
	refused(open, "mode 0777", "chmod 700")
	if fi, _ := os.Stat(open); fi.Mode().Perm() != 0o777 {
		t.Fatalf("the refused directory's mode changed to %v", fi.Mode())
	}

	// A parent anyone may write without the sticky bit: anyone could
	// rename the directory away and put theirs in its place.
	loose := mkdir(filepath.Join(t.TempDir(), "loose"), 0o777)
	refused(mkdir(filepath.Join(loose, "l1"), 0o700), "parent", "writable by others")

	if os.Geteuid() != 0 {
		t.Log("not root: the foreign-owner cases need chown and are not run")
		return
	}
	// Squatted: another user made the directory first (0700 or 0777).
	for _, mode := range []os.FileMode{0o700, 0o777} {
		sq := mkdir(filepath.Join(sticky, "squat"+mode.String()[1:]), mode)
		if err := os.Chown(sq, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		refused(sq, "owned by uid 65534", "another user created it")
	}
	// A parent of another user: that user can rename our directory.
	theirs := mkdir(filepath.Join(t.TempDir(), "theirs"), 0o755)
	mine := mkdir(filepath.Join(theirs, "l1"), 0o700)
	if err := os.Chown(theirs, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	refused(mine, "parent", "owned by uid 65534")
	// A segment file another uid planted in our directory (only root could)
	// is replaced by ours, never opened as a peer's.
	good := mkdir(filepath.Join(t.TempDir(), "l1"), 0o700)
	planted := filepath.Join(good, FileName(r0))
	if err := os.WriteFile(planted, make([]byte, 8192), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(planted, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenPeer(good, r0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a planted segment of uid 65534 opened as a peer's: %v", err)
	}
	s, _, err := Create(good, r0, geo, 1)
	if err != nil {
		t.Fatalf("Create over a planted segment file: %v", err)
	}
	defer s.Close()
	p, err := OpenPeer(good, r0)
	if err != nil {
		t.Fatalf("our segment replaced the planted one: %v", err)
	}
	p.Unmap()
}
