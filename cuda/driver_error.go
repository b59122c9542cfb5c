package cuda

import "strconv"

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
