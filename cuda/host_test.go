package cuda_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/cuda/cudatest"
)

// openHost opens a host device whose shared files live in a fresh
// directory of the test.
func openHost(t *testing.T) cuda.Device { return openHostIn(t, privDir(t)) }

// privDir returns a fresh private (0700) directory: the host backend
// refuses any other.
func privDir(t *testing.T) string {
	t.Helper()
	d := t.TempDir()
	if err := os.Chmod(d, 0o700); err != nil {
		t.Fatal(err)
	}
	return d
}

func openHostIn(t *testing.T, dir string) cuda.Device {
	t.Helper()
	dev, err := cuda.OpenHost(cuda.HostConfig{Dir: dir})
	if err != nil {
		t.Fatalf("OpenHost: %v", err)
	}
	return dev
}

// The conformance suite as the device picks the copy path, and with every
// transfer forced onto the copy-engine (DMA) path.
func TestHostConformance(t *testing.T) {
	t.Run("auto", func(t *testing.T) { cudatest.Run(t, openHost) })
	t.Run("dma", func(t *testing.T) {
		cudatest.Run(t, func(t *testing.T) cuda.Device {
			dev := openHost(t)
			cuda.SetCopyPath(dev, cuda.PathDMA)
			return dev
		})
	})
}

// The copy kernels' path and the DMA path give the same bytes and sums.
func TestHostPaths(t *testing.T) {
	cudatest.RunPaths(t, func(t *testing.T, path string) cuda.Device {
		dev := openHost(t)
		cuda.SetCopyPath(dev, path)
		return dev
	})
}

func TestHostCrossProcess(t *testing.T) {
	cudatest.RunCrossProcess(t, cudatest.CrossProcessConfig{
		HelperTest:             "TestHelperEngine",
		Open:                   openHostIn,
		DetectsDestroyedEvents: true,
		CheckDir:               checkHostDir,
	})
}

// TestHelperEngine is the engine process of TestHostCrossProcess.
func TestHelperEngine(t *testing.T) { cudatest.EngineMain(t, openHostIn) }

// checkHostDir: an engine that exited cleanly left no file behind; a killed
// one left its pool and event, which SweepStaleHost removes.
func checkHostDir(t *testing.T, dir string, killed bool) {
	t.Helper()
	if killed {
		removed, err := cuda.SweepStaleHost(dir)
		if err != nil {
			t.Fatalf("SweepStaleHost: %v", err)
		}
		if len(removed) != 2 {
			t.Errorf("SweepStaleHost removed %q, want the killed engine's pool and event", removed)
		}
	}
	left, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range left {
		t.Errorf("file left behind in %s: %s", dir, e.Name())
	}
}

var bg = context.Background()

// must(f())(t) returns f's value, failing the test on f's error.
func must[T any](v T, err error) func(t *testing.T) T {
	return func(t *testing.T) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

func wantErr(t *testing.T, what string, err error, targets ...error) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: nil error, want %v", what, targets)
	}
	for _, target := range targets {
		if !errors.Is(err, target) {
			t.Fatalf("%s: %q does not wrap %q", what, err, target)
		}
	}
}

func shmFiles(t *testing.T, dir string) []string {
	t.Helper()
	prefix := fmt.Sprintf("kvtier-%d-", os.Getpid())
	var names []string
	for _, e := range must(os.ReadDir(dir))(t) {
		if strings.HasPrefix(e.Name(), prefix) {
			names = append(names, e.Name())
		}
	}
	return names
}

