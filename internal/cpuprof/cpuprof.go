// Package cpuprof writes a CPU profile of a daemon for its whole run
// (--cpu-profile): profiling a benchmark through the real daemons, with no
// HTTP endpoint to expose.
package cpuprof

import (
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
)

// DefaultHz is the Go runtime's own sampling rate.
const DefaultHz = 100

// MaxHz bounds the sampling rate: past it the signal handler's work
// becomes a noticeable part of what is measured.
const MaxHz = 10000

// Start starts a CPU profile into path ("" : none), sampling hz times a
// second of CPU (DefaultHz when 0), and returns the function that stops it
// and closes the file. A rate above the default resolves short stages (a
// 1 ms stage of a restore is one sample in ten at 100 Hz); the runtime
// then prints once that it cannot set the rate, and keeps hz.
func Start(path string, hz int) (stop func() error, err error) {
	if hz < 0 || hz > MaxHz {
		return nil, fmt.Errorf("cpu profile rate %d Hz: want 0 (the default %d) to %d", hz, DefaultHz, MaxHz)
	}
	if path == "" {
		return func() error { return nil }, nil
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if hz != 0 && hz != DefaultHz {
		runtime.SetCPUProfileRate(hz) // StartCPUProfile's own 100 Hz then does not apply
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("cpu profile %s: %w", path, err)
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
}
