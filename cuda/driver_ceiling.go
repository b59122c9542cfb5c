//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import (
	"context"
	"fmt"
	"slices"
	"time"
	"unsafe"
)

// Measurement helpers of the CUDA backend for its benchmarks
// (driver_bench_test.go, driver_peerl1_test.go): timing events and the
// plain copy-engine copy the transfers are compared with; CopyCeilingHtoD
// offers that ceiling to other packages' benchmarks (transfer's peer-L1
// restore).

// timer is a pair of timing-enabled events.
type timer struct {
	d          *driverDevice
	start, end C.CUevent
}

func (d *driverDevice) newTimer() (*timer, error) {
	t := &timer{d: d}
	if err := check("cuEventCreate", C.kv_event_create(d.ctx, &t.start, 0)); err != nil {
		return nil, err
	}
	if err := check("cuEventCreate", C.kv_event_create(d.ctx, &t.end, 0)); err != nil {
		C.kv_event_destroy(d.ctx, t.start)
		return nil, err
	}
	return t, nil
}

func (t *timer) close() {
	C.kv_event_destroy(t.d.ctx, t.start)
	C.kv_event_destroy(t.d.ctx, t.end)
}

// begin and end record the two events on s.
func (t *timer) begin(s *driverStream) error {
	return check("cuEventRecord", C.kv_event_record(t.d.ctx, t.start, s.h))
}

