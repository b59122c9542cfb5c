package cuda

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// eventWords is the state of a host event. For an interprocess event it
// lives at the start of the event's file and every process that opened the
// event maps it; only the owner writes it, importers poll it.
//
// Records are numbered 1, 2, ... at the time Record is called; a record
// resolves when its stream reaches it (completed) or fails before reaching
// it (abandoned). A wait captures the number of the most recent record when
// it is issued and is satisfied when every record up to that number has
// resolved and none of them was abandoned.
type eventWords struct {
	magic     atomic.Uint64
	recorded  atomic.Uint64 // number of the most recent Record; 0: never recorded
	completed atomic.Uint64 // every record <= completed has resolved
	poisoned  atomic.Uint64 // lowest abandoned record; 0: none
	destroyed atomic.Uint64 // 1 once the owner released the event
	owner     atomic.Uint64 // pid of the owner
}

const (
	eventMagic    = 0x31305456454b564b // "KVKEVT01" in little-endian bytes
	eventFileSize = 4096

	// Importers poll the shared words with exponential backoff between
	// these bounds; at the upper bound they also check that the owner
	// process still runs.
	eventPollMin = 20 * time.Microsecond
	eventPollMax = 2 * time.Millisecond
)

var eventIDs atomic.Uint64

// hostEvent is an event of the host backend: process-local, interprocess
// (owned by this process, exported through a file) or imported.
type hostEvent struct {
	dev      *hostDevice
	id       uint64
	name     string // file name of an interprocess event; "" for a local one
	path     string // owner of an interprocess event: removed on Release
	imported bool
	owner    int // pid of the process that created the event

	mu       sync.Mutex // guards the following
	released bool
	w        *eventWords     // nil after Release
	mapping  []byte          // mapping of the event file, if any
	resolved map[uint64]bool // owner: resolved records above w.completed
	changed  chan struct{}   // closed and replaced on every state change
}

func newHostEvent(d *hostDevice, interprocess bool) (*hostEvent, error) {
	e := &hostEvent{
		dev:      d,
		id:       eventIDs.Add(1),
		owner:    os.Getpid(),
		resolved: make(map[uint64]bool),
		changed:  make(chan struct{}),
	}
	if !interprocess {
		e.w = new(eventWords)
		e.w.owner.Store(uint64(e.owner))
		e.w.magic.Store(eventMagic)
		return e, nil
	}
	name, err := newShmName(true)
	if err != nil {
		return nil, err
	}
	f, err := createShmFile(d.cfg.Dir, name, eventFileSize)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	mapping, view, err := mapFile(f, 0, eventFileSize)
	if err != nil {
		os.Remove(f.Name())
		return nil, err
	}
	e.name, e.path, e.mapping = name, f.Name(), mapping
	e.w = (*eventWords)(unsafe.Pointer(&view[0]))
	e.w.owner.Store(uint64(e.owner))
	e.w.magic.Store(eventMagic)
	return e, nil
}

func importHostEvent(d *hostDevice, name string, pid int) (*hostEvent, error) {
	f, err := openShmFile(d.cfg.Dir, name, "event")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%w: event %s: %w", ErrBadHandle, name, err)
	}
	if fi.Size() < eventFileSize {
		return nil, fmt.Errorf("%w: event %s has %d B, want %d", ErrBadHandle, name, fi.Size(), eventFileSize)
	}
	mapping, view, err := mapFile(f, 0, eventFileSize)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadHandle, err)
	}
	w := (*eventWords)(unsafe.Pointer(&view[0]))
	switch {
	case w.magic.Load() != eventMagic:
		err = fmt.Errorf("%w: event %s: bad magic %#x", ErrBadHandle, name, w.magic.Load())
	case w.owner.Load() != uint64(pid):
		err = fmt.Errorf("%w: event %s names pid %d, file says %d", ErrBadHandle, name, pid, w.owner.Load())
	case w.destroyed.Load() != 0:
		err = fmt.Errorf("%w: event %s: %w by its owner (pid %d)", ErrBadHandle, name, ErrReleased, pid)
	}
	if err != nil {
		syscall.Munmap(mapping)
		return nil, err
	}
	return &hostEvent{
		dev:      d,
		id:       eventIDs.Add(1),
		name:     name,
		imported: true,
		owner:    pid,
		w:        w,
		mapping:  mapping,
		changed:  make(chan struct{}),
	}, nil
}

func (e *hostEvent) label() string {
	if e.name != "" {
		return e.name
	}
	return "#" + strconv.FormatUint(e.id, 10)
}

// stateErrLocked reports a released or destroyed event.
func (e *hostEvent) stateErrLocked() error {
	if e.released {
		return fmt.Errorf("%w: event %s was released by this process", ErrReleased, e.label())
	}
	if e.w.destroyed.Load() != 0 {
		return fmt.Errorf("%w: event %s was destroyed by its owner (pid %d)", ErrReleased, e.label(), e.owner)
	}
	return nil
}

func (e *hostEvent) checkLive() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stateErrLocked()
}

// capture returns the number of the most recent record: what a wait issued
// now must wait for.
func (e *hostEvent) capture() (uint64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.stateErrLocked(); err != nil {
		return 0, err
	}
	return e.w.recorded.Load(), nil
}

