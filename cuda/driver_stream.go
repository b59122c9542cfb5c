//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvtier/kvtier/checksum"
)

// driverStream is a Stream of the CUDA backend: a non-blocking CUstream,
// plus, for staged transfers, a second stream and a staging buffer.
type driverStream struct {
	d  *driverDevice
	h  C.CUstream
	id uint64

	mu       sync.Mutex // guards the following; held while enqueuing, so the driver sees work in call order
	closed   bool
	failed   error      // set: nothing more is enqueued
	inflight []*opState // operations not yet finished, in order
	holds    []hold     // event waits not yet passed, in order
	aux      C.CUstream // staged transfers: the kernel stream
	stage    uint64     // staged transfers: device staging buffer of 2*stageHalf bytes
	half     uint64

	poolMu sync.Mutex // guards pool
	pool   []C.CUevent

	// asyncErr is the first failure the device reported for an operation
	// (an *error); it fails the stream like failed.
	asyncErr atomic.Pointer[error]
}

// hold is a stream wait on e: e's reference is dropped once the stream has
// passed the wait, which tracker marks.
type hold struct {
	tracker C.CUevent
	e       *driverEvent
}

var driverStreamIDs atomic.Uint64

// defaultStageHalf is the size of each half of a stream's staging buffer:
// large enough that one copy-engine copy per half costs nothing measurable,
// small enough to be a rounding error of device memory.
const defaultStageHalf = 32 << 20

func (d *driverDevice) NewStream() (Stream, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	s := &driverStream{d: d, id: driverStreamIDs.Add(1)}
	if err := check("cuStreamCreate", C.kv_stream_create(d.ctx, &s.h)); err != nil {
		return nil, fmt.Errorf("cuda: NewStream: %w", err)
	}
	if err := d.res.add(s); err != nil {
		C.kv_stream_destroy(d.ctx, s.h)
		return nil, err
	}
	d.o.mu.Lock()
	d.o.streams[s] = struct{}{}
	d.o.mu.Unlock()
	return s, nil
}

// event returns an idle internal event (timing disabled).
func (s *driverStream) event() (C.CUevent, error) {
	s.poolMu.Lock()
	if n := len(s.pool); n > 0 {
		e := s.pool[n-1]
		s.pool = s.pool[:n-1]
		s.poolMu.Unlock()
		return e, nil
	}
	s.poolMu.Unlock()
	var e C.CUevent
	if err := check("cuEventCreate", C.kv_event_create(s.d.ctx, &e, C.KV_EVENT_DISABLE_TIMING)); err != nil {
		return nil, err
	}
	return e, nil
}

func (s *driverStream) recycle(evs ...C.CUevent) {
	s.poolMu.Lock()
	s.pool = append(s.pool, evs...)
	s.poolMu.Unlock()
}

// record records a fresh internal event on stream h.
func (s *driverStream) record(h C.CUstream) (C.CUevent, error) {
	e, err := s.event()
	if err != nil {
		return nil, err
	}
	if err := check("cuEventRecord", C.kv_event_record(s.d.ctx, e, h)); err != nil {
		s.recycle(e)
		return nil, err
	}
	return e, nil
}

// lockEnqueue takes the locks under which work is enqueued on s: the
// ordinal's enqueue lock shared (so drain never frees while another thread
// is putting work on the device) and then s.mu.
func (s *driverStream) lockEnqueue() {
	s.d.o.enq.RLock()
	s.mu.Lock()
}

func (s *driverStream) unlockEnqueue() {
	s.mu.Unlock()
	s.d.o.enq.RUnlock()
}

// refuseLocked reports why no work can be enqueued, if so.
func (s *driverStream) refuseLocked() error {
	if s.closed {
		return fmt.Errorf("%w: stream %d is closed", ErrReleased, s.id)
	}
	if s.failed == nil {
		if p := s.asyncErr.Load(); p != nil {
			s.failed = *p
		}
	}
	return s.failed
}

// failLocked marks the stream failed by err, a driver error while enqueuing.
func (s *driverStream) failLocked(what string, err error) error {
	if s.failed == nil {
		s.failed = fmt.Errorf("%w: stream %d: %s: %w", ErrStreamFailed, s.id, what, err)
	}
	return s.failed
}

// reapLocked finishes operations and event holds the device has passed.
func (s *driverStream) reapLocked() {
	for len(s.inflight) > 0 {
		if done, _ := s.inflight[0].poll(); !done {
			break
		}
		s.inflight[0] = nil
		s.inflight = s.inflight[1:]
	}
	for len(s.holds) > 0 {
		h := s.holds[0]
		if done, err := s.d.queryEvent(h.tracker, "event wait"); !done && err == nil {
			break
		}
		s.releaseHold(h)
		s.holds = s.holds[1:]
	}
}

func (s *driverStream) releaseHold(h hold) {
	h.e.life.unref()
	s.recycle(h.tracker)
}

