//go:build cgo && linux

package cuda

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Discover lists the NVIDIA GPUs of this machine through NVML
// (libnvidia-ml.so.1, loaded at run time). Info.Ordinal is the NVML index,
// which equals the CUDA ordinal only with CUDA_DEVICE_ORDER=PCI_BUS_ID and
// no CUDA_VISIBLE_DEVICES; open by UUID (Open("GPU-...")) to be exact.
// Without the library or without a device it returns an error wrapping
// ErrNoDriver.
func Discover() ([]Info, error) { return discover(nvml.New()) }

func discover(lib nvml.Interface) (infos []Info, err error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%w: NVML init: %w", ErrNoDriver, ret)
	}
	defer func() {
		if ret := lib.Shutdown(); ret != nvml.SUCCESS && err == nil {
			err = fmt.Errorf("cuda: NVML shutdown: %w", ret)
		}
	}()
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%w: NVML device count: %w", ErrNoDriver, ret)
	}
	if n == 0 {
		return nil, fmt.Errorf("%w: NVML lists no device", ErrNoDriver)
	}
	for i := range n {
		dev, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("cuda: NVML device %d of %d: %w", i, n, ret)
		}
		uuid, ret := dev.GetUUID()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("cuda: NVML device %d UUID: %w", i, ret)
		}
		in := Info{Backend: "cuda", Ordinal: i, UUID: uuid}
		// Name, memory and bus id are descriptive: a device that cannot
		// report them is still listed.
		if name, ret := dev.GetName(); ret == nvml.SUCCESS {
			in.Name = name
		}
		if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			in.Memory = mem.Total
		}
		if pci, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
			in.PCIBus = cString(pci.BusId[:])
		}
		infos = append(infos, in)
	}
	return infos, nil
}

// cString converts a NUL-terminated C char array.
func cString(b []int8) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}
