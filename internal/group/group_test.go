package group

import (
	"bytes"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
)

func TestMain(m *testing.M) { testutil.Main(m) }

func TestGoRefusedAfterClose(t *testing.T) {
	g := New("test")
	g.Close()
	var ran atomic.Bool
	if g.Go("late", func() { ran.Store(true) }) {
		t.Fatal("Go after Close reported true")
	}
	g.Wait()
	if ran.Load() {
		t.Fatal("Go after Close ran its function")
	}
	if !g.Closed() {
		t.Fatal("Closed is false after Close")
	}
	g.Close() // idempotent
}

func TestZeroGroupUsable(t *testing.T) {
	var g Group
	done := make(chan struct{})
	if !g.Go("zero", func() { close(done) }) {
		t.Fatal("zero Group refused Go")
	}
	<-done
	g.CloseAndWait()
}

func TestWaitWaitsForAll(t *testing.T) {
	g := New("test")
	const n = 50
	release := make(chan struct{})
	var finished atomic.Int64
	for i := 0; i < n; i++ {
		if !g.Go("worker", func() {
			<-release
			time.Sleep(time.Millisecond)
			finished.Add(1)
		}) {
			t.Fatal("open group refused Go")
		}
	}
	if got := g.Running(); got != n {
		t.Fatalf("Running = %d before release, want %d", got, n)
	}
	g.Close()
	close(release)
	g.Wait()
	if got := finished.Load(); got != n {
		t.Fatalf("Wait returned with %d of %d goroutines finished", got, n)
	}
	if got := g.Running(); got != 0 {
		t.Fatalf("Running = %d after Wait, want 0", got)
	}
}

// TestGoRacesClose starts goroutines from many goroutines while another
// closes the group and waits: every Go that reported true must have run to
// completion by the time Wait returns, every false must have run nothing,
// and the race detector must see no Add racing the Wait.
func TestGoRacesClose(t *testing.T) {
	for round := 0; round < 200; round++ {
		g := New("race")
		var started, ran atomic.Int64
		var callers sync.WaitGroup
		for i := 0; i < 8; i++ {
			callers.Add(1)
			go func() {
				defer callers.Done()
				for j := 0; j < 20; j++ {
					if g.Go("racer", func() { ran.Add(1) }) {
						started.Add(1)
					}
				}
			}()
		}
		g.Close()
		g.Wait()
		// A Go that won against Close was counted before Wait could
		// return; one that lost ran nothing. Let the callers finish and
		// compare: no goroutine may run after Wait returned.
		after := ran.Load()
		callers.Wait()
		if got := ran.Load(); got != after {
			t.Fatalf("round %d: %d goroutines ran after Wait returned", round, got-after)
		}
		if s, r := started.Load(), ran.Load(); s != r {
			t.Fatalf("round %d: Go reported %d started, %d ran", round, s, r)
		}
	}
}

// TestPprofLabels reads the labels back from a goroutine profile, as an
// operator would with /debug/pprof/goroutine?debug=1.
func TestPprofLabels(t *testing.T) {
	g := New("labgroup")
	inside := make(chan struct{})
	release := make(chan struct{})
	g.Go("labworker", func() {
		close(inside)
		<-release
	})
	<-inside
	var buf bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&buf, 1); err != nil {
		t.Fatal(err)
	}
	close(release)
	g.CloseAndWait()
	// The profile prints one "# labels: {...}" line per stack, keys in an
	// order of its own; both labels must be on the worker's line.
	for _, line := range strings.Split(buf.String(), "\n") {
		if strings.Contains(line, "# labels:") &&
			strings.Contains(line, `"goroutine":"labworker"`) &&
			strings.Contains(line, `"group":"labgroup"`) {
			return
		}
	}
	t.Fatalf("goroutine profile lacks labels goroutine=labworker group=labgroup:\n%s", buf.String())
}