// WaitEvent makes later work wait for e's most recent Record
// (cuStreamWaitEvent). The stream holds e until it has passed the wait, so a
// Release of e in the meantime never destroys the driver event under it.
// Waiting on a released event fails the stream.
func (s *driverStream) WaitEvent(e Event) error {
	de, err := s.d.asEvent(e, "WaitEvent")
	if err != nil {
		return err
	}
	s.lockEnqueue()
	defer s.unlockEnqueue()
	if err := s.refuseLocked(); err != nil {
		return err
	}
	s.reapLocked()
	if err := de.hold(); err != nil {
		s.failed = fmt.Errorf("%w: stream %d: wait on event: %w", ErrStreamFailed, s.id, err)
		return fmt.Errorf("stream %d: wait on event: %w", s.id, err)
	}
	if err := check("cuStreamWaitEvent", C.kv_stream_wait_event(s.d.ctx, s.h, de.core.h)); err != nil {
		de.life.unref()
		return s.failLocked("wait on event "+de.label, err)
	}
	tracker, err := s.record(s.h)
	if err != nil {
		// The wait is enqueued but cannot be tracked: keep the hold until
		// the stream is closed.
		s.holds = append(s.holds, hold{e: de})
		return s.failLocked("track wait on event "+de.label, err)
	}
	s.holds = append(s.holds, hold{tracker: tracker, e: de})
	return nil
}

// Record captures the work enqueued so far into e (cuEventRecord).
func (s *driverStream) Record(e Event) error {
	de, err := s.d.asEvent(e, "Record")
	if err != nil {
		return err
	}
	s.lockEnqueue()
	defer s.unlockEnqueue()
	if err := s.refuseLocked(); err != nil {
		return err
	}
	if err := de.hold(); err != nil {
		return fmt.Errorf("stream %d: record: %w", s.id, err)
	}
	defer de.life.unref()
	if err := check("cuEventRecord", C.kv_event_record(s.d.ctx, de.core.h, s.h)); err != nil {
		return fmt.Errorf("cuda: stream %d: record event %s: %w", s.id, de.label, err)
	}
	return nil
}

// Delay enqueues a kernel that spins for d.
func (s *driverStream) Delay(d time.Duration) error {
	s.lockEnqueue()
	defer s.unlockEnqueue()
	if err := s.refuseLocked(); err != nil {
		return err
	}
	if d <= 0 {
		return nil
	}
	if err := check("cuLaunchKernel", C.kv_launch_delay(s.d.ctx, s.d.delay, s.h, C.ulonglong(d.Nanoseconds()))); err != nil {
		return s.failLocked("delay", err)
	}
	return nil
}

// Upload copies src to dst at off. src is first copied into pinned memory
// (a table block of the ordinal's pool), so the caller may reuse it at once
// and the driver copy (cuMemcpyHtoDAsync_v2) is truly asynchronous: it
// never blocks the caller behind work already on the stream.
func (s *driverStream) Upload(dst Mem, off uint64, src []byte) (*Op, error) {
	m, err := s.d.asMem(dst, "Upload")
	if err != nil {
		return nil, err
	}
	if err := checkRange(off, uint64(len(src)), m.size); err != nil {
		return nil, fmt.Errorf("Upload: %w", err)
	}
	if err := m.acquire(); err != nil {
		return nil, fmt.Errorf("Upload: %w", err)
	}
	st := &opState{s: s, what: fmt.Sprintf("upload of %d B", len(src)), unref: []func() error{m.life.unref}}
	var host unsafe.Pointer
	if len(src) > 0 {
		if st.job, err = s.d.getJob(uint64(len(src))); err != nil {
			st.drop()
			return nil, fmt.Errorf("cuda: Upload of %d B: %w", len(src), err)
		}
		host = st.job.host
		copy(st.job.buf, src)
	}
	s.lockEnqueue()
	defer s.unlockEnqueue()
	if err := s.refuseLocked(); err != nil {
		st.drop()
		return nil, err
	}
	s.reapLocked()
	if len(src) > 0 {
		r := C.kv_memcpy_htod_async(s.d.ctx, C.CUdeviceptr(m.ptr+off), host, C.size_t(len(src)), s.h)
		if err := check("cuMemcpyHtoDAsync_v2", r); err != nil {
			C.kv_stream_synchronize(s.d.ctx, s.h)
			st.drop()
			return nil, s.failLocked(st.what, err)
		}
	}
	return s.finishLocked(st)
}

// finishLocked records st's completion event and tracks it.
func (s *driverStream) finishLocked(st *opState) (*Op, error) {
	done, err := s.record(s.h)
	if err != nil {
		// The work is enqueued but cannot be tracked: let it drain first.
		C.kv_stream_synchronize(s.d.ctx, s.h)
		if s.aux != nil {
			C.kv_stream_synchronize(s.d.ctx, s.aux)
		}
		st.drop()
		return nil, s.failLocked(st.what, err)
	}
	st.done = done
	s.inflight = append(s.inflight, st)
	return &Op{wait: st.wait, sums: st.sums, lens: st.lens, path: st.path, mode: st.mode, started: st.start}, nil
}

