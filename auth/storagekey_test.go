package auth_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/auth"
)

// TestStorageKey (issue 28.1, C12): Init writes a private 32-byte storage
// MAC key; InitStorageKey adds one to a directory made without it, leaving
// every other file as it was, and never overwrites one; LoadStorageKey
// refuses a group- or world-readable key, a symlink, a short key and
// anything but base64.
func TestStorageKey(t *testing.T) {
	dir := initDir(t)
	path := filepath.Join(dir, auth.StorageKeyFile)
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("storage key mode %v, %v; want 0600", st, err)
	}
	key, err := auth.LoadStorageKey(path)
	if err != nil || len(key) != 32 {
		t.Fatalf("LoadStorageKey = %d B, %v; want 32 B", len(key), err)
	}
	if err := auth.InitStorageKey(dir); !errors.Is(err, auth.ErrExists) {
		t.Fatalf("second InitStorageKey: %v, want ErrExists", err)
	}
	if again, err := auth.LoadStorageKey(path); err != nil || !bytes.Equal(again, key) {
		t.Fatalf("the key changed after a refused InitStorageKey: %v", err)
	}

	// A directory made before Init wrote storage keys: the key is added,
	// nothing else is touched.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, dir)
	if err := auth.InitStorageKey(dir); err != nil {
		t.Fatal(err)
	}
	after := snapshot(t, dir)
	delete(after, auth.StorageKeyFile)
	if len(after) != len(before) {
		t.Fatalf("InitStorageKey changed the directory's files: %d before, %d after", len(before), len(after))
	}
	for name, b := range before {
		if !bytes.Equal(after[name], b) {
			t.Fatalf("InitStorageKey changed %s", name)
		}
	}
	if k2, err := auth.LoadStorageKey(path); err != nil || bytes.Equal(k2, key) {
		t.Fatalf("added key: %v (same as the old one: %v)", err, bytes.Equal(k2, key))
	}

	for _, c := range []struct {
		name, want string
		prep       func(p string) error
	}{
		{"group-readable", "mode 0640", func(p string) error { return os.Chmod(p, 0o640) }},
		{"world-readable", "mode 0604", func(p string) error { return os.Chmod(p, 0o604) }},
		{"symlink", "symlinks are refused", func(p string) error {
			if err := os.Rename(p, p+".real"); err != nil {
				return err
			}
			return os.Symlink(p+".real", p)
		}},
		{"short", "holds 16 bytes", func(p string) error {
			return os.WriteFile(p, []byte("AAAAAAAAAAAAAAAAAAAAAA==\n"), 0o600)
		}},
		{"not base64", "not one base64 key", func(p string) error { return os.WriteFile(p, []byte("not a key!\n"), 0o600) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := t.TempDir()
			p := filepath.Join(d, auth.StorageKeyFile)
			if err := auth.InitStorageKey(d); err != nil {
				t.Fatal(err)
			}
			if err := c.prep(p); err != nil {
				t.Fatal(err)
			}
			if _, err := auth.LoadStorageKey(p); !errors.Is(err, auth.ErrCredsFile) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("LoadStorageKey: %v, want ErrCredsFile naming %q", err, c.want)
			}
		})
	}
}

// snapshot reads every regular file of dir.
func snapshot(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = b
	}
	return out
}
