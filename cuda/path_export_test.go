package cuda

import "fmt"

// pathSetter is a device whose copy path tests force.
type pathSetter interface{ setPath(copyPath) }

func (d *hostDevice) setPath(p copyPath) { d.path = p }

// SetCopyPath forces the copy path of a device's Gather and Scatter:
// "auto", "sm" or "dma". It is for the tests of package cuda_test; call it
// before the device is shared.
func SetCopyPath(dev Device, path string) {
	p, ok := parseCopyPath(path)
	if !ok {
		panic(fmt.Sprintf("SetCopyPath: path %q", path))
	}
	dev.(pathSetter).setPath(p)
}
