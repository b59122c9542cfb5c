package cuda

import (
	"context"
	"time"

	"github.com/kvtier/kvtier/wire"
)

// Device is one GPU, or the host simulator standing in for one.
// All methods are safe for concurrent use.
type Device interface {
	// Info describes the device.
	Info() Info

	// Alloc allocates size bytes of device memory (cuMemAlloc). The memory
	// is not zeroed.
	Alloc(size uint64) (Mem, error)
	// AllocHost allocates size bytes of pinned host memory that the device
	// can read and write directly (cuMemHostAlloc, portable + device-mapped).
	AllocHost(size uint64) (HostBuf, error)
	// RegisterHost makes existing host memory b (a mapping of a shared
	// segment, page-aligned, length a multiple of 4096) usable as a
	// HostBuf without copying it: the CUDA backend pins it with
	// cuMemHostRegister (portable + device-mapped, plus read-only when
	// readOnly: the device never writes it, so a read-only mapping of
	// another process's memory can be registered); the host backend uses
	// it as it is. Release unregisters; it never unmaps b, which stays
	// the caller's.
	RegisterHost(b []byte, readOnly bool) (HostBuf, error)

	// NewStream creates an asynchronous, in-order work queue.
	NewStream() (Stream, error)
	// NewEvent creates an event. Interprocess events can be exported with
	// ExportEvent (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING).
	NewEvent(interprocess bool) (Event, error)
	// NewTimer creates a timer: a process-local point in a stream whose
	// completion time the device reports (a timing-enabled cuEvent).
	// Stream.Mark places it; Timer.Time reads it.
	NewTimer() (Timer, error)

	// ExportMem returns an IPC handle for [off, off+size) of m. A CUDA legacy
	// IPC handle names the whole base allocation, so the handle carries the
	// offset and size of the view as well.
	ExportMem(m Mem, off, size uint64) (MemHandle, error)
	// ImportMem opens a handle exported by another process (or this one) and
	// returns a Mem covering exactly the exported view.
	ImportMem(h MemHandle) (Mem, error)
	// ExportEvent returns an IPC handle for an interprocess event.
	ExportEvent(e Event) (EventHandle, error)
	// ImportEvent opens an event exported by another process.
	ImportEvent(h EventHandle) (Event, error)

	// Write and Read copy synchronously between host memory and device
	// memory; they are for setup, tests and simulators, not the data path.
	Write(dst Mem, off uint64, src []byte) error
	Read(src Mem, off uint64, dst []byte) error

	// Close releases the device. Outstanding allocations become invalid.
	// Close is idempotent.
	Close() error
}

// Info describes a device.
type Info struct {
	Backend string // "host" or "cuda"
	Ordinal int    // CUDA device ordinal; 0 for the host backend
	UUID    string // "GPU-..." for CUDA; a stable made-up id for the host backend
	Name    string
	Memory  uint64 // bytes of device memory; 0 when unknown
	PCIBus  string // PCI bus id, "" when unknown
}

// Mem is a range of device memory: an allocation or an imported IPC view.
type Mem interface {
	Size() uint64
	// Release frees an allocation or closes an imported view. Using a
	// released Mem is an error. Release is idempotent.
	Release() error
}

// HostBuf is pinned host memory.
type HostBuf interface {
	// Bytes returns the buffer's memory. It is valid until Release; the Go
	// side may read and write it while no stream operation uses the range.
	Bytes() []byte
	Release() error
}

// Span is a byte range [Off, Off+Len) of a device allocation.
type Span struct {
	Mem Mem
	Off uint64
	Len uint64
}

// Object is one packed object in a host buffer: the concatenation of Spans,
// in order, stored at [HostOff, HostOff+sum of Len) of the buffer.
type Object struct {
	HostOff uint64
	Spans   []Span
}

// Len returns the packed length of o.
func (o Object) Len() uint64 {
	var n uint64
	for _, s := range o.Spans {
		n += s.Len
	}
	return n
}

