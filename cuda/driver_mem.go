//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

// memKind says how a driverMem came to be, and so how it is freed.
type memKind int

const (
	memOwned memKind = iota // cuMemAlloc_v2 of this process: cuMemFree_v2
	memIPC                  // cuIpcOpenMemHandle_v2: cuIpcCloseMemHandle
	memAlias                // an import of memory this process exported: drops its reference
)

// driverMem is device memory of the CUDA backend.
type driverMem struct {
	d     *driverDevice
	kind  memKind
	ptr   uint64 // device address of the view's first byte
	size  uint64
	base  uint64     // memIPC: the address cuIpcOpenMemHandle_v2 returned
	owner *driverMem // memAlias: the allocation it views
	life  lifetime
}

func (m *driverMem) Size() uint64 { return m.size }

// Release frees an allocation (imports of it in this process keep their
// views; those of other processes keep theirs as the driver guarantees) or
// closes an imported view. Operations in flight that use m finish first: the
// driver resource is freed when the last of them has completed.
func (m *driverMem) Release() error {
	if m.kind == memOwned {
		ipcRegistry.forgetMem(m)
	}
	first, err := m.life.release()
	if first {
		m.d.res.remove(m)
	}
	if err != nil {
		return fmt.Errorf("cuda: release %s: %w", m.describe(), err)
	}
	return nil
}

func (m *driverMem) describe() string {
	switch m.kind {
	case memIPC:
		return fmt.Sprintf("imported view of %d B", m.size)
	case memAlias:
		return fmt.Sprintf("imported view of %d B (exported by this process)", m.size)
	}
	return fmt.Sprintf("allocation of %d B", m.size)
}

func (m *driverMem) free() error {
	ctx := m.d.ctx
	switch m.kind {
	case memIPC:
		base := C.CUdeviceptr(m.base)
		return m.d.o.freeLater(func() error { return check("cuIpcCloseMemHandle", C.kv_ipc_close_mem_handle(ctx, base)) })
	case memAlias:
		return m.owner.life.unref()
	}
	ptr := C.CUdeviceptr(m.ptr)
	return m.d.o.freeLater(func() error { return check("cuMemFree_v2", C.kv_mem_free(ctx, ptr)) })
}

// acquire takes a reference for an operation, or fails with ErrReleased.
func (m *driverMem) acquire() error {
	if !m.life.acquire() {
		return fmt.Errorf("%w: %s", ErrReleased, m.describe())
	}
	return nil
}

func (d *driverDevice) newMem(kind memKind, ptr, size uint64) *driverMem {
	m := &driverMem{d: d, kind: kind, ptr: ptr, size: size}
	m.life.free = m.free
	return m
}

func (d *driverDevice) Alloc(size uint64) (Mem, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	if size == 0 {
		return nil, fmt.Errorf("%w: Alloc of 0 B", ErrOutOfRange)
	}
	d.o.drain() // its errors belong to earlier releases
	var p C.CUdeviceptr
	if err := check("cuMemAlloc_v2", C.kv_mem_alloc(d.ctx, &p, C.size_t(size))); err != nil {
		return nil, fmt.Errorf("cuda: Alloc(%d B): %w", size, err)
	}
	m := d.newMem(memOwned, uint64(p), size)
	if err := d.res.add(m); err != nil {
		m.life.release()
		return nil, err
	}
	return m, nil
}

// asMem returns m as memory of this device.
func (d *driverDevice) asMem(m Mem, what string) (*driverMem, error) {
	dm, ok := m.(*driverMem)
	if !ok || dm == nil {
		return nil, fmt.Errorf("%w: %s of a %T, not CUDA backend memory", ErrBadHandle, what, m)
	}
	if dm.d != d {
		return nil, fmt.Errorf("%w: %s of memory of another device (%d, %s)", ErrBadHandle, what, dm.d.ordinal, dm.d.info.UUID)
	}
	return dm, nil
}

// Write copies src to dst at off, synchronously (cuMemcpyHtoD_v2).
func (d *driverDevice) Write(dst Mem, off uint64, src []byte) error {
	m, err := d.asMem(dst, "Write")
	if err != nil {
		return err
	}
	if err := checkRange(off, uint64(len(src)), m.size); err != nil {
		return fmt.Errorf("Write: %w", err)
	}
	if err := m.acquire(); err != nil {
		return fmt.Errorf("Write: %w", err)
	}
	defer m.life.unref()
	if len(src) == 0 {
		return nil
	}
	if err := check("cuMemcpyHtoD_v2", C.kv_memcpy_htod(d.ctx, C.CUdeviceptr(m.ptr+off), unsafe.Pointer(&src[0]), C.size_t(len(src)))); err != nil {
		return fmt.Errorf("cuda: Write of %d B at %d: %w", len(src), off, err)
	}
	return nil
}

