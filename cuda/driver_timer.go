//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// Timers of the CUDA backend. A timer is a timing-enabled event
// (cuEventCreate without CU_EVENT_DISABLE_TIMING). The driver reports
// only the time between two such events (cuEventElapsedTime), so each
// mark is tied to an anchor: a timing event recorded on an idle stream of
// its own and seen complete at a known host time. A mark's host time is
// the anchor's plus the elapsed time from the anchor to the mark. An
// anchor serves the marks of one second at most (anchorMaxAge), so the
// float milliseconds of cuEventElapsedTime keep microsecond resolution and
// the drift between the device's clock and the host's stays negligible;
// each mark holds its anchor until the timer is marked again or released.

// anchorMaxAge is how long an anchor serves new marks.
const anchorMaxAge = time.Second

// clockAnchor is one anchor event and the host time at which it completed.
type clockAnchor struct {
	ev   C.CUevent
	host time.Time
	refs refcount // the clock's while current, and each mark's
}

// deviceClock is the anchor state of one ordinal (one context), in
// ordinalState.
type deviceClock struct {
	mu     sync.Mutex // guards the following
	stream C.CUstream // the anchors' stream, created on first use
	cur    *clockAnchor
}

// anchor returns the current anchor with a reference the caller drops,
// recording a new one when the current one is older than anchorMaxAge.
func (o *ordinalState) anchor() (*clockAnchor, error) {
	c := &o.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	if a := c.cur; a != nil && time.Since(a.host) < anchorMaxAge && a.refs.inc() {
		return a, nil
	}
	ctx := o.base.ctx
	if c.stream == nil {
		var s C.CUstream
		if err := check("cuStreamCreate", C.kv_stream_create(ctx, &s)); err != nil {
			return nil, fmt.Errorf("cuda: timer clock stream: %w", err)
		}
		c.stream = s
	}
	var ev C.CUevent
	if err := check("cuEventCreate", C.kv_event_create(ctx, &ev, 0)); err != nil {
		return nil, fmt.Errorf("cuda: timer clock anchor: %w", err)
	}
	host, err := settleAnchor(ctx, c.stream, ev)
	if err != nil {
		C.kv_event_destroy(ctx, ev)
		return nil, fmt.Errorf("cuda: timer clock anchor: %w", err)
	}
	a := &clockAnchor{ev: ev, host: host}
	a.refs.free = func() error { return check("cuEventDestroy_v2", C.kv_event_destroy(ctx, ev)) }
	a.refs.inc() // the clock's
	a.refs.inc() // the caller's
	if old := c.cur; old != nil {
		_ = old.refs.dec()
	}
	c.cur = a
	return a, nil
}

// settleAnchor records ev on the idle stream s, spins until the device has
// reached it and returns the host time at which it did: the middle of the
// interval from just before the record to the first query that saw it
// complete. It keeps the tightest of three tries.
func settleAnchor(ctx C.CUcontext, s C.CUstream, ev C.CUevent) (time.Time, error) {
	var best time.Time
	spread := time.Duration(-1)
	for range 3 {
		before := time.Now()
		if err := check("cuEventRecord", C.kv_event_record(ctx, ev, s)); err != nil {
			return time.Time{}, err
		}
		for {
			r := C.kv_event_query(ctx, ev)
			if r == C.KV_CUDA_ERROR_NOT_READY {
				if time.Since(before) > 100*time.Millisecond {
					// The device is that busy: wait without spinning.
					if err := check("cuEventSynchronize", C.kv_event_synchronize(ctx, ev)); err != nil {
						return time.Time{}, err
					}
					break
				}
				continue
			}
			if err := check("cuEventQuery", r); err != nil {
				return time.Time{}, err
			}
			break
		}
		after := time.Now()
		if d := after.Sub(before); spread < 0 || d < spread {
			best, spread = before.Add(d/2), d
		}
		if spread < 20*time.Microsecond {
			break
		}
	}
	return best, nil
}

