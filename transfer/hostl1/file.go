package hostl1

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/kvtier/kvtier/dcp"
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
//
// Squatting (issue 28.5). The directory usually lives in /dev/shm, where
// any local user may create a name first. Create makes a missing
// directory itself (0700), and never uses or changes one it did not make
// and that is not this uid's: a squatter's directory is refused with its
// owner and the remedy named (remove it, create it at boot before users
// can, or use a parent only this uid or root can write). A squat can stop
// a rankd from starting; it can never make one use the squatter's files.
// Once the directory is ours no one else can replace it: its parent must
// be this uid's or root's, and writable by others only with the sticky bit
// (/dev/shm's 1777), which keeps others from renaming or removing what is
// not theirs. In the private directory no one else can plant a segment
// file; one root planted is replaced by Create (rename) and refused by
// peers (checkSegFile).

func FileName(r wire.Rank) string { return r.Instance + "." + strconv.Itoa(r.TPRank) + ".l1" }

// owner names uid for an error: "uid 65534 (nobody)".
func owner(uid uint32) string {
	if u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10)); err == nil && u.Username != "" {
		return fmt.Sprintf("uid %d (%s)", uid, u.Username)
	}
	return fmt.Sprintf("uid %d", uid)
}

// prepareSegDir creates dir (0700) when it is missing and verifies the
// rules above for it and its parent.
func prepareSegDir(dir string) error {
	if err := checkSegParent(dir); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o700); err == nil {
		// Ours now: make the mode exact whatever the umask.
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("host L1 dir %s: %w: %w", dir, err, ErrConfig)
		}
	} else if !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("create host L1 dir %s (its parent must exist): %w: %w", dir, err, ErrConfig)
	}
	return checkSegDir(dir)
}

// checkSegParent verifies that no one but this uid and root can replace
// dir: its parent is theirs, and writable by others only if sticky.
func checkSegParent(dir string) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("host L1 dir %s: %w: %w", dir, err, ErrConfig)
	}
	parent := filepath.Dir(abs)
	fi, err := os.Stat(parent)
	if err != nil {
		return fmt.Errorf("host L1 dir %s: parent: %w: %w", dir, err, ErrConfig)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fmt.Errorf("host L1 dir %s: parent %s is not a directory: %w", dir, parent, ErrConfig)
	case !ok:
		return fmt.Errorf("host L1 dir %s: parent %s: no owner information: %w", dir, parent, ErrConfig)
	case int(st.Uid) != os.Geteuid() && st.Uid != 0:
		return fmt.Errorf("host L1 dir %s: parent %s is owned by %s, neither this process's uid %d nor root: that user could rename the directory and put another in its place: %w", dir, parent, owner(st.Uid), os.Geteuid(), ErrConfig)
	case fi.Mode().Perm()&0o022 != 0 && fi.Mode()&os.ModeSticky == 0:
		return fmt.Errorf("host L1 dir %s: parent %s has mode %04o, writable by others without the sticky bit: anyone could rename the directory and put another in its place (use a parent like /dev/shm, mode 1777, or one only this user can write): %w", dir, parent, fi.Mode().Perm(), ErrConfig)
	}
	return nil
}

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
		return fmt.Errorf("host L1 dir %s is owned by %s, not this process's uid %d: another user created it first, and rankd never uses or changes it: remove it (as root), then let rankd create it or create it at boot before users can (systemd-tmpfiles: d %s 0700 <user> - -), or give a directory under a parent only this user or root can write: %w", dir, owner(st.Uid), os.Geteuid(), dir, ErrConfig)
	case fi.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("host L1 dir %s has mode %04o; it must grant nothing to group or others (0700); others may have put files in it, so rankd does not change it: check its content, then chmod 700: %w", dir, fi.Mode().Perm(), ErrConfig)
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

// Collected is what Create found of earlier runs of its rank.
type Collected struct {
	// Replaced: the segment an earlier run left (a kill -9, or a crash)
	// was replaced; DeadHolder when no process held it any more, else its
	// holder was alive (another rankd of the same rank: a misconfiguration).
	Replaced, DeadHolder bool
	Temps                int // temporary files of dead creators removed
}

// lockFree reports whether no process holds a lock on f: it takes and
// gives back a lock of kind how (LOCK_SH or LOCK_EX) without waiting.
func lockFree(f *os.File, how int) (bool, error) {
	err := syscall.Flock(int(f.Fd()), how|syscall.LOCK_NB)
	switch {
	case err == nil:
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		return true, nil
	case errors.Is(err, syscall.EWOULDBLOCK):
		return false, nil
	}
	return false, err
}

