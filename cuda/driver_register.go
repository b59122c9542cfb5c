//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// RegisterHost pins b (a shared mapping the caller owns) with
// cuMemHostRegister, portable (every context may use it) and device-mapped
// (the transfer kernels read and write it directly), adding the read-only
// flag for a read-only mapping of another process's segment (a peer's L1).
// Release unregisters it; b stays mapped. Proven on the host backend only;
// the lead runs it on the H200 (the read-only flag needs
// CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED).
func (d *driverDevice) RegisterHost(b []byte, readOnly bool) (HostBuf, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	if err := checkRegisterable(b); err != nil {
		return nil, err
	}
	host := unsafe.Pointer(&b[0])
	flags := C.uint(C.KV_MEMHOSTREGISTER_PORTABLE | C.KV_MEMHOSTREGISTER_DEVICEMAP)
	if readOnly {
		flags |= C.KV_MEMHOSTREGISTER_READ_ONLY
	}
	if err := check("cuMemHostRegister_v2", C.kv_mem_host_register(d.ctx, host, C.size_t(len(b)), flags)); err != nil {
		return nil, fmt.Errorf("cuda: RegisterHost(%d B, read-only %t): %w", len(b), readOnly, err)
	}
	var dptr C.CUdeviceptr
	if err := check("cuMemHostGetDevicePointer_v2", C.kv_mem_host_device_ptr(d.ctx, &dptr, host)); err != nil {
		C.kv_mem_host_unregister(d.ctx, host)
		return nil, fmt.Errorf("cuda: RegisterHost(%d B): %w", len(b), err)
	}
	hb := &driverHostBuf{d: d, host: host, dptr: uint64(dptr), size: uint64(len(b)), buf: b}
	hb.life.free = func() error {
		return d.o.freeLater(func() error { return check("cuMemHostUnregister", C.kv_mem_host_unregister(d.ctx, host)) })
	}
	if err := d.res.add(hb); err != nil {
		hb.life.release()
		return nil, err
	}
	return hb, nil
}
