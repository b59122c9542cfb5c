package tier

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/dcp"
)

// CollectResult counts what one collection removed.
type CollectResult struct {
	Quarantined int    // quarantined files (and their .why notes)
	Temp        int    // temporary files of interrupted writes
	Orphans     int    // other regular files in namespace directories
	Bytes       uint64 // their sizes
}

// Collect removes, beneath the tier's root, the files last modified before
// before: quarantined files, temporary files of writes (of any writer:
// one modified that long ago is an interrupted write) and orphans, regular
// files in namespace directories that are not named as objects of that
// namespace. Objects, the root's own files (rankd's incarnation record)
// and anything not a regular file are left alone. Files that vanish
// meanwhile (another rank collecting) are not counted.
func (t *FileTier) Collect(ctx context.Context, before time.Time) (CollectResult, error) {
	var res CollectResult
	rfd, err := t.openRoot()
	if err != nil {
		return res, fmt.Errorf("collect L2: %w", err)
	}
	defer syscall.Close(rfd)
	// The age comes from the listing's lstat; the removal goes through
	// the directory's descriptor, so a swapped directory is never entered.
	remove := func(dfd int, d fs.DirEntry, n *int) {
		info, err := d.Info()
		if err != nil || !info.Mode().IsRegular() || !info.ModTime().Before(before) {
			return
		}
		if err := syscall.Unlinkat(dfd, d.Name()); err == nil {
			*n++
			res.Bytes += uint64(info.Size())
		}
	}

	if qfd, err := t.openDir(rfd, QuarantineDir, false); err == nil {
		ents, err := readDirFD(qfd, filepath.Join(t.root, QuarantineDir))
		if err == nil {
			for _, d := range ents {
				if ctx.Err() != nil {
					break
				}
				if d.Type().IsRegular() {
					remove(qfd, d, &res.Quarantined)
				}
			}
		}
		syscall.Close(qfd)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return res, fmt.Errorf("collect L2 quarantine: %w", err)
	}

	nsDirs, err := readDirFD(rfd, t.root)
	if err != nil {
		return res, fmt.Errorf("collect L2 root %s: %w", t.root, errors.Join(err, ErrIO))
	}
	for _, d := range nsDirs {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		ns, err := dcp.ParseNamespace(d.Name())
		if err != nil || !d.IsDir() {
			continue
		}
		dfd, err := t.openDir(rfd, d.Name(), false)
		if err != nil {
			continue // vanished, or a symlink (the rescan reports it)
		}
		files, err := readDirFD(dfd, filepath.Join(t.root, d.Name()))
		if err == nil {
			for _, fe := range files {
				name := fe.Name()
				if !fe.Type().IsRegular() {
					continue
				}
				switch {
				case strings.HasPrefix(name, TmpPrefix):
					remove(dfd, fe, &res.Temp)
				case strings.HasSuffix(name, FileExt):
					if key, err := dcp.ParseKey(strings.TrimSuffix(name, FileExt)); err == nil && key.NS == ns {
						continue // an object: eviction and quarantine judge it
					}
					remove(dfd, fe, &res.Orphans)
				default:
					remove(dfd, fe, &res.Orphans)
				}
			}
		}
		syscall.Close(dfd)
	}
	return res, ctx.Err()
}
