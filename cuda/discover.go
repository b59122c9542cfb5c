package cuda

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// ErrBadSpec: a device spec given to Open, or a HostConfig, is malformed.
var ErrBadSpec = errors.New("cuda: bad device spec")

// Device specs accepted by Open.
const (
	SpecAuto = "auto" // CUDA device 0 if a driver and device exist, else the host backend
	SpecHost = "host" // the host backend
	SpecCUDA = "cuda" // CUDA device 0; "cuda:N" names ordinal N
)

// deviceSpec is a parsed Open spec.
type deviceSpec struct {
	kind    string // SpecAuto, SpecHost, SpecCUDA or "uuid"
	ordinal int    // SpecCUDA
	uuid    string // "uuid"
}

// parseSpec parses "auto", "host", "cuda", "cuda:N" or "GPU-<uuid>".
func parseSpec(spec string) (deviceSpec, error) {
	switch {
	case spec == SpecAuto || spec == SpecHost:
		return deviceSpec{kind: spec}, nil
	case spec == SpecCUDA:
		return deviceSpec{kind: SpecCUDA}, nil
	case strings.HasPrefix(spec, SpecCUDA+":"):
		digits := spec[len(SpecCUDA)+1:]
		n, err := strconv.Atoi(digits)
		if err != nil || n < 0 || digits == "" || digits[0] == '+' || digits[0] == '-' {
			return deviceSpec{}, fmt.Errorf("%w: %q: ordinal must be a decimal number >= 0", ErrBadSpec, spec)
		}
		return deviceSpec{kind: SpecCUDA, ordinal: n}, nil
	case strings.HasPrefix(spec, "GPU-") && len(spec) > len("GPU-"):
		return deviceSpec{kind: "uuid", uuid: spec}, nil
	}
	return deviceSpec{}, fmt.Errorf("%w: %q: want \"auto\", \"host\", \"cuda\", \"cuda:N\" or a \"GPU-...\" UUID", ErrBadSpec, spec)
}

// Open opens the device that spec names:
//
//	"auto"       CUDA device 0 if the driver loads and a device exists,
//	             otherwise the host backend with hostCfg; any other CUDA
//	             error is returned, never papered over with the host backend
//	"host"       the host backend with hostCfg
//	"cuda"       CUDA device ordinal 0; "cuda:N" ordinal N
//	"GPU-<uuid>" the CUDA device with that UUID (as nvidia-smi -L prints it)
//
// hostCfg is used only for the host backend.
func Open(spec string, hostCfg HostConfig) (Device, error) {
	ds, err := parseSpec(spec)
	if err != nil {
		return nil, err
	}
	switch ds.kind {
	case SpecHost:
		return OpenHost(hostCfg)
	case SpecCUDA:
		return OpenCUDA(ds.ordinal)
	case SpecAuto:
		dev, err := OpenCUDA(0)
		if err == nil {
			return dev, nil
		}
		if errors.Is(err, ErrNoDriver) {
			return OpenHost(hostCfg)
		}
		return nil, err
	}
	return openUUID(ds.uuid, Discover, func(ordinal int) (Device, error) { return OpenCUDA(ordinal) })
}

// openUUID opens the CUDA device with the given UUID. NVML numbers devices
// by PCI bus id while CUDA ordinals follow CUDA_DEVICE_ORDER and
// CUDA_VISIBLE_DEVICES, so the NVML index is only a first guess: the opened
// device's own UUID decides, and on a mismatch every ordinal is tried.
func openUUID(uuid string, discover func() ([]Info, error), open func(int) (Device, error)) (Device, error) {
	infos, err := discover()
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", uuid, err)
	}
	guess := -1
	for i, in := range infos {
		if in.UUID == uuid {
			guess = i
		}
	}
	if guess < 0 {
		return nil, fmt.Errorf("%w: no device %s among the %d that NVML lists", ErrNoDriver, uuid, len(infos))
	}
	tried := map[int]bool{}
	var errs []error
	try := func(ordinal int) Device {
		if tried[ordinal] {
			return nil
		}
		tried[ordinal] = true
		dev, err := open(ordinal)
		if err != nil {
			errs = append(errs, fmt.Errorf("ordinal %d: %w", ordinal, err))
			return nil
		}
		if dev.Info().UUID == uuid {
			return dev
		}
		if err := dev.Close(); err != nil {
			errs = append(errs, fmt.Errorf("ordinal %d: %w", ordinal, err))
		}
		return nil
	}
	if dev := try(guess); dev != nil {
		return dev, nil
	}
	for ordinal := range infos {
		if dev := try(ordinal); dev != nil {
			return dev, nil
		}
	}
	return nil, fmt.Errorf("%w: NVML lists %s but no CUDA ordinal opens it: %w", ErrNoDriver, uuid, errors.Join(errs...))
}
