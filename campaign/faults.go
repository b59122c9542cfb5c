package campaign

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
)

func (r *runner) inject(ctx context.Context, sched []Fault) {
	for _, f := range sched {
		if d := time.Until(r.start.Add(f.At)); d > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(d):
			}
		}
		r.lastOn = ""
		skip := r.apply(ctx, f)
		rec := struct {
			Fault
			T       float64 `json:"t"`
			On      string  `json:"on,omitempty"` // the process a process fault hit
			Skipped string  `json:"skipped,omitempty"`
		}{f, time.Since(r.start).Seconds(), r.lastOn, skip}
		b, _ := json.Marshal(rec)
		r.mu.Lock()
		_, _ = r.flog.Write(append(b, '\n'))
		if skip != "" {
			r.rep.Skipped[f.Kind]++
			r.rep.SkipWhy[f.Kind] = skip
		} else {
			r.rep.ByKind[f.Kind]++
			r.rep.Injected++
		}
		r.mu.Unlock()
		r.log.Debug("fault", zap.Int("seq", f.Seq), zap.String("kind", string(f.Kind)), zap.Int("target", f.Target),
			zap.Duration("for", f.For), zap.String("skipped", skip))
	}
}

// procOf resolves a fault's target to a process. A coordinator fault
// with raft hits the leader when bit 40 of its pick is clear (the
// leader's death is the failover the campaign must survive), else the
// node its pick names; without raft the one coordinator.
func (r *runner) procOf(ctx context.Context, f Fault) *proc {
	if f.Target >= 0 {
		return r.c.ranks[f.Target]
	}
	n := r.c.coords[0]
	if r.c.raftMode() {
		n = r.c.coords[(f.Pick>>41)%uint64(len(r.c.coords))]
		if f.Pick>>40&1 == 0 {
			if l := r.c.leader(ctx); l >= 0 {
				n = r.c.coords[l]
				r.mu.Lock()
				r.rep.LeaderHits++
				r.mu.Unlock()
			}
		}
	}
	return n.p
}

// after runs f after d on a goroutine the runner owns.
func (r *runner) after(ctx context.Context, d time.Duration, f func()) {
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
		f()
	}()
}

func (r *runner) hit(target int) {
	now := time.Now()
	if target < 0 {
		r.led.hitCoordinator(now)
		// A coordinator restart may resync every rank.
		for t := range r.cfg.Ranks {
			r.led.hitRank(r.c.rank(t).String(), now)
		}
		return
	}
	r.led.hitRank(r.c.rank(target).String(), now)
}

// apply injects f; it returns why it was skipped, "" when injected.
func (r *runner) apply(ctx context.Context, f Fault) string {
	c := r.c
	switch f.Kind {
	case KillRankd, KillCoordinator:
		p := r.procOf(ctx, f)
		r.lastOn = p.name
		r.mu.Lock()
		r.downUntil[p.name] = time.Now().Add(f.For)
		r.stops[p.name] = 0
		r.mu.Unlock()
		r.hit(f.Target)
		p.signal(syscall.SIGKILL)
	case StopRankd, StopCoordinator:
		p := r.procOf(ctx, f)
		r.lastOn = p.name
		if !p.alive() {
			return "process down"
		}
		r.mu.Lock()
		r.stops[p.name]++
		r.mu.Unlock()
		r.hit(f.Target)
		p.signal(syscall.SIGSTOP)
		r.after(ctx, f.For, func() {
			r.mu.Lock()
			r.stops[p.name] = max(0, r.stops[p.name]-1)
			n := r.stops[p.name]
			r.mu.Unlock()
			if n == 0 {
				p.signal(syscall.SIGCONT)
			}
		})
	case L2BitFlip, L2Truncate, L2Delete, L2Swap:
		return r.l2Fault(f)
	case L3BitFlip, L3Truncate, L3Delete:
		if c.l3 == nil {
			return "no L3 (--l3=false)"
		}
		key, skip := c.l3.fault(f.Kind, f.Pick)
		if skip == "" {
			r.led.hitL3(key, time.Now())
		}
		return skip
	case L2NoSpace:
		if !c.tmpfs {
			return "no tmpfs for L2 (" + c.l2Why + ")"
		}
		r.mu.Lock()
		r.enospc++
		first := r.enospc == 1
		r.mu.Unlock()
		if first {
			if err := fillFS(filepath.Join(c.l2FS, "ballast")); err != nil {
				r.log.Warn("filling the L2 file system", zap.Error(err))
			}
		}
		r.after(ctx, f.For, func() {
			r.mu.Lock()
			r.enospc--
			last := r.enospc == 0
			r.mu.Unlock()
			if last {
				_ = os.Remove(filepath.Join(c.l2FS, "ballast"))
			}
		})
	case NATSDrop, NATSDup, NATSReorder:
		r.hit(f.Target)
		c.proxies[f.Target].Inject(f.Kind, f.Dir, max(1, f.Count))
	case NATSDelay:
		c.proxies[f.Target].Stall(f.Dir, f.For)
	case NATSCut:
		r.hit(f.Target)
		c.proxies[f.Target].Cut()
	case Partition:
		if c.lab == nil {
			return "no network namespaces (" + c.labWhy + ")"
		}
		r.hit(f.Target)
		if err := c.lab.partition(f.Target, 1); err != nil {
			return err.Error()
		}
		r.after(ctx, f.For, func() {
			if err := c.lab.partition(f.Target, -1); err != nil {
				r.problem("healing partition of rank %d: %v", f.Target, err)
			}
		})
	case LossyLink:
		if c.lab == nil {
			return "no network namespaces (" + c.labWhy + ")"
		}
		r.hit(f.Target)
		rng := rand.New(rand.NewPCG(f.Pick, uint64(f.Seq)))
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			end := time.Now().Add(f.For)
			for time.Now().Before(end) && ctx.Err() == nil {
				_ = c.lab.flap(f.Target, true)
				time.Sleep(time.Duration(20+rng.IntN(60)) * time.Millisecond)
				_ = c.lab.flap(f.Target, false)
				time.Sleep(time.Duration(50+rng.IntN(150)) * time.Millisecond)
			}
			_ = c.lab.flap(f.Target, false)
		}()
	default:
		return "unknown kind"
	}
	return ""
}

