package powercut

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// envMount, set in the environment of a test binary started by Mount,
// makes that process the file system's server for the mount point it
// names: see serve.
const envMount = "KVTIER_POWERCUT_MOUNT"

// The server runs in a child process (the same test binary, re-executed),
// never in the process that uses the mount: a goroutine faulting on an
// mmap of a FUSE file (bbolt reads that way) blocks its thread in the
// kernel without the Go scheduler knowing, and a stop-the-world then waits
// for it while the fault waits for a server goroutine that cannot run.
func init() {
	if mp := os.Getenv(envMount); mp != "" {
		os.Exit(serve(mp))
	}
}

// Control protocol, one line each way: commands on fd 3, replies on fd 4.
//
//	state          -> ok <mutating ops so far> <cut: true|false>
//	cutafter <n>   -> ok      (the next n mutations happen, the one after is the cut)
//	cut            -> ok      (cut now)
//	crash          -> ok      (cut, drop what is not durable, remount)
//	quit, or EOF   -> the mount is detached and the process exits
//
// An error is "error <kind> <message>", kind "perm" when mounting is not
// permitted here and "fail" otherwise.
func serve(mp string) int {
	cmds := bufio.NewScanner(os.NewFile(3, "powercut-commands"))
	replies := os.NewFile(4, "powercut-replies")
	m := newModel(uint32(os.Getuid()), uint32(os.Getgid()))
	if err := mountGen(m, m.gen, mp); err != nil {
		fmt.Fprintf(replies, "error %s %s\n", errKind(err), oneLine(err))
		return 1
	}
	fmt.Fprintln(replies, "ready")
	for cmds.Scan() {
		f := strings.Fields(cmds.Text())
		if len(f) == 0 {
			continue
		}
		reply := "ok"
		switch f[0] {
		case "state":
			ops, cut := m.state()
			reply = fmt.Sprintf("ok %d %t", ops, cut)
		case "cutafter":
			n, err := strconv.ParseInt(f[len(f)-1], 10, 64)
			if len(f) != 2 || err != nil || n < 0 {
				reply = "error fail cutafter wants one count >= 0"
				break
			}
			m.cutAfter(n)
		case "cut":
			m.cutNow()
		case "crash":
			g := m.crash()
			if err := detach(mp); err != nil {
				reply = "error fail unmount at crash: " + oneLine(err)
			} else if err := mountGen(m, g, mp); err != nil {
				reply = "error fail remount at crash: " + oneLine(err)
			}
		case "quit":
			_ = detach(mp)
			return 0
		default:
			reply = "error fail unknown command " + strconv.Quote(f[0])
		}
		fmt.Fprintln(replies, reply)
	}
	_ = detach(mp) // the test process is gone
	return 0
}

// mountGen mounts generation g of m at mp and serves it until the kernel
// drops the mount (detached and its last open file closed).
func mountGen(m *model, g *generation, mp string) error {
	opts := &fuse.MountOptions{
		FsName:             "powercut",
		Name:               "powercut",
		DirectMount:        true, // mount(2) as root; fusermount otherwise
		DisableXAttrs:      true,
		DisableReadDirPlus: true,
		MaxBackground:      64,
	}
	srv, err := fuse.NewServer(newRawFS(m, g), mp, opts)
	if err != nil {
		return err
	}
	go srv.Serve()
	return srv.WaitMount()
}

// detach unmounts mp lazily: files still open on it stay served (by a
// generation whose power is cut) until they are closed.
func detach(mp string) error {
	err := syscall.Unmount(mp, syscall.MNT_DETACH)
	if errors.Is(err, syscall.EPERM) {
		if bin, lerr := exec.LookPath("fusermount3"); lerr == nil {
			return exec.Command(bin, "-u", "-z", mp).Run()
		}
		if bin, lerr := exec.LookPath("fusermount"); lerr == nil {
			return exec.Command(bin, "-u", "-z", mp).Run()
		}
	}
	return err
}

// errKind is "perm" when this machine cannot mount FUSE at all (no
// permission, no fusermount, no FUSE in the kernel), "fail" otherwise.
func errKind(err error) string {
	if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.ENODEV) ||
		errors.Is(err, exec.ErrNotFound) || strings.Contains(err.Error(), "fusermount") {
		return "perm"
	}
	return "fail"
}

func oneLine(err error) string { return strings.ReplaceAll(err.Error(), "\n", " ") }