// finish records the end event on s, waits for it and returns the device
// time between the events.
func (t *timer) finish(s *driverStream) (time.Duration, error) {
	if err := check("cuEventRecord", C.kv_event_record(t.d.ctx, t.end, s.h)); err != nil {
		return 0, err
	}
	if err := check("cuEventSynchronize", C.kv_event_synchronize(t.d.ctx, t.end)); err != nil {
		return 0, err
	}
	var ms C.float
	if err := check("cuEventElapsedTime", C.kv_event_elapsed(t.d.ctx, &ms, t.start, t.end)); err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// rawAlloc allocates device memory outside the Mem bookkeeping.
func (d *driverDevice) rawAlloc(n uint64) (uint64, error) {
	var p C.CUdeviceptr
	err := check("cuMemAlloc_v2", C.kv_mem_alloc(d.ctx, &p, C.size_t(n)))
	return uint64(p), err
}

func (d *driverDevice) rawFree(p uint64) error {
	return check("cuMemFree_v2", C.kv_mem_free(d.ctx, C.CUdeviceptr(p)))
}

// copyCE enqueues one contiguous copy-engine copy of n bytes between the
// pinned buffer h and device memory dev, in direction h2d or d2h.
func (s *driverStream) copyCE(h unsafe.Pointer, dev uint64, n uint64, h2d bool) error {
	if h2d {
		return check("cuMemcpyHtoDAsync_v2", C.kv_memcpy_htod_async(s.d.ctx, C.CUdeviceptr(dev), h, C.size_t(n), s.h))
	}
	return check("cuMemcpyDtoHAsync_v2", C.kv_memcpy_dtoh_async(s.d.ctx, h, C.CUdeviceptr(dev), C.size_t(n), s.h))
}

// CopyCeilingHtoD measures, on a CUDA device, the copy engine's
// host-to-device ceiling that benchmarks of other packages report their
// restores against: one cuMemcpyHtoDAsync of n bytes from a pinned
// (cuMemHostAlloc) buffer into one device buffer, timed with CUDA events
// on a stream of its own; the median of reps copies after one warm-up, in
// GB/s (1e9 B/s). It is a measurement helper, never on the data path. On a
// device that is not the CUDA backend it returns an error wrapping
// ErrNoDriver.
func CopyCeilingHtoD(dev Device, n uint64, reps int) (float64, error) {
	d, ok := dev.(*driverDevice)
	if !ok {
		return 0, fmt.Errorf("cuda: copy ceiling of a %s device: %w", dev.Info().Backend, ErrNoDriver)
	}
	if n == 0 || reps < 1 {
		return 0, fmt.Errorf("cuda: copy ceiling of %d B, %d repetitions: want both > 0", n, reps)
	}
	hb, err := d.AllocHost(n)
	if err != nil {
		return 0, err
	}
	defer hb.Release()
	dst, err := d.rawAlloc(n)
	if err != nil {
		return 0, err
	}
	defer d.rawFree(dst)
	st, err := d.NewStream()
	if err != nil {
		return 0, err
	}
	defer st.Close()
	s := st.(*driverStream)
	tm, err := d.newTimer()
	if err != nil {
		return 0, err
	}
	defer tm.close()
	host := hb.(*driverHostBuf).host
	var ts []time.Duration
	for rep := range reps + 1 {
		if err := tm.begin(s); err != nil {
			return 0, err
		}
		if err := s.copyCE(host, dst, n, true); err != nil {
			return 0, err
		}
		t, err := tm.finish(s)
		if err != nil {
			return 0, err
		}
		if rep > 0 {
			ts = append(ts, t)
		}
	}
	slices.Sort(ts)
	return float64(n) / ts[len(ts)/2].Seconds() / 1e9, nil
}

// plainCopy is PlainCopy on the CUDA backend: one copy-engine copy of n
// bytes between the start of m and the start of the pinned buffer hb,
// enqueued on s after its earlier work, waited for with
// cuStreamSynchronize (no polling, so the ceiling is not slowed by a wait
// granularity).
func (s *driverStream) plainCopy(ctx context.Context, m Mem, hb HostBuf, n uint64, toDevice bool) error {
	dm, err := s.d.asMem(m, "PlainCopy")
	if err != nil {
		return err
	}
	buf, ok := hb.(*driverHostBuf)
	if !ok || buf == nil || buf.d.ctx != s.d.ctx {
		return fmt.Errorf("%w: PlainCopy with a host buffer (%T) not of this device", ErrBadHandle, hb)
	}
	if n > buf.size {
		return fmt.Errorf("%w: PlainCopy of %d B into a host buffer of %d B", ErrOutOfRange, n, buf.size)
	}
	if !dm.life.acquire() {
		return fmt.Errorf("%w: PlainCopy from a released Mem", ErrReleased)
	}
	defer dm.life.unref()
	if !buf.life.acquire() {
		return fmt.Errorf("%w: PlainCopy with a released host buffer", ErrReleased)
	}
	defer buf.life.unref()
	if err := ctx.Err(); err != nil {
		return err
	}
	s.lockEnqueue()
	if err := s.refuseLocked(); err != nil {
		s.unlockEnqueue()
		return fmt.Errorf("PlainCopy: %w", err)
	}
	err = s.copyCE(buf.host, dm.ptr, n, toDevice)
	s.unlockEnqueue()
	if err != nil {
		return fmt.Errorf("PlainCopy: %w", err)
	}
	return check("cuStreamSynchronize", C.kv_stream_synchronize(s.d.ctx, s.h))
}

// spanTimer times work on several streams from one start: a timing event
// recorded on a gate stream after a Delay, which every stream waits for
// before its work, and an end event per stream. Benchmarks of both
// directions at once (driver_dma_bench_test.go) use it.
type spanTimer struct {
	d     *driverDevice
	start C.CUevent
	ends  []C.CUevent
}

func (d *driverDevice) newSpanTimer(n int) (*spanTimer, error) {
	t := &spanTimer{d: d, ends: make([]C.CUevent, n)}
	// Each event is created into a local: cgo refuses a pointer into t,
	// whose memory holds Go pointers (d, ends).
	for i := -1; i < n; i++ {
		var e C.CUevent
		if err := check("cuEventCreate", C.kv_event_create(d.ctx, &e, 0)); err != nil {
			t.close()
			return nil, err
		}
		if i < 0 {
			t.start = e
		} else {
			t.ends[i] = e
		}
	}
	return t, nil
}

func (t *spanTimer) close() {
	for _, e := range append([]C.CUevent{t.start}, t.ends...) {
		if e != nil {
			C.kv_event_destroy(t.d.ctx, e)
		}
	}
}

// run holds gate for delay (the host enqueues meanwhile), makes every
// stream of ss (at most as many as the timer has end events) wait for the
// start, calls enqueue, and returns the device time from the start to the
// latest end, and the host time enqueue took.
func (t *spanTimer) run(gate *driverStream, ss []*driverStream, delay time.Duration, enqueue func() error) (dev, host time.Duration, err error) {
	if err := gate.Delay(delay); err != nil {
		return 0, 0, err
	}
	if err := check("cuEventRecord", C.kv_event_record(t.d.ctx, t.start, gate.h)); err != nil {
		return 0, 0, err
	}
	for _, s := range ss {
		if err := check("cuStreamWaitEvent", C.kv_stream_wait_event(t.d.ctx, s.h, t.start)); err != nil {
			return 0, 0, err
		}
	}
	t0 := time.Now()
	if err := enqueue(); err != nil {
		return 0, 0, err
	}
	host = time.Since(t0)
	for i, s := range ss {
		if err := check("cuEventRecord", C.kv_event_record(t.d.ctx, t.ends[i], s.h)); err != nil {
			return 0, 0, err
		}
	}
	for i := range ss {
		if err := check("cuEventSynchronize", C.kv_event_synchronize(t.d.ctx, t.ends[i])); err != nil {
			return 0, 0, err
		}
		var ms C.float
		if err := check("cuEventElapsedTime", C.kv_event_elapsed(t.d.ctx, &ms, t.start, t.ends[i])); err != nil {
			return 0, 0, err
		}
		dev = max(dev, time.Duration(float64(ms)*float64(time.Millisecond)))
	}
	return dev, host, nil
}
