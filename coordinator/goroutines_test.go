package coordinator

import (
	"sync/atomic"
	"testing"
	"time"
)

// TestShutdownClosesGroups: once Shutdown has returned, both of the
// coordinator's groups refuse new goroutines and none is left running (a
// resync, fence sweep or probe asked for late is refused, never started
// behind Shutdown's wait).
func TestShutdownClosesGroups(t *testing.T) {
	c := startCoord(t, nil)
	if c.goroutines.Running() == 0 || c.ingestGroup.Running() != 2*ingestWorkers {
		t.Fatalf("a started coordinator runs %d goroutines and %d ingest goroutines, want some and %d",
			c.goroutines.Running(), c.ingestGroup.Running(), 2*ingestWorkers)
	}
	// A goroutine slow to end once Shutdown began: Shutdown returns only
	// after it did (the group's Wait), never with it still running.
	var ended atomic.Bool
	if !c.goroutines.Go("slow", func() {
		<-c.ctx.Done()
		time.Sleep(300 * time.Millisecond)
		ended.Store(true)
	}) {
		t.Fatal("a started coordinator's group refused a goroutine")
	}
	c.Shutdown()
	if !ended.Load() {
		t.Error("Shutdown returned before a goroutine of its group ended")
	}
	for _, g := range []struct {
		name string
		run  func(string, func()) bool
		n    func() int
	}{
		{"coordinator", c.goroutines.Go, c.goroutines.Running},
		{"coordinator.ingest", c.ingestGroup.Go, c.ingestGroup.Running},
	} {
		if g.run("late", func() { t.Errorf("a goroutine of %s started after Shutdown", g.name) }) {
			t.Errorf("group %s started a goroutine after Shutdown", g.name)
		}
		if n := g.n(); n != 0 {
			t.Errorf("group %s has %d goroutines running after Shutdown", g.name, n)
		}
	}
}