// Synchronize waits until all work enqueued so far has finished.
func (s *driverStream) Synchronize(ctx context.Context) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("%w: stream %d is closed", ErrReleased, s.id)
	}
	mark, err := s.record(s.h)
	s.mu.Unlock()
	if err != nil {
		return fmt.Errorf("cuda: synchronize stream %d: %w", s.id, err)
	}
	err = pollUntil(ctx, func() (bool, error) {
		return s.d.queryEvent(mark, fmt.Sprintf("stream %d", s.id))
	}, func() error { return fmt.Errorf("cuda: synchronize stream %d: %w", s.id, ctx.Err()) })
	if err != nil {
		if errors.As(err, new(*DriverError)) {
			s.mu.Lock()
			err = s.failLocked("synchronize", err)
			s.mu.Unlock()
		}
		return err
	}
	s.recycle(mark)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reapLocked()
	if s.closed {
		return nil
	}
	return s.refuseLocked()
}

// Close waits for the enqueued work (cuStreamSynchronize: a wait on an event
// that another process never completes blocks it), finishes every
// operation, drops every event hold and frees the stream. Idempotent.
func (s *driverStream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	ctx := s.d.ctx
	// The ordinal forgets the stream before anything of it is destroyed:
	// drain must never query a destroyed stream.
	s.d.o.mu.Lock()
	delete(s.d.o.streams, s)
	s.d.o.mu.Unlock()
	var errs []error
	errs = append(errs, check("cuStreamSynchronize", C.kv_stream_synchronize(ctx, s.h)))
	if s.aux != nil {
		errs = append(errs, check("cuStreamSynchronize", C.kv_stream_synchronize(ctx, s.aux)))
	}
	for _, st := range s.inflight {
		st.poll()
	}
	s.inflight = nil
	for _, h := range s.holds {
		h.e.life.unref()
		if h.tracker != nil {
			s.recycle(h.tracker)
		}
	}
	s.holds = nil
	s.poolMu.Lock()
	for _, e := range s.pool {
		errs = append(errs, check("cuEventDestroy_v2", C.kv_event_destroy(ctx, e)))
	}
	s.pool = nil
	s.poolMu.Unlock()
	if s.stage != 0 {
		errs = append(errs, check("cuMemFreeAsync", C.kv_mem_free_async(ctx, C.CUdeviceptr(s.stage), s.h)))
		errs = append(errs, check("cuStreamSynchronize", C.kv_stream_synchronize(ctx, s.h)))
	}
	if s.aux != nil {
		errs = append(errs, check("cuStreamDestroy_v2", C.kv_stream_destroy(ctx, s.aux)))
	}
	errs = append(errs, check("cuStreamDestroy_v2", C.kv_stream_destroy(ctx, s.h)))
	s.d.res.remove(s)
	errs = append(errs, s.d.o.drain())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cuda: close stream %d: %w", s.id, err)
	}
	return nil
}

// opState is one enqueued operation of a stream.
type opState struct {
	s      *driverStream
	what   string
	done   C.CUevent   // recorded after the operation's last work
	events []C.CUevent // internal events the operation used
	job    *job        // tables and partial sums of a transfer
	lens   []uint64    // packed length of every object
	sums   []uint64    // filled when the operation has finished
	path   string      // a transfer's copy path (Op.Path)
	mode   string      // the SM path's mode (Op.Mode)
	start  time.Time   // the work began to be enqueued (Op.Started)
	unref  []func() error
	busy   *atomic.Int64 // the device's count of its direction's transfers in flight, until finished or dropped

	mu       sync.Mutex // guards the following
	finished bool
	err      error
}

func (st *opState) wait(ctx context.Context) error {
	return pollUntil(ctx, st.poll, func() error {
		return fmt.Errorf("cuda: wait for %s on stream %d: %w", st.what, st.s.id, ctx.Err())
	})
}

// poll reports whether the operation has finished, and finishes it: fills
// the sums, returns its tables and events, drops its references.
func (st *opState) poll() (bool, error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.finished {
		return true, st.err
	}
	done, err := st.s.d.queryEvent(st.done, st.what)
	if err == nil && !done {
		return false, nil
	}
	st.finished = true
	if err != nil {
		st.err = fmt.Errorf("%w: stream %d: %s: %w", ErrStreamFailed, st.s.id, st.what, err)
		st.s.asyncErr.CompareAndSwap(nil, &st.err)
	} else if st.job != nil {
		parts := st.job.partials(len(st.sums))
		for i := range st.sums {
			st.sums[i] = checksum.Finish(parts[i], st.lens[i])
		}
	}
	st.s.recycle(st.done)
	st.s.recycle(st.events...)
	st.release()
	return true, st.err
}

// drop gives back what an operation that was never enqueued holds.
func (st *opState) drop() {
	st.s.recycle(st.events...)
	st.release()
}

func (st *opState) release() {
	if st.busy != nil {
		st.busy.Add(-1)
		st.busy = nil
	}
	if st.job != nil {
		st.s.d.putJob(st.job)
		st.job = nil
	}
	for _, u := range st.unref {
		u()
	}
	st.unref = nil
}
