//go:build cgo && linux

// driver_cgo.c: loads libcuda.so.1 with dlopen and calls it through function
// pointers resolved by dlsym. Prototypes are the driver API's (cuda.h), the
// _v2 names where the driver exports them.

#include "driver_cgo.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int CUjit_option;

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDriverGetVersion)(int *);
static CUresult (*p_cuGetErrorName)(CUresult, const char **);
static CUresult (*p_cuDeviceGetCount)(int *);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDeviceGetName)(char *, int, CUdevice);
static CUresult (*p_cuDeviceTotalMem_v2)(size_t *, CUdevice);
static CUresult (*p_cuDeviceGetUuid)(CUuuid *, CUdevice);
static CUresult (*p_cuDeviceGetPCIBusId)(char *, int, CUdevice);
static CUresult (*p_cuDeviceGetAttribute)(int *, int, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRelease_v2)(CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree_v2)(CUdeviceptr);
static CUresult (*p_cuMemHostAlloc)(void **, size_t, unsigned int);
static CUresult (*p_cuMemFreeHost)(void *);
static CUresult (*p_cuMemHostRegister_v2)(void *, size_t, unsigned int);
static CUresult (*p_cuMemHostUnregister)(void *);
static CUresult (*p_cuMemHostGetDevicePointer_v2)(CUdeviceptr *, void *, unsigned int);
static CUresult (*p_cuMemGetAddressRange_v2)(CUdeviceptr *, size_t *, CUdeviceptr);
static CUresult (*p_cuMemcpyHtoD_v2)(CUdeviceptr, const void *, size_t);
static CUresult (*p_cuMemcpyDtoH_v2)(void *, CUdeviceptr, size_t);
static CUresult (*p_cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*p_cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
// CUDA_MEMCPY2D of cuda.h, field for field.
typedef struct {
	size_t srcXInBytes, srcY;
	int srcMemoryType;
	const void *srcHost;
	CUdeviceptr srcDevice;
	void *srcArray;
	size_t srcPitch;
	size_t dstXInBytes, dstY;
	int dstMemoryType;
	void *dstHost;
	CUdeviceptr dstDevice;
	void *dstArray;
	size_t dstPitch;
	size_t WidthInBytes, Height;
} kv_memcpy2d;
_Static_assert(sizeof(kv_memcpy2d) == 128, "CUDA_MEMCPY2D is 128 bytes on LP64");
enum { KV_MEMORYTYPE_HOST = 1, KV_MEMORYTYPE_DEVICE = 2 };

static CUresult (*p_cuMemcpy2DAsync_v2)(const kv_memcpy2d *, CUstream);
// CUmemcpyAttributes of cuda.h (CUDA 12.8+), field for field: the source
// access order, two CUmemLocation hints ({type, id}) and the flags.
typedef struct {
	int srcAccessOrder;
	int srcLocType, srcLocID;
	int dstLocType, dstLocID;
	unsigned int flags;
} kv_memcpy_attrs;
_Static_assert(sizeof(kv_memcpy_attrs) == 24, "CUmemcpyAttributes is 24 bytes");
enum { KV_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1, KV_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1 };
// Optional (NULL when the driver lacks them): cuMemcpyBatchAsync_v2 of
// CUDA 13 (what cuda.h 13 calls cuMemcpyBatchAsync) and the CUDA 12.8
// cuMemcpyBatchAsync, which takes a failIdx before the stream.
static CUresult (*p_cuMemcpyBatchAsync_v2)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, kv_memcpy_attrs *,
	size_t *, size_t, CUstream);
static CUresult (*p_cuMemcpyBatchAsync_v1)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, kv_memcpy_attrs *,
	size_t *, size_t, size_t *, CUstream);
