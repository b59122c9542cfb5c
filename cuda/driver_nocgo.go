//go:build !cgo || !linux

package cuda

import "fmt"

// OpenCUDA opens CUDA device ordinal through the driver API. This binary was
// built without cgo (or not for Linux), so it cannot load libcuda.so.1 and
// always returns an error wrapping ErrNoDriver.
func OpenCUDA(ordinal int) (Device, error) {
	return nil, fmt.Errorf("%w: built without cgo, libcuda.so.1 cannot be loaded (device %d)", ErrNoDriver, ordinal)
}

// CopyCeilingHtoD measures the copy engine's host-to-device ceiling of a
// CUDA device; without cgo there is none: an error wrapping ErrNoDriver.
func CopyCeilingHtoD(dev Device, n uint64, reps int) (float64, error) {
	return 0, fmt.Errorf("cuda: copy ceiling of a %s device: %w", dev.Info().Backend, ErrNoDriver)
}
