package cuda

import "fmt"

// pathSetter is a device whose Gather and Scatter copy path can be forced.
type pathSetter interface{ setPath(copyPath) }

func (d *hostDevice) setPath(p copyPath) { d.path = p }

// ForceCopyPath sets how a device's Gather and Scatter move bytes: "auto"
// (the rule of useDMA: the copy engine for page runs averaging at least
// 256 KiB where copies are enqueued in batches), "sm" (the copy kernels)
// or "dma" (copy-engine copies of the page runs, then a checksum kernel
// over the device pages). rankd's --copy-path calls it after Open, before
// the device is shared; the verification is the same on every path.
func ForceCopyPath(dev Device, path string) error {
	p, ok := parseCopyPath(path)
	if !ok {
		return fmt.Errorf("cuda: copy path %q: want auto, sm or dma", path)
	}
	ps, ok := dev.(pathSetter)
	if !ok {
		return fmt.Errorf("cuda: device %T has no copy path to set", dev)
	}
	ps.setPath(p)
	return nil
}
