package rankd

import (
	"context"
	"testing"
)

// TestDaemonGoroutinesInGroup (STYLE 21): Start runs the HTTP server, the
// event publisher and the watch and heartbeat loops in the daemon's group;
// Shutdown waits until every one has returned, and the group then refuses.
func TestDaemonGoroutinesInGroup(t *testing.T) {
	h := newHarness(t)
	if n := h.d.goroutines.Running(); n < 4 {
		t.Fatalf("%d goroutines in the daemon's group after Start, want at least 4 (http, events, watch, heartbeat)", n)
	}
	if err := h.d.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := h.d.goroutines.Running(); n != 0 {
		t.Fatalf("%d goroutines of the daemon's group still running after Shutdown", n)
	}
	if h.d.goroutines.Go("late", func() {}) {
		t.Fatal("the daemon's group started a goroutine after Shutdown")
	}
}
