package rankd

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/wire"
)

// TestStorageKeyRequired (issue 28.1, C12): a rank with L2 or L3 and no
// storage MAC key refuses to start unless insecure, and says how to make
// one; an unsafe key file (group-readable, symlink) is refused even
// insecure; a rank without durable tiers needs none. Seen red before the
// key existed: New started with an L2 directory and no key.
func TestStorageKeyRequired(t *testing.T) {
	creds := filepath.Join(t.TempDir(), "creds")
	if err := auth.Init(creds, []auth.Instance{{Name: "eng", TPSize: 1}}); err != nil {
		t.Fatal(err)
	}
	noKey := t.TempDir()
	readable := t.TempDir()
	if err := auth.InitStorageKey(readable); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(readable, auth.StorageKeyFile), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "storage.key")
	if err := os.Symlink(filepath.Join(creds, auth.StorageKeyFile), link); err != nil {
		t.Fatal(err)
	}
	base := func() Config {
		c := DefaultConfig(wire.Rank{Instance: "eng", TPRank: 0})
		c.TPSize, c.Join = 1, []string{"127.0.0.1:7946"}
		c.L2Dir, c.CredsDir = t.TempDir(), creds
		c.Logger = zaptest.NewLogger(t)
		return c
	}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		err  string // "" when a key (or none) is accepted
		key  bool
	}{
		{"creds dir with the key", func(*Config) {}, "", true},
		{"creds dir without the key", func(c *Config) { c.CredsDir = noKey }, "coordinator creds storage-key", false},
		{"L3 only, no key", func(c *Config) { c.CredsDir, c.L2Dir, c.L3.Endpoint = noKey, "", "127.0.0.1:9000" }, "no storage MAC key", false},
		{"explicit missing file", func(c *Config) { c.StorageKeyFile = filepath.Join(noKey, "nope") }, "no such file", false},
		{"group-readable key", func(c *Config) { c.CredsDir = readable }, "mode 0644", false},
		{"group-readable key, insecure", func(c *Config) { c.CredsDir, c.Insecure = readable, true }, "mode 0644", false},
		{"symlinked key", func(c *Config) { c.StorageKeyFile = link }, "symlinks are refused", false},
		{"insecure, no key", func(c *Config) { c.CredsDir, c.Insecure = "", true }, "", false},
		{"no durable tier, no key", func(c *Config) { c.CredsDir, c.L2Dir = noKey, "" }, "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base()
			tc.mod(&c)
			key, err := loadStorageKey(c, c.Logger)
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("%v; want an error naming %q", err, tc.err)
			case tc.err == "" && (len(key) == 32) != tc.key:
				t.Fatalf("key of %d B; want one: %v", len(key), tc.key)
			}
		})
	}
	// New refuses before opening anything, with ErrConfig.
	c := base()
	c.CredsDir = noKey
	if _, err := New(c); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "--insecure") {
		t.Fatalf("New without a storage key: %v, want ErrConfig naming --insecure", err)
	}
}