// Read copies from src at off into dst, synchronously (cuMemcpyDtoH_v2).
func (d *driverDevice) Read(src Mem, off uint64, dst []byte) error {
	m, err := d.asMem(src, "Read")
	if err != nil {
		return err
	}
	if err := checkRange(off, uint64(len(dst)), m.size); err != nil {
		return fmt.Errorf("Read: %w", err)
	}
	if err := m.acquire(); err != nil {
		return fmt.Errorf("Read: %w", err)
	}
	defer m.life.unref()
	if len(dst) == 0 {
		return nil
	}
	if err := check("cuMemcpyDtoH_v2", C.kv_memcpy_dtoh(d.ctx, unsafe.Pointer(&dst[0]), C.CUdeviceptr(m.ptr+off), C.size_t(len(dst)))); err != nil {
		return fmt.Errorf("cuda: Read of %d B at %d: %w", len(dst), off, err)
	}
	return nil
}

// driverHostBuf is pinned host memory, portable and mapped into the device
// (cuMemHostAlloc); kernels read and write it directly.
type driverHostBuf struct {
	d    *driverDevice
	host unsafe.Pointer
	dptr uint64 // the device address of host
	size uint64
	buf  []byte
	life lifetime
}

// hostAllocRound rounds pinned allocations up, so that a kernel's aligned
// 16-byte access to the last bytes of a buffer stays inside it.
const hostAllocRound = 64

func (d *driverDevice) AllocHost(size uint64) (HostBuf, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	if size == 0 {
		return nil, fmt.Errorf("%w: AllocHost of 0 B", ErrOutOfRange)
	}
	if size > uint64(maxInt)-hostAllocRound {
		return nil, fmt.Errorf("%w: AllocHost of %d B exceeds the address space", ErrOutOfRange, size)
	}
	host, dptr, err := d.pinned((size + hostAllocRound - 1) &^ (hostAllocRound - 1))
	if err != nil {
		return nil, fmt.Errorf("cuda: AllocHost(%d B): %w", size, err)
	}
	b := &driverHostBuf{d: d, host: host, dptr: dptr, size: size, buf: unsafe.Slice((*byte)(host), size)}
	b.life.free = func() error {
		return d.o.freeLater(func() error { return check("cuMemFreeHost", C.kv_mem_free_host(d.ctx, host)) })
	}
	if err := d.res.add(b); err != nil {
		b.life.release()
		return nil, err
	}
	return b, nil
}

// pinned allocates portable, device-mapped pinned memory.
func (d *driverDevice) pinned(size uint64) (unsafe.Pointer, uint64, error) {
	var host unsafe.Pointer
	flags := C.uint(C.KV_MEMHOSTALLOC_PORTABLE | C.KV_MEMHOSTALLOC_DEVICEMAP)
	if err := check("cuMemHostAlloc", C.kv_mem_host_alloc(d.ctx, &host, C.size_t(size), flags)); err != nil {
		return nil, 0, err
	}
	var dptr C.CUdeviceptr
	if err := check("cuMemHostGetDevicePointer_v2", C.kv_mem_host_device_ptr(d.ctx, &dptr, host)); err != nil {
		C.kv_mem_free_host(d.ctx, host)
		return nil, 0, err
	}
	return host, uint64(dptr), nil
}

// Bytes returns the buffer, or nil after Release.
func (b *driverHostBuf) Bytes() []byte {
	if b.life.isReleased() {
		return nil
	}
	return b.buf
}

// Release frees the buffer once no operation in flight uses it.
// Idempotent.
func (b *driverHostBuf) Release() error {
	first, err := b.life.release()
	if first {
		b.d.res.remove(b)
	}
	if err != nil {
		return fmt.Errorf("cuda: release host buffer of %d B: %w", b.size, err)
	}
	return nil
}

// ipcHandleSize is the size of a legacy IPC handle (CUipcMemHandle,
// CUipcEventHandle).
const ipcHandleSize = 64

type handleKey [ipcHandleSize]byte

// ipcTable remembers the handles this process exported, so that it can
// import them itself: the driver opens a legacy IPC handle only in another
// process.
type ipcTable struct {
	mu     sync.Mutex // guards the following
	mems   map[handleKey]*driverMem
	events map[handleKey]*eventCore
}

var ipcRegistry = ipcTable{
	mems:   make(map[handleKey]*driverMem),
	events: make(map[handleKey]*eventCore),
}

func (r *ipcTable) forgetMem(m *driverMem) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, v := range r.mems {
		if v == m {
			delete(r.mems, k)
		}
	}
}

func (r *ipcTable) forgetEvent(c *eventCore) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, v := range r.events {
		if v == c {
			delete(r.events, k)
		}
	}
}