// record numbers a new record. The caller enqueues its resolution.
func (e *hostEvent) record() (uint64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.stateErrLocked(); err != nil {
		return 0, err
	}
	if e.imported {
		return 0, fmt.Errorf("%w: the host backend records only events created by this process (event %s is imported)", ErrBadHandle, e.label())
	}
	return e.w.recorded.Add(1), nil
}

// resolve marks record seq completed, or abandoned by a failed stream.
func (e *hostEvent) resolve(seq uint64, abandoned bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.released {
		return
	}
	if abandoned {
		if p := e.w.poisoned.Load(); p == 0 || seq < p {
			e.w.poisoned.Store(seq)
		}
	}
	e.resolved[seq] = true
	c := e.w.completed.Load()
	for e.resolved[c+1] {
		delete(e.resolved, c+1)
		c++
	}
	if e.name != "" {
		localEdge(e.name).Add(1) // before the store an importer polls
	}
	e.w.completed.Store(c)
	e.notifyLocked()
}

// localEdges mirrors, per interprocess event, each completion in memory of
// this process. An importer in the same process (tests import what they
// export) maps the event file a second time, and the race detector cannot
// see that atomics through the two mappings touch the same words, so it
// would miss the happens-before edge the event provides and report the
// data the event orders as racing. The owner bumps the local word before
// publishing a completion; an importer that sees the completion then loads
// the word, which gives the detector the edge. Across processes the words
// are separate and unused.
var localEdges sync.Map // event file name -> *atomic.Uint64

func localEdge(name string) *atomic.Uint64 {
	if v, ok := localEdges.Load(name); ok {
		return v.(*atomic.Uint64)
	}
	v, _ := localEdges.LoadOrStore(name, new(atomic.Uint64))
	return v.(*atomic.Uint64)
}

func (e *hostEvent) notifyLocked() {
	close(e.changed)
	e.changed = make(chan struct{})
}

// poll reports whether every record up to target has completed.
func (e *hostEvent) poll(target uint64) (done bool, changed <-chan struct{}, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.stateErrLocked(); err != nil {
		return false, nil, err
	}
	if e.w.completed.Load() < target {
		return false, e.changed, nil
	}
	if p := e.w.poisoned.Load(); p != 0 && p <= target {
		return false, nil, fmt.Errorf("%w: record %d of event %s was abandoned by its stream", ErrStreamFailed, p, e.label())
	}
	if e.imported {
		localEdge(e.name).Load() // see localEdges
	}
	return true, nil, nil
}

// wait blocks until every record up to target has completed, the event is
// released or destroyed (an error wrapping ErrReleased), or cancel is
// closed (cancelErr gives the error). An importer polls the shared state and
// treats an owner that exited without destroying the event as destroyed.
func (e *hostEvent) wait(target uint64, cancel <-chan struct{}, cancelErr func() error) error {
	backoff := eventPollMin
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		done, changed, err := e.poll(target)
		if err != nil || done {
			return err
		}
		if !e.imported {
			select {
			case <-changed:
			case <-cancel:
				return cancelErr()
			}
			continue
		}
		if timer == nil {
			timer = time.NewTimer(backoff)
		} else {
			timer.Reset(backoff)
		}
		select {
		case <-changed:
		case <-timer.C:
		case <-cancel:
			return cancelErr()
		}
		if backoff < eventPollMax {
			backoff = min(2*backoff, eventPollMax)
		} else if !processAlive(e.owner) {
			if done, _, err := e.poll(target); err != nil || done {
				return err
			}
			return fmt.Errorf("%w: owner (pid %d) of event %s exited without destroying it", ErrReleased, e.owner, e.label())
		}
	}
}

// Query reports whether the work captured by the most recent Record has
// completed.
func (e *hostEvent) Query() (bool, error) {
	target, err := e.capture()
	if err != nil {
		return false, err
	}
	done, _, err := e.poll(target)
	if err == nil && !done && e.imported && !processAlive(e.owner) {
		return false, fmt.Errorf("%w: owner (pid %d) of event %s exited without destroying it", ErrReleased, e.owner, e.label())
	}
	return done, err
}

// Synchronize blocks until the work captured by the most recent Record has
// completed, the event is released or destroyed, or ctx is done.
func (e *hostEvent) Synchronize(ctx context.Context) error {
	target, err := e.capture()
	if err != nil {
		return err
	}
	return e.wait(target, ctx.Done(), func() error {
		return fmt.Errorf("cuda: synchronize event %s: %w", e.label(), ctx.Err())
	})
}

// Release destroys an event this process created (importers then fail
// their waits with ErrReleased, and the file is removed) or closes an
// imported one. Waits still pending on it in this process fail.
func (e *hostEvent) Release() error {
	e.mu.Lock()
	if e.released {
		e.mu.Unlock()
		return nil
	}
	e.released = true
	var err error
	if !e.imported && e.mapping != nil {
		localEdges.Delete(e.name)
		e.w.destroyed.Store(1)
		if rerr := os.Remove(e.path); rerr != nil && !os.IsNotExist(rerr) {
			err = fmt.Errorf("cuda: host: destroy event %s: %w", e.name, rerr)
		}
	}
	if e.mapping != nil {
		_ = syscall.Munmap(e.mapping)
		e.mapping = nil
	}
	e.w = nil
	e.notifyLocked()
	e.mu.Unlock()
	e.dev.res.remove(e)
	return err
}
