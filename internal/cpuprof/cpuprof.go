// Package cpuprof writes a CPU profile of a daemon for its whole run
// (--cpu-profile), and where its goroutines waited (--wait-profile):
// profiling a benchmark through the real daemons, with no HTTP endpoint to
// expose.
package cpuprof

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// DefaultHz is the Go runtime's own sampling rate.
const DefaultHz = 100

// MaxHz bounds the sampling rate: past it the signal handler's work
// becomes a noticeable part of what is measured.
const MaxHz = 10000

// Start starts a CPU profile into path ("" : none), sampling hz times a
// second of CPU (DefaultHz when 0), and returns the function that stops it,
// closes the file and says how much of the process's CPU time the profile
// holds (Coverage). A rate above the default resolves short stages (a 1 ms
// stage of a restore is one sample in ten at 100 Hz); the runtime then
// prints once that it cannot set the rate, and keeps hz.
//
// Linux delivers the profiling signal from its timer tick (CONFIG_HZ), so a
// thread is sampled at most that often: on this project's VM (tick 250 Hz)
// a profile at 4,000 Hz held 1/16 of the CPU time used, its times 16 times
// too short (their shares stay right). Stop reports the coverage, so a
// profile past the tick is read with it.
func Start(path string, hz int) (stop func() (Coverage, error), err error) {
	if hz < 0 || hz > MaxHz {
		return nil, fmt.Errorf("cpu profile rate %d Hz: want 0 (the default %d) to %d", hz, DefaultHz, MaxHz)
	}
	if path == "" {
		return func() (Coverage, error) { return Coverage{}, nil }, nil
	}
	if hz == 0 {
		hz = DefaultHz
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if hz != DefaultHz {
		runtime.SetCPUProfileRate(hz) // StartCPUProfile's own 100 Hz then does not apply
	}
	used0 := processCPU()
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("cpu profile %s: %w", path, err)
	}
	var once sync.Once
	return func() (cov Coverage, err error) {
		once.Do(func() {
			pprof.StopCPUProfile()
			cov = Coverage{Path: path, Hz: hz, Used: processCPU() - used0}
			if err = f.Close(); err != nil {
				return
			}
			var samples int64
			samples, err = cpuSamples(path)
			cov.Sampled = time.Duration(samples) * (time.Second / time.Duration(hz))
		})
		return cov, err // a later call: nothing (Path "")
	}, nil
}

// Report stops a profile (stop, from Start) and logs what it holds, at
// Warn when it is Short. Once stopped, a later call does nothing.
func Report(log *zap.Logger, stop func() (Coverage, error)) {
	cov, err := stop()
	switch {
	case err != nil:
		log.Error("cpu profile", zap.String("path", cov.Path), zap.Error(err))
	case cov.Path == "":
	case cov.Short():
		log.Warn("the cpu profile holds less CPU time than the process used: the kernel's timer tick samples a thread more slowly than the rate asked for; the profile's times are short by its ratio, their shares stay right",
			zap.String("path", cov.Path), zap.Int("hz", cov.Hz), zap.Duration("sampled", cov.Sampled), zap.Duration("used", cov.Used),
			zap.Float64("ratio", cov.Ratio()), zap.Int("effective_hz", int(float64(cov.Hz)*cov.Ratio())))
	default:
		log.Info("cpu profile written", zap.String("path", cov.Path), zap.Int("hz", cov.Hz),
			zap.Duration("sampled", cov.Sampled), zap.Duration("used", cov.Used), zap.Float64("ratio", cov.Ratio()))
	}
}

// Coverage compares a CPU profile with the CPU time the process used
// while it ran.
type Coverage struct {
	Path string
	Hz   int           // the rate asked for
	Used time.Duration // the process's CPU time (user and system) over the profile
	// Sampled is the CPU time the profile's samples stand for.
	Sampled time.Duration
}

// Ratio is Sampled / Used (1 when nothing was used).
func (c Coverage) Ratio() float64 {
	if c.Used <= 0 {
		return 1
	}
	return c.Sampled.Seconds() / c.Used.Seconds()
}

// Short reports whether the profile holds clearly less CPU time than the
// process used: a rate past the kernel's tick (Start).
func (c Coverage) Short() bool { return c.Used > 100*time.Millisecond && c.Ratio() < 0.7 }

// processCPU is the CPU time the process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuSamples sums the sample counts (each sample's first value) of the
// gzipped profile.proto message at path.
func cpuSamples(path string) (int64, error) {
	var n int64
	err := walkProfile(path, func(field uint64, varint uint64, msg []byte) error {
		if field != 2 || msg == nil {
			return nil
		}
		// A Sample: location ids (1) and values (2), packed varints or
		// one varint each; the first value is the count.
		first := true
		return walkFields(msg, func(f uint64, varint uint64, packed []byte) error {
			if f != 2 || !first {
				return nil
			}
			first = false
			if packed != nil {
				v, k := binary.Uvarint(packed)
				if k <= 0 {
					return errors.New("cpu profile: bad sample value")
				}
				varint = v
			}
			n += int64(varint)
			return nil
		})
	})
	return n, err
}

// walkProfile calls fn with each top-level field of the gzipped
// profile.proto message at path (walkFields).
func walkProfile(path string, fn func(field, varint uint64, msg []byte) error) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	zr, err := gzip.NewReader(bytes.NewReader(raw))
	if err != nil {
		return fmt.Errorf("cpu profile %s: %w", path, err)
	}
	b, err := io.ReadAll(zr)
	if err != nil {
		return fmt.Errorf("cpu profile %s: %w", path, err)
	}
	return walkFields(b, fn)
}

// walkFields calls fn with each field of the protobuf message b: its
// number, and its value when a varint or its bytes when length-delimited
// (msg nil otherwise).
func walkFields(b []byte, fn func(field, varint uint64, msg []byte) error) error {
	for len(b) > 0 {
		key, n := binary.Uvarint(b)
		if n <= 0 {
			return errors.New("profile: bad field key")
		}
		b = b[n:]
		switch key & 7 {
		case 0:
			v, n := binary.Uvarint(b)
			if n <= 0 {
				return errors.New("profile: bad varint")
			}
			b = b[n:]
			if err := fn(key>>3, v, nil); err != nil {
				return err
			}
		case 2:
			l, n := binary.Uvarint(b)
			if n <= 0 || uint64(len(b)-n) < l {
				return errors.New("profile: bad length")
			}
			msg := b[n : n+int(l)]
			b = b[n+int(l):]
			if err := fn(key>>3, 0, msg); err != nil {
				return err
			}
		default:
			return fmt.Errorf("profile: wire type %d", key&7)
		}
	}
	return nil
}

// StartWaits records where goroutines wait: every blocking event on a
// channel, a select or a sync primitive (Go's block profile) and every
// contended mutex (the mutex profile), until the returned function writes
// them to path+".block" and path+".mutex" ("" : none): time a CPU
// profile cannot show. Both files are created at once, so a bad path fails at
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
