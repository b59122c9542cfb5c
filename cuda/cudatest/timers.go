package cudatest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
)

// notATimer is a Timer of no backend.
type notATimer struct{}

func (notATimer) Time(context.Context) (time.Time, error) { return time.Time{}, nil }
func (notATimer) Release() error                          { return nil }

func newTimer(t *testing.T, dev cuda.Device) cuda.Timer {
	t.Helper()
	tm, err := dev.NewTimer()
	if err != nil {
		t.Fatalf("NewTimer: %v", err)
	}
	t.Cleanup(func() { _ = tm.Release() })
	return tm
}

func timeOf(t *testing.T, ctx context.Context, tm cuda.Timer, what string) time.Time {
	t.Helper()
	at, err := tm.Time(ctx)
	if err != nil {
		t.Fatalf("Time of %s: %v", what, err)
	}
	return at
}

// testTimers: a mark is reached when the work before it is done, and its
// time lies on the host's clock between the Mark call and the Time that
// returned it; a Delay between two marks separates their times; a timer
// marked again reports its new mark; misuse is an error.
func testTimers(t *testing.T, open Opener) {
	ctx := testCtx(t)
	dev := openDev(t, open)
	s := newStream(t, dev)

	t.Run("Order", func(t *testing.T) {
		a, b := newTimer(t, dev), newTimer(t, dev)
		if _, err := a.Time(ctx); err == nil {
			t.Fatal("Time of a timer never marked: nil error")
		}
		const d = 50 * time.Millisecond
		before := time.Now()
		if err := s.Mark(a); err != nil {
			t.Fatal(err)
		}
		if err := s.Delay(d); err != nil {
			t.Fatal(err)
		}
		if err := s.Mark(b); err != nil {
			t.Fatal(err)
		}
		tb := timeOf(t, ctx, b, "b")
		after := time.Now()
		ta := timeOf(t, ctx, a, "a")
		// The CUDA backend maps device times onto the host clock through
		// an anchor event: allow it a little slack at either end.
		const slack = 5 * time.Millisecond
		if ta.Before(before.Add(-slack)) {
			t.Errorf("mark a reached %v before Mark was called", before.Sub(ta))
		}
		if tb.After(after.Add(slack)) {
			t.Errorf("mark b reached %v after Time returned", tb.Sub(after))
		}
		// The delay of at least d lies between the marks.
		if gap := tb.Sub(ta); gap < d/2 {
			t.Errorf("marks around a Delay of %v are %v apart", d, gap)
		}
		// Marked again, a reports its new mark: after b.
		if err := s.Mark(a); err != nil {
			t.Fatal(err)
		}
		if ta2 := timeOf(t, ctx, a, "a marked again"); ta2.Before(tb) {
			t.Errorf("a marked again after b reports %v, %v before b", ta2, tb.Sub(ta2))
		}
	})

	t.Run("Pending", func(t *testing.T) {
		a := newTimer(t, dev)
		if err := s.Delay(300 * time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if err := s.Mark(a); err != nil {
			t.Fatal(err)
		}
		short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
		_, err := a.Time(short)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Time of a mark behind a 300 ms Delay, 20 ms context: %v, want a deadline error", err)
		}
		timeOf(t, ctx, a, "a after the delay")
	})

	t.Run("Misuse", func(t *testing.T) {
		a := newTimer(t, dev)
		isErr(t, "Mark of a foreign timer", s.Mark(notATimer{}), cuda.ErrBadHandle)
		if err := s.Mark(a); err != nil {
			t.Fatal(err)
		}
		timeOf(t, ctx, a, "a")
		if err := a.Release(); err != nil {
			t.Fatal(err)
		}
		if err := a.Release(); err != nil {
			t.Fatalf("second Release: %v", err)
		}
		_, err := a.Time(ctx)
		isErr(t, "Time of a released timer", err, cuda.ErrReleased)
		isErr(t, "Mark of a released timer", s.Mark(a), cuda.ErrReleased)
	})

	t.Run("FailedStream", func(t *testing.T) {
		fs := newStream(t, dev)
		a := newTimer(t, dev)
		ev := newEvent(t, dev, false)
		if err := fs.Record(ev); err != nil {
			t.Fatal(err)
		}
		if err := ev.Release(); err != nil {
			t.Fatal(err)
		}
		if err := fs.WaitEvent(ev); err == nil {
			t.Fatal("WaitEvent on a released event: nil error")
		}
		if err := fs.Mark(a); err == nil {
			t.Fatal("Mark on a failed stream: nil error")
		}
	})

	t.Run("Closed", func(t *testing.T) {
		d2 := openDev(t, open)
		s2 := newStream(t, d2)
		a := newTimer(t, d2)
		if err := s2.Mark(a); err != nil {
			t.Fatal(err)
		}
		timeOf(t, ctx, a, "a")
		if err := d2.Close(); err != nil {
			t.Fatal(err)
		}
		_, err := a.Time(ctx)
		isErr(t, "Time of a timer of a closed device", err, cuda.ErrReleased)
		if _, err := d2.NewTimer(); !errors.Is(err, cuda.ErrReleased) {
			t.Fatalf("NewTimer on a closed device: %v, want ErrReleased", err)
		}
	})
}
