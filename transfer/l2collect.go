package transfer

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
)

// CollectResult counts what one collection removed.
type CollectResult struct {
	Quarantined int    // quarantined files (and their .why notes)
	Temp        int    // temporary files of interrupted writes
	Orphans     int    // other regular files in namespace directories
	Bytes       uint64 // their sizes
}

// l2Collector is implemented by tiers that can collect their garbage
// (FileTier).
type l2Collector interface {
	Collect(ctx context.Context, before time.Time) (CollectResult, error)
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

	if qfd, err := t.openDir(rfd, quarantineDir, false); err == nil {
		ents, err := readDirFD(qfd, filepath.Join(t.root, quarantineDir))
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
				case strings.HasPrefix(name, tmpPrefix):
					remove(dfd, fe, &res.Temp)
				case strings.HasSuffix(name, fileExt):
					if key, err := dcp.ParseKey(strings.TrimSuffix(name, fileExt)); err == nil && key.NS == ns {
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

// collectL2 runs one collection of the tier's garbage older than
// L2CollectGrace, counted and logged.
func (e *Engine) collectL2() {
	c, ok := e.l2.(l2Collector)
	if !ok {
		return
	}
	res, err := c.Collect(e.life, e.cfg.Now().Add(-e.cfg.L2CollectGrace))
	e.ctr.l2CollectedQuarantine.Add(uint64(res.Quarantined))
	e.ctr.l2CollectedTemp.Add(uint64(res.Temp))
	e.ctr.l2CollectedOrphan.Add(uint64(res.Orphans))
	e.ctr.l2CollectedBytes.Add(res.Bytes)
	if err != nil && e.life.Err() == nil {
		e.log.Warn("L2 collection failed", zap.Error(err))
	}
	if n := res.Quarantined + res.Temp + res.Orphans; n > 0 {
		e.log.Info("L2 collected old files", zap.Int("quarantined", res.Quarantined), zap.Int("temp", res.Temp),
			zap.Int("orphans", res.Orphans), zap.Uint64("bytes", res.Bytes), zap.Duration("grace", e.cfg.L2CollectGrace))
	}
}

// collectLoop collects L2's garbage at start-up and every L2CollectEvery.
func (e *Engine) collectLoop() {
	e.collectL2()
	t := time.NewTicker(e.cfg.L2CollectEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			e.collectL2()
		case <-e.life.Done():
			return
		}
	}
}
