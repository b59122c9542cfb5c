package campaign

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// proc is one daemon process; its output goes to an append-only log file
// shared by its incarnations.
type proc struct {
	name string
	argv []string
	log  string

	// mu guards the following.
	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{}
	err    error // exit status, valid after done
	killed bool  // the campaign killed this incarnation on purpose
	// stopping: the campaign is shutting the cluster down.
	stopping bool
	starts   int
	crashes  []string // exits the campaign did not cause
	// refusals counts exits with status 1 the campaign did not cause.
	refusals int
}

func newProc(name, log string, argv []string) *proc {
	return &proc{name: name, argv: argv, log: log}
}

// start starts a new incarnation; the previous one must have exited.
func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done != nil {
		select {
		case <-p.done:
		default:
			return fmt.Errorf("%s: still running", p.name)
		}
	}
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	p.starts++
	fmt.Fprintf(f, "=== campaign: start %d of %s\n", p.starts, p.name)
	cmd := exec.Command(p.argv[0], p.argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	p.cmd, p.done, p.killed, p.err = cmd, done, false, nil
	go func() {
		err := cmd.Wait()
		f.Close()
		p.mu.Lock()
		p.err = err
		if !p.killed && !p.stopping {
			// Exit status 1 is a daemon refusing to run (it logs why: a
			// start under ENOSPC cannot record its incarnation); a Go
			// panic exits 2; a signal the campaign did not send is a
			// crash too.
			var ee *exec.ExitError
			if errors.As(err, &ee) && ee.ExitCode() == 1 {
				p.refusals++
			} else {
				p.crashes = append(p.crashes, fmt.Sprintf("%s start %d exited on its own: %v", p.name, p.starts, err))
			}
		}
		p.mu.Unlock()
		close(done)
	}()
	return nil
}

// alive reports whether the current incarnation runs.
func (p *proc) alive() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// signal sends sig to the current incarnation (no-op when it is not
// running). SIGKILL marks the exit as the campaign's doing and waits.
func (p *proc) signal(sig syscall.Signal) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	if sig == syscall.SIGKILL || sig == syscall.SIGTERM {
		p.killed = true
	}
	p.mu.Unlock()
	if cmd == nil || done == nil {
		return
	}
	select {
	case <-done:
		return
	default:
	}
	_ = cmd.Process.Signal(sig)
	if sig == syscall.SIGKILL {
		<-done
	}
}

// rssBytes reads VmRSS of the current incarnation (0 when not running).
func (p *proc) rssBytes() uint64 {
	pid := p.pid()
	if pid == 0 || !p.alive() {
		return 0
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			f := strings.Fields(l)
			if len(f) >= 2 {
				kb, _ := strconv.ParseUint(f[1], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}
