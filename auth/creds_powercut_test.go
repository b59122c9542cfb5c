package auth

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/internal/powercut"
)

// TestPowerCutCredentials (issue 29.6): credentials a command reported
// written survive a power cut. The credentials directory is on a powercut
// mount (only what was fsynced survives) and the power is cut at every
// mutation of an Init followed by a Rotate. After each cut: when Init
// returned, every identity's seed, the users file, the gossip key and the
// storage key load; when Rotate returned, the seed on disk is the new one
// and the users file names its public key (else the identity could not
// connect after a restart, or the old, rotated-out seed would work again).
// Then a storage key added alone to a directory without one (the upgrade
// path of 'coordinator creds storage-key', a lone new file) must survive
// once InitStorageKey returned.
func TestPowerCutCredentials(t *testing.T) {
	fs := powercut.Mount(t)
	in := []Instance{{Name: "pc", TPSize: 2}}
	const rotated = "engine-pc"
	run := func(name string, cut int64) (inited, rotatedOK bool, dir string, before []byte) {
		dir = filepath.Join(fs.Dir(), name)
		if cut >= 0 {
			fs.CutAfter(cut)
		}
		defer func() {
			if cut >= 0 {
				fs.Crash()
			}
		}()
		if err := Init(dir, in); err != nil {
			if cut < 0 {
				t.Fatalf("Init: %v", err)
			}
			return false, false, dir, nil
		}
		before, _ = os.ReadFile(filepath.Join(dir, rotated+SeedSuffix))
		if err := Rotate(dir, rotated); err != nil {
			if cut < 0 {
				t.Fatalf("Rotate: %v", err)
			}
			return true, false, dir, before
		}
		return true, true, dir, before
	}
	start := fs.Ops()
	run("uncut", -1)
	total := fs.Ops() - start
	if total < 10 {
		t.Fatalf("Init and Rotate made %d mutations; the mount saw none of them?", total)
	}
	for cut := range total + 1 {
		inited, rotatedOK, dir, before := run(fmt.Sprintf("cut-%d", cut), cut)
		at := fmt.Sprintf("power cut after %d of %d mutations", cut, total)
		if !inited {
			continue
		}
		u, err := LoadUsers(filepath.Join(dir, UsersFile))
		if err != nil {
			t.Fatalf("%s, Init acknowledged: users file: %v", at, err)
		}
		for _, id := range u.Users {
			if _, err := LoadSeed(filepath.Join(dir, id.Name+SeedSuffix)); err != nil {
				t.Fatalf("%s, Init acknowledged: seed of %s: %v", at, id.Name, err)
			}
		}
		if _, _, err := LoadGossipKeys(filepath.Join(dir, GossipKeyFile)); err != nil {
			t.Fatalf("%s, Init acknowledged: gossip key: %v", at, err)
		}
		if _, err := LoadStorageKey(filepath.Join(dir, StorageKeyFile)); err != nil {
			t.Fatalf("%s, Init acknowledged: storage key: %v", at, err)
		}
		if !rotatedOK {
			continue
		}
		seed, err := LoadSeed(filepath.Join(dir, rotated+SeedSuffix))
		if err != nil {
			t.Fatalf("%s, Rotate acknowledged: seed: %v", at, err)
		}
		now, _ := os.ReadFile(filepath.Join(dir, rotated+SeedSuffix))
		if bytes.Equal(now, before) {
			t.Fatalf("%s, Rotate acknowledged: the old seed of %s is back", at, rotated)
		}
		i := u.find(rotated)
		if i < 0 || u.Users[i].NKey != seed.PublicKey() {
			t.Fatalf("%s, Rotate acknowledged: the users file does not name the new seed's key", at)
		}
	}

	// The storage key alone.
	dir := filepath.Join(fs.Dir(), "upgrade")
	if err := Init(dir, in); err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, StorageKeyFile)
	if err := os.Remove(key); err != nil {
		t.Fatal(err)
	}
	if err := syncDir(dir); err != nil {
		t.Fatal(err)
	}
	start = fs.Ops()
	if err := InitStorageKey(dir); err != nil {
		t.Fatal(err)
	}
	total = fs.Ops() - start
	for cut := range total + 1 {
		if err := os.Remove(key); err != nil && !os.IsNotExist(err) { // absent after a cut before it was made
			t.Fatal(err)
		}
		if err := syncDir(dir); err != nil {
			t.Fatal(err)
		}
		fs.CutAfter(cut)
		err := InitStorageKey(dir)
		fs.Crash()
		if err != nil {
			continue
		}
		if _, err := LoadStorageKey(key); err != nil {
			t.Fatalf("power cut after %d of %d mutations, InitStorageKey acknowledged: %v", cut, total, err)
		}
	}
}
