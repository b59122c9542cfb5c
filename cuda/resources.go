package cuda

import (
	"fmt"
	"sync"
)

// resourceSet is what a Device of either backend keeps for Close: whether
// it is closed, and the memory, host buffers, streams and events created
// through it that are still live. Creating one on a closed device fails.
type resourceSet struct {
	name string // the device in errors: "host device HOST-…", "CUDA device 0 (GPU-…)"

	mu     sync.Mutex // guards the following
	closed bool
	live   map[any]struct{}
}

func (r *resourceSet) errClosed() error {
	return fmt.Errorf("%w: %s is closed", ErrReleased, r.name)
}

// add tracks v for Close; it fails once the device is closed.
func (r *resourceSet) add(v any) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return r.errClosed()
	}
	if r.live == nil {
		r.live = make(map[any]struct{})
	}
	r.live[v] = struct{}{}
	return nil
}

// remove stops tracking v: it was released.
func (r *resourceSet) remove(v any) {
	r.mu.Lock()
	delete(r.live, v)
	r.mu.Unlock()
}

func (r *resourceSet) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// close marks the device closed. It reports false if it already was.
func (r *resourceSet) close() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.closed = true
	return true
}

// liveOf returns the tracked resources of type T.
func liveOf[T any](r *resourceSet) []T {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []T
	for v := range r.live {
		if t, ok := v.(T); ok {
			out = append(out, t)
		}
	}
	return out
}
