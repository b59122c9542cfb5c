package transfer

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/kvtier/kvtier/wire"
)

// Segment files (C9: files the daemons open are theirs). The directory
// must be a real directory (not a symlink) of this process's effective uid
// granting nothing to group or others; a segment file is created there
// under a temporary name (O_EXCL, O_NOFOLLOW, 0600) and renamed into
// place once its header is written, and a peer opens it with O_NOFOLLOW
// and accepts only a regular file of the same uid with a private mode.
// The file of rank r of instance i is "<i>.<r>.l1"; instances are
// [A-Za-z0-9_-], so the name is always one path element.

func segFileName(r wire.Rank) string { return r.Instance + "." + strconv.Itoa(r.TPRank) + ".l1" }

// checkSegDir verifies the directory rules above.
func checkSegDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("host L1 dir: %w: %w", err, ErrConfig)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case fi.Mode()&os.ModeSymlink != 0:
		return fmt.Errorf("host L1 dir %s is a symlink; give the directory itself: %w", dir, ErrConfig)
	case !fi.IsDir():
		return fmt.Errorf("host L1 dir %s is not a directory: %w", dir, ErrConfig)
	case !ok:
		return fmt.Errorf("host L1 dir %s: no owner information: %w", dir, ErrConfig)
	case int(st.Uid) != os.Geteuid():
		return fmt.Errorf("host L1 dir %s is owned by uid %d, this process runs as uid %d: %w", dir, st.Uid, os.Geteuid(), ErrConfig)
	case fi.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("host L1 dir %s has mode %#o; it must grant nothing to group or others (0700): %w", dir, fi.Mode().Perm(), ErrConfig)
	}
	return nil
}

// checkSegFile verifies that an open segment file is a regular file of
// this uid with a private mode.
func checkSegFile(f *os.File) (int64, uint64, error) {
	fi, err := f.Stat()
	if err != nil {
		return 0, 0, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.Mode().IsRegular():
		return 0, 0, fmt.Errorf("%s is not a regular file (%s): %w", f.Name(), fi.Mode().Type(), ErrCorrupt)
	case !ok || int(st.Uid) != os.Geteuid():
		return 0, 0, fmt.Errorf("%s is not owned by uid %d: %w", f.Name(), os.Geteuid(), ErrCorrupt)
	case fi.Mode().Perm()&0o077 != 0:
		return 0, 0, fmt.Errorf("%s has mode %#o, want no group or other bits: %w", f.Name(), fi.Mode().Perm(), ErrCorrupt)
	}
	return fi.Size(), st.Ino, nil
}

// createSegment creates and maps this rank's segment, replacing any left
// by an earlier run (a peer still mapping that one keeps its old pages and
// finds it closed or its objects gone).
func createSegment(dir string, r wire.Rank, geo segGeometry, incarnation uint64) (*segment, error) {
	if err := checkSegDir(dir); err != nil {
		return nil, err
	}
	final := filepath.Join(dir, segFileName(r))
	tmp := final + ".tmp-" + strconv.Itoa(os.Getpid())
	_ = os.Remove(tmp) // ours from a crashed run of this pid, if any
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create host L1 segment %s: %w", tmp, errors.Join(err, ErrIO))
	}
	defer f.Close()
	fail := func(err error) (*segment, error) {
		_ = os.Remove(tmp)
		return nil, fmt.Errorf("create host L1 segment %s of %d B: %w", tmp, geo.size(), errors.Join(err, ErrIO))
	}
	if err := f.Truncate(int64(geo.size())); err != nil {
		return fail(err)
	}
	all, err := syscall.Mmap(int(f.Fd()), 0, int(geo.size()), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return fail(err)
	}
	s := &segment{meta: all[:geo.dataOff], data: all[geo.dataOff:], whole: all, geo: geo}
	if _, s.ino, err = checkSegFile(f); err != nil {
		_ = syscall.Munmap(all)
		return fail(err)
	}
	s.initHeader(incarnation, os.Getpid())
	if err := os.Rename(tmp, final); err != nil {
		_ = syscall.Munmap(all)
		return fail(err)
	}
	return s, nil
}

// closeOwn marks the holder's segment closed (peers drop their
// mappings), removes its file when it is still the one this run created,
// and unmaps it. The caller has stopped every use of the data.
func (s *segment) closeOwn(dir string, r wire.Rank) {
	s.markClosed()
	if segInode(dir, r) == s.ino {
		_ = os.Remove(filepath.Join(dir, segFileName(r)))
	}
	_ = syscall.Munmap(s.whole)
	s.meta, s.data, s.whole = nil, nil, nil
}

// peerSeg is a peer's segment as this rank mapped it.
type peerSeg struct {
	seg         *segment
	ino         uint64
	incarnation uint64
	metaMap     []byte // header and slots, read-write (leases)
	dataMap     []byte // the slabs, read-only
}

// openPeerSegment maps a peer's segment: its header and slots read-write
// (leases are written there), its data read-only.
func openPeerSegment(dir string, r wire.Rank) (*peerSeg, error) {
	path := filepath.Join(dir, segFileName(r))
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("open host L1 segment of %s: %w", r, errors.Join(err, ErrNotFound))
	}
	defer f.Close()
	size, ino, err := checkSegFile(f)
	if err != nil {
		return nil, fmt.Errorf("open host L1 segment of %s: %w", r, err)
	}
	if size < segHeaderBytes {
		return nil, fmt.Errorf("host L1 segment %s of %d B, smaller than its header: %w", path, size, ErrCorrupt)
	}
	hdr := make([]byte, segHeaderBytes)
	if _, err := f.ReadAt(hdr, 0); err != nil {
		return nil, fmt.Errorf("read host L1 segment header %s: %w", path, errors.Join(err, ErrIO))
	}
	geo, inc, err := parseSegHeader(hdr, uint64(size))
	if err != nil {
		return nil, fmt.Errorf("host L1 segment %s: %w", path, err)
	}
	meta, err := syscall.Mmap(int(f.Fd()), 0, int(geo.dataOff), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map host L1 segment %s: %w", path, errors.Join(err, ErrIO))
	}
	data, err := syscall.Mmap(int(f.Fd()), int64(geo.dataOff), int(geo.slabs*geo.slabBytes), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		_ = syscall.Munmap(meta)
		return nil, fmt.Errorf("map host L1 segment data %s: %w", path, errors.Join(err, ErrIO))
	}
	return &peerSeg{seg: &segment{meta: meta, data: data, geo: geo}, ino: ino, incarnation: inc, metaMap: meta, dataMap: data}, nil
}

func (p *peerSeg) unmap() {
	_ = syscall.Munmap(p.metaMap)
	_ = syscall.Munmap(p.dataMap)
}

// segInode returns the inode of the segment file of r now (0 if none), to
// see whether the peer restarted and replaced it.
func segInode(dir string, r wire.Rank) uint64 {
	fi, err := os.Lstat(filepath.Join(dir, segFileName(r)))
	if err != nil {
		return 0
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}
