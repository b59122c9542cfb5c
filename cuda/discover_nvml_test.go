//go:build cgo && linux

package cuda

import (
	"errors"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

func mockDevice(uuid, name string, mem uint64, bus string) *mock.Device {
	var pci nvml.PciInfo
	for i := range bus {
		pci.BusId[i] = int8(bus[i])
	}
	return &mock.Device{
		GetUUIDFunc:       func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
		GetNameFunc:       func() (string, nvml.Return) { return name, nvml.SUCCESS },
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) { return nvml.Memory{Total: mem}, nvml.SUCCESS },
		GetPciInfoFunc:    func() (nvml.PciInfo, nvml.Return) { return pci, nvml.SUCCESS },
	}
}

func mockLib(init nvml.Return, devs ...nvml.Device) (*mock.Interface, *int) {
	shutdowns := new(int)
	return &mock.Interface{
		InitFunc:     func() nvml.Return { return init },
		ShutdownFunc: func() nvml.Return { *shutdowns++; return nvml.SUCCESS },
		DeviceGetCountFunc: func() (int, nvml.Return) {
			return len(devs), nvml.SUCCESS
		},
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i >= len(devs) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return devs[i], nvml.SUCCESS
		},
	}, shutdowns
}

func TestDiscoverNVML(t *testing.T) {
	lib, shutdowns := mockLib(nvml.SUCCESS,
		mockDevice("GPU-11111111-2222-3333-4444-555555555555", "NVIDIA H200", 150_000_000_000, "00000000:19:00.0"),
		mockDevice("GPU-66666666-7777-8888-9999-000000000000", "NVIDIA H200", 150_000_000_000, "00000000:3B:00.0"),
	)
	infos, err := discover(lib)
	if err != nil {
		t.Fatal(err)
	}
	want := []Info{
		{Backend: "cuda", Ordinal: 0, UUID: "GPU-11111111-2222-3333-4444-555555555555", Name: "NVIDIA H200", Memory: 150_000_000_000, PCIBus: "00000000:19:00.0"},
		{Backend: "cuda", Ordinal: 1, UUID: "GPU-66666666-7777-8888-9999-000000000000", Name: "NVIDIA H200", Memory: 150_000_000_000, PCIBus: "00000000:3B:00.0"},
	}
	if len(infos) != len(want) {
		t.Fatalf("got %d devices, want %d", len(infos), len(want))
	}
	for i := range want {
		if infos[i] != want[i] {
			t.Errorf("device %d: %+v, want %+v", i, infos[i], want[i])
		}
	}
	if *shutdowns != 1 {
		t.Errorf("NVML shut down %d times, want 1", *shutdowns)
	}
}

func TestDiscoverNoDriver(t *testing.T) {
	for _, c := range []struct {
		name string
		lib  nvml.Interface
	}{
		{"library not found", func() nvml.Interface { l, _ := mockLib(nvml.ERROR_LIBRARY_NOT_FOUND); return l }()},
		{"driver not loaded", func() nvml.Interface { l, _ := mockLib(nvml.ERROR_DRIVER_NOT_LOADED); return l }()},
		{"no device", func() nvml.Interface { l, _ := mockLib(nvml.SUCCESS); return l }()},
	} {
		infos, err := discover(c.lib)
		if !errors.Is(err, ErrNoDriver) || infos != nil {
			t.Errorf("%s: %v, %v; want ErrNoDriver", c.name, infos, err)
		}
	}
}

// A device whose UUID cannot be read is an error, not a silent omission.
func TestDiscoverBrokenDevice(t *testing.T) {
	bad := mockDevice("", "", 0, "")
	bad.GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
	lib, shutdowns := mockLib(nvml.SUCCESS, mockDevice("GPU-1", "x", 1, "b"), bad)
	if _, err := discover(lib); err == nil || !errors.Is(err, nvml.ERROR_GPU_IS_LOST) {
		t.Fatalf("err %v; want one wrapping ERROR_GPU_IS_LOST", err)
	}
	if *shutdowns != 1 {
		t.Errorf("NVML shut down %d times, want 1", *shutdowns)
	}
}
