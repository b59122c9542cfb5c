package cuda_test

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvtier/kvtier/cuda"
)

// TestHostImportFileSafety (C9, issue 10.4): an import opens its file
// without following symlinks and accepts only a regular file of this uid
// that grants nothing to group or others; the directory itself must be
// private. A local user who can write the shared directory must not make
// rankd map another file.
func TestHostImportFileSafety(t *testing.T) {
	dir := privDir(t)
	dev := openHostIn(t, dir)
	defer dev.Close()
	m := must(dev.Alloc(4096))(t)
	good := must(dev.ExportMem(m, 0, 4096))(t)
	e := must(dev.NewEvent(true))(t)
	goodEv := must(dev.ExportEvent(e))(t)

	// A victim file outside the directory, of the right size.
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, make([]byte, 1<<16), 0o600); err != nil {
		t.Fatal(err)
	}
	n := 0
	name := func(event bool) string {
		n++
		s := fmt.Sprintf("kvtier-%d-%016x", os.Getpid(), 0xfeed0000+n)
		if event {
			s += ".event"
		}
		return s
	}
	plant := func(t *testing.T, event bool, mk func(path string) error) string {
		t.Helper()
		nm := name(event)
		if err := mk(filepath.Join(dir, nm)); err != nil {
			t.Fatal(err)
		}
		return nm
	}
	file := func(mode os.FileMode) func(string) error {
		return func(p string) error {
			if err := os.WriteFile(p, make([]byte, 1<<16), 0o600); err != nil {
				return err
			}
			return os.Chmod(p, mode)
		}
	}
	cases := []struct {
		name string
		mk   func(string) error
	}{
		{"symlink to a file elsewhere", func(p string) error { return os.Symlink(victim, p) }},
		{"symlink to a live allocation", func(p string) error { return os.Symlink(filepath.Join(dir, string(good.Raw)), p) }},
		{"file open to others (0644)", file(0o644)},
		{"file open to the group (0660)", file(0o660)},
		{"FIFO", func(p string) error { return syscall.Mkfifo(p, 0o600) }},
		{"directory", func(p string) error { return os.Mkdir(p, 0o700) }},
	}
	if os.Geteuid() == 0 {
		cases = append(cases, struct {
			name string
			mk   func(string) error
		}{"file of another user", func(p string) error {
			if err := file(0o600)(p); err != nil {
				return err
			}
			return os.Chown(p, 65534, 65534)
		}})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := good
			h.Raw = []byte(plant(t, false, c.mk))
			_, err := dev.ImportMem(h)
			wantErr(t, "ImportMem of a "+c.name, err, cuda.ErrBadHandle)
			eh := goodEv
			eh.Raw = []byte(plant(t, true, c.mk))
			_, err = dev.ImportEvent(eh)
			wantErr(t, "ImportEvent of a "+c.name, err, cuda.ErrBadHandle)
		})
	}
	// The genuine handles still import.
	must(dev.ImportMem(good))(t)
	must(dev.ImportEvent(goodEv))(t)
}

// TestHostDirMustBePrivate: a shared (group/world-accessible) directory,
// a symlinked one or one of another owner is refused at OpenHost.
func TestHostDirMustBePrivate(t *testing.T) {
	open := t.TempDir()
	if err := os.Chmod(open, 0o1777); err != nil {
		t.Fatal(err)
	}
	group := t.TempDir()
	if err := os.Chmod(group, 0o750); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	dirs := map[string]string{"world-writable like /dev/shm": open, "group-readable": group, "symlink": link}
	if os.Geteuid() == 0 {
		foreign := t.TempDir()
		if err := os.Chown(foreign, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		dirs["owned by another user"] = foreign
	}
	for what, d := range dirs {
		_, err := cuda.OpenHost(cuda.HostConfig{Dir: d})
		wantErr(t, "OpenHost in a "+what+" directory", err, cuda.ErrBadSpec)
	}
}
