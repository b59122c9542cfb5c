//go:build cgo && linux

package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "driver_cgo.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/kvtier/kvtier/cuda/kernels"
)

// The CUDA backend: the driver API through dlopen("libcuda.so.1") (see
// driver_cgo.c), the primary context of the device, copy kernels JIT-loaded
// from the committed PTX of package kernels.

var driverLoad struct {
	once sync.Once
	err  error
}

// loadDriver loads libcuda.so.1 and initializes the driver, once per
// process. A missing library, a driver that fails to initialize for lack of
// a device, or a driver too old for the entry points used wrap ErrNoDriver.
func loadDriver() error {
	driverLoad.once.Do(func() {
		var msg [512]C.char
		if C.kv_load(&msg[0], C.size_t(len(msg))) != 0 {
			driverLoad.err = fmt.Errorf("%w: %s", ErrNoDriver, C.GoString(&msg[0]))
			return
		}
		if err := check("cuInit", C.kv_init()); err != nil {
			driverLoad.err = fmt.Errorf("%w: %w", ErrNoDriver, err)
		}
	})
	return driverLoad.err
}

// check maps a CUresult to nil or a *DriverError.
func check(op string, r C.CUresult) error {
	if r == C.KV_CUDA_SUCCESS {
		return nil
	}
	return &DriverError{Op: op, Code: int(r), Name: C.GoString(C.kv_error_name(r))}
}

// kernelSet is the module's entry points (loadKernels). One value, so a
// device opened on a shared context copies them all: a kernel added to
// the module and not copied was a zero handle (CUDA_ERROR_INVALID_HANDLE
// at its first launch on the H100, stop 50).
type kernelSet struct {
	gather   C.CUfunction
	scatter  C.CUfunction
	sum      C.CUfunction // kv_checksum: the verification of a DMA transfer
	sumUnits C.CUfunction // kv_sum_units: the same where every span is word-aligned
	move     C.CUfunction // kv_move: tables and sums by a multiprocessor (DMATuning.SMControl)
	delay    C.CUfunction
}

// kernelEntry is one entry point of the module and its handle in a set.
type kernelEntry struct {
	name string
	fn   *C.CUfunction
}

// entries lists every handle of k with its entry point's name: what
// loadKernels fills (TestKernelSetLoadsEveryHandle checks that it is
// every field, each named in the PTX).
func (k *kernelSet) entries() []kernelEntry {
	return []kernelEntry{
		{"kv_gather", &k.gather},
		{"kv_scatter", &k.scatter},
		{"kv_checksum", &k.sum},
		{"kv_sum_units", &k.sumUnits},
		{"kv_move", &k.move},
		{"kv_delay", &k.delay},
	}
}

