//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"
)

// eventCore is one driver event (CUevent). Every driverEvent that names it
// holds a reference, and so does every stream wait in flight through one of
// them; cuEventDestroy_v2 runs when the last reference is gone. So an event,
// imported ones included, is never destroyed while a stream still waits on
// it (contract C1), whatever the caller releases when.
type eventCore struct {
	d         *driverDevice
	h         C.CUevent
	ownerGone atomic.Bool // the creating driverEvent was released
	refs      refcount
}

func (d *driverDevice) newCore(h C.CUevent) *eventCore {
	c := &eventCore{d: d, h: h}
	c.refs.free = func() error { return check("cuEventDestroy_v2", C.kv_event_destroy(d.ctx, h)) }
	return c
}

// driverEvent is an Event of the CUDA backend.
type driverEvent struct {
	d            *driverDevice
	core         *eventCore
	interprocess bool
	imported     bool // opened from another process's handle
	alias        bool // an import of an event this process exported
	label        string
	life         lifetime // Release and the holds of stream waits
}

var driverEventIDs atomic.Uint64

func (d *driverDevice) newEventFor(core *eventCore, interprocess, imported, alias bool) (*driverEvent, error) {
	if !core.refs.inc() {
		return nil, fmt.Errorf("%w: event was destroyed", ErrReleased)
	}
	e := &driverEvent{
		d:            d,
		core:         core,
		interprocess: interprocess,
		imported:     imported,
		alias:        alias,
		label:        fmt.Sprintf("#%d", driverEventIDs.Add(1)),
	}
	e.life.free = core.refs.dec
	if err := d.res.add(e); err != nil {
		e.life.release()
		return nil, err
	}
	return e, nil
}

func (d *driverDevice) NewEvent(interprocess bool) (Event, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	flags := C.uint(C.KV_EVENT_DISABLE_TIMING)
	if interprocess {
		flags |= C.KV_EVENT_INTERPROCESS
	}
	var h C.CUevent
	if err := check("cuEventCreate", C.kv_event_create(d.ctx, &h, flags)); err != nil {
		return nil, fmt.Errorf("cuda: NewEvent: %w", err)
	}
	e, err := d.newEventFor(d.newCore(h), interprocess, false, false)
	if err != nil {
		return nil, err
	}
	return e, nil
}

// stateErr reports a released event, or an alias whose owner released it.
func (e *driverEvent) stateErr() error {
	if e.life.isReleased() {
		return fmt.Errorf("%w: event %s was released by this process", ErrReleased, e.label)
	}
	if e.alias && e.core.ownerGone.Load() {
		return fmt.Errorf("%w: event %s was destroyed by its owner", ErrReleased, e.label)
	}
	return nil
}

// hold takes a reference for a stream wait or a query, or fails with
// ErrReleased for a released or destroyed event.
func (e *driverEvent) hold() error {
	if err := e.stateErr(); err != nil {
		return err
	}
	if !e.life.acquire() {
		return fmt.Errorf("%w: event %s was released by this process", ErrReleased, e.label)
	}
	if err := e.stateErr(); err != nil {
		e.life.unref()
		return err
	}
	return nil
}

// Query reports whether the work captured by the most recent Record has
// completed (cuEventQuery).
func (e *driverEvent) Query() (bool, error) {
	if err := e.hold(); err != nil {
		return false, err
	}
	defer e.life.unref()
	return e.d.queryEvent(e.core.h, "event "+e.label)
}

// queryEvent maps cuEventQuery: done, not yet, or a failure.
func (d *driverDevice) queryEvent(h C.CUevent, what string) (bool, error) {
	r := C.kv_event_query(d.ctx, h)
	if r == C.KV_CUDA_ERROR_NOT_READY {
		return false, nil
	}
	if err := check("cuEventQuery", r); err != nil {
		return false, fmt.Errorf("cuda: query %s: %w", what, err)
	}
	return true, nil
}

// Synchronize blocks until the captured work has completed, the event is
// released (an error wrapping ErrReleased) or ctx is done.
func (e *driverEvent) Synchronize(ctx context.Context) error {
	if err := e.hold(); err != nil {
		return err
	}
	defer e.life.unref()
	return pollUntil(ctx, func() (bool, error) {
		if err := e.stateErr(); err != nil {
			return false, err
		}
		return e.d.queryEvent(e.core.h, "event "+e.label)
	}, func() error { return fmt.Errorf("cuda: synchronize event %s: %w", e.label, ctx.Err()) })
}