// driverTimer is a Timer of the CUDA backend.
type driverTimer struct {
	d    *driverDevice
	h    C.CUevent
	id   uint64
	life lifetime // Release, and the holds of Mark and Time

	mu     sync.Mutex   // guards the following
	anchor *clockAnchor // of the most recent mark; nil: never marked
}

func (d *driverDevice) NewTimer() (Timer, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	var h C.CUevent
	if err := check("cuEventCreate", C.kv_event_create(d.ctx, &h, 0)); err != nil {
		return nil, fmt.Errorf("cuda: NewTimer: %w", err)
	}
	t := &driverTimer{d: d, h: h, id: timerIDs.Add(1)}
	t.life.free = func() error {
		t.mu.Lock()
		a := t.anchor
		t.anchor = nil
		t.mu.Unlock()
		if a != nil {
			_ = a.refs.dec()
		}
		return check("cuEventDestroy_v2", C.kv_event_destroy(d.ctx, h))
	}
	if err := d.res.add(t); err != nil {
		t.life.release()
		return nil, err
	}
	return t, nil
}

func (d *driverDevice) asTimer(t Timer) (*driverTimer, error) {
	dt, ok := t.(*driverTimer)
	if !ok || dt == nil {
		return nil, fmt.Errorf("%w: Mark of a %T, not a CUDA backend timer", ErrBadHandle, t)
	}
	if dt.d.ctx != d.ctx {
		return nil, fmt.Errorf("%w: Mark of a timer of another device", ErrBadHandle)
	}
	return dt, nil
}

// Mark records the timer's event on the stream (cuEventRecord) and ties
// it to the current anchor.
func (s *driverStream) Mark(t Timer) error {
	dt, err := s.d.asTimer(t)
	if err != nil {
		return err
	}
	if !dt.life.acquire() {
		return fmt.Errorf("%w: timer #%d was released", ErrReleased, dt.id)
	}
	defer dt.life.unref()
	a, err := s.d.o.anchor()
	if err != nil {
		return fmt.Errorf("stream %d: mark: %w", s.id, err)
	}
	s.lockEnqueue()
	err = s.refuseLocked()
	if err == nil {
		err = check("cuEventRecord", C.kv_event_record(s.d.ctx, dt.h, s.h))
		if err != nil {
			err = fmt.Errorf("cuda: stream %d: mark timer #%d: %w", s.id, dt.id, err)
		}
	}
	s.unlockEnqueue()
	if err != nil {
		_ = a.refs.dec()
		return err
	}
	dt.mu.Lock()
	old := dt.anchor
	dt.anchor = a
	dt.mu.Unlock()
	if old != nil {
		_ = old.refs.dec()
	}
	return nil
}

func (t *driverTimer) Time(ctx context.Context) (time.Time, error) {
	if !t.life.acquire() {
		return time.Time{}, fmt.Errorf("%w: timer #%d was released", ErrReleased, t.id)
	}
	defer t.life.unref()
	t.mu.Lock()
	a := t.anchor
	if a != nil && !a.refs.inc() {
		a = nil
	}
	t.mu.Unlock()
	if a == nil {
		return time.Time{}, fmt.Errorf("cuda: time of timer #%d: it was never marked", t.id)
	}
	defer a.refs.dec()
	what := fmt.Sprintf("timer #%d", t.id)
	err := pollUntil(ctx, func() (bool, error) { return t.d.queryEvent(t.h, what) },
		func() error { return fmt.Errorf("cuda: time of %s: %w", what, ctx.Err()) })
	if err != nil {
		return time.Time{}, err
	}
	var ms C.float
	if err := check("cuEventElapsedTime", C.kv_event_elapsed(t.d.ctx, &ms, a.ev, t.h)); err != nil {
		return time.Time{}, fmt.Errorf("cuda: time of %s: %w", what, err)
	}
	return a.host.Add(time.Duration(float64(ms) * float64(time.Millisecond))), nil
}

func (t *driverTimer) Release() error {
	first, err := t.life.release()
	if first {
		t.d.res.remove(t)
	}
	if err != nil {
		return fmt.Errorf("cuda: release timer #%d: %w", t.id, err)
	}
	return nil
}
