package rankd

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/auth"
)

// loadStorageKey reads the storage MAC key of cfg (C12): StorageKeyFile,
// or CredsDir/storage.key when that exists. Without a key a rank with an
// L2 directory or L3 is refused unless Insecure; an unsafe key file
// (symlink, group or other access, foreign owner) is refused always.
func loadStorageKey(cfg Config, log *zap.Logger) ([]byte, error) {
	path, explicit := cfg.StorageKeyFile, cfg.StorageKeyFile != ""
	if !explicit && cfg.CredsDir != "" {
		path = filepath.Join(cfg.CredsDir, auth.StorageKeyFile)
	}
	if path != "" {
		key, err := auth.LoadStorageKey(path)
		switch {
		case err == nil:
			return key, nil
		case explicit || !errors.Is(err, fs.ErrNotExist):
			return nil, fmt.Errorf("storage MAC key: %w", err)
		}
	}
	durable := cfg.L2Dir != "" || cfg.L3.Endpoint != ""
	switch {
	case !durable:
		return nil, nil // no L2 or L3: nothing is stored beside a header
	case cfg.Insecure:
		log.Warn("INSECURE: no storage MAC key; L2 and L3 headers are trusted as found: whoever can write the L2 directory or the bucket can make this rank announce other bytes with a matching sum after a restart (C12)")
		return nil, nil
	}
	where := "no --creds-dir"
	if path != "" {
		where = path + " does not exist"
	}
	return nil, fmt.Errorf("no storage MAC key (%s): without it the L2 rescan and the L3 scan would announce the checksum in each object's header, and whoever can write the L2 directory or the bucket could make a restore of other bytes COMPLETE (C12); add one with 'coordinator creds storage-key --dir <creds-dir>' and copy storage.key to every rankd, give --storage-key-file, or run --insecure (development only): %w", where, ErrConfig)
}