func TestHostConfig(t *testing.T) {
	c := cuda.DefaultHostConfig()
	if c.Dir != cuda.DefaultHostDir() || !strings.HasPrefix(c.UUID, "HOST-") || c.Name == "" {
		t.Fatalf("DefaultHostConfig() = %+v", c)
	}
	if c2 := cuda.DefaultHostConfig(); c2.UUID != c.UUID {
		t.Fatalf("default UUID not stable: %s, %s", c.UUID, c2.UUID)
	}
	file := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		cfg  cuda.HostConfig
	}{
		{"missing dir", cuda.HostConfig{Dir: filepath.Join(t.TempDir(), "nope")}},
		{"dir is a file", cuda.HostConfig{Dir: file}},
		{"UUID with a slash", cuda.HostConfig{Dir: privDir(t), UUID: "HOST-a/b"}},
		{"UUID with a space", cuda.HostConfig{Dir: privDir(t), UUID: "HOST a"}},
	} {
		wantErr(t, c.name+": Validate", c.cfg.Validate(), cuda.ErrBadSpec)
		_, err := cuda.OpenHost(c.cfg)
		wantErr(t, c.name+": OpenHost", err, cuda.ErrBadSpec)
	}
}

func TestOpen(t *testing.T) {
	cfg := cuda.HostConfig{Dir: privDir(t)}
	dev := must(cuda.Open("host", cfg))(t)
	if in := dev.Info(); in.Backend != "host" {
		t.Fatalf("Open(host): %+v", in)
	}
	dev.Close()

	_, cudaErr := cuda.OpenCUDA(0)
	dev, err := cuda.Open("auto", cfg)
	if err != nil {
		t.Fatalf("Open(auto): %v", err)
	}
	want := "cuda"
	if errors.Is(cudaErr, cuda.ErrNoDriver) {
		want = "host"
	}
	if got := dev.Info().Backend; got != want {
		t.Fatalf("Open(auto) opened %s, want %s (OpenCUDA(0): %v)", got, want, cudaErr)
	}
	dev.Close()

	for _, spec := range []string{"", "gpu", "cuda:x", "cuda:-1", "HOST"} {
		_, err := cuda.Open(spec, cfg)
		wantErr(t, fmt.Sprintf("Open(%q)", spec), err, cuda.ErrBadSpec)
	}
	if _, err := cuda.Discover(); err != nil {
		// Without a driver every CUDA spec says so.
		for _, spec := range []string{"cuda", "cuda:0", "cuda:3", "GPU-00000000-0000-0000-0000-000000000000"} {
			_, err := cuda.Open(spec, cfg)
			wantErr(t, fmt.Sprintf("Open(%q) without a driver", spec), err, cuda.ErrNoDriver)
		}
	}
}

// The default directory is a private one under /dev/shm, created 0700;
// every file goes away with its owner.
func TestHostDefaultDir(t *testing.T) {
	if fi, err := os.Stat("/dev/shm"); err != nil || !fi.IsDir() {
		t.Skip("no /dev/shm")
	}
	dir := cuda.DefaultHostDir()
	probe := must(cuda.OpenHost(cuda.HostConfig{}))(t)
	probe.Close()
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Fatalf("default host dir %s: %v %v, want a 0700 directory", dir, fi, err)
	}
	before := len(shmFiles(t, dir))
	dev := must(cuda.OpenHost(cuda.HostConfig{}))(t)
	defer dev.Close()
	m := must(dev.Alloc(1 << 20))(t)
	e := must(dev.NewEvent(true))(t)
	must(dev.Alloc(4096))(t)
	if got := len(shmFiles(t, dir)); got != before+3 {
		t.Fatalf("%d files of this process in %s, want %d", got, dir, before+3)
	}
	m.Release()
	e.Release()
	if got := len(shmFiles(t, dir)); got != before+1 {
		t.Fatalf("%d files after Release, want %d", got, before+1)
	}
	if err := dev.Close(); err != nil {
		t.Fatal(err)
	}
	if got := len(shmFiles(t, dir)); got != before {
		t.Fatalf("%d files after Close, want %d", got, before)
	}
}

