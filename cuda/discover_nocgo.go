//go:build !cgo || !linux

package cuda

import "fmt"

// Discover lists the NVIDIA GPUs of this machine through NVML. This binary
// was built without cgo, so it cannot load NVML and always returns an error
// wrapping ErrNoDriver.
func Discover() ([]Info, error) {
	return nil, fmt.Errorf("%w: built without cgo, NVML cannot be loaded", ErrNoDriver)
}
