package durable_test

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/internal/durable"
	"github.com/kvtier/kvtier/internal/powercut"
)

// TestPowerCutMkdirAll: directories MkdirAll reported made are there
// after a power cut at any point (red with the parents' fsync removed:
// the new directories vanish).
func TestPowerCutMkdirAll(t *testing.T) {
	fs := powercut.Mount(t)
	mk := func(root string) string { return filepath.Join(root, "a", "b", "c") }
	start := fs.Ops()
	if err := durable.MkdirAll(mk(filepath.Join(fs.Dir(), "uncut")), 0o700); err != nil {
		t.Fatal(err)
	}
	total := fs.Ops() - start
	for cut := range total + 1 {
		dir := mk(filepath.Join(fs.Dir(), fmt.Sprintf("cut-%d", cut)))
		fs.CutAfter(cut)
		err := durable.MkdirAll(dir, 0o700)
		fs.Crash()
		if err != nil {
			continue
		}
		if st, err := os.Stat(dir); err != nil || !st.IsDir() {
			t.Fatalf("power cut after %d of %d mutations, MkdirAll acknowledged: %s: %v", cut, total, dir, err)
		}
	}
}

func TestMkdirAllExisting(t *testing.T) {
	dir := t.TempDir()
	if err := durable.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(dir, "file")
	if err := os.WriteFile(f, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := durable.MkdirAll(filepath.Join(f, "x"), 0o700); err == nil {
		t.Fatal("MkdirAll under a regular file succeeded")
	}
}
