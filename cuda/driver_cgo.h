// driver_cgo.h: the slice of the CUDA driver API that kvtier uses, declared
// here so that no CUDA header or toolkit is needed to build. Every entry point
// is loaded at run time from libcuda.so.1 with dlsym (driver_cgo.c); the
// kv_* wrappers make the primary context current on the calling thread first,
// because a goroutine may run on any OS thread between two calls.

#ifndef KVTIER_DRIVER_CGO_H
#define KVTIER_DRIVER_CGO_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;

enum {
	KV_CUDA_SUCCESS = 0,
	KV_CUDA_ERROR_NOT_READY = 600,
	KV_CUDA_ERROR_NOT_SUPPORTED = 801,
	KV_ATTR_MULTIPROCESSOR_COUNT = 16,
	KV_ATTR_CAN_MAP_HOST_MEMORY = 19,
	KV_ATTR_UNIFIED_ADDRESSING = 41,
	KV_ATTR_CC_MAJOR = 75,
	KV_ATTR_CC_MINOR = 76,
	KV_MEMHOSTALLOC_PORTABLE = 0x01,
	KV_MEMHOSTALLOC_DEVICEMAP = 0x02,
	KV_MEMHOSTREGISTER_PORTABLE = 0x01,
	KV_MEMHOSTREGISTER_DEVICEMAP = 0x02,
	KV_MEMHOSTREGISTER_READ_ONLY = 0x08,
	KV_STREAM_NON_BLOCKING = 0x1,
	KV_EVENT_DISABLE_TIMING = 0x2,
	KV_EVENT_INTERPROCESS = 0x4,
	KV_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1,
	KV_IPC_HANDLE_SIZE = 64,
};

// kv_load dlopens libcuda.so.1 and resolves every entry point. It returns 0,
// or -1 with a message in err.
int kv_load(char *err, size_t errlen);

// Wrappers: each returns the CUresult of the driver call.
CUresult kv_init(void);
CUresult kv_driver_version(int *v);
const char *kv_error_name(CUresult r);
CUresult kv_device_count(int *n);
CUresult kv_device_get(CUdevice *d, int ordinal);
CUresult kv_device_name(char *name, int len, CUdevice d);
CUresult kv_device_total_mem(size_t *bytes, CUdevice d);
CUresult kv_device_uuid(CUuuid *u, CUdevice d);
CUresult kv_device_pci_bus_id(char *id, int len, CUdevice d);
CUresult kv_device_attr(int *v, int attr, CUdevice d);
CUresult kv_primary_ctx_retain(CUcontext *c, CUdevice d);
CUresult kv_primary_ctx_release(CUdevice d);

CUresult kv_mem_alloc(CUcontext c, CUdeviceptr *p, size_t n);
CUresult kv_mem_free(CUcontext c, CUdeviceptr p);
CUresult kv_mem_host_alloc(CUcontext c, void **p, size_t n, unsigned int flags);
CUresult kv_mem_free_host(CUcontext c, void *p);
CUresult kv_mem_host_register(CUcontext c, void *p, size_t n, unsigned int flags);
CUresult kv_mem_host_unregister(CUcontext c, void *p);
CUresult kv_mem_host_device_ptr(CUcontext c, CUdeviceptr *d, void *h);
CUresult kv_mem_address_range(CUcontext c, CUdeviceptr *base, size_t *size, CUdeviceptr p);
CUresult kv_memcpy_htod(CUcontext c, CUdeviceptr dst, const void *src, size_t n);
CUresult kv_memcpy_dtoh(CUcontext c, void *dst, CUdeviceptr src, size_t n);
CUresult kv_memcpy_htod_async(CUcontext c, CUdeviceptr dst, const void *src, size_t n, CUstream s);
CUresult kv_memcpy_dtoh_async(CUcontext c, void *dst, CUdeviceptr src, size_t n, CUstream s);
// kv_memcpy2d_async copies rows rows of width bytes between device memory
// (row k at dev + k*pitch) and host memory (row k at host + k*width), to the
// device when to_device, with cuMemcpy2DAsync_v2.
CUresult kv_memcpy2d_async(CUcontext c, CUdeviceptr dev, size_t pitch, void *host, size_t width, size_t rows,
	int to_device, CUstream s);
