package cuda

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Shared files of the host backend. Every allocation and every interprocess
// event is one file in HostConfig.Dir named
//
//	kvtier-<pid>-<16 hex digits>          device memory (raw bytes, no header)
//	kvtier-<pid>-<16 hex digits>.event    interprocess event (eventWords)
//
// where pid is the creating process. The name is the IPC handle (MemHandle.Raw,
// EventHandle.Raw). A process that dies without releasing leaves its files
// behind; SweepStaleHost removes those whose pid no longer runs.
const (
	shmPrefix   = "kvtier-"
	eventSuffix = ".event"
	randHexLen  = 16
)

// File safety (C9). The directory must be private: a real directory (not
// a symlink), owned by this process's effective uid, with no group or
// other permission bits (0700), so no other local user can plant or swap
// a file in it. Imports open their file with O_NOFOLLOW and accept only a
// regular file owned by the same uid whose mode grants nothing to group or
// others; anything else is refused with ErrBadHandle.

// DefaultHostDir is the default HostConfig.Dir: a private directory under
// /dev/shm per effective uid, created 0700 by OpenHost when missing.
func DefaultHostDir() string { return "/dev/shm/kvtier-" + strconv.Itoa(os.Geteuid()) }

// checkPrivateDir verifies the rules above for dir.
func checkPrivateDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("%w: host Dir: %w", ErrBadSpec, err)
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		return fmt.Errorf("%w: host Dir %s is a symlink; give the directory itself", ErrBadSpec, dir)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%w: host Dir %s is not a directory", ErrBadSpec, dir)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("%w: host Dir %s: no owner information", ErrBadSpec, dir)
	}
	if uid := os.Geteuid(); int(st.Uid) != uid {
		return fmt.Errorf("%w: host Dir %s is owned by uid %d, this process runs as uid %d; it must be the process's own", ErrBadSpec, dir, st.Uid, uid)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return fmt.Errorf("%w: host Dir %s has mode %#o; it must grant nothing to group or others (0700), not be a shared directory such as bare /dev/shm", ErrBadSpec, dir, perm)
	}
	return nil
}

// ensureHostDir creates the default directory (0700) when it is missing.
func ensureHostDir(dir string) error {
	if dir != DefaultHostDir() {
		return nil
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("%w: create host Dir %s: %w", ErrBadSpec, dir, err)
	}
	return nil
}

// openShmFile opens the shared file name of dir for an import, without
// following a symlink, and checks that it is a regular file of this uid
// that grants nothing to group or others.
func openShmFile(dir, name, what string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("%w: %s %s is a symlink: refused", ErrBadHandle, what, name)
		}
		return nil, fmt.Errorf("%w: %s %s: %w", ErrBadHandle, what, name, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%w: %s %s: %w", ErrBadHandle, what, name, err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.Mode().IsRegular():
		err = fmt.Errorf("%w: %s %s is not a regular file (mode %s): refused", ErrBadHandle, what, name, fi.Mode())
	case !ok:
		err = fmt.Errorf("%w: %s %s: no owner information", ErrBadHandle, what, name)
	case int(st.Uid) != os.Geteuid():
		err = fmt.Errorf("%w: %s %s is owned by uid %d, not this process's uid %d: refused", ErrBadHandle, what, name, st.Uid, os.Geteuid())
	case fi.Mode().Perm()&0o077 != 0:
		err = fmt.Errorf("%w: %s %s has mode %#o, want no group or other bits (0600): refused", ErrBadHandle, what, name, fi.Mode().Perm())
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// newShmName returns a fresh file name for this process.
func newShmName(event bool) (string, error) {
	var b [randHexLen / 2]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("cuda: host: random name: %w", err)
	}
	name := shmPrefix + strconv.Itoa(os.Getpid()) + "-" + hex.EncodeToString(b[:])
	if event {
		name += eventSuffix
	}
	return name, nil
}

