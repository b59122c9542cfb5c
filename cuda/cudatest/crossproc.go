package cudatest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
)

// The cross-process test runs the test binary a second time as an
// inference "engine": RunCrossProcess starts os.Args[0] with
// -test.run=^<HelperTest>$ and the environment below, and the helper test
// calls EngineMain, which does nothing in an ordinary run.
const (
	envEngine = "KVTIER_CUDATEST_ENGINE"   // "1" in the engine process
	envDir    = "KVTIER_CUDATEST_DIR"      // directory shared by both processes
	envDelay  = "KVTIER_CUDATEST_DELAY_MS" // how long the engine's writes take
	msgPrefix = "kvtier-engine "           // prefix of the engine's protocol lines on stdout
)

// The engine's KV pool: xpPages pages of xpWidth bytes every xpStride bytes,
// in a view that starts xpViewOff bytes into the allocation, so the handle
// must carry the offset (a CUDA legacy IPC handle names the base).
const (
	xpPages    = 8
	xpWidth    = 561 * 16
	xpStride   = xpWidth + 37
	xpViewOff  = 3*4096 + 37
	xpViewSize = xpPages * xpStride
	xpPoolSize = xpViewOff + xpViewSize + 100
)

// xpOld is the pool before the engine's writes; xpFresh the view after
// them, pages only (padding keeps xpOld). Every page byte differs.
func xpOld() []byte { return sentinelBytes(xpPoolSize, 0x11) }

func xpFresh() []byte {
	old := xpOld()[xpViewOff : xpViewOff+xpViewSize]
	mask := randomBytes(xpViewSize, 0xfeed)
	view := append([]byte(nil), old...)
	for p := range xpPages {
		for i := p * xpStride; i < p*xpStride+xpWidth; i++ {
			m := mask[i]
			if m == 0 {
				m = 1
			}
			view[i] ^= m
		}
	}
	return view
}

// SharedOpener opens the device in either process of the cross-process
// test. dir is a directory both processes see; the host backend keeps its
// shared files there (HostConfig.Dir), the CUDA backend ignores it.
type SharedOpener func(t *testing.T, dir string) cuda.Device

// CrossProcessConfig configures RunCrossProcess.
type CrossProcessConfig struct {
	// HelperTest is the name of the test function of the calling package
	// that calls EngineMain with the same Open, e.g. "TestHelperEngine".
	HelperTest string
	// Open opens the device in both processes.
	Open SharedOpener
	// DetectsDestroyedEvents: the backend reports a wait on an event that
	// its owner process destroyed, or that died with, as an error wrapping
	// ErrReleased. The host backend does; the CUDA driver cannot tell, so
	// those variants are skipped for it.
	DetectsDestroyedEvents bool
	// WriteDelay is how long the engine takes to write its pages after it
	// has sent the handles. The variant that skips the wait must gather
	// well within it. Default 2 s.
	WriteDelay time.Duration
	// CheckDir, if set, runs after each variant, once the engine has exited
	// and the test's device is closed, with the shared directory and
	// whether the engine was killed.
	CheckDir func(t *testing.T, dir string, killed bool)
}

// engineHello is the engine's first message: the handles of its pool view
// and of its producer event, recorded after its writes.
type engineHello struct {
	PID   int              `json:"pid"`
	Mem   cuda.MemHandle   `json:"mem"`
	Event cuda.EventHandle `json:"event"`
	// Not before these times (Unix ns) can the engine's stream start its
	// writes, and reach its Record: what the test process did before them
	// surely saw the old bytes and an incomplete event.
	WritesAt int64 `json:"writes_at"`
	RecordAt int64 `json:"record_at"`
}

type engineAck struct {
	Destroyed bool `json:"destroyed"`
}