// Close finishes promptly even with a Delay of an hour and a wait that can
// never complete; the work behind them fails; every file is removed.
func TestHostCloseAbortsAndCleansUp(t *testing.T) {
	dir := privDir(t)
	dev := openHostIn(t, dir)
	a, b := must(dev.NewStream())(t), must(dev.NewStream())(t)
	m := must(dev.Alloc(4096))(t)
	hb := must(dev.AllocHost(4096))(t)
	host := bytes.Repeat([]byte{0xEE}, 4096)
	copy(hb.Bytes(), host)
	e := must(dev.NewEvent(true))(t)
	if err := a.Delay(time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := a.Record(e); err != nil {
		t.Fatal(err)
	}
	// b waits on an event of another device, which Close does not touch:
	// the wait can only be aborted.
	other := openHost(t)
	defer other.Close()
	slow := must(other.NewStream())(t)
	never := must(other.NewEvent(false))(t)
	if err := slow.Delay(time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := slow.Record(never); err != nil {
		t.Fatal(err)
	}
	if err := b.WaitEvent(never); err != nil {
		t.Fatal(err)
	}
	op := must(b.Gather(hb, []cuda.Object{{Spans: []cuda.Span{{Mem: m, Off: 0, Len: 4096}}}}))(t)
	if len(shmFiles(t, dir)) != 2 {
		t.Fatalf("files %v, want the allocation and the event", shmFiles(t, dir))
	}
	buf := hb.Bytes() // Close releases hb
	done := make(chan error, 1)
	go func() { done <- dev.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Device.Close blocked")
	}
	wantErr(t, "Gather behind the aborted wait", op.Wait(bg), cuda.ErrStreamFailed, cuda.ErrReleased)
	if !bytes.Equal(buf, host) {
		t.Fatal("the aborted gather wrote the host buffer")
	}
	if hb.Bytes() != nil {
		t.Fatal("a host buffer is still usable after Device.Close")
	}
	if left := shmFiles(t, dir); len(left) != 0 {
		t.Fatalf("files left after Close: %v", left)
	}
	_, err := dev.Alloc(1)
	wantErr(t, "Alloc after Close", err, cuda.ErrReleased)
	_, err = dev.NewEvent(false)
	wantErr(t, "NewEvent after Close", err, cuda.ErrReleased)
	_, err = dev.NewStream()
	wantErr(t, "NewStream after Close", err, cuda.ErrReleased)
	_, err = a.Gather(hb, nil)
	wantErr(t, "Gather on a stream of a closed device", err, cuda.ErrReleased)
}

// C1 in one process: releasing an event while a stream waits on it fails
// the stream instead of letting the gather read pages still being written.
func TestHostReleaseDuringWait(t *testing.T) {
	for _, ipc := range []bool{false, true} {
		t.Run(fmt.Sprintf("interprocess=%v", ipc), func(t *testing.T) {
			dev := openHost(t)
			defer dev.Close()
			a, b := must(dev.NewStream())(t), must(dev.NewStream())(t)
			m := must(dev.Alloc(1024))(t)
			hb := must(dev.AllocHost(1024))(t)
			host := bytes.Repeat([]byte{0x5A}, 1024)
			copy(hb.Bytes(), host)
			e := must(dev.NewEvent(ipc))(t)
			if err := a.Delay(time.Hour); err != nil {
				t.Fatal(err)
			}
			if err := a.Record(e); err != nil {
				t.Fatal(err)
			}
			if err := b.WaitEvent(e); err != nil {
				t.Fatal(err)
			}
			op := must(b.Gather(hb, []cuda.Object{{Spans: []cuda.Span{{Mem: m, Off: 0, Len: 1024}}}}))(t)
			if err := e.Release(); err != nil {
				t.Fatal(err)
			}
			wantErr(t, "Gather after the event was released during the wait", op.Wait(bg), cuda.ErrStreamFailed, cuda.ErrReleased)
			if !bytes.Equal(hb.Bytes(), host) {
				t.Fatal("the gather ran")
			}
			wantErr(t, "Synchronize", b.Synchronize(bg), cuda.ErrStreamFailed, cuda.ErrReleased)
		})
	}
}

// A record that its stream abandons (the stream failed before reaching it)
// fails every wait for it: the failure propagates along the event chain.
func TestHostAbandonedRecordPropagates(t *testing.T) {
	dev := openHost(t)
	defer dev.Close()
	a, b, c := must(dev.NewStream())(t), must(dev.NewStream())(t), must(dev.NewStream())(t)
	m := must(dev.Alloc(64))(t)
	hb := must(dev.AllocHost(64))(t)
	e0, e1 := must(dev.NewEvent(false))(t), must(dev.NewEvent(true))(t)
	if err := c.Delay(time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := c.Record(e0); err != nil {
		t.Fatal(err)
	}
	if err := a.WaitEvent(e0); err != nil {
		t.Fatal(err)
	}
	if err := a.Record(e1); err != nil {
		t.Fatal(err)
	}
	if err := b.WaitEvent(e1); err != nil {
		t.Fatal(err)
	}
	op := must(b.Gather(hb, []cuda.Object{{Spans: []cuda.Span{{Mem: m, Off: 0, Len: 64}}}}))(t)
	e0.Release()
	wantErr(t, "stream a", a.Synchronize(bg), cuda.ErrStreamFailed, cuda.ErrReleased)
	wantErr(t, "gather on stream b", op.Wait(bg), cuda.ErrStreamFailed)
	wantErr(t, "e1.Synchronize", e1.Synchronize(bg), cuda.ErrStreamFailed)
	_, err := e1.Query()
	wantErr(t, "e1.Query", err, cuda.ErrStreamFailed)
}

// Memory released while an enqueued copy still uses it stays mapped until
// the copy has run; new work on it is refused.
func TestHostReleaseWhileInFlight(t *testing.T) {
	dev := openHost(t)
	defer dev.Close()
	s := must(dev.NewStream())(t)
	m := must(dev.Alloc(8192))(t)
	want := make([]byte, 8192)
	for i := range want {
		want[i] = byte(i * 13)
	}
	if err := dev.Write(m, 0, want); err != nil {
		t.Fatal(err)
	}
	hb := must(dev.AllocHost(8192))(t)
	if err := s.Delay(100 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	objs := []cuda.Object{{Spans: []cuda.Span{{Mem: m, Off: 0, Len: 8192}}}}
	op := must(s.Gather(hb, objs))(t)
	if err := m.Release(); err != nil {
		t.Fatal(err)
	}
	_, err := s.Gather(hb, objs)
	wantErr(t, "Gather of released memory", err, cuda.ErrReleased)
	if err := op.Wait(bg); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(hb.Bytes(), want) {
		t.Fatal("the in-flight gather did not see the memory")
	}
}

// Close of a stream cuts its Delay and fails its pending event waits.
func TestHostStreamClose(t *testing.T) {
	dev := openHost(t)
	defer dev.Close()
	a, b := must(dev.NewStream())(t), must(dev.NewStream())(t)
	e := must(dev.NewEvent(false))(t)
	if err := a.Delay(time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := a.Record(e); err != nil {
		t.Fatal(err)
	}
	if err := b.WaitEvent(e); err != nil {
		t.Fatal(err)
	}
	up := must(b.Upload(must(dev.Alloc(8))(t), 0, []byte("12345678")))(t)
	start := time.Now()
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	wantErr(t, "Upload behind a wait of a closed stream", up.Wait(bg), cuda.ErrStreamFailed, cuda.ErrReleased)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if time.Since(start) > 10*time.Second {
		t.Fatalf("Close took %v", time.Since(start))
	}
	// The delay was cut short, and Record still completed the event.
	if done, err := e.Query(); err != nil || !done {
		t.Fatalf("Query after Close = %v, %v", done, err)
	}
}

// Importing in the exporting process: the view is exact, aliases are seen
// by the overlap check, events work through their files.
func TestHostSelfImport(t *testing.T) {
	dev := openHost(t)
	defer dev.Close()
	s := must(dev.NewStream())(t)
	m := must(dev.Alloc(3 * 4096))(t)
	h := must(dev.ExportMem(m, 4096+37, 1000))(t)
	if h.Backend != "host" || h.Device != dev.Info().UUID || h.Offset != 4096+37 || h.Size != 1000 {
		t.Fatalf("handle %+v", h)
	}
	v := must(dev.ImportMem(h))(t)
	if v.Size() != 1000 {
		t.Fatalf("view size %d", v.Size())
	}
	if err := dev.Write(v, 3, []byte("through the view")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 16)
	if err := dev.Read(m, 4096+37+3, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != "through the view" {
		t.Fatalf("read %q through the allocation", got)
	}
	err := dev.Write(v, 999, []byte{1, 2})
	wantErr(t, "Write past the view", err, cuda.ErrOutOfRange)

	hb := must(dev.AllocHost(64))(t)
	_, err = s.Scatter(hb, []cuda.Object{
		{HostOff: 0, Spans: []cuda.Span{{Mem: m, Off: 4096 + 37 + 10, Len: 8}}},
		{HostOff: 8, Spans: []cuda.Span{{Mem: v, Off: 17, Len: 8}}},
	})
	wantErr(t, "Scatter to aliased ranges through two views", err, cuda.ErrOverlap)
	must(s.Scatter(hb, []cuda.Object{
		{HostOff: 0, Spans: []cuda.Span{{Mem: m, Off: 4096 + 37 + 10, Len: 8}}},
		{HostOff: 8, Spans: []cuda.Span{{Mem: v, Off: 18, Len: 8}}},
	}))(t)
	_, err = dev.ExportMem(v, 0, 10)
	wantErr(t, "ExportMem of an imported view", err, cuda.ErrBadHandle)

	e := must(dev.NewEvent(true))(t)
	eh := must(dev.ExportEvent(e))(t)
	ie := must(dev.ImportEvent(eh))(t)
	if err := s.Record(ie); !errors.Is(err, cuda.ErrBadHandle) {
		t.Fatalf("Record of an imported event: %v", err)
	}
	if err := s.Delay(50 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Upload(m, 0, []byte("late")); err != nil {
		t.Fatal(err)
	}
	if err := s.Record(e); err != nil {
		t.Fatal(err)
	}
	b := must(dev.NewStream())(t)
	if err := b.WaitEvent(ie); err != nil {
		t.Fatal(err)
	}
	op := must(b.Gather(hb, []cuda.Object{{Spans: []cuda.Span{{Mem: m, Off: 0, Len: 4}}}}))(t)
	if err := op.Wait(bg); err != nil {
		t.Fatal(err)
	}
	if string(hb.Bytes()[:4]) != "late" {
		t.Fatalf("gathered %q after waiting on the imported event", hb.Bytes()[:4])
	}
	if err := ie.Synchronize(bg); err != nil {
		t.Fatal(err)
	}
	// The owner destroys it: the import reports ErrReleased, a new import
	// fails.
	e.Release()
	_, err = ie.Query()
	wantErr(t, "Query of an event destroyed by its owner", err, cuda.ErrReleased)
	_, err = dev.ImportEvent(eh)
	wantErr(t, "ImportEvent after destroy", err, cuda.ErrBadHandle)
	// Freed memory cannot be imported; the existing view stays usable.
	before := make([]byte, v.Size())
	if err := dev.Read(v, 0, before); err != nil {
		t.Fatal(err)
	}
	m.Release()
	_, err = dev.ImportMem(h)
	wantErr(t, "ImportMem after free", err, cuda.ErrBadHandle)
	after := make([]byte, v.Size())
	if err := dev.Read(v, 0, after); err != nil || !bytes.Equal(after, before) {
		t.Fatalf("view after the owner freed: changed or unreadable (%v)", err)
	}
}

func TestHostBadHandles(t *testing.T) {
	dir := privDir(t)
	dev := openHostIn(t, dir)
	defer dev.Close()
	m := must(dev.Alloc(4096))(t)
	good := must(dev.ExportMem(m, 100, 200))(t)
	e := must(dev.NewEvent(true))(t)
	goodEv := must(dev.ExportEvent(e))(t)
	missing := fmt.Sprintf("kvtier-%d-00000000deadbeef", os.Getpid())
	badMagic := missing[:len(missing)-1] + "0.event"
	if err := os.WriteFile(filepath.Join(dir, badMagic), make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	mh := func(f func(h *cuda.MemHandle)) cuda.MemHandle {
		h := good
		h.Raw = append([]byte(nil), good.Raw...)
		f(&h)
		return h
	}
	for _, c := range []struct {
		name string
		h    cuda.MemHandle
	}{
		{"other backend", mh(func(h *cuda.MemHandle) { h.Backend = "cuda" })},
		{"other device", mh(func(h *cuda.MemHandle) { h.Device = "HOST-other" })},
		{"path", mh(func(h *cuda.MemHandle) { h.Raw = []byte("../" + string(h.Raw)) })},
		{"event name", mh(func(h *cuda.MemHandle) { h.Raw = goodEv.Raw })},
		{"missing file", mh(func(h *cuda.MemHandle) { h.Raw = []byte(missing) })},
		{"view past the allocation", mh(func(h *cuda.MemHandle) { h.Offset = 4000 })},
		{"empty view", mh(func(h *cuda.MemHandle) { h.Size = 0 })},
		{"overflowing view", mh(func(h *cuda.MemHandle) { h.Offset = ^uint64(0) - 10 })},
	} {
		_, err := dev.ImportMem(c.h)
		wantErr(t, "ImportMem: "+c.name, err, cuda.ErrBadHandle)
	}
	for _, c := range []struct {
		name string
		h    cuda.EventHandle
	}{
		{"other backend", cuda.EventHandle{Backend: "cuda", Device: goodEv.Device, Raw: goodEv.Raw}},
		{"other device", cuda.EventHandle{Backend: "host", Device: "HOST-x", Raw: goodEv.Raw}},
		{"memory name", cuda.EventHandle{Backend: "host", Device: goodEv.Device, Raw: good.Raw}},
		{"missing", cuda.EventHandle{Backend: "host", Device: goodEv.Device, Raw: []byte(missing + ".event")}},
		{"bad magic", cuda.EventHandle{Backend: "host", Device: goodEv.Device, Raw: []byte(badMagic)}},
	} {
		_, err := dev.ImportEvent(c.h)
		wantErr(t, "ImportEvent: "+c.name, err, cuda.ErrBadHandle)
	}
	_, err := dev.ExportMem(m, 4000, 97)
	wantErr(t, "ExportMem past the end", err, cuda.ErrOutOfRange)
	_, err = dev.ExportEvent(must(dev.NewEvent(false))(t))
	wantErr(t, "ExportEvent of a local event", err, cuda.ErrBadHandle)
	must(dev.ImportMem(good))(t)
	must(dev.ImportEvent(goodEv))(t)
}

// Gather destinations overlapping in the host buffer are rejected too
// (host backend only: the API leaves it open).
func TestHostGatherOverlap(t *testing.T) {
	dev := openHost(t)
	defer dev.Close()
	s := must(dev.NewStream())(t)
	m := must(dev.Alloc(64))(t)
	hb := must(dev.AllocHost(64))(t)
	_, err := s.Gather(hb, []cuda.Object{
		{HostOff: 0, Spans: []cuda.Span{{Mem: m, Off: 0, Len: 10}}},
		{HostOff: 9, Spans: []cuda.Span{{Mem: m, Off: 0, Len: 10}}},
	})
	wantErr(t, "Gather into overlapping host ranges", err, cuda.ErrOverlap)
}

func TestSweepStaleHost(t *testing.T) {
	dir := privDir(t)
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skip("cannot run true:", err)
	}
	dead := cmd.Process.Pid
	names := map[string]bool{ // name: should be swept
		fmt.Sprintf("kvtier-%d-0123456789abcdef", dead):        true,
		fmt.Sprintf("kvtier-%d-0123456789abcdef.event", dead):  true,
		fmt.Sprintf("kvtier-%d-0123456789abcdef", os.Getpid()): false,
		"kvtier-1-0123456789abcdef":                            false, // init runs
		fmt.Sprintf("other-%d-0123456789abcdef", dead):         false,
		fmt.Sprintf("kvtier-%d-xyz", dead):                     false,
	}
	for n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	removed, err := cuda.SweepStaleHost(dir)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(removed)
	var want []string
	for n, sweep := range names {
		if sweep {
			want = append(want, n)
		}
		_, statErr := os.Stat(filepath.Join(dir, n))
		if exists := statErr == nil; exists == sweep {
			t.Errorf("%s: exists=%v after the sweep", n, exists)
		}
	}
	slices.Sort(want)
	if !slices.Equal(removed, want) {
		t.Errorf("removed %v, want %v", removed, want)
	}
	_, err = cuda.SweepStaleHost(filepath.Join(dir, "nope"))
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("sweep of a missing dir: %v", err)
	}
}

// The copy kernels' modes are the CUDA backend's: forcing one on the host
// backend is refused by name, the paths it has are taken, and a path
// nobody has is refused listing the ones there are.
func TestForceCopyPathModes(t *testing.T) {
	dev := openHostIn(t, privDir(t))
	defer dev.Close()
	for _, p := range []string{"auto", "sm", "dma"} {
		if err := cuda.ForceCopyPath(dev, p); err != nil {
			t.Errorf("ForceCopyPath(host, %q): %v", p, err)
		}
	}
	for _, p := range []string{"sm-direct", "sm-staged"} {
		err := cuda.ForceCopyPath(dev, p)
		if err == nil || !strings.Contains(err.Error(), "no copy modes") {
			t.Errorf("ForceCopyPath(host, %q) = %v, want the host device refused for having no copy modes", p, err)
		}
	}
	err := cuda.ForceCopyPath(dev, "staged")
	if err == nil || !strings.Contains(err.Error(), "sm-staged") {
		t.Errorf("ForceCopyPath(host, \"staged\") = %v, want an error naming the paths, sm-staged among them", err)
	}
}

// A Gather's and a Scatter's Op says when its work began to reach the
// stream (Op.Started: after its checks, before the call returns); other
// operations say nothing.
func TestOpStarted(t *testing.T) {
	dev := openHostIn(t, privDir(t))
	defer dev.Close()
	mem := must(dev.Alloc(4096))(t)
	defer mem.Release()
	hb := must(dev.AllocHost(4096))(t)
	defer hb.Release()
	st := must(dev.NewStream())(t)
	defer st.Close()
	objs := []cuda.Object{{HostOff: 0, Spans: []cuda.Span{{Mem: mem, Off: 0, Len: 4096}}}}
	for _, scatter := range []bool{false, true} {
		before := time.Now()
		op, err := st.Gather(hb, objs)
		if scatter {
			op, err = st.Scatter(hb, objs)
		}
		after := time.Now()
		if err != nil {
			t.Fatal(err)
		}
		if s := op.Started(); s.Before(before) || s.After(after) {
			t.Errorf("scatter %v: Started %v, want within the call (%v .. %v)", scatter, s, before, after)
		}
		if err := op.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	op, err := st.Upload(mem, 0, make([]byte, 16))
	if err != nil {
		t.Fatal(err)
	}
	if !op.Started().IsZero() {
		t.Errorf("an upload's Started %v, want zero", op.Started())
	}
}