// driverDevice implements Device on one CUDA device.
type driverDevice struct {
	ordinal int
	dev     C.CUdevice
	ctx     C.CUcontext
	info    Info
	sms     int
	module  C.CUmodule
	kernelSet

	// mode chooses direct or staged transfers; tests and benchmarks force
	// one. Set before the device is shared.
	mode copyMode
	// path chooses the copy kernels or the copy engine for Gather and
	// Scatter (dma_plan.go); tests and benchmarks force one.
	path copyPath
	// batch: the DMA path enqueues its copies with cuMemcpyBatchAsync
	// (driver_dma.go); false where the driver lacks it, and in the
	// benchmark's copy-by-copy runs. Set before the device is shared.
	batch bool
	// batchRefused holds the first error with which the driver refused a
	// cuMemcpyBatchAsync call (batchRefusal): the device then enqueues a
	// call per copy (driverDevice.batching).
	batchRefused atomic.Pointer[error]
	// refuseBatch, set by a test before the device is shared, stands for
	// the driver's answer to every cuMemcpyBatchAsync call.
	refuseBatch error
	// dmaTune: the DMA path's checksum batch and copy queue (TuneDMA).
	// Set before the device is shared.
	dmaTune DMATuning
	// stageHalf overrides the size of each half of a stream's staging
	// buffer (defaultStageHalf); tests make it small to exercise batching.
	stageHalf uint64
	// busy counts the transfers in flight, gathers [0] and scatters [1]:
	// enqueued and not yet seen finished (DMATuning.SMControlDuplex).
	busy [2]atomic.Int64
	// moveTransfers counts the transfers whose tables and sums went by
	// kv_move (the tests' proof of SMControlDuplex's choice); a scatter
	// whose sums alone did (DMATuning.SMSumsScatter, on by default) is not
	// counted, so the count still says how often both directions met.
	moveTransfers atomic.Uint64
	// unitLaunches counts the kv_sum_units launches (the tests' proof of
	// which checksum kernel verified a transfer).
	unitLaunches atomic.Uint64
	// sumOnly, set only by BenchmarkDriverSums before the device is
	// shared, makes a DMA transfer enqueue its checksum kernels alone,
	// every batch with this many blocks per multiprocessor, and no copy
	// (0: off). Such a transfer moves no byte yet reports the pages' sums:
	// nothing outside that benchmark may set it (no setter exists).
	sumOnly int

	o   *ordinalState
	res resourceSet // its memory, host buffers, streams and events
}

// ordinalState is what every Device of one ordinal in this process shares,
// for the life of the process: the retained primary context, the loaded
// kernels and the pool of transfer table blocks. Creating them is slow
// (the kernels are JIT-compiled) and undoing them (cuModuleUnload, freeing
// memory) waits for the whole device, stalling every other user of it; so
// Device.Close releases only what that Device created.
type ordinalState struct {
	base driverDevice // the immutable fields every Device copies

	// enq is held shared by every thread that enqueues device work and
	// exclusively by drain from its idle check to the end of its frees: a
	// free runs only while no new work can reach the device, so it never
	// waits for work enqueued after the check (a free that waits holds back
	// every other thread's transfers, see freeLater).
	enq sync.RWMutex

	mu      sync.Mutex // guards the following
	jobs    []*job     // idle table blocks
	streams map[*driverStream]struct{}
	pending []func() error // frees waiting for the device to be idle

	clock deviceClock // the anchors of timers (driver_timer.go); its own lock

	order scatterOrder // DMATuning.OrderScatters; its own lock
}

// scatterOrder chains the copies of DMA scatters (DMATuning.OrderScatters):
// a scatter holds mu from its wait on ev, the state ev captured after the
// previous scatter's copies, to its own record of ev after its copies.
// Every wait refers to copies already enqueued, so the chain cannot
// deadlock. ev lives as long as the process's ordinal state.
type scatterOrder struct {
	mu sync.Mutex
	ev C.CUevent // nil until the first scatter records it
}

// freeLater runs free (cuMemFree_v2, cuMemFreeHost, cuIpcCloseMemHandle)
// once no stream of the ordinal in this process has work in flight. Those
// calls wait for the whole device to drain, and while one waits the driver
// holds back other threads' copies (cuMemcpy*Async), measured on an H200
// (driver 580): a free issued while another stream runs would stall
// unrelated transfers for as long. Deferred frees run at the next release,
// allocation, stream close or device close that finds the device idle.
func (o *ordinalState) freeLater(free func() error) error {
	o.mu.Lock()
	o.pending = append(o.pending, free)
	o.mu.Unlock()
	return o.drain()
}

