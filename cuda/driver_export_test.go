//go:build cgo && linux

package cuda

import "fmt"

// SetDriverCopyMode forces how a CUDA device moves bytes: "auto", "direct"
// or "staged", with staging halves of half bytes (0: the default). It is
// for the tests of package cuda_test and panics on another backend.
func SetDriverCopyMode(dev Device, mode string, half uint64) {
	d := dev.(*driverDevice)
	switch mode {
	case "auto":
		d.mode = modeAuto
	case "direct":
		d.mode = modeDirect
	case "staged":
		d.mode = modeStaged
	default:
		panic(fmt.Sprintf("SetDriverCopyMode: mode %q", mode))
	}
	d.stageHalf = half
}
