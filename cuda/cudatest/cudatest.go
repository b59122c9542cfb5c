// Package cudatest is the backend-independent conformance suite of package
// cuda. Every backend runs the same tests from its own test files:
//
//	func TestConformance(t *testing.T) {
//		cudatest.Run(t, func(t *testing.T) cuda.Device { ... open the backend ... })
//	}
//
// and the cross-process test of the IPC contract (an engine process exports
// a KV pool and a producer event, the test process imports them), see
// RunCrossProcess and EngineMain.
//
// The suite checks behaviour, never speed. Where an ordering can only be
// observed through time (work queued behind a Delay has not run yet), Run
// skips that one check when the machine was too slow to make it meaningful;
// the cross-process test, whose point is to see stale bytes, fails instead
// and says the machine was too slow. It compares every byte it can: packed
// objects, padding between pages and between objects, and whole pools after
// rejected transfers.
package cudatest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
)

// Opener opens a fresh device for one test. The suite closes it (Close must
// be idempotent); the opener may also register its own cleanup.
type Opener func(t *testing.T) cuda.Device

// Run runs the whole conformance suite against the backend that open opens.
// In -short mode it skips the case that needs a 2.2 GB allocation.
func Run(t *testing.T, open Opener) {
	t.Run("Info", func(t *testing.T) { testInfo(t, openDev(t, open)) })
	t.Run("WriteRead", func(t *testing.T) { testWriteRead(t, openDev(t, open)) })
	t.Run("Upload", func(t *testing.T) { testUpload(t, openDev(t, open)) })
	t.Run("RoundTrip", func(t *testing.T) { testRoundTrips(t, open) })
	t.Run("MultiMem", func(t *testing.T) { testMultiMem(t, openDev(t, open)) })
	t.Run("Duplicates", func(t *testing.T) { testDuplicates(t, openDev(t, open)) })
	t.Run("Empty", func(t *testing.T) { testEmpty(t, openDev(t, open)) })
	t.Run("UnalignedHost", func(t *testing.T) { testUnalignedHost(t, openDev(t, open)) })
	t.Run("ChecksumVectors", func(t *testing.T) { testChecksumVectors(t, openDev(t, open)) })
	t.Run("Reject", func(t *testing.T) { testReject(t, open) })
	t.Run("LargeOffsets", func(t *testing.T) { testLargeOffsets(t, openDev(t, open)) })
	t.Run("Events", func(t *testing.T) { testEvents(t, open) })
	t.Run("ManyStreams", func(t *testing.T) { testManyStreams(t, openDev(t, open)) })
	t.Run("Lifecycle", func(t *testing.T) { testLifecycle(t, openDev(t, open)) })
	t.Run("PlainCopy", func(t *testing.T) { testPlainCopy(t, openDev(t, open)) })
	t.Run("Timers", func(t *testing.T) { testTimers(t, open) })
}

func openDev(t *testing.T, open Opener) cuda.Device {
	t.Helper()
	dev := open(t)
	if dev == nil {
		t.Fatal("opener returned a nil device")
	}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Errorf("Device.Close: %v", err)
		}
	})
	return dev
}

// testCtx bounds every blocking call of the suite.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func newStream(t *testing.T, dev cuda.Device) cuda.Stream {
	t.Helper()
	s, err := dev.NewStream()
	if err != nil {
		t.Fatalf("NewStream: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Stream.Close: %v", err)
		}
	})
	return s
}

func alloc(t *testing.T, dev cuda.Device, size uint64) cuda.Mem {
	t.Helper()
	m, err := dev.Alloc(size)
	if err != nil {
		t.Fatalf("Alloc(%d): %v", size, err)
	}
	if m.Size() != size {
		t.Fatalf("Alloc(%d).Size() = %d", size, m.Size())
	}
	t.Cleanup(func() {
		if err := m.Release(); err != nil {
			t.Errorf("Mem.Release: %v", err)
		}
	})
	return m
}

func allocHost(t *testing.T, dev cuda.Device, size uint64) cuda.HostBuf {
	t.Helper()
	h, err := dev.AllocHost(size)
	if err != nil {
		t.Fatalf("AllocHost(%d): %v", size, err)
	}
	if got := len(h.Bytes()); uint64(got) != size {
		t.Fatalf("AllocHost(%d): %d bytes", size, got)
	}
	t.Cleanup(func() {
		if err := h.Release(); err != nil {
			t.Errorf("HostBuf.Release: %v", err)
		}
	})
	return h
}