// drain runs the deferred frees if the ordinal's streams are all idle.
func (o *ordinalState) drain() error {
	// Never blocks: a thread enqueuing now (or this very thread, when a
	// release runs under an enqueue) makes the frees wait for the next
	// drain.
	if !o.enq.TryLock() {
		return nil
	}
	defer o.enq.Unlock()
	o.mu.Lock()
	if len(o.pending) == 0 {
		o.mu.Unlock()
		return nil
	}
	// Queried under o.mu: a stream leaves o.streams before it is
	// destroyed, and gets its aux stream under o.mu.
	ctx := o.base.ctx
	for s := range o.streams {
		for _, h := range []C.CUstream{s.h, s.aux} {
			if h != nil && C.kv_stream_query(ctx, h) == C.KV_CUDA_ERROR_NOT_READY {
				o.mu.Unlock()
				return nil
			}
		}
	}
	pending := o.pending
	o.pending = nil
	o.mu.Unlock()
	var errs []error
	for _, f := range pending {
		errs = append(errs, f())
	}
	return errors.Join(errs...)
}

var ordinals = struct {
	mu sync.Mutex // guards m
	m  map[int]*ordinalState
}{m: make(map[int]*ordinalState)}

// preallocJobs table blocks of preallocJobSize bytes are made when an
// ordinal is first opened, so that ordinary transfers and uploads never
// allocate (allocations can wait for the device).
const (
	preallocJobs    = 4
	preallocJobSize = 1 << 20
)

// OpenCUDA opens CUDA device ordinal through the driver API: the first
// open of an ordinal in a process loads libcuda.so.1, retains the device's
// primary context and JIT-loads the copy kernels; later opens share them.
// Without the library or the device it returns an error wrapping
// ErrNoDriver.
func OpenCUDA(ordinal int) (Device, error) {
	d, err := openDriver(ordinal)
	if err != nil {
		return nil, err
	}
	return d, nil
}

func openDriver(ordinal int) (*driverDevice, error) {
	o, err := openOrdinal(ordinal)
	if err != nil {
		return nil, err
	}
	b := &o.base
	return &driverDevice{
		ordinal:   ordinal,
		dev:       b.dev,
		ctx:       b.ctx,
		info:      b.info,
		sms:       b.sms,
		module:    b.module,
		kernelSet: b.kernelSet,
		batch:     C.kv_has_memcpy_batch() != 0,
		dmaTune:   DefaultDMATuning(),
		o:         o,
		res:       resourceSet{name: fmt.Sprintf("CUDA device %d (%s)", ordinal, b.info.UUID)},
	}, nil
}

// openOrdinal returns the shared state of ordinal, creating it on first use.
func openOrdinal(ordinal int) (*ordinalState, error) {
	if err := loadDriver(); err != nil {
		return nil, err
	}
	ordinals.mu.Lock()
	defer ordinals.mu.Unlock()
	if o := ordinals.m[ordinal]; o != nil {
		return o, nil
	}
	var n C.int
	if err := check("cuDeviceGetCount", C.kv_device_count(&n)); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoDriver, err)
	}
	if ordinal < 0 || ordinal >= int(n) {
		return nil, fmt.Errorf("%w: device ordinal %d, the driver sees %d devices", ErrNoDriver, ordinal, int(n))
	}
	o := &ordinalState{streams: make(map[*driverStream]struct{})}
	d := &o.base
	d.ordinal = ordinal
	if err := check("cuDeviceGet", C.kv_device_get(&d.dev, C.int(ordinal))); err != nil {
		return nil, fmt.Errorf("cuda: device %d: %w", ordinal, err)
	}
	if err := d.describe(); err != nil {
		return nil, err
	}
	if err := check("cuDevicePrimaryCtxRetain", C.kv_primary_ctx_retain(&d.ctx, d.dev)); err != nil {
		return nil, fmt.Errorf("cuda: device %d: %w", ordinal, err)
	}
	if err := d.loadKernels(); err != nil {
		C.kv_primary_ctx_release(d.dev)
		return nil, err
	}
	d.o = o
	for range preallocJobs {
		j, err := d.newJob(preallocJobSize)
		if err != nil {
			break // transfers allocate their own
		}
		o.jobs = append(o.jobs, j)
	}
	ordinals.m[ordinal] = o
	return o, nil
}