// keyOfFile is the object key text of an L2 file (its name less .kvo).
func keyOfFile(path string) string { return strings.TrimSuffix(filepath.Base(path), ".kvo") }

func (r *runner) l2Fault(f Fault) string {
	files := r.c.l2Files()
	if len(files) == 0 {
		return "no L2 object yet"
	}
	i := int(f.Pick % uint64(len(files)))
	a := files[i]
	now := time.Now()
	switch f.Kind {
	case L2BitFlip, L2Truncate:
		fh, err := os.OpenFile(a, os.O_RDWR, 0)
		if err != nil {
			return "open: " + err.Error()
		}
		defer fh.Close()
		st, err := fh.Stat()
		if err != nil || st.Size() == 0 {
			return "empty or unreadable file"
		}
		r.led.hitL2(keyOfFile(a), now)
		if f.Kind == L2Truncate {
			if err := fh.Truncate(st.Size() * int64((f.Pick>>16)%100) / 100); err != nil {
				return "truncate: " + err.Error()
			}
			return ""
		}
		off := int64((f.Pick >> 20) % uint64(st.Size()))
		var b [1]byte
		if _, err := fh.ReadAt(b[:], off); err != nil {
			return "read: " + err.Error()
		}
		b[0] ^= 1 << ((f.Pick >> 8) & 7)
		if _, err := fh.WriteAt(b[:], off); err != nil {
			return "write: " + err.Error()
		}
	case L2Delete:
		r.led.hitL2(keyOfFile(a), now)
		if err := os.Remove(a); err != nil {
			return "remove: " + err.Error()
		}
	case L2Swap:
		if len(files) < 2 {
			return "fewer than 2 L2 objects"
		}
		j := int((f.Pick >> 32) % uint64(len(files)))
		if j == i {
			j = (i + 1) % len(files)
		}
		b := files[j]
		r.led.hitL2(keyOfFile(a), now)
		r.led.hitL2(keyOfFile(b), now)
		tmp := a + ".campaign-swap"
		if err := os.Rename(a, tmp); err != nil {
			return "rename: " + err.Error()
		}
		_ = os.Rename(b, a)
		_ = os.Rename(tmp, b)
	}
	return ""
}

// fillFS writes path until its file system is full.
func fillFS(path string) error {
	fh, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer fh.Close()
	var st syscall.Statfs_t
	if err := syscall.Statfs(filepath.Dir(path), &st); err == nil {
		free := int64(st.Bavail) * int64(st.Bsize)
		if free > 1<<20 {
			_ = syscall.Fallocate(int(fh.Fd()), 0, 0, free-(1<<20))
		}
	}
	buf := make([]byte, 64<<10)
	for {
		if _, err := fh.Write(buf); err != nil {
			if errors.Is(err, syscall.ENOSPC) {
				return nil
			}
			return err
		}
	}
}

// heal ends every fault: processes continue, links come up, proxies pass
// everything, the L2 file system has room again.
func (r *runner) heal() {
	r.mu.Lock()
	for t := range r.stops {
		r.stops[t] = 0
	}
	r.downUntil = map[string]time.Time{}
	r.enospc = 0
	r.mu.Unlock()
	for _, p := range append(r.c.coordProcs(), r.c.ranks...) {
		p.signal(syscall.SIGCONT)
	}
	for _, p := range r.c.proxies {
		p.Heal()
	}
	if r.c.lab != nil {
		if err := r.c.lab.healAll(); err != nil {
			r.problem("healing the network: %v", err)
		}
	}
	_ = os.Remove(filepath.Join(r.c.l2FS, "ballast"))
	// Let restarts happen now.
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		all := true
		for _, p := range append(r.c.coordProcs(), r.c.ranks...) {
			all = all && p.alive()
		}
		if all {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// anyCoordinator reports whether some coordinator process runs.
func (r *runner) anyCoordinator() bool {
	for _, p := range r.c.coordProcs() {
		if p.alive() {
			return true
		}
	}
	return false
}

// supervise restarts every daemon that is down once its kill's down time
// passed (a daemon that exits on its own is a crash, recorded by proc).
func (r *runner) supervise(ctx context.Context) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, p := range append(r.c.coordProcs(), r.c.ranks...) {
			if p.alive() {
				continue
			}
			r.mu.Lock()
			wait := time.Now().Before(r.downUntil[p.name])
			r.mu.Unlock()
			if wait {
				continue
			}
			if err := p.start(); err != nil {
				r.log.Warn("restart", zap.String("proc", p.name), zap.Error(err))
			}
		}
	}
}