static CUresult (*p_cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream);
static CUresult (*p_cuMemFreeAsync)(CUdeviceptr, CUstream);
static CUresult (*p_cuStreamCreate)(CUstream *, unsigned int);
static CUresult (*p_cuStreamDestroy_v2)(CUstream);
static CUresult (*p_cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
static CUresult (*p_cuStreamQuery)(CUstream);
static CUresult (*p_cuStreamSynchronize)(CUstream);
static CUresult (*p_cuEventCreate)(CUevent *, unsigned int);
static CUresult (*p_cuEventRecord)(CUevent, CUstream);
static CUresult (*p_cuEventQuery)(CUevent);
static CUresult (*p_cuEventSynchronize)(CUevent);
static CUresult (*p_cuEventDestroy_v2)(CUevent);
static CUresult (*p_cuEventElapsedTime)(float *, CUevent, CUevent);
static CUresult (*p_cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
static CUresult (*p_cuIpcOpenMemHandle_v2)(CUdeviceptr *, CUipcMemHandle, unsigned int);
static CUresult (*p_cuIpcCloseMemHandle)(CUdeviceptr);
static CUresult (*p_cuIpcGetEventHandle)(CUipcEventHandle *, CUevent);
static CUresult (*p_cuIpcOpenEventHandle)(CUevent *, CUipcEventHandle);
static CUresult (*p_cuModuleLoadDataEx)(CUmodule *, const void *, unsigned int, CUjit_option *, void **);
static CUresult (*p_cuModuleUnload)(CUmodule);
static CUresult (*p_cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*p_cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int,
	unsigned int, unsigned int, unsigned int, unsigned int, CUstream, void **, void **);

struct sym {
	const char *name;
	const char *alt; // older name tried when name is missing, or NULL
	void **fn;
};

#define SYM(v, n, a) {n, a, (void **)&v}

int kv_load(char *err, size_t errlen) {
	static const struct sym syms[] = {
		SYM(p_cuInit, "cuInit", NULL),
		SYM(p_cuDriverGetVersion, "cuDriverGetVersion", NULL),
		SYM(p_cuGetErrorName, "cuGetErrorName", NULL),
		SYM(p_cuDeviceGetCount, "cuDeviceGetCount", NULL),
		SYM(p_cuDeviceGet, "cuDeviceGet", NULL),
		SYM(p_cuDeviceGetName, "cuDeviceGetName", NULL),
		SYM(p_cuDeviceTotalMem_v2, "cuDeviceTotalMem_v2", NULL),
		SYM(p_cuDeviceGetUuid, "cuDeviceGetUuid_v2", "cuDeviceGetUuid"),
		SYM(p_cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId", NULL),
		SYM(p_cuDeviceGetAttribute, "cuDeviceGetAttribute", NULL),
		SYM(p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL),
		SYM(p_cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
		SYM(p_cuCtxSetCurrent, "cuCtxSetCurrent", NULL),
		SYM(p_cuMemAlloc_v2, "cuMemAlloc_v2", NULL),
		SYM(p_cuMemFree_v2, "cuMemFree_v2", NULL),
		SYM(p_cuMemHostAlloc, "cuMemHostAlloc", NULL),
		SYM(p_cuMemFreeHost, "cuMemFreeHost", NULL),
		SYM(p_cuMemHostRegister_v2, "cuMemHostRegister_v2", "cuMemHostRegister"),
		SYM(p_cuMemHostUnregister, "cuMemHostUnregister", NULL),
		SYM(p_cuMemHostGetDevicePointer_v2, "cuMemHostGetDevicePointer_v2", NULL),
		SYM(p_cuMemGetAddressRange_v2, "cuMemGetAddressRange_v2", NULL),
		SYM(p_cuMemcpyHtoD_v2, "cuMemcpyHtoD_v2", NULL),
		SYM(p_cuMemcpyDtoH_v2, "cuMemcpyDtoH_v2", NULL),
		SYM(p_cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync_v2", NULL),
		SYM(p_cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync_v2", NULL),
		SYM(p_cuMemcpy2DAsync_v2, "cuMemcpy2DAsync_v2", NULL),
		SYM(p_cuMemAllocAsync, "cuMemAllocAsync", NULL),
		SYM(p_cuMemFreeAsync, "cuMemFreeAsync", NULL),
		SYM(p_cuStreamCreate, "cuStreamCreate", NULL),
		SYM(p_cuStreamDestroy_v2, "cuStreamDestroy_v2", NULL),
		SYM(p_cuStreamWaitEvent, "cuStreamWaitEvent", NULL),
		SYM(p_cuStreamQuery, "cuStreamQuery", NULL),
		SYM(p_cuStreamSynchronize, "cuStreamSynchronize", NULL),
		SYM(p_cuEventCreate, "cuEventCreate", NULL),
		SYM(p_cuEventRecord, "cuEventRecord", NULL),
		SYM(p_cuEventQuery, "cuEventQuery", NULL),
		SYM(p_cuEventSynchronize, "cuEventSynchronize", NULL),
		SYM(p_cuEventDestroy_v2, "cuEventDestroy_v2", NULL),
		SYM(p_cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime"),
		SYM(p_cuIpcGetMemHandle, "cuIpcGetMemHandle", NULL),
		SYM(p_cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle_v2", NULL),
		SYM(p_cuIpcCloseMemHandle, "cuIpcCloseMemHandle", NULL),
		SYM(p_cuIpcGetEventHandle, "cuIpcGetEventHandle", NULL),
		SYM(p_cuIpcOpenEventHandle, "cuIpcOpenEventHandle", NULL),
		SYM(p_cuModuleLoadDataEx, "cuModuleLoadDataEx", NULL),
		SYM(p_cuModuleUnload, "cuModuleUnload", NULL),
		SYM(p_cuModuleGetFunction, "cuModuleGetFunction", NULL),
		SYM(p_cuLaunchKernel, "cuLaunchKernel", NULL),
	};
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (lib == NULL) {
		const char *e = dlerror();
		snprintf(err, errlen, "dlopen libcuda.so.1: %s", e ? e : "unknown error");
		return -1;
	}
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		void *f = dlsym(lib, syms[i].name);
		if (f == NULL && syms[i].alt != NULL) {
			f = dlsym(lib, syms[i].alt);
		}
		if (f == NULL) {
			snprintf(err, errlen, "libcuda.so.1 lacks %s", syms[i].name);
			dlclose(lib);
			return -1;
		}
		*syms[i].fn = f;
	}
	p_cuMemcpyBatchAsync_v2 = dlsym(lib, "cuMemcpyBatchAsync_v2");
	if (p_cuMemcpyBatchAsync_v2 == NULL) {
		p_cuMemcpyBatchAsync_v1 = dlsym(lib, "cuMemcpyBatchAsync");
	}
	return 0;
}

#define CTX(c)                                  \
	do {                                        \
		CUresult r_ = p_cuCtxSetCurrent(c);     \
		if (r_ != KV_CUDA_SUCCESS) return r_;   \
	} while (0)

CUresult kv_init(void) { return p_cuInit(0); }
CUresult kv_driver_version(int *v) { return p_cuDriverGetVersion(v); }

const char *kv_error_name(CUresult r) {
	const char *s = NULL;
	if (p_cuGetErrorName == NULL || p_cuGetErrorName(r, &s) != KV_CUDA_SUCCESS || s == NULL) {
		return "CUDA_ERROR_UNKNOWN_CODE";
	}
	return s;
}

CUresult kv_device_count(int *n) { return p_cuDeviceGetCount(n); }
CUresult kv_device_get(CUdevice *d, int ordinal) { return p_cuDeviceGet(d, ordinal); }
CUresult kv_device_name(char *name, int len, CUdevice d) { return p_cuDeviceGetName(name, len, d); }
CUresult kv_device_total_mem(size_t *bytes, CUdevice d) { return p_cuDeviceTotalMem_v2(bytes, d); }
CUresult kv_device_uuid(CUuuid *u, CUdevice d) { return p_cuDeviceGetUuid(u, d); }
CUresult kv_device_pci_bus_id(char *id, int len, CUdevice d) { return p_cuDeviceGetPCIBusId(id, len, d); }
CUresult kv_device_attr(int *v, int attr, CUdevice d) { return p_cuDeviceGetAttribute(v, attr, d); }
CUresult kv_primary_ctx_retain(CUcontext *c, CUdevice d) { return p_cuDevicePrimaryCtxRetain(c, d); }
CUresult kv_primary_ctx_release(CUdevice d) { return p_cuDevicePrimaryCtxRelease_v2(d); }

CUresult kv_mem_alloc(CUcontext c, CUdeviceptr *p, size_t n) { CTX(c); return p_cuMemAlloc_v2(p, n); }
CUresult kv_mem_free(CUcontext c, CUdeviceptr p) { CTX(c); return p_cuMemFree_v2(p); }
CUresult kv_mem_host_alloc(CUcontext c, void **p, size_t n, unsigned int flags) {
	CTX(c);
	return p_cuMemHostAlloc(p, n, flags);
}
CUresult kv_mem_free_host(CUcontext c, void *p) { CTX(c); return p_cuMemFreeHost(p); }
CUresult kv_mem_host_register(CUcontext c, void *p, size_t n, unsigned int flags) {
	CTX(c);
	return p_cuMemHostRegister_v2(p, n, flags);
}
CUresult kv_mem_host_unregister(CUcontext c, void *p) { CTX(c); return p_cuMemHostUnregister(p); }
CUresult kv_mem_host_device_ptr(CUcontext c, CUdeviceptr *d, void *h) {
	CTX(c);
	return p_cuMemHostGetDevicePointer_v2(d, h, 0);
}
CUresult kv_mem_address_range(CUcontext c, CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	CTX(c);
	return p_cuMemGetAddressRange_v2(base, size, p);
}
CUresult kv_memcpy_htod(CUcontext c, CUdeviceptr dst, const void *src, size_t n) {
	CTX(c);
	return p_cuMemcpyHtoD_v2(dst, src, n);
}
CUresult kv_memcpy_dtoh(CUcontext c, void *dst, CUdeviceptr src, size_t n) {
	CTX(c);
	return p_cuMemcpyDtoH_v2(dst, src, n);
}
CUresult kv_memcpy_htod_async(CUcontext c, CUdeviceptr dst, const void *src, size_t n, CUstream s) {
	CTX(c);
	return p_cuMemcpyHtoDAsync_v2(dst, src, n, s);
}
CUresult kv_memcpy_dtoh_async(CUcontext c, void *dst, CUdeviceptr src, size_t n, CUstream s) {
	CTX(c);
	return p_cuMemcpyDtoHAsync_v2(dst, src, n, s);
}
CUresult kv_memcpy2d_async(CUcontext c, CUdeviceptr dev, size_t pitch, void *host, size_t width, size_t rows,
	int to_device, CUstream s) {
	CTX(c);
	kv_memcpy2d p;
	memset(&p, 0, sizeof p);
	if (to_device) {
		p.srcMemoryType = KV_MEMORYTYPE_HOST;
		p.srcHost = host;
		p.srcPitch = width;
		p.dstMemoryType = KV_MEMORYTYPE_DEVICE;
		p.dstDevice = dev;
		p.dstPitch = pitch;
	} else {
		p.srcMemoryType = KV_MEMORYTYPE_DEVICE;
		p.srcDevice = dev;
		p.srcPitch = pitch;
		p.dstMemoryType = KV_MEMORYTYPE_HOST;
		p.dstHost = host;
		p.dstPitch = width;
	}
	p.WidthInBytes = width;
	p.Height = rows;
	return p_cuMemcpy2DAsync_v2(&p, s);
}
int kv_has_memcpy_batch(void) { return p_cuMemcpyBatchAsync_v2 != NULL || p_cuMemcpyBatchAsync_v1 != NULL; }

CUresult kv_memcpy_batch_async(CUcontext c, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
	unsigned int flags, CUstream s) {
	CTX(c);
	kv_memcpy_attrs a;
	memset(&a, 0, sizeof a);
	a.srcAccessOrder = KV_MEMCPY_SRC_ACCESS_ORDER_STREAM;
	a.flags = flags & KV_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
	size_t idx = 0;
	if (p_cuMemcpyBatchAsync_v2 != NULL) {
		return p_cuMemcpyBatchAsync_v2(dsts, srcs, sizes, count, &a, &idx, 1, s);
	}
	if (p_cuMemcpyBatchAsync_v1 != NULL) {
		size_t fail = 0;
		return p_cuMemcpyBatchAsync_v1(dsts, srcs, sizes, count, &a, &idx, 1, &fail, s);
	}
	return KV_CUDA_ERROR_NOT_SUPPORTED;
}

CUresult kv_memcpy_each_async(CUcontext c, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
	int toDevice, CUstream s) {
	CTX(c);
	for (size_t i = 0; i < count; i++) {
		CUresult r = toDevice ? p_cuMemcpyHtoDAsync_v2(dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i], s)
				      : p_cuMemcpyDtoHAsync_v2((void *)(uintptr_t)dsts[i], srcs[i], sizes[i], s);
		if (r != 0) {
			return r;
		}
	}
	return 0;
}

CUresult kv_mem_alloc_async(CUcontext c, CUdeviceptr *p, size_t n, CUstream s) {
	CTX(c);
	return p_cuMemAllocAsync(p, n, s);
}
CUresult kv_mem_free_async(CUcontext c, CUdeviceptr p, CUstream s) { CTX(c); return p_cuMemFreeAsync(p, s); }

CUresult kv_stream_create(CUcontext c, CUstream *s) { CTX(c); return p_cuStreamCreate(s, KV_STREAM_NON_BLOCKING); }
CUresult kv_stream_destroy(CUcontext c, CUstream s) { CTX(c); return p_cuStreamDestroy_v2(s); }
CUresult kv_stream_wait_event(CUcontext c, CUstream s, CUevent e) { CTX(c); return p_cuStreamWaitEvent(s, e, 0); }
CUresult kv_stream_query(CUcontext c, CUstream s) { CTX(c); return p_cuStreamQuery(s); }
CUresult kv_stream_synchronize(CUcontext c, CUstream s) { CTX(c); return p_cuStreamSynchronize(s); }

CUresult kv_event_create(CUcontext c, CUevent *e, unsigned int flags) { CTX(c); return p_cuEventCreate(e, flags); }
CUresult kv_event_record(CUcontext c, CUevent e, CUstream s) { CTX(c); return p_cuEventRecord(e, s); }
CUresult kv_event_query(CUcontext c, CUevent e) { CTX(c); return p_cuEventQuery(e); }
CUresult kv_event_synchronize(CUcontext c, CUevent e) { CTX(c); return p_cuEventSynchronize(e); }
CUresult kv_event_destroy(CUcontext c, CUevent e) { CTX(c); return p_cuEventDestroy_v2(e); }
CUresult kv_event_elapsed(CUcontext c, float *ms, CUevent start, CUevent end) {
	CTX(c);
	return p_cuEventElapsedTime(ms, start, end);
}

CUresult kv_ipc_get_mem_handle(CUcontext c, void *out64, CUdeviceptr p) {
	CTX(c);
	CUipcMemHandle h;
	CUresult r = p_cuIpcGetMemHandle(&h, p);
	if (r == KV_CUDA_SUCCESS) memcpy(out64, h.reserved, sizeof h.reserved);
	return r;
}
CUresult kv_ipc_open_mem_handle(CUcontext c, CUdeviceptr *p, const void *in64) {
	CTX(c);
	CUipcMemHandle h;
	memcpy(h.reserved, in64, sizeof h.reserved);
	return p_cuIpcOpenMemHandle_v2(p, h, KV_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}
CUresult kv_ipc_close_mem_handle(CUcontext c, CUdeviceptr p) { CTX(c); return p_cuIpcCloseMemHandle(p); }
CUresult kv_ipc_get_event_handle(CUcontext c, void *out64, CUevent e) {
	CTX(c);
	CUipcEventHandle h;
	CUresult r = p_cuIpcGetEventHandle(&h, e);
	if (r == KV_CUDA_SUCCESS) memcpy(out64, h.reserved, sizeof h.reserved);
	return r;
}
CUresult kv_ipc_open_event_handle(CUcontext c, CUevent *e, const void *in64) {
	CTX(c);
	CUipcEventHandle h;
	memcpy(h.reserved, in64, sizeof h.reserved);
	return p_cuIpcOpenEventHandle(e, h);
}

CUresult kv_module_load(CUcontext c, CUmodule *m, const char *ptx, char *log, size_t loglen) {
	CTX(c);
	enum { JIT_ERROR_LOG_BUFFER = 5, JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6 };
	CUjit_option opts[2] = {JIT_ERROR_LOG_BUFFER, JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
	void *vals[2] = {log, (void *)(uintptr_t)loglen};
	if (loglen > 0) log[0] = 0;
	return p_cuModuleLoadDataEx(m, ptx, 2, opts, vals);
}
CUresult kv_module_unload(CUcontext c, CUmodule m) { CTX(c); return p_cuModuleUnload(m); }
CUresult kv_module_function(CUcontext c, CUfunction *f, CUmodule m, const char *name) {
	CTX(c);
	return p_cuModuleGetFunction(f, m, name);
}

CUresult kv_launch_copy(CUcontext c, CUfunction f, unsigned int grid, unsigned int block, CUstream s,
	CUdeviceptr segs, unsigned int nsegs, CUdeviceptr spans, unsigned long long nchunks,
	CUdeviceptr partials, unsigned int flags) {
	CTX(c);
	void *params[] = {&segs, &nsegs, &spans, &nchunks, &partials, &flags};
	return p_cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, s, params, NULL);
}

CUresult kv_launch_move(CUcontext c, CUfunction f, unsigned int grid, unsigned int block, CUstream s,
	CUdeviceptr dst, CUdeviceptr src, unsigned long long n) {
	CTX(c);
	void *params[] = {&dst, &src, &n};
	return p_cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, s, params, NULL);
}

CUresult kv_launch_delay(CUcontext c, CUfunction f, CUstream s, unsigned long long ns) {
	CTX(c);
	void *params[] = {&ns};
	return p_cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
}