func (d *driverDevice) attr(a C.int) (int, error) {
	var v C.int
	if err := check("cuDeviceGetAttribute", C.kv_device_attr(&v, a, d.dev)); err != nil {
		return 0, fmt.Errorf("cuda: device %d: %w", d.ordinal, err)
	}
	return int(v), nil
}

// describe fills Info and checks what the backend relies on: unified
// addressing and host memory mapped into the device.
func (d *driverDevice) describe() error {
	var name [256]C.char
	if err := check("cuDeviceGetName", C.kv_device_name(&name[0], C.int(len(name)), d.dev)); err != nil {
		return fmt.Errorf("cuda: device %d: %w", d.ordinal, err)
	}
	var mem C.size_t
	if err := check("cuDeviceTotalMem_v2", C.kv_device_total_mem(&mem, d.dev)); err != nil {
		return fmt.Errorf("cuda: device %d: %w", d.ordinal, err)
	}
	var u C.CUuuid
	if err := check("cuDeviceGetUuid", C.kv_device_uuid(&u, d.dev)); err != nil {
		return fmt.Errorf("cuda: device %d: %w", d.ordinal, err)
	}
	var bus [64]C.char
	pci := ""
	if check("cuDeviceGetPCIBusId", C.kv_device_pci_bus_id(&bus[0], C.int(len(bus)), d.dev)) == nil {
		pci = C.GoString(&bus[0])
	}
	ub := C.GoBytes(unsafe.Pointer(&u.bytes[0]), 16)
	d.info = Info{
		Backend: "cuda",
		Ordinal: d.ordinal,
		UUID:    formatUUID(ub),
		Name:    C.GoString(&name[0]),
		Memory:  uint64(mem),
		PCIBus:  pci,
	}
	var err error
	if d.sms, err = d.attr(C.KV_ATTR_MULTIPROCESSOR_COUNT); err != nil {
		return err
	}
	for _, need := range []struct {
		attr C.int
		what string
	}{
		{C.KV_ATTR_UNIFIED_ADDRESSING, "unified addressing"},
		{C.KV_ATTR_CAN_MAP_HOST_MEMORY, "mapping host memory"},
	} {
		v, err := d.attr(need.attr)
		if err != nil {
			return err
		}
		if v == 0 {
			return fmt.Errorf("%w: device %d (%s) does not support %s", ErrNoDriver, d.ordinal, d.info.Name, need.what)
		}
	}
	return nil
}

// formatUUID writes a device UUID as nvidia-smi and NVML do.
func formatUUID(b []byte) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// loadKernels JIT-compiles the committed PTX and finds the entry points.
func (d *driverDevice) loadKernels() error {
	ptx := C.CString(kernels.KVCopyPTX)
	defer C.free(unsafe.Pointer(ptx))
	var log [4096]C.char
	if err := check("cuModuleLoadDataEx", C.kv_module_load(d.ctx, &d.module, ptx, &log[0], C.size_t(len(log)))); err != nil {
		return fmt.Errorf("cuda: device %d: load kernels (JIT log: %q): %w", d.ordinal, C.GoString(&log[0]), err)
	}
	for _, f := range d.kernelSet.entries() {
		cname := C.CString(f.name)
		var fn C.CUfunction // a local: cgo may not see into d
		err := check("cuModuleGetFunction", C.kv_module_function(d.ctx, &fn, d.module, cname))
		C.free(unsafe.Pointer(cname))
		if err != nil {
			C.kv_module_unload(d.ctx, d.module)
			return fmt.Errorf("cuda: device %d: kernel %s: %w", d.ordinal, f.name, err)
		}
		*f.fn = fn
	}
	return nil
}

func (d *driverDevice) Info() Info { return d.info }

func (d *driverDevice) setPath(p copyPath) { d.path = p }

func (d *driverDevice) setMode(m copyMode) { d.mode = m }

func (d *driverDevice) smControlTransfers() uint64 { return d.moveTransfers.Load() }

func (d *driverDevice) tuneDMA(t DMATuning) { d.dmaTune = t }

