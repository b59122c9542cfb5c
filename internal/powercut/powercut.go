package powercut

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/durable"
)

// FS is a mounted power-cut file system: Dir is its mount point.
type FS struct {
	tb      testing.TB
	dir     string
	cmd     *exec.Cmd
	cmds    *os.File
	replies *bufio.Reader
	stderr  syncBuffer // the server's output, for failures

	mu     sync.Mutex // serializes commands; guards closed
	closed bool
}

// Mount mounts an empty power-cut file system on a fresh directory (Dir)
// for the rest of the test. It skips the test when this machine cannot
// mount FUSE (no /dev/fuse, or no permission to mount), and fails it
// instead when the environment variable CI is set: CI must run these.
func Mount(tb testing.TB) *FS {
	tb.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		unavailable(tb, "no /dev/fuse: %v", err)
	}
	exe, err := os.Executable()
	if err != nil {
		tb.Fatalf("powercut: the test binary: %v", err)
	}
	f := &FS{tb: tb, dir: tb.TempDir()}
	cr, cw, err := os.Pipe()
	if err != nil {
		tb.Fatal(err)
	}
	rr, rw, err := os.Pipe()
	if err != nil {
		tb.Fatal(err)
	}
	f.cmd = exec.Command(exe)
	// Under -race a process sleeps 1 s at exit by default (atexit_sleep_ms):
	// the server's exit is on every test's path.
	f.cmd.Env = append(os.Environ(), envMount+"="+f.dir, "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	f.cmd.ExtraFiles = []*os.File{cr, rw} // fds 3 and 4
	f.cmd.Stdout, f.cmd.Stderr = &f.stderr, &f.stderr
	err = f.cmd.Start()
	cr.Close()
	rw.Close()
	if err != nil {
		cw.Close()
		rr.Close()
		tb.Fatalf("powercut: start the file system server: %v", err)
	}
	f.cmds, f.replies = cw, bufio.NewReader(rr)
	tb.Cleanup(func() {
		f.close(true)
		rr.Close()
	})
	line, err := f.replies.ReadString('\n')
	switch {
	case err != nil:
		f.close(false)
		tb.Fatalf("powercut: the server exited before mounting: %v; its output: %s", err, f.stderr.String())
	case strings.HasPrefix(line, "error perm "):
		f.close(false)
		unavailable(tb, "cannot mount FUSE here (mount(2) needs root or CAP_SYS_ADMIN, else fusermount): %s",
			strings.TrimSpace(strings.TrimPrefix(line, "error perm ")))
	case line != "ready\n":
		f.close(false)
		tb.Fatalf("powercut: mount %s: %s", f.dir, strings.TrimSpace(line))
	}
	return f
}

func unavailable(tb testing.TB, format string, args ...any) {
	tb.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("CI") != "" {
		tb.Fatalf("powercut: %s (CI is set: the power-cut tests must run, not skip)", msg)
	}
	tb.Skipf("powercut: %s; the power-cut tests need FUSE", msg)
}

// Dir is the mount point: everything under it follows the power-cut rules
// (doc.go).
func (f *FS) Dir() string { return f.dir }

// Ops returns the number of mutating operations (writes, syncs, creates,
// removes, renames, attribute changes) the file system has counted since
// Mount: the clock that CutAfter counts on.
func (f *FS) Ops() int64 {
	ops, _ := f.state()
	return ops
}

// IsCut reports whether the power of the running mount is cut (by Cut or
// CutAfter) and not yet restored by Crash.
func (f *FS) IsCut() bool {
	_, cut := f.state()
	return cut
}

func (f *FS) state() (int64, bool) {
	r := strings.Fields(f.call("state"))
	if len(r) != 2 {
		f.tb.Fatalf("powercut: state reply %q", r)
	}
	ops, err := strconv.ParseInt(r[0], 10, 64)
	if err != nil {
		f.tb.Fatalf("powercut: state reply %q: %v", r, err)
	}
	return ops, r[1] == "true"
}

// CutAfter cuts the power at the (n+1)th mutating operation from now: the
// next n happen, that one and every later one fail with EIO and change
// nothing. Reads go on seeing the state at the cut.
func (f *FS) CutAfter(n int64) { f.call("cutafter " + strconv.FormatInt(n, 10)) }

// Cut cuts the power now (see CutAfter).
func (f *FS) Cut() { f.call("cut") }

// Crash cuts the power (if not yet cut) and brings the machine back: the
// mount is replaced by one that holds only what was durable. Files still
// open on the old mount keep reading what they saw and fail every change;
// close them (their close changes nothing). Open everything again under
// Dir.
func (f *FS) Crash() { f.call("crash") }

func (f *FS) call(cmd string) string {
	f.tb.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		f.tb.Fatalf("powercut: %s after the file system was unmounted", cmd)
	}
	if _, err := fmt.Fprintln(f.cmds, cmd); err != nil {
		f.tb.Fatalf("powercut: %s: %v; server output: %s", cmd, err, f.stderr.String())
	}
	line, err := f.replies.ReadString('\n')
	if err != nil {
		f.tb.Fatalf("powercut: %s: no reply: %v; server output: %s", cmd, err, f.stderr.String())
	}
	line = strings.TrimSuffix(line, "\n")
	if line != "ok" && !strings.HasPrefix(line, "ok ") {
		f.tb.Fatalf("powercut: %s: %s", cmd, line)
	}
	return strings.TrimPrefix(strings.TrimPrefix(line, "ok"), " ")
}

// close unmounts (lazily: files the test left open stay readable until
// closed) and waits for the server to exit; report: a failed exit fails
// the test.
func (f *FS) close(report bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return
	}
	f.closed = true
	fmt.Fprintln(f.cmds, "quit")
	f.cmds.Close()
	done := make(chan error, 1)
	go func() { done <- f.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil && report {
			f.tb.Errorf("powercut: the file system server failed: %v; its output: %s", err, f.stderr.String())
		}
	case <-time.After(30 * time.Second):
		_ = f.cmd.Process.Kill()
		<-done
		f.tb.Errorf("powercut: the file system server did not exit; killed; its output: %s", f.stderr.String())
	}
}

// syncBuffer is the server's output, written by exec's copier while a
// failing test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// SyncDir fsyncs the directory dir (making the names in it durable on a
// mount), failing tb when it cannot: the tests' own setup steps.
func SyncDir(tb testing.TB, dir string) {
	tb.Helper()
	if err := durable.SyncDir(dir); err != nil {
		tb.Fatal(err)
	}
}
