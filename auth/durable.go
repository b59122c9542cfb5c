package auth

import (
	"os"
	"path/filepath"

	"github.com/kvtier/kvtier/internal/durable"
)

// syncDir makes the names in dir durable: a file created or renamed there
// is on disk only once its directory is fsynced (a power cut after a
// rename that was not would bring the old file back, or none).
func syncDir(dir string) error { return durable.SyncDir(dir) }

// replaceFile renames tmp over path, durably.
func replaceFile(tmp, path string) error {
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(filepath.Dir(path))
}