// parseShmName checks that name is a host-backend file name (never a path)
// and returns the pid of the process that created it.
func parseShmName(name string) (pid int, event bool, ok bool) {
	rest, found := strings.CutPrefix(name, shmPrefix)
	if !found {
		return 0, false, false
	}
	rest, event = strings.CutSuffix(rest, eventSuffix)
	pidStr, rnd, found := strings.Cut(rest, "-")
	if !found || len(rnd) != randHexLen || len(pidStr) == 0 || len(pidStr) > 10 {
		return 0, false, false
	}
	for _, c := range rnd {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return 0, false, false
		}
	}
	for _, c := range pidStr {
		if c < '0' || c > '9' {
			return 0, false, false
		}
	}
	pid, err := strconv.Atoi(pidStr)
	if err != nil || pid <= 0 {
		return 0, false, false
	}
	return pid, event, true
}

// processAlive reports whether a process with this pid runs. A recycled pid
// reads as alive: the sweep then keeps a stale file, never removes a live
// one.
func processAlive(pid int) bool {
	if pid == os.Getpid() {
		return true
	}
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	// A zombie (exited, not yet reaped by its parent) is dead too.
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	// The state follows the command name, which is in parentheses and may
	// itself contain them.
	if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
		return stat[i+2] != 'Z' && stat[i+2] != 'X'
	}
	return true
}

// SweepStaleHost removes the host backend's shared files (device memory and
// interprocess events) in dir whose creating process no longer runs: the
// leftovers of a crashed engine or rankd. Files of live processes and files
// that are not the host backend's are never touched. It returns the names it
// removed. Run it at startup of a long-lived process that owns dir (for
// /dev/shm, any kvtier process of the machine), before allocating.
func SweepStaleHost(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("cuda: sweep %s: %w", dir, err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue
		}
		pid, _, ok := parseShmName(e.Name())
		if !ok || processAlive(pid) {
			continue
		}
		if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
			if !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("cuda: sweep: %w", err))
			}
			continue
		}
		removed = append(removed, e.Name())
	}
	return removed, errors.Join(errs...)
}

// mapFile maps [off, off+size) of the open file f, shared and read-write.
// mmap needs a page-aligned offset, so it maps from the page below off and
// returns the whole mapping (for munmap) and the requested view in it.
func mapFile(f *os.File, off, size uint64) (mapping, view []byte, err error) {
	page := uint64(os.Getpagesize())
	start := off &^ (page - 1)
	length := off + size - start
	if size == 0 || length > uint64(maxInt) || start > uint64(maxInt) {
		return nil, nil, fmt.Errorf("%w: cannot map %d B at offset %d", ErrOutOfRange, size, off)
	}
	mapping, err = syscall.Mmap(int(f.Fd()), int64(start), int(length),
		syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("cuda: host: mmap %s (%d B at %d): %w", f.Name(), length, start, err)
	}
	return mapping, mapping[off-start : off-start+size : off-start+size], nil
}

const maxInt = int(^uint(0) >> 1)

// createShmFile creates name in dir, sized and (where the filesystem can)
// reserved, so that running out of space fails here and not as SIGBUS on a
// later store.
func createShmFile(dir, name string, size uint64) (*os.File, error) {
	if size > uint64(maxInt) {
		return nil, fmt.Errorf("%w: allocation of %d B exceeds the address space", ErrOutOfRange, size)
	}
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("cuda: host: create %s: %w", path, err)
	}
	fail := func(err error) (*os.File, error) {
		f.Close()
		os.Remove(path)
		return nil, err
	}
	if err := f.Truncate(int64(size)); err != nil {
		return fail(fmt.Errorf("cuda: host: size %s to %d B: %w", path, size, err))
	}
	if err := syscall.Fallocate(int(f.Fd()), 0, 0, int64(size)); err != nil &&
		!errors.Is(err, syscall.EOPNOTSUPP) && !errors.Is(err, syscall.ENOSYS) {
		return fail(fmt.Errorf("cuda: host: reserve %d B for %s: %w", size, path, err))
	}
	return f, nil
}