// collectSegFiles removes the temporary files of r's segment whose
// creator died (no lock held on them) and reports whether r's segment
// file exists and whether its holder died. Only regular files of this uid
// are touched.
func collectSegFiles(dir string, r wire.Rank) (c Collected, exists bool) {
	final := filepath.Join(dir, FileName(r))
	tmps, _ := filepath.Glob(final + ".tmp-*") // the name has no pattern characters
	for _, p := range tmps {
		f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
		if err != nil {
			continue
		}
		if _, _, err := checkSegFile(f); err == nil {
			if free, err := lockFree(f, syscall.LOCK_EX); err == nil && free && os.Remove(p) == nil {
				c.Temps++
			}
		}
		f.Close()
	}
	f, err := os.OpenFile(final, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	if err != nil {
		return c, false
	}
	defer f.Close()
	if _, _, err := checkSegFile(f); err != nil {
		return c, true
	}
	free, err := lockFree(f, syscall.LOCK_EX)
	c.DeadHolder = err == nil && free
	return c, true
}

// Create creates and maps this rank's segment, replacing any left
// by an earlier run (a peer still mapping that one keeps its old pages and
// finds it closed, its holder dead, or its objects gone; the old file's
// memory is freed when the last mapping goes) and removing the temporary
// files of earlier runs that died while creating theirs. The file stays
// open, flock'ed exclusive, until Close: the lock is how peers tell a
// live holder from a dead one.
func Create(dir string, r wire.Rank, geo Geometry, incarnation uint64) (*Segment, Collected, error) {
	if err := prepareSegDir(dir); err != nil {
		return nil, Collected{}, err
	}
	col, exists := collectSegFiles(dir, r)
	final := filepath.Join(dir, FileName(r))
	tmp := final + ".tmp-" + strconv.Itoa(os.Getpid())
	_ = os.Remove(tmp) // ours from a crashed run of this pid, if any
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, col, fmt.Errorf("create host L1 segment %s: %w", tmp, errors.Join(err, ErrIO))
	}
	fail := func(err error) (*Segment, Collected, error) {
		_ = os.Remove(tmp)
		f.Close()
		return nil, col, fmt.Errorf("create host L1 segment %s of %d B: %w", tmp, geo.Size(), errors.Join(err, ErrIO))
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return fail(fmt.Errorf("lock: %w", err))
	}
	if err := f.Truncate(int64(geo.Size())); err != nil {
		return fail(err)
	}
	all, err := syscall.Mmap(int(f.Fd()), 0, int(geo.Size()), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return fail(err)
	}
	s := &Segment{meta: all[:geo.dataOff], data: all[geo.dataOff:], whole: all, geo: geo, lock: f, dir: dir, rank: r}
	if _, s.ino, err = checkSegFile(f); err != nil {
		_ = syscall.Munmap(all)
		return fail(err)
	}
	s.initHeader(incarnation, os.Getpid())
	if err := os.Rename(tmp, final); err != nil {
		_ = syscall.Munmap(all)
		return fail(err)
	}
	col.Replaced = exists
	return s, col, nil
}

// Close marks the holder's segment (from Create) closed (peers drop
// their mappings), removes its file when it is still the one this run
// created, and unmaps it. The caller has stopped every use of the data.
func (s *Segment) Close() {
	s.markClosed()
	if Inode(s.dir, s.rank) == s.ino {
		_ = os.Remove(filepath.Join(s.dir, FileName(s.rank)))
	}
	_ = syscall.Munmap(s.whole)
	s.meta, s.data, s.whole = nil, nil, nil
	if s.lock != nil {
		_ = s.lock.Close() // the lock goes with the descriptor
		s.lock = nil
	}
}

// Peer is a peer's segment as this rank mapped it (OpenPeer): the reader's
// side, which finds and leases slots and never publishes.
type Peer struct {
	seg         *Segment
	ino         uint64
	incarnation uint64
	metaMap     []byte   // header and slots, read-write (leases)
	dataMap     []byte   // the slabs, read-only
	f           *os.File // open while mapped: tests the holder's lock
}

// HolderAlive reports whether the segment's holder still holds its lock:
// false once it died, even by kill -9 (the kernel dropped the lock), or
// when the lock cannot be tested.
func (p *Peer) HolderAlive() bool {
	free, err := lockFree(p.f, syscall.LOCK_SH)
	return err == nil && !free
}

// OpenPeer maps a peer's segment: its header and slots read-write
// (leases are written there), its data read-only.
func OpenPeer(dir string, r wire.Rank) (*Peer, error) {
	path := filepath.Join(dir, FileName(r))
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("open host L1 segment of %s: %w", r, errors.Join(err, ErrNotFound))
	}
	ok := false
	defer func() {
		if !ok {
			f.Close()
		}
	}()
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
	ok = true
	return &Peer{seg: &Segment{meta: meta, data: data, geo: geo}, ino: ino, incarnation: inc, metaMap: meta, dataMap: data, f: f}, nil
}

// Find is Segment.Find on the peer's catalog.
func (p *Peer) Find(k dcp.Key) (Slot, Miss) { return p.seg.Find(k) }

// Lease is Segment.Lease on the peer's catalog.
func (p *Peer) Lease(v Slot, now int64) bool { return p.seg.Lease(v, now) }

// Unlease is Segment.Unlease on the peer's catalog.
func (p *Peer) Unlease(v Slot) { p.seg.Unlease(v) }

// Closed reports whether the holder closed the segment (it is gone).
func (p *Peer) Closed() bool { return p.seg.Closed() }

// Data is the peer's data region, mapped read-only.
func (p *Peer) Data() []byte { return p.dataMap }

// Inode is the inode of the file mapped (Inode tells whether it was
// replaced since).
func (p *Peer) Inode() uint64 { return p.ino }

// Incarnation is the holder's incarnation, from the segment's header.
func (p *Peer) Incarnation() uint64 { return p.incarnation }

// Unmap drops the peer's mappings and closes its file.
func (p *Peer) Unmap() {
	_ = syscall.Munmap(p.metaMap)
	_ = syscall.Munmap(p.dataMap)
	_ = p.f.Close()
}

// Inode returns the inode of the segment file of r now (0 if none), to
// see whether the peer restarted and replaced it.
func Inode(dir string, r wire.Rank) uint64 {
	fi, err := os.Lstat(filepath.Join(dir, FileName(r)))
	if err != nil {
		return 0
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}
