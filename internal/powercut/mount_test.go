package powercut

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// The same rules through a real mount and real system calls.

func writeSynced(t *testing.T, path string, data []byte, syncFile bool) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if syncFile {
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestMountSyncedSurvivesUnsyncedVanishes(t *testing.T) {
	fs := Mount(t)
	dir := fs.Dir()
	synced, unsynced, unnamed := filepath.Join(dir, "synced"), filepath.Join(dir, "unsynced"), filepath.Join(dir, "unnamed")
	writeSynced(t, synced, []byte("durable"), true)
	writeSynced(t, unsynced, []byte("lost bytes"), false)
	SyncDir(t, dir)
	writeSynced(t, unnamed, []byte("synced, but its name is not"), true)
	// An overwrite of the synced file that is never synced.
	f, err := os.OpenFile(synced, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("XX"), 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if b, _ := os.ReadFile(synced); string(b) != "XXrable" {
		t.Fatalf("reads before the crash see %q, want the unsynced %q", b, "XXrable")
	}
	fs.Crash()
	if b, err := os.ReadFile(synced); err != nil || string(b) != "durable" {
		t.Fatalf("synced file after crash: %q, %v; want %q", b, err, "durable")
	}
	if b, err := os.ReadFile(unsynced); err != nil || !bytes.Equal(b, make([]byte, len("lost bytes"))) {
		t.Fatalf("file named durably but never synced: %q, %v; want %d zeros", b, err, len("lost bytes"))
	}
	if _, err := os.Stat(unnamed); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("file whose name was never synced: %v; want it gone", err)
	}
}

func TestMountRenameWithoutDirSyncVanishes(t *testing.T) {
	fs := Mount(t)
	dir := filepath.Join(fs.Dir(), "d")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	SyncDir(t, fs.Dir())
	final := filepath.Join(dir, "obj")
	writeSynced(t, final, []byte("v1"), true)
	SyncDir(t, dir)
	writeSynced(t, final+".tmp", []byte("v2"), true)
	if err := os.Rename(final+".tmp", final); err != nil {
		t.Fatal(err)
	}
	fs.Crash()
	if b, err := os.ReadFile(final); err != nil || string(b) != "v1" {
		t.Fatalf("after a rename whose directory was not synced: %q, %v; want %q", b, err, "v1")
	}
	writeSynced(t, final+".tmp", []byte("v3"), true)
	if err := os.Rename(final+".tmp", final); err != nil {
		t.Fatal(err)
	}
	SyncDir(t, dir)
	fs.Crash()
	if b, err := os.ReadFile(final); err != nil || string(b) != "v3" {
		t.Fatalf("after a rename and directory fsync: %q, %v; want %q", b, err, "v3")
	}
	// A directory whose own name was never synced takes its files along.
	sub := filepath.Join(fs.Dir(), "new")
	if err := os.Mkdir(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	writeSynced(t, filepath.Join(sub, "f"), []byte("x"), true)
	SyncDir(t, sub)
	fs.Crash()
	if _, err := os.Stat(sub); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("directory whose name was never synced: %v; want it gone", err)
	}
}

func TestMountCutFailsWritesKeepsReads(t *testing.T) {
	fs := Mount(t)
	path := filepath.Join(fs.Dir(), "f")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write([]byte("before")); err != nil {
		t.Fatal(err)
	}
	fs.CutAfter(0)
	if _, err := f.WriteAt([]byte("after"), 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("write after the cut: %v, want EIO", err)
	}
	if err := f.Sync(); !errors.Is(err, syscall.EIO) {
		t.Fatalf("fsync after the cut: %v, want EIO", err)
	}
	if err := os.WriteFile(filepath.Join(fs.Dir(), "g"), nil, 0o600); !errors.Is(err, syscall.EIO) {
		t.Fatalf("create after the cut: %v, want EIO", err)
	}
	if !fs.IsCut() {
		t.Fatal("IsCut is false after the cut")
	}
	b := make([]byte, 6)
	if _, err := f.ReadAt(b, 0); err != nil || string(b) != "before" {
		t.Fatalf("read after the cut: %q, %v; want %q", b, err, "before")
	}
	fs.Crash() // f is still open on the old mount
	if _, err := f.WriteAt([]byte("x"), 0); err == nil {
		t.Fatal("a file open across the crash could still be written")
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("after the crash: %v; want f gone (its name was never synced)", err)
	}
	if err := os.WriteFile(filepath.Join(fs.Dir(), "g"), []byte("ok"), 0o600); err != nil {
		t.Fatalf("the remounted file system refuses a write: %v", err)
	}
}

func TestMountMmapReadsThroughThePageCache(t *testing.T) {
	fs := Mount(t)
	path := filepath.Join(fs.Dir(), "m")
	want := bytes.Repeat([]byte("0123456789abcdef"), 3*pageSize/16+7)
	writeSynced(t, path, want, false)
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem, err := syscall.Mmap(int(f.Fd()), 0, len(want), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		t.Fatalf("mmap on the power-cut mount: %v", err)
	}
	defer syscall.Munmap(mem)
	if !bytes.Equal(mem, want) {
		t.Fatal("mmap reads other bytes than were written")
	}
}

// TestMountBbolt: bbolt (mmap reads, pwrite, fdatasync) works on the
// mount, a committed transaction survives a crash at every point after
// its commit, and the same with NoSync is lost: the mount sees bbolt's
// missing fsync.
func TestMountBbolt(t *testing.T) {
	for _, noSync := range []bool{false, true} {
		fs := Mount(t)
		path := filepath.Join(fs.Dir(), "b.db")
		db, err := bolt.Open(path, 0o600, &bolt.Options{NoSync: noSync})
		if err != nil {
			t.Fatalf("bolt open on the mount: %v", err)
		}
		SyncDir(t, fs.Dir()) // bbolt does not sync the directory of a new file
		for i := range 50 {
			if err := db.Update(func(tx *bolt.Tx) error {
				b, err := tx.CreateBucketIfNotExists([]byte("b"))
				if err != nil {
					return err
				}
				return b.Put([]byte{byte(i)}, bytes.Repeat([]byte{byte(i)}, 3000))
			}); err != nil {
				t.Fatal(err)
			}
		}
		fs.Crash()
		_ = db.Close()
		db, err = bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
		if err != nil {
			if noSync {
				continue // lost, as it must be (the file is all zeros: not a bolt file)
			}
			t.Fatalf("reopen after crash: %v", err)
		}
		var n int
		_ = db.View(func(tx *bolt.Tx) error {
			if b := tx.Bucket([]byte("b")); b != nil {
				n = b.Stats().KeyN
			}
			return nil
		})
		db.Close()
		switch {
		case !noSync && n != 50:
			t.Fatalf("bbolt after crash holds %d of 50 committed keys", n)
		case noSync && n == 50:
			t.Fatal("bbolt with NoSync kept all 50 keys across the crash: the mount did not drop unsynced writes")
		}
	}
}
