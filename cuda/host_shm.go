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
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
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