// ExportMem returns a legacy IPC handle (cuIpcGetMemHandle) of m's
// allocation with the view [off, off+size).
func (d *driverDevice) ExportMem(m Mem, off, size uint64) (MemHandle, error) {
	dm, err := d.asMem(m, "ExportMem")
	if err != nil {
		return MemHandle{}, err
	}
	if dm.kind != memOwned {
		return MemHandle{}, fmt.Errorf("%w: ExportMem of an imported view (export from the owning process)", ErrBadHandle)
	}
	if size == 0 || off > dm.size || size > dm.size-off {
		return MemHandle{}, fmt.Errorf("%w: ExportMem view [%d, +%d B) of a %d B allocation", ErrOutOfRange, off, size, dm.size)
	}
	if err := dm.acquire(); err != nil {
		return MemHandle{}, fmt.Errorf("ExportMem: %w", err)
	}
	defer dm.life.unref()
	var raw handleKey
	if err := check("cuIpcGetMemHandle", C.kv_ipc_get_mem_handle(d.ctx, unsafe.Pointer(&raw[0]), C.CUdeviceptr(dm.ptr))); err != nil {
		return MemHandle{}, fmt.Errorf("cuda: ExportMem: %w", err)
	}
	ipcRegistry.mu.Lock()
	ipcRegistry.mems[raw] = dm
	ipcRegistry.mu.Unlock()
	return MemHandle{Backend: "cuda", Device: d.info.UUID, Raw: raw[:], Offset: off, Size: size}, nil
}

func (d *driverDevice) checkHandle(backend, dev string, raw []byte) (handleKey, error) {
	var key handleKey
	if backend != "cuda" {
		return key, fmt.Errorf("%w: backend %q, want \"cuda\"", ErrBadHandle, backend)
	}
	if dev != d.info.UUID {
		return key, fmt.Errorf("%w: handle of device %q opened on device %q", ErrBadHandle, dev, d.info.UUID)
	}
	if len(raw) != len(key) {
		return key, fmt.Errorf("%w: %d handle bytes, want %d", ErrBadHandle, len(raw), len(key))
	}
	copy(key[:], raw)
	return key, nil
}

// ImportMem opens a handle: through cuIpcOpenMemHandle_v2 when another
// process exported it, as a view of the allocation when this one did.
func (d *driverDevice) ImportMem(h MemHandle) (Mem, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	key, err := d.checkHandle(h.Backend, h.Device, h.Raw)
	if err != nil {
		return nil, err
	}
	if h.Size == 0 || h.Offset+h.Size < h.Offset {
		return nil, fmt.Errorf("%w: view [%d, +%d B)", ErrBadHandle, h.Offset, h.Size)
	}
	ipcRegistry.mu.Lock()
	owner := ipcRegistry.mems[key]
	ipcRegistry.mu.Unlock()

	var m *driverMem
	if owner != nil {
		if owner.d.ctx != d.ctx {
			return nil, fmt.Errorf("%w: memory exported by this process on another context", ErrBadHandle)
		}
		if !owner.life.acquire() {
			return nil, fmt.Errorf("%w: %w: the exported allocation was freed", ErrBadHandle, ErrReleased)
		}
		if h.Offset+h.Size > owner.size {
			owner.life.unref()
			return nil, fmt.Errorf("%w: view [%d, %d) of an allocation of %d B", ErrBadHandle, h.Offset, h.Offset+h.Size, owner.size)
		}
		m = d.newMem(memAlias, owner.ptr+h.Offset, h.Size)
		m.owner = owner
	} else {
		var base C.CUdeviceptr
		if err := check("cuIpcOpenMemHandle_v2", C.kv_ipc_open_mem_handle(d.ctx, &base, unsafe.Pointer(&key[0]))); err != nil {
			return nil, fmt.Errorf("%w: ImportMem: %w", ErrBadHandle, err)
		}
		var rb C.CUdeviceptr
		var rs C.size_t
		if err := check("cuMemGetAddressRange_v2", C.kv_mem_address_range(d.ctx, &rb, &rs, base)); err != nil {
			C.kv_ipc_close_mem_handle(d.ctx, base)
			return nil, fmt.Errorf("cuda: ImportMem: %w", err)
		}
		if limit := uint64(rs) - uint64(base-rb); h.Offset+h.Size > limit {
			C.kv_ipc_close_mem_handle(d.ctx, base)
			return nil, fmt.Errorf("%w: view [%d, %d) of an allocation of %d B", ErrBadHandle, h.Offset, h.Offset+h.Size, limit)
		}
		m = d.newMem(memIPC, uint64(base)+h.Offset, h.Size)
		m.base = uint64(base)
	}
	if err := d.res.add(m); err != nil {
		m.life.release()
		return nil, err
	}
	return m, nil
}
