// Package durable makes file-system names durable: a directory created or
// a file renamed is on disk only once the directory holding its name is
// fsynced (os.MkdirAll and os.Rename sync nothing). The power-cut tests
// (internal/powercut) show what is lost without it.
package durable

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// SyncDir fsyncs the directory dir, making the names in it durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open dir %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	return nil
}

// MkdirAll is os.MkdirAll whose new directories survive a power cut: the
// parent of each directory it created is fsynced, innermost last.
func MkdirAll(dir string, perm os.FileMode) error {
	dir = filepath.Clean(dir)
	var made []string // missing before, innermost first
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) || filepath.Dir(d) == d {
			break
		}
		made = append(made, d)
	}
	if err := os.MkdirAll(dir, perm); err != nil {
		return err
	}
	for i := len(made) - 1; i >= 0; i-- {
		if err := SyncDir(filepath.Dir(made[i])); err != nil {
			return err
		}
	}
	return nil
}
