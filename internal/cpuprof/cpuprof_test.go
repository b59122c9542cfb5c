package cpuprof

import (
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func TestStartWritesProfile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "cpu.pprof")
	stop, err := Start(p, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stop(); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() == 0 {
		t.Fatalf("%s is empty, want a profile", p)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("%s has mode %v, want 0600", p, fi.Mode().Perm())
	}
}

func TestStartNoneAndBadPath(t *testing.T) {
	stop, err := Start("", 0)
	if err != nil {
		t.Fatalf("Start(\"\"): %v", err)
	}
	if _, err := stop(); err != nil {
		t.Fatalf("Start(\"\"): %v", err)
	}
	if _, err := Start(filepath.Join(t.TempDir(), "missing", "cpu.pprof"), 0); err == nil {
		t.Fatal("Start into a missing directory succeeded")
	}
	for _, hz := range []int{-1, MaxHz + 1} {
		if _, err := Start(filepath.Join(t.TempDir(), "cpu.pprof"), hz); err == nil {
			t.Fatalf("Start at %d Hz succeeded", hz)
		}
	}
}

// TestStartRate: the profile's sampling period is the asked rate's, not
// the runtime's 100 Hz.
func TestStartRate(t *testing.T) {
	for _, tc := range []struct{ hz, period int64 }{{0, 1e7}, {1000, 1e6}} {
		p := filepath.Join(t.TempDir(), "cpu.pprof")
		stop, err := Start(p, int(tc.hz))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stop(); err != nil {
			t.Fatal(err)
		}
		if got := profilePeriod(t, p); got != tc.period {
			t.Errorf("%d Hz: period %d ns, want %d", tc.hz, got, tc.period)
		}
	}
}

// profilePeriod reads the period (field 12, a varint) of the gzipped
// profile.proto message at path.
func profilePeriod(t *testing.T, path string) int64 {
	t.Helper()
	period := int64(-1)
	walkTop(t, path, func(field, v uint64) {
		if field == 12 {
			period = int64(v)
		}
	})
	if period < 0 {
		t.Fatal("no period in the profile")
	}
	return period
}

// walkTop calls fn with each top-level field of the gzipped
// profile.proto message at path: its number, and its value when a varint.
func walkTop(t *testing.T, path string, fn func(field, varint uint64)) {
	t.Helper()
	if err := walkProfile(path, func(field, varint uint64, _ []byte) error {
		fn(field, varint)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// TestCoverage: Stop says how much of the process's CPU time the profile
// holds. At the default rate a busy loop is covered (about 1); at 10,000 Hz
// it cannot be, on any Linux (its timer tick is at most 1,000 Hz), and
// Short says so.
func TestCoverage(t *testing.T) {
	for _, tc := range []struct {
		hz    int
		short bool
	}{{0, false}, {MaxHz, true}} {
		stop, err := Start(filepath.Join(t.TempDir(), "cpu.pprof"), tc.hz)
		if err != nil {
			t.Fatal(err)
		}
		spin(500 * time.Millisecond)
		cov, err := stop()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%d Hz: %v sampled of %v used (%.3f)", cov.Hz, cov.Sampled, cov.Used, cov.Ratio())
		if cov.Used < 500*time.Millisecond {
			t.Fatalf("%d Hz: %v of CPU used by a busy loop of 500 ms of CPU", tc.hz, cov.Used)
		}
		if cov.Short() != tc.short {
			t.Errorf("%d Hz: Short() %v, want %v (%v sampled of %v used)", cov.Hz, cov.Short(), tc.short, cov.Sampled, cov.Used)
		}
		if !tc.short && (cov.Ratio() < 0.7 || cov.Ratio() > 1.3) {
			t.Errorf("%d Hz: %v sampled of %v used, want about all", cov.Hz, cov.Sampled, cov.Used)
		}
		if again, err := stop(); err != nil || again.Path != "" {
			t.Errorf("a second stop: %+v, %v", again, err)
		}
	}
}

// spin keeps one goroutine busy until the process has used d more of
// CPU (not of wall time: on a loaded host a wall-time loop got 226 ms of
// CPU in 500 ms), or 30 s have passed.
func spin(d time.Duration) {
	x := uint64(1)
	from, end := processCPU(), time.Now().Add(30*time.Second)
	for processCPU()-from < d && time.Now().Before(end) {
		for range 100000 {
			x = x*6364136223846793005 + 1442695040888963407
		}
	}
	spinSink = x
}

var spinSink uint64

// TestStartWaits: a goroutine blocked on a channel and a contended mutex
// each leave a sample in their profile; a second stop does nothing; a bad
// path fails at the start.
func TestStartWaits(t *testing.T) {
	p := filepath.Join(t.TempDir(), "waits")
	stop, err := StartWaits(p)
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan struct{})
	var mu sync.Mutex
	mu.Lock()
	done := make(chan struct{})
	go func() {
		<-ch
		mu.Lock() // contended: held below until after a pause
		mu.Unlock()
		close(done)
	}()
	time.Sleep(20 * time.Millisecond)
	close(ch)
	time.Sleep(20 * time.Millisecond)
	mu.Unlock()
	<-done
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if err := stop(); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	for _, kind := range []string{"block", "mutex"} {
		if n := profileSamples(t, p+"."+kind); n == 0 {
			t.Errorf("%s profile has no sample", kind)
		}
	}
	if _, err := StartWaits(filepath.Join(t.TempDir(), "missing", "waits")); err == nil {
		t.Fatal("StartWaits into a missing directory succeeded")
	}
}

// profileSamples counts the samples (field 2) of the gzipped profile.proto
// message at path.
func profileSamples(t *testing.T, path string) int {
	t.Helper()
	n := 0
	walkTop(t, path, func(field uint64, _ uint64) {
		if field == 2 {
			n++
		}
	})
	return n
}