// EngineMain is the body of the engine process: call it from the helper test
// named in CrossProcessConfig.HelperTest. In an ordinary test run it skips.
//
// The engine opens the device, fills its pool with the old pattern, then
// enqueues on a stream: a Delay, the first half of the new pages, another
// Delay, the second half, and the Record of an interprocess event. Only then
// does it print the handles (the engine records its event before it sends
// the store request), so the writes are still running when the test
// process imports them. It then obeys commands on stdin: "destroy" releases
// the event and acknowledges; "done" (or EOF) releases everything and exits.
func EngineMain(t *testing.T, open SharedOpener) {
	if os.Getenv(envEngine) != "1" {
		t.Skip("helper process of the cross-process test; RunCrossProcess starts it")
	}
	delayMS, err := strconv.Atoi(os.Getenv(envDelay))
	if err != nil || delayMS <= 0 {
		t.Fatalf("%s=%q", envDelay, os.Getenv(envDelay))
	}
	delay := time.Duration(delayMS) * time.Millisecond
	dev := open(t, os.Getenv(envDir))
	defer func() {
		if err := dev.Close(); err != nil {
			t.Errorf("engine: Device.Close: %v", err)
		}
	}()
	pool, err := dev.Alloc(xpPoolSize)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.Write(pool, 0, xpOld()); err != nil {
		t.Fatal(err)
	}
	ev, err := dev.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	fresh := xpFresh()
	enqueued := time.Now()
	for p := range xpPages {
		switch p {
		case 0:
			err = s.Delay(delay * 3 / 4)
		case xpPages / 2:
			err = s.Delay(delay / 4)
		}
		if err != nil {
			t.Fatal(err)
		}
		off := p * xpStride
		if _, err := s.Upload(pool, uint64(xpViewOff+off), fresh[off:off+xpWidth]); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Record(ev); err != nil {
		t.Fatal(err)
	}
	mh, err := dev.ExportMem(pool, xpViewOff, xpViewSize)
	if err != nil {
		t.Fatal(err)
	}
	eh, err := dev.ExportEvent(ev)
	if err != nil {
		t.Fatal(err)
	}
	send := func(v any) {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("%s%s\n", msgPrefix, b)
	}
	send(engineHello{
		PID:      os.Getpid(),
		Mem:      mh,
		Event:    eh,
		WritesAt: enqueued.Add(delay * 3 / 4).UnixNano(),
		RecordAt: enqueued.Add(delay).UnixNano(),
	})

	in := bufio.NewScanner(os.Stdin)
loop:
	for in.Scan() {
		switch cmd := strings.TrimSpace(in.Text()); cmd {
		case "destroy":
			if err := ev.Release(); err != nil {
				t.Fatal(err)
			}
			send(engineAck{Destroyed: true})
		case "done":
			break loop
		default:
			t.Fatalf("engine: unknown command %q", cmd)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := s.Synchronize(ctx); err != nil {
		t.Errorf("engine: Synchronize: %v", err)
	}
	for _, err := range []error{s.Close(), ev.Release(), pool.Release()} {
		if err != nil {
			t.Error(err)
		}
	}
}

// RunCrossProcess runs the cross-process IPC contract test: in every
// variant an engine process (EngineMain) exports a KV pool view and its
// producer event while its writes are still running, and this process
// imports both. Variants:
//
//	WaitEvent              wait on the event, then gather: the final bytes
//	SkipWait               gather without waiting: the stale bytes (proves
//	                       the wait is what makes the data right)
//	DestroyedBeforeWait    the engine destroys the event before the wait:
//	                       errors wrapping ErrReleased, no data
//	DestroyedWhileWaiting  destroyed while the stream waits: the same
//	EngineKilled           the engine is killed while the stream waits
//
// The last three run only with DetectsDestroyedEvents. Variants run in
// parallel, each with its own engine and directory.
func RunCrossProcess(t *testing.T, cfg CrossProcessConfig) {
	if cfg.HelperTest == "" || cfg.Open == nil {
		t.Fatal("CrossProcessConfig needs HelperTest and Open")
	}
	if cfg.WriteDelay <= 0 {
		cfg.WriteDelay = 2 * time.Second
	}
	variants := []struct {
		name    string
		destroy bool // needs DetectsDestroyedEvents
		run     func(t *testing.T, x *xpRun)
	}{
		{"WaitEvent", false, xpWaitEvent},
		{"SkipWait", false, xpSkipWait},
		{"DestroyedBeforeWait", true, xpDestroyedBeforeWait},
		{"DestroyedWhileWaiting", true, xpDestroyedWhileWaiting},
		{"EngineKilled", true, xpEngineKilled},
	}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			if v.destroy && !cfg.DetectsDestroyedEvents {
				t.Skip("the backend cannot detect an event destroyed by its owner process")
			}
			t.Parallel()
			dir := t.TempDir()
			if err := os.Chmod(dir, 0o700); err != nil { // the host backend wants a private dir
				t.Fatal(err)
			}
			eng := startEngine(t, cfg, dir)
			dev := cfg.Open(t, dir)
			t.Cleanup(func() { dev.Close() })
			x := &xpRun{cfg: cfg, eng: eng, dev: dev, hello: eng.hello(t)}
			v.run(t, x)
			if err := dev.Close(); err != nil {
				t.Errorf("Device.Close: %v", err)
			}
			eng.finish(t)
			if cfg.CheckDir != nil {
				cfg.CheckDir(t, dir, eng.killed)
			}
		})
	}
}

