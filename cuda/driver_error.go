package cuda

import (
	"errors"
	"strconv"
)

// DriverError is a CUDA driver API call that failed. Errors of the CUDA
// backend wrap it (next to a sentinel where one applies), so callers can
// test errors.As(err, &de) and read the driver's own code and name.
type DriverError struct {
	Op   string // the driver entry point, e.g. "cuMemAlloc_v2"
	Code int    // the CUresult
	Name string // its name from cuGetErrorName, e.g. "CUDA_ERROR_OUT_OF_MEMORY"
}

func (e *DriverError) Error() string {
	return "cuda: " + e.Op + ": " + e.Name + " (" + strconv.Itoa(e.Code) + ")"
}

// The driver's codes that refuse a call rather than fail it.
const (
	cudaErrorInvalidValue = 1   // CUDA_ERROR_INVALID_VALUE: arguments (or attributes) it does not take
	cudaErrorNotPermitted = 800 // CUDA_ERROR_NOT_PERMITTED
	cudaErrorNotSupported = 801 // CUDA_ERROR_NOT_SUPPORTED
)

// batchRefusal reports whether err, a cuMemcpyBatchAsync call's failure, is
// the driver refusing the call (the DMA path then enqueues the same copies
// a call each and stops batching on the device) rather than a failure the
// per-copy calls would meet too (out of memory, a broken context): those
// fail the transfer and leave batching on. The copies' addresses were
// checked before the call (checkTransfer), so an invalid value is the
// call itself: its attributes or its form.
func batchRefusal(err error) bool {
	var de *DriverError
	if !errors.As(err, &de) {
		return false
	}
	switch de.Code {
	case cudaErrorInvalidValue, cudaErrorNotPermitted, cudaErrorNotSupported:
		return true
	}
	return false
}
