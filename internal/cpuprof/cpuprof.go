// Package cpuprof writes a CPU profile of a daemon for its whole run
// (--cpu-profile): profiling a benchmark through the real daemons, with no
// HTTP endpoint to expose.
package cpuprof

import (
	"fmt"
	"os"
	"runtime/pprof"
)

// Start starts a CPU profile into path ("" : none) and returns the function
// that stops it and closes the file.
func Start(path string) (stop func() error, err error) {
	if path == "" {
		return func() error { return nil }, nil
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
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