func (d *driverDevice) copyBatching() (bool, error) {
	if p := d.batchRefused.Load(); p != nil {
		return false, *p
	}
	return d.batch, nil
}

// batching reports whether the DMA path enqueues with cuMemcpyBatchAsync:
// the driver has it and has not refused it.
func (d *driverDevice) batching() bool { return d.batch && d.batchRefused.Load() == nil }

// Close closes every stream (waiting for its work), destroys events and
// frees the memory and host buffers of this Device. The primary context and
// the kernels stay loaded for other Devices of the ordinal (see
// ordinalState). Idempotent.
func (d *driverDevice) Close() error {
	if !d.res.close() {
		return nil
	}
	streams := liveOf[*driverStream](&d.res)

	var errs []error
	for _, s := range streams {
		errs = append(errs, s.Close())
	}
	events, mems, bufs := liveOf[*driverEvent](&d.res), liveOf[*driverMem](&d.res), liveOf[*driverHostBuf](&d.res)
	for _, e := range events {
		errs = append(errs, e.Release())
	}
	for _, t := range liveOf[*driverTimer](&d.res) {
		errs = append(errs, t.Release())
	}
	// Imported and aliased views first: they may hold their allocation.
	for _, m := range mems {
		if m.kind != memOwned {
			errs = append(errs, m.Release())
		}
	}
	for _, m := range mems {
		errs = append(errs, m.Release())
		errs = append(errs, m.life.forceFree())
	}
	for _, b := range bufs {
		errs = append(errs, b.Release())
		errs = append(errs, b.life.forceFree())
	}
	errs = append(errs, d.o.drain())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cuda: close device %d: %w", d.ordinal, err)
	}
	return nil
}

// lifetime is the release protocol shared by memory, host buffers and
// events: Release marks the object released at once (later uses fail with
// ErrReleased), and the driver resource is freed when the last operation in
// flight that holds a reference has finished.
type lifetime struct {
	mu       sync.Mutex // guards the following
	released bool
	refs     int
	freed    bool
	free     func() error // frees the driver resource; run once
}

// acquire takes a reference, or reports that the object was released.
func (l *lifetime) acquire() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.released {
		return false
	}
	l.refs++
	return true
}

func (l *lifetime) isReleased() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.released
}

// unref drops a reference; the last one after release frees.
func (l *lifetime) unref() error {
	l.mu.Lock()
	l.refs--
	run := l.released && l.refs == 0 && !l.freed
	if run {
		l.freed = true
	}
	l.mu.Unlock()
	if run {
		return l.free()
	}
	return nil
}

// release marks the object released and frees it if nothing holds it. It
// reports whether this call released it.
func (l *lifetime) release() (first bool, err error) {
	l.mu.Lock()
	if l.released {
		l.mu.Unlock()
		return false, nil
	}
	l.released = true
	run := l.refs == 0 && !l.freed
	if run {
		l.freed = true
	}
	l.mu.Unlock()
	if run {
		return true, l.free()
	}
	return true, nil
}

// forceFree frees the resource even if references remain: Device.Close,
// after every stream has finished.
func (l *lifetime) forceFree() error {
	l.mu.Lock()
	l.released = true
	run := !l.freed
	l.freed = true
	l.mu.Unlock()
	if run {
		return l.free()
	}
	return nil
}

// refcount frees a driver resource when its last reference is dropped.
type refcount struct {
	mu    sync.Mutex // guards the following
	n     int
	freed bool
	free  func() error
}

// inc takes a reference, unless the resource was already freed.
func (r *refcount) inc() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.freed {
		return false
	}
	r.n++
	return true
}

// dec drops a reference and frees the resource with the last one.
func (r *refcount) dec() error {
	r.mu.Lock()
	r.n--
	run := r.n == 0 && !r.freed
	if run {
		r.freed = true
	}
	r.mu.Unlock()
	if run {
		return r.free()
	}
	return nil
}