// Stream is an in-order asynchronous queue of device work. Operations return
// once they are validated and enqueued; their effects happen later, in order.
// A stream that fails (for example, it waited on a destroyed event) reports
// the error from every later Op.Wait and Synchronize; nothing enqueued after
// the failure runs.
type Stream interface {
	// WaitEvent makes all later work on the stream wait until the work that
	// e captured at its most recent Record has completed (cuStreamWaitEvent).
	// Waiting on a released or destroyed event fails the stream (C1).
	WaitEvent(e Event) error
	// Record captures all work enqueued so far on the stream into e.
	Record(e Event) error
	// Mark places t after all work enqueued so far on the stream
	// (cuEventRecord of a timing event): the device reaches it when that
	// work has completed. Marking t again replaces its earlier mark.
	Mark(t Timer) error

	// Gather copies each object's spans from device memory into dst,
	// packed, and computes each object's kvsum64. All spans and host ranges
	// are checked before anything is enqueued.
	Gather(dst HostBuf, objs []Object) (*Op, error)
	// Scatter copies each object's packed bytes from src back into its
	// spans and computes each object's kvsum64 of what the spans hold
	// afterwards, in span order, so the caller can verify them. Both
	// backends read the destination back once every span of the transfer
	// is placed: the CUDA backend runs a second kernel pass over the spans
	// in device memory (a gather that writes nothing; on the DMA path,
	// kv_checksum once the copy engine has placed a batch), the host
	// backend hashes the destination spans after copying into them. A
	// matching sum therefore confirms the bytes in device memory at the
	// end of the transfer, not only the values the copy carried.
	// Overlapping destination spans are rejected.
	Scatter(src HostBuf, objs []Object) (*Op, error)

	// Upload copies src into device memory asynchronously. src must not be
	// modified until the returned Op completes.
	Upload(dst Mem, off uint64, src []byte) (*Op, error)
	// Delay enqueues device-side work that takes at least d. Tests and
	// simulators use it to model an engine still writing its pages.
	Delay(d time.Duration) error

	// Synchronize waits until all enqueued work has finished, ctx is done
	// or the stream fails.
	Synchronize(ctx context.Context) error
	// Close waits for enqueued work and frees the stream. Idempotent.
	Close() error
}

// Event marks a point in a stream.
type Event interface {
	// Query reports whether the captured work has completed. It returns an
	// error for a released or destroyed event.
	Query() (bool, error)
	// Synchronize blocks until the captured work has completed or ctx is
	// done. It returns an error for a released or destroyed event (C1).
	Synchronize(ctx context.Context) error
	// Release destroys an event this process created, or closes an imported
	// one. Later waits on it are errors. Idempotent.
	Release() error
}

// Timer is a point in a stream whose time the device reports, for stage
// timelines and benchmarks; it never orders work (that is Event's job).
type Timer interface {
	// Time waits until the device has reached the timer's most recent
	// Mark and returns when it did, on this process's clock: a time.Time
	// with a monotonic reading, comparable with time.Now. The host
	// backend takes it when its stream reaches the mark; the CUDA backend
	// adds the cuEventElapsedTime from a reference event to the host time
	// at which that event was seen complete (a reference renewed every
	// second), so its times are within microseconds of the host clock.
	// It fails for a timer never marked, released, or whose stream
	// failed before reaching the mark, and when ctx is done.
	Time(ctx context.Context) (time.Time, error)
	// Release destroys the timer; a later Mark or Time fails with
	// ErrReleased. Idempotent.
	Release() error
}

// MemHandle names exported device memory for another process. The type
// lives in wire (plain data, no device code behind it); see wire.MemHandle.
type MemHandle = wire.MemHandle

// EventHandle names an exported interprocess event; see wire.EventHandle.
type EventHandle = wire.EventHandle

// Op is one enqueued operation.
type Op struct {
	wait func(ctx context.Context) error
	sums []uint64 // filled when the op completes
	lens []uint64
	path string
	mode string
	// started: a Gather's or Scatter's work began to be handed to the
	// stream (its checks, plan and tables done) at this host time
	started time.Time
}

// Wait blocks until the operation has completed on the device, ctx is done
// or the stream failed.
func (o *Op) Wait(ctx context.Context) error { return o.wait(ctx) }

// Started is the host time at which a Gather's or Scatter's work began to
// be handed to its stream, its checks, plan and tables done: the device
// cannot have begun it earlier, whatever was before it on the stream. A
// stage timeline's device stage of the copy starts no earlier (transfer's
// Timeline): a Timer marked before the call is reached while the host
// still plans. Zero for other operations.
func (o *Op) Started() time.Time { return o.started }

// Path says how a Gather or Scatter moves its bytes: PathSM (copy kernels
// that checksum as they copy) or PathDMA (copy-engine copies of the page
// runs, then a checksum pass that reads the pages in device memory); ""
// for other operations. Both give the same sums and bytes; the device
// picks by the layout of the transfer (see docs/gpu.md).
func (o *Op) Path() string { return o.path }

// Mode says how the copy kernels of the CUDA backend's SM path reached the
// host buffer: ModeDirect (the kernels read or write the mapped host
// buffer over PCIe) or ModeStaged (through a device staging buffer that
// copy-engine copies fill or drain, chosen for long runs in the host
// buffer); "" on the DMA path, on the host backend and for other
// operations.
func (o *Op) Mode() string { return o.mode }

// The modes Op.Mode reports.
const (
	ModeDirect = "direct"
	ModeStaged = "staged"
)

// Sums returns the kvsum64 digest of every object of a Gather or Scatter,
// in order. It is valid only after Wait returned nil.
func (o *Op) Sums() []uint64 { return o.sums }