func newEvent(t *testing.T, dev cuda.Device, interprocess bool) cuda.Event {
	t.Helper()
	e, err := dev.NewEvent(interprocess)
	if err != nil {
		t.Fatalf("NewEvent(%v): %v", interprocess, err)
	}
	t.Cleanup(func() { e.Release() })
	return e
}

// write fills m with b (at 0) through the synchronous path.
func write(t *testing.T, dev cuda.Device, m cuda.Mem, off uint64, b []byte) {
	t.Helper()
	if err := dev.Write(m, off, b); err != nil {
		t.Fatalf("Write(%d B at %d): %v", len(b), off, err)
	}
}

// readAll returns the whole content of m.
func readAll(t *testing.T, dev cuda.Device, m cuda.Mem) []byte {
	t.Helper()
	b := make([]byte, m.Size())
	if err := dev.Read(m, 0, b); err != nil {
		t.Fatalf("Read(%d B): %v", len(b), err)
	}
	return b
}

// wait waits for op and fails the test on error.
func wait(t *testing.T, op *cuda.Op, what string) {
	t.Helper()
	if err := op.Wait(testCtx(t)); err != nil {
		t.Fatalf("%s: Wait: %v", what, err)
	}
}

func gather(t *testing.T, s cuda.Stream, dst cuda.HostBuf, objs []cuda.Object) []uint64 {
	t.Helper()
	op, err := s.Gather(dst, objs)
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	wait(t, op, "Gather")
	if got := len(op.Sums()); got != len(objs) {
		t.Fatalf("Gather of %d objects returned %d sums", len(objs), got)
	}
	return append([]uint64(nil), op.Sums()...)
}

func scatter(t *testing.T, s cuda.Stream, src cuda.HostBuf, objs []cuda.Object) []uint64 {
	t.Helper()
	op, err := s.Scatter(src, objs)
	if err != nil {
		t.Fatalf("Scatter: %v", err)
	}
	wait(t, op, "Scatter")
	if got := len(op.Sums()); got != len(objs) {
		t.Fatalf("Scatter of %d objects returned %d sums", len(objs), got)
	}
	return append([]uint64(nil), op.Sums()...)
}

// transferPath runs a Gather (a Scatter when scatter) and, when path is
// not "", fails unless the Op reports that copy path.
func transferPath(t *testing.T, s cuda.Stream, hb cuda.HostBuf, objs []cuda.Object, scatter bool, path string) []uint64 {
	t.Helper()
	what, run := "Gather", s.Gather
	if scatter {
		what, run = "Scatter", s.Scatter
	}
	op, err := run(hb, objs)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	wait(t, op, what)
	if path != "" && op.Path() != path {
		t.Fatalf("%s took copy path %q, want %q", what, op.Path(), path)
	}
	if got := len(op.Sums()); got != len(objs) {
		t.Fatalf("%s of %d objects returned %d sums", what, len(objs), got)
	}
	return append([]uint64(nil), op.Sums()...)
}

// sentinel fills b with a position-dependent pattern: a byte that lands one
// place off, or a stray write of any constant, shows.
func sentinel(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*131+(i>>8)*7) ^ seed ^ 0xA5
	}
}

func sentinelBytes(n uint64, seed byte) []byte {
	b := make([]byte, n)
	sentinel(b, seed)
	return b
}

func randomBytes(n uint64, seed uint64) []byte {
	b := make([]byte, n)
	var s [32]byte
	s[0], s[1], s[2] = byte(seed), byte(seed>>8), byte(seed>>16)
	rand.NewChaCha8(s).Read(b)
	return b
}

// equalBytes compares every byte and reports the first differences.
func equalBytes(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if err := diff(got, want); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func diff(got, want []byte) error {
	if bytes.Equal(got, want) {
		return nil
	}
	if len(got) != len(want) {
		return fmt.Errorf("length %d, want %d", len(got), len(want))
	}
	var first []string
	n := 0
	for i := range got {
		if got[i] != want[i] {
			if len(first) < 5 {
				first = append(first, fmt.Sprintf("[%d]=%#02x want %#02x", i, got[i], want[i]))
			}
			n++
		}
	}
	return fmt.Errorf("%d of %d bytes differ, first %v", n, len(got), first)
}

// isErr fails unless err wraps every one of targets.
func isErr(t *testing.T, what string, err error, targets ...error) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: nil error, want %v", what, targets)
	}
	for _, target := range targets {
		if !errors.Is(err, target) {
			t.Fatalf("%s: error %q does not wrap %q", what, err, target)
		}
	}
}
