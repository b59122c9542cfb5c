// Package cpuprof writes a CPU profile of a daemon for its whole run
// (--cpu-profile), and where its goroutines waited (--wait-profile):
// profiling a benchmark through the real daemons, with no HTTP endpoint to
// expose.
package cpuprof

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"sync"
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

// StartWaits records where goroutines wait: every blocking event on a
// channel, a select or a sync primitive (Go's block profile) and every
// contended mutex (the mutex profile), until the returned function writes
// them to path+".block" and path+".mutex" ("" : none). CPU profiles miss
// that time: a restore whose enqueue takes 1.5 ms of which 0.2 ms are CPU
// waits somewhere. Both files are created at once, so a bad path fails at
// the start. The returned function may be called more than once.
func StartWaits(path string) (stop func() error, err error) {
	if path == "" {
		return func() error { return nil }, nil
	}
	var files [2]*os.File
	for i, kind := range waitKinds {
		f, err := os.OpenFile(path+"."+kind, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
		if err != nil {
			for _, g := range files[:i] { // no half-written pair left behind
				_ = g.Close()
				_ = os.Remove(g.Name())
			}
			return nil, fmt.Errorf("wait profile: %w", err)
		}
		files[i] = f
	}
	runtime.SetBlockProfileRate(1)
	runtime.SetMutexProfileFraction(1)
	var once sync.Once
	return func() error {
		var errs []error
		once.Do(func() {
			for i, kind := range waitKinds {
				errs = append(errs, pprof.Lookup(kind).WriteTo(files[i], 0), files[i].Close())
			}
			runtime.SetBlockProfileRate(0)
			runtime.SetMutexProfileFraction(0)
		})
		return errors.Join(errs...)
	}, nil
}

// waitKinds are the runtime profiles StartWaits writes, in file order.
var waitKinds = [2]string{"block", "mutex"}