// pollUntil calls poll until it reports done or an error, or ctx is done:
// a short spin for the common fast completion, then sleeps that grow to
// pollFine for the first pollFineFor of the wait and to a millisecond
// after. A transfer's completion is noticed at most pollFine late while
// it is short: with sleeps up to a millisecond from the start, the H200's
// timelines saw a restore's copies noticed 0.2-1.7 ms after they ended.
func pollUntil(ctx context.Context, poll func() (bool, error), ctxErr func() error) error {
	sleep := 10 * time.Microsecond
	start := time.Now()
	for i := 0; ; i++ {
		done, err := poll()
		if err != nil || done {
			return err
		}
		if ctx.Err() != nil {
			return ctxErr()
		}
		if i < 64 {
			continue
		}
		t := time.NewTimer(sleep)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctxErr()
		}
		sleep = nextPollSleep(sleep, time.Since(start))
	}
}

const (
	// pollFine is the longest sleep of a wait's first pollFineFor: about
	// 1 % of a core in event queries while it lasts.
	pollFine    = 100 * time.Microsecond
	pollFineFor = 200 * time.Millisecond
	pollCoarse  = time.Millisecond // the longest sleep after that
)

// nextPollSleep is pollUntil's sleep after one of sleep, waited into the
// wait: twice as long, up to pollFine during the first pollFineFor, up to
// pollCoarse after.
func nextPollSleep(sleep, waited time.Duration) time.Duration {
	if waited > pollFineFor {
		return min(2*sleep, pollCoarse)
	}
	return min(2*sleep, pollFine)
}

// Release destroys an event this process created, or closes an imported
// one. Stream waits already enqueued on it still hold the driver event, which
// is destroyed when the last of them has passed. Idempotent.
func (e *driverEvent) Release() error {
	if !e.imported && !e.alias {
		e.core.ownerGone.Store(true)
		ipcRegistry.forgetEvent(e.core)
	}
	first, err := e.life.release()
	if first {
		e.d.res.remove(e)
	}
	if err != nil {
		return fmt.Errorf("cuda: release event %s: %w", e.label, err)
	}
	return nil
}

func (d *driverDevice) asEvent(e Event, what string) (*driverEvent, error) {
	de, ok := e.(*driverEvent)
	if !ok || de == nil {
		return nil, fmt.Errorf("%w: %s of a %T, not a CUDA backend event", ErrBadHandle, what, e)
	}
	if de.core.d.ctx != d.ctx {
		return nil, fmt.Errorf("%w: %s of an event of another device", ErrBadHandle, what)
	}
	return de, nil
}

// ExportEvent returns the IPC handle of an interprocess event created by
// this process (cuIpcGetEventHandle).
func (d *driverDevice) ExportEvent(e Event) (EventHandle, error) {
	de, err := d.asEvent(e, "ExportEvent")
	if err != nil {
		return EventHandle{}, err
	}
	if !de.interprocess || de.imported || de.alias {
		return EventHandle{}, fmt.Errorf("%w: ExportEvent needs an interprocess event created by this process", ErrBadHandle)
	}
	if err := de.hold(); err != nil {
		return EventHandle{}, fmt.Errorf("ExportEvent: %w", err)
	}
	defer de.life.unref()
	var raw handleKey
	if err := check("cuIpcGetEventHandle", C.kv_ipc_get_event_handle(d.ctx, unsafe.Pointer(&raw[0]), de.core.h)); err != nil {
		return EventHandle{}, fmt.Errorf("cuda: ExportEvent: %w", err)
	}
	ipcRegistry.mu.Lock()
	ipcRegistry.events[raw] = de.core
	ipcRegistry.mu.Unlock()
	return EventHandle{Backend: "cuda", Device: d.info.UUID, Raw: raw[:]}, nil
}

// ImportEvent opens an exported event: through cuIpcOpenEventHandle when
// another process exported it, as the same driver event when this one did.
// Waiting on an imported event whose owner destroyed it is an error in the
// exporting process only: the driver gives another process no way to tell.
func (d *driverDevice) ImportEvent(h EventHandle) (Event, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	key, err := d.checkHandle(h.Backend, h.Device, h.Raw)
	if err != nil {
		return nil, err
	}
	ipcRegistry.mu.Lock()
	core := ipcRegistry.events[key]
	ipcRegistry.mu.Unlock()
	if core != nil {
		if core.d.ctx != d.ctx {
			return nil, fmt.Errorf("%w: event exported by this process on another context", ErrBadHandle)
		}
		if core.ownerGone.Load() {
			return nil, fmt.Errorf("%w: %w: the exported event was destroyed by its owner", ErrBadHandle, ErrReleased)
		}
		e, err := d.newEventFor(core, true, false, true)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadHandle, err)
		}
		return e, nil
	}
	var ev C.CUevent
	if err := check("cuIpcOpenEventHandle", C.kv_ipc_open_event_handle(d.ctx, &ev, unsafe.Pointer(&key[0]))); err != nil {
		return nil, fmt.Errorf("%w: ImportEvent: %w", ErrBadHandle, err)
	}
	e, err := d.newEventFor(d.newCore(ev), true, true, false)
	if err != nil {
		return nil, err
	}
	return e, nil
}
