package auth_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
)

// TestCredentialFilesFIFORefused (issue 28.5): a FIFO planted where a
// seed, key or users file is expected is refused at once. Opened without
// O_NONBLOCK, the open waited for a writer: a daemon hung at start.
func TestCredentialFilesFIFORefused(t *testing.T) {
	dir := t.TempDir()
	for name, load := range map[string]func(string) error{
		"seed":        func(p string) error { _, err := auth.LoadSeed(p); return err },
		"storage key": func(p string) error { _, err := auth.LoadStorageKey(p); return err },
		"gossip key":  func(p string) error { _, _, err := auth.LoadGossipKeys(p); return err },
		"users":       func(p string) error { _, err := auth.LoadUsers(p); return err },
	} {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-"))
		if err := syscall.Mkfifo(path, 0o600); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- load(path) }()
		select {
		case err := <-done:
			if !errors.Is(err, auth.ErrCredsFile) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "not a regular file") {
				t.Errorf("%s FIFO: %v; want ErrCredsFile naming %s, not a regular file", name, err, path)
			}
		case <-time.After(10 * time.Second):
			if w, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
				_ = w.Close() // let the blocked open return
			}
			<-done
			t.Errorf("loading a %s FIFO blocked on open", name)
		}
	}
}
