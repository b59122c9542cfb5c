package cuda

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
)

// hostMem is device memory of the host backend: a shared mapping of a file
// in HostConfig.Dir, either an allocation of this process or an imported
// view of one.
type hostMem struct {
	dev      *hostDevice
	name     string // file name: the identity of the base allocation
	path     string // set for allocations: removed on Release
	off      uint64 // start of this view in the file
	size     uint64
	data     []byte // exactly the view; valid while mapped
	mapping  []byte // the whole mapping, for munmap
	imported bool

	mu       sync.Mutex // guards the following
	released bool
	refs     int // operations in flight that use data
}

func (m *hostMem) Size() uint64 { return m.size }

// acquire takes a reference that keeps data mapped until unref, or fails for
// a released Mem.
func (m *hostMem) acquire() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.released {
		return fmt.Errorf("%w: %s of %d B at offset %d", ErrReleased, m.describe(), m.size, m.off)
	}
	m.refs++
	return nil
}

func (m *hostMem) describe() string {
	if m.imported {
		return "imported view of " + m.name
	}
	return "allocation " + m.name
}

// unref drops a reference; the last one after Release unmaps.
func (m *hostMem) unref() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.refs--
	if m.refs == 0 && m.released {
		m.unmapLocked()
	}
}

func (m *hostMem) unmapLocked() {
	if m.mapping != nil {
		// An munmap error leaves the mapping in place; nothing refers to it.
		_ = syscall.Munmap(m.mapping)
		m.mapping, m.data = nil, nil
	}
}

// Release frees an allocation (its file is removed at once, so later
// imports fail; processes that imported it keep their views) or closes an
// imported view. Operations already enqueued that use m still complete:
// the mapping goes away when the last of them has finished.
func (m *hostMem) Release() error {
	m.mu.Lock()
	if m.released {
		m.mu.Unlock()
		return nil
	}
	m.released = true
	var err error
	if m.path != "" {
		if rerr := os.Remove(m.path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			err = fmt.Errorf("cuda: host: free %s: %w", m.name, rerr)
		}
	}
	if m.refs == 0 {
		m.unmapLocked()
	}
	m.mu.Unlock()
	m.dev.res.remove(m)
	return err
}