// xpRun is one variant in the test process.
type xpRun struct {
	cfg   CrossProcessConfig
	eng   *engineProc
	dev   cuda.Device
	hello engineHello
}

// before fails the test, naming the cause, unless it is still earlier than
// the engine time at (Unix ns): what was done so far did not race with it.
func (x *xpRun) before(t *testing.T, at int64, what, engine string) {
	t.Helper()
	if late := time.Since(time.Unix(0, at)); late >= 0 {
		t.Fatalf("machine too slow: %s finished %v after the engine %s (WriteDelay %v)", what, late, engine, x.cfg.WriteDelay)
	}
}

// imports opens the engine's pool view and event and checks the view.
func (x *xpRun) imports(t *testing.T) (cuda.Mem, cuda.Event) {
	t.Helper()
	if x.hello.Mem.Offset != xpViewOff || x.hello.Mem.Size != xpViewSize {
		t.Fatalf("handle view [%d, +%d B), want [%d, +%d B)", x.hello.Mem.Offset, x.hello.Mem.Size, xpViewOff, xpViewSize)
	}
	m, err := x.dev.ImportMem(x.hello.Mem)
	if err != nil {
		t.Fatalf("ImportMem: %v", err)
	}
	t.Cleanup(func() { m.Release() })
	if m.Size() != xpViewSize {
		t.Fatalf("imported view has %d B, want %d", m.Size(), xpViewSize)
	}
	e, err := x.dev.ImportEvent(x.hello.Event)
	if err != nil {
		t.Fatalf("ImportEvent: %v", err)
	}
	t.Cleanup(func() { e.Release() })
	return m, e
}

// xpObjects: object 0 is the whole view (pages and padding), objects 1..
// are the pages, at odd host offsets. xpHostSize is the buffer they need.
func xpObjects(m cuda.Mem) []cuda.Object {
	objs := []cuda.Object{{HostOff: 3, Spans: []cuda.Span{{Mem: m, Off: 0, Len: xpViewSize}}}}
	pos := uint64(3 + xpViewSize + 1)
	for p := range xpPages {
		objs = append(objs, cuda.Object{HostOff: pos, Spans: []cuda.Span{{Mem: m, Off: uint64(p * xpStride), Len: xpWidth}}})
		pos += xpWidth + 7
	}
	return objs
}

const xpHostSize = 3 + xpViewSize + 1 + xpPages*(xpWidth+7)

// checkGathered compares every gathered byte with the view image and the
// sums with checksum.Sum.
func checkGathered(t *testing.T, what string, hb cuda.HostBuf, objs []cuda.Object, sums []uint64, view []byte) {
	t.Helper()
	b := hb.Bytes()
	for i, o := range objs {
		sp := o.Spans[0]
		want := view[sp.Off : sp.Off+sp.Len]
		equalBytes(t, fmt.Sprintf("%s: object %d", what, i), b[o.HostOff:o.HostOff+sp.Len], want)
		if sums != nil && sums[i] != checksum.Sum(want) {
			t.Fatalf("%s: object %d: sum %#016x, want %#016x", what, i, sums[i], checksum.Sum(want))
		}
	}
}

