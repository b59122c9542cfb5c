package testutil

import (
	"testing"
	"time"
)

// Eventually polls cond until it holds and returns how long that took; it
// fails tb with "timed out after d waiting for what" when d passes first.
// cond runs at once, then every millisecond, backing off to every 5 ms
// after the first 50 ms so a long wait does not take a shared CPU.
func Eventually(tb testing.TB, d time.Duration, what string, cond func() bool) time.Duration {
	tb.Helper()
	t0 := time.Now()
	for !cond() {
		waited := time.Since(t0)
		if waited > d {
			tb.Fatalf("timed out after %v waiting for %s", d, what)
		}
		if waited < 50*time.Millisecond {
			time.Sleep(time.Millisecond)
		} else {
			time.Sleep(5 * time.Millisecond)
		}
	}
	return time.Since(t0)
}