// kv_has_memcpy_batch reports whether the driver has cuMemcpyBatchAsync
// (CUDA 12.8+); kv_memcpy_batch_async enqueues count copies (sizes[i]
// bytes from srcs[i] to dsts[i], host addresses as unified addresses) on s
// in one call, in stream order, with the driver's flags (1: prefer to
// overlap with compute, the copy engines; 0: no hint). The arrays are read
// during the call.
int kv_has_memcpy_batch(void);
CUresult kv_memcpy_batch_async(CUcontext c, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
	unsigned int flags, CUstream s);
// kv_memcpy_each_async enqueues the same copies with a driver call each
// (cuMemcpyHtoDAsync or cuMemcpyDtoHAsync): where a batch call is refused.
CUresult kv_memcpy_each_async(CUcontext c, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
	int toDevice, CUstream s);
// Stream-ordered allocations (staging buffers): they never wait for the device.
CUresult kv_mem_alloc_async(CUcontext c, CUdeviceptr *p, size_t n, CUstream s);
CUresult kv_mem_free_async(CUcontext c, CUdeviceptr p, CUstream s);

CUresult kv_stream_create(CUcontext c, CUstream *s);
CUresult kv_stream_destroy(CUcontext c, CUstream s);
CUresult kv_stream_wait_event(CUcontext c, CUstream s, CUevent e);
CUresult kv_stream_query(CUcontext c, CUstream s);
CUresult kv_stream_synchronize(CUcontext c, CUstream s);

CUresult kv_event_create(CUcontext c, CUevent *e, unsigned int flags);
CUresult kv_event_record(CUcontext c, CUevent e, CUstream s);
CUresult kv_event_query(CUcontext c, CUevent e);
CUresult kv_event_synchronize(CUcontext c, CUevent e);
CUresult kv_event_destroy(CUcontext c, CUevent e);
CUresult kv_event_elapsed(CUcontext c, float *ms, CUevent start, CUevent end);

CUresult kv_ipc_get_mem_handle(CUcontext c, void *out64, CUdeviceptr p);
CUresult kv_ipc_open_mem_handle(CUcontext c, CUdeviceptr *p, const void *in64);
CUresult kv_ipc_close_mem_handle(CUcontext c, CUdeviceptr p);
CUresult kv_ipc_get_event_handle(CUcontext c, void *out64, CUevent e);
CUresult kv_ipc_open_event_handle(CUcontext c, CUevent *e, const void *in64);

// kv_module_load JIT-loads a NUL-terminated PTX image; on failure the JIT's
// error log is copied into log.
CUresult kv_module_load(CUcontext c, CUmodule *m, const char *ptx, char *log, size_t loglen);
CUresult kv_module_unload(CUcontext c, CUmodule m);
CUresult kv_module_function(CUcontext c, CUfunction *f, CUmodule m, const char *name);

// kv_launch_copy launches kv_gather or kv_scatter (see kernels/kvcopy.cu).
CUresult kv_launch_copy(CUcontext c, CUfunction f, unsigned int grid, unsigned int block, CUstream s,
	CUdeviceptr segs, unsigned int nsegs, CUdeviceptr spans, unsigned long long nchunks,
	CUdeviceptr partials, unsigned int flags);
// kv_launch_move launches kv_move, which copies n bytes from src to dst.
CUresult kv_launch_move(CUcontext c, CUfunction f, unsigned int grid, unsigned int block, CUstream s,
	CUdeviceptr dst, CUdeviceptr src, unsigned long long n);
// kv_launch_delay launches kv_delay, which spins for ns nanoseconds.
CUresult kv_launch_delay(CUcontext c, CUfunction f, CUstream s, unsigned long long ns);

#endif