func xpWaitEvent(t *testing.T, x *xpRun) {
	m, e := x.imports(t)
	s := newStream(t, x.dev)
	hb := allocHost(t, x.dev, xpHostSize)
	if err := s.WaitEvent(e); err != nil {
		t.Fatalf("WaitEvent: %v", err)
	}
	objs := xpObjects(m)
	sums := gather(t, s, hb, objs)
	checkGathered(t, "after WaitEvent", hb, objs, sums, xpFresh())
	if done, err := e.Query(); err != nil || !done {
		t.Fatalf("event Query after the wait = %v, %v", done, err)
	}
	_, err := s.Gather(hb, []cuda.Object{{Spans: []cuda.Span{{Mem: m, Off: xpViewSize - 10, Len: 11}}}})
	isErr(t, "Gather past the imported view", err, cuda.ErrOutOfRange)
}

func xpSkipWait(t *testing.T, x *xpRun) {
	m, e := x.imports(t)
	s := newStream(t, x.dev)
	hb := allocHost(t, x.dev, xpHostSize)
	objs := xpObjects(m)
	gather(t, s, hb, objs)
	x.before(t, x.hello.WritesAt, "the gather without a wait", "may have started writing")
	old := xpOld()[xpViewOff : xpViewOff+xpViewSize]
	checkGathered(t, "without WaitEvent (stale bytes expected)", hb, objs, nil, old)
	if done, err := e.Query(); err != nil || done {
		t.Fatalf("event Query while the engine writes = %v, %v; want false, nil", done, err)
	}
	// The same gather after the wait sees the engine's final bytes.
	if err := s.WaitEvent(e); err != nil {
		t.Fatal(err)
	}
	sums := gather(t, s, hb, objs)
	checkGathered(t, "after WaitEvent", hb, objs, sums, xpFresh())
}

// checkNoData: the gather on a stream whose wait failed reports an error
// wrapping ErrReleased and ErrStreamFailed, and wrote nothing.
func checkNoData(t *testing.T, s cuda.Stream, hb cuda.HostBuf, host []byte, op *cuda.Op, err error) {
	t.Helper()
	if err == nil {
		err = op.Wait(testCtx(t))
	}
	isErr(t, "Gather after the wait on a destroyed event", err, cuda.ErrStreamFailed)
	isErr(t, "Stream.Synchronize", s.Synchronize(testCtx(t)), cuda.ErrStreamFailed, cuda.ErrReleased)
	equalBytes(t, "host buffer (no data may be reported)", hb.Bytes(), host)
}

func xpDestroyedBeforeWait(t *testing.T, x *xpRun) {
	m, e := x.imports(t)
	s := newStream(t, x.dev)
	hb := allocHost(t, x.dev, xpHostSize)
	host := sentinelBytes(xpHostSize, 0x33)
	copy(hb.Bytes(), host)
	x.eng.send(t, "destroy")
	var ack engineAck
	x.eng.expect(t, &ack)
	if !ack.Destroyed {
		t.Fatal("engine did not destroy its event")
	}
	if err := s.WaitEvent(e); err != nil {
		isErr(t, "WaitEvent on a destroyed event", err, cuda.ErrReleased)
	}
	op, err := s.Gather(hb, xpObjects(m))
	checkNoData(t, s, hb, host, op, err)
	_, err = e.Query()
	isErr(t, "Query of a destroyed event", err, cuda.ErrReleased)
	isErr(t, "Synchronize of a destroyed event", e.Synchronize(testCtx(t)), cuda.ErrReleased)
}

func xpDestroyedWhileWaiting(t *testing.T, x *xpRun) {
	m, e := x.imports(t)
	s := newStream(t, x.dev)
	hb := allocHost(t, x.dev, xpHostSize)
	host := sentinelBytes(xpHostSize, 0x34)
	copy(hb.Bytes(), host)
	if err := s.WaitEvent(e); err != nil {
		t.Fatal(err)
	}
	op, err := s.Gather(hb, xpObjects(m))
	if err != nil {
		t.Fatal(err)
	}
	x.eng.send(t, "destroy")
	var ack engineAck
	x.eng.expect(t, &ack)
	if !ack.Destroyed {
		t.Fatal("engine did not destroy its event")
	}
	x.before(t, x.hello.RecordAt, "destroying the event", "may have reached its Record")
	checkNoData(t, s, hb, host, nil, op.Wait(testCtx(t)))
}

