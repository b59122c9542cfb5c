package rankd

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// TestDaemonGoroutinesInGroup (STYLE 21): Start runs the HTTP server, the
// event publisher and the watch and heartbeat loops in the daemon's group;
// Shutdown waits until every one has returned, and the group then refuses.
func TestDaemonGoroutinesInGroup(t *testing.T) {
	h := newHarness(t)
	if n := h.d.goroutines.Running(); n < 4 {
		t.Fatalf("%d goroutines in the daemon's group after Start, want at least 4 (http, events, watch, heartbeat)", n)
	}
	// A goroutine slow to end once Shutdown began: Shutdown returns only
	// after it did (the group's Wait), never with it still running.
	var ended atomic.Bool
	if !h.d.goroutines.Go("slow", func() {
		<-h.d.life.Done()
		time.Sleep(300 * time.Millisecond)
		ended.Store(true)
	}) {
		t.Fatal("a started daemon's group refused a goroutine")
	}
	if err := h.d.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !ended.Load() {
		t.Fatal("Shutdown returned before a goroutine of the daemon's group ended")
	}
	if n := h.d.goroutines.Running(); n != 0 {
		t.Fatalf("%d goroutines of the daemon's group still running after Shutdown", n)
	}
	if h.d.goroutines.Go("late", func() {}) {
		t.Fatal("the daemon's group started a goroutine after Shutdown")
	}
}
