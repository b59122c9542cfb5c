package auth

import (
	"fmt"
	"os"
	"path/filepath"
)

// syncDir makes the names in dir durable: a file created or renamed there
// is on disk only once its directory is fsynced (a power cut after a
// rename that was not would bring the old file back, or none).
func syncDir(dir string) error {
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

// replaceFile renames tmp over path, durably.
func replaceFile(tmp, path string) error {
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(filepath.Dir(path))
}