func xpEngineKilled(t *testing.T, x *xpRun) {
	m, e := x.imports(t)
	s := newStream(t, x.dev)
	hb := allocHost(t, x.dev, xpHostSize)
	host := sentinelBytes(xpHostSize, 0x35)
	copy(hb.Bytes(), host)
	if err := s.WaitEvent(e); err != nil {
		t.Fatal(err)
	}
	op, err := s.Gather(hb, xpObjects(m))
	if err != nil {
		t.Fatal(err)
	}
	x.eng.kill(t)
	x.before(t, x.hello.RecordAt, "killing the engine", "may have reached its Record")
	checkNoData(t, s, hb, host, nil, op.Wait(testCtx(t)))
}

// engineProc is the engine process, seen from the test process.
type engineProc struct {
	cmd        *exec.Cmd
	stdin      io.WriteCloser
	msgs       chan string   // protocol lines, prefix stripped
	readerDone chan struct{} // closed when stdout is drained
	stderr     bytes.Buffer  // written by exec until Wait returns

	mu    sync.Mutex // guards other
	other []string   // stdout lines that are not protocol

	killed, exited bool
}

func startEngine(t *testing.T, cfg CrossProcessConfig, dir string) *engineProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+cfg.HelperTest+"$", "-test.count=1")
	cmd.Env = append(os.Environ(),
		envEngine+"=1",
		envDir+"="+dir,
		envDelay+"="+strconv.FormatInt(cfg.WriteDelay.Milliseconds(), 10),
	)
	e := &engineProc{cmd: cmd, msgs: make(chan string, 16), readerDone: make(chan struct{})}
	cmd.Stderr = &e.stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if e.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start engine: %v", err)
	}
	go func() {
		defer close(e.readerDone)
		defer close(e.msgs)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if msg, ok := strings.CutPrefix(line, msgPrefix); ok {
				e.msgs <- msg
				continue
			}
			e.mu.Lock()
			e.other = append(e.other, line)
			e.mu.Unlock()
		}
		io.Copy(io.Discard, stdout)
	}()
	t.Cleanup(func() {
		if !e.exited {
			e.cmd.Process.Kill()
			e.reap()
		}
	})
	return e
}

// reap closes stdin, drains stdout and waits for the process.
func (e *engineProc) reap() error {
	e.stdin.Close()
	for range e.msgs {
	}
	<-e.readerDone
	e.exited = true
	return e.cmd.Wait()
}

func (e *engineProc) output() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return fmt.Sprintf("engine stdout:\n%s\nengine stderr:\n%s", strings.Join(e.other, "\n"), e.stderr.String())
}

func (e *engineProc) hello(t *testing.T) engineHello {
	t.Helper()
	var h engineHello
	e.expect(t, &h)
	if h.PID != e.cmd.Process.Pid {
		t.Fatalf("engine says pid %d, started %d", h.PID, e.cmd.Process.Pid)
	}
	return h
}

// expect decodes the engine's next message into v.
func (e *engineProc) expect(t *testing.T, v any) {
	t.Helper()
	select {
	case msg, ok := <-e.msgs:
		if !ok {
			err := e.reap()
			t.Fatalf("engine exited (%v) before its message\n%s", err, e.output())
		}
		if err := json.Unmarshal([]byte(msg), v); err != nil {
			t.Fatalf("engine message %q: %v", msg, err)
		}
	case <-time.After(time.Minute):
		t.Fatal("no message from the engine within a minute")
	}
}

func (e *engineProc) send(t *testing.T, cmd string) {
	t.Helper()
	if _, err := fmt.Fprintln(e.stdin, cmd); err != nil {
		t.Fatalf("send %q to the engine: %v", cmd, err)
	}
}

// kill kills the engine (SIGKILL) and reaps it, so that it is gone, not a
// zombie, when kill returns.
func (e *engineProc) kill(t *testing.T) {
	t.Helper()
	if err := e.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	e.killed = true
	err := e.reap()
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("killed engine: Wait: %v", err)
	}
}

// finish tells a live engine it is done and checks that it exits cleanly.
func (e *engineProc) finish(t *testing.T) {
	t.Helper()
	if e.exited {
		return
	}
	e.send(t, "done")
	if err := e.reap(); err != nil {
		t.Fatalf("engine: %v\n%s", err, e.output())
	}
}
