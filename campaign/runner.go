package campaign

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/coordinator"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/wire"
)

// prompt is one replayed request the engine stored (or tried to).
type prompt struct {
	scenario string
	tokens   []uint32
	ns       dcp.Namespace
	hashes   []dcp.ChunkHash
}

// runner is one campaign in progress.
type runner struct {
	cfg   Config
	log   *zap.Logger
	c     *cluster
	led   *ledger
	trace []traceRequest
	start time.Time
	flog  *os.File // faults.jsonl
	elog  io.Writer

	wg sync.WaitGroup

	// mu guards the following.
	mu        sync.Mutex
	rep       *Report
	prompts   []*prompt
	downUntil map[string]time.Time // process name -> no restart before (kill down time)
	stops     map[string]int       // process name -> stops in force
	enospc    int
	maxRSS    map[string]uint64
	logOff    map[string]int64

	leaders map[uint64]string // raft term -> leader seen (under mu)

	// lastOn names the process the fault being applied hit (inject's
	// goroutine only).
	lastOn string
}

// Run runs one campaign and returns its report. The error is for a
// campaign that could not run (no cluster); a campaign that found a
// problem returns a report with OK false.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	dir := cfg.WorkDir
	if dir == "" {
		d, err := os.MkdirTemp("", "kvtier-campaign-")
		if err != nil {
			return nil, err
		}
		dir = d
		if !cfg.Keep {
			defer os.RemoveAll(dir)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	tp := cfg.TracePath
	if tp == "" {
		tp = findTrace(cfg.SourceDir)
	}
	trace, err := loadTrace(tp)
	if err != nil {
		return nil, err
	}
	traceName := tp
	if traceName == "" {
		traceName = sampleTraceName
	}
	c, err := newCluster(cfg, dir)
	if err != nil {
		return nil, err
	}
	// The host backend's shared memory wants a tmpfs.
	if shm, err := os.MkdirTemp("/dev/shm", "kvtier-campaign-"); err == nil {
		_ = os.Chmod(shm, 0o700)
		c.hostD = shm
		defer os.RemoveAll(shm)
	}
	r := &runner{cfg: cfg, log: cfg.Log, c: c, led: newLedger(), trace: trace, downUntil: map[string]time.Time{},
		stops: map[string]int{}, maxRSS: map[string]uint64{}, logOff: map[string]int64{},
		rep: &Report{Seed: cfg.Seed, Faults: cfg.Faults, Rate: cfg.Rate, Trace: traceName, ByKind: map[Kind]int{}, Skipped: map[Kind]int{},
			SkipWhy: map[Kind]string{}, Restores: map[Outcome]int{}, Final: map[Outcome]int{}, RSSBound: cfg.MaxRSS,
			NotCovered: map[string]string{
				"clock_step":     "no per-process wall clock: Linux time namespaces offset only the monotonic and boot clocks, libfaketime does not reach Go (it reads the clock through the vDSO, not libc), and stepping the host clock would hit every engineer's processes",
				"packet_loss":    "tc netem is not available on this kernel (sch_netem missing) and neither is iptables; lossy_link flaps the veth instead",
				"vllm_connector": "needs a GPU and vLLM; the Go engine simulator plays the engines",
			}}}
	if cfg.Keep {
		r.rep.WorkDir = dir
	}
	r.rep.Coordinators = cfg.Coordinators
	if !cfg.L3 {
		r.rep.NotCovered["l3"] = "switched off (--l3=false)"
	}
	if cfg.Coordinators == 1 {
		r.rep.NotCovered["raft_leader"] = "this campaign ran one coordinator (--coordinators 3 runs a raft trio with the leader among the targets)"
	}
	defer c.down()
	if err := c.up(ctx); err != nil {
		return nil, fmt.Errorf("campaign cluster: %w (logs in %s)", err, c.logD)
	}
	if c.lab != nil {
		r.rep.Network = "netns (one namespace per rankd, bridge " + c.lab.bridge + ")"
	} else {
		r.rep.Network = "loopback: " + c.labWhy
	}
	if c.tmpfs {
		r.rep.L2FS = fmt.Sprintf("tmpfs %d MiB", cfg.L2Bytes>>20)
	} else {
		r.rep.L2FS = "directory: " + c.l2Why
	}
	if r.flog, err = os.OpenFile(filepath.Join(dir, "faults.jsonl"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600); err != nil {
		return nil, err
	}
	defer r.flog.Close()
	ef, err := os.OpenFile(filepath.Join(c.logD, "engine.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer ef.Close()
	r.elog = &lockedWriter{w: ef}
	sub, err := c.observer.Subscribe(c.subj.EventsAll(), r.observe)
	if err != nil {
		return nil, fmt.Errorf("subscribe to events: %w", err)
	}
	defer sub.Unsubscribe()

	r.start = time.Now()
	sched := Schedule(cfg.Seed, cfg.Faults, cfg.Rate, cfg.Ranks)
	bg, stopBG := context.WithCancel(ctx)
	work, stopWork := context.WithCancel(ctx)
	r.wg.Add(3)
	go func() { defer r.wg.Done(); r.supervise(bg) }()
	go func() { defer r.wg.Done(); r.sample(bg) }()
	workDone := make(chan struct{})
	go func() { defer r.wg.Done(); defer close(workDone); r.workload(work) }()

	r.inject(ctx, sched)
	stopWork()
	<-workDone
	r.log.Info("faults done; healing", zap.Int("faults", len(sched)), zap.Duration("elapsed", time.Since(r.start)))
	r.heal()
	if ctx.Err() != nil {
		r.problem("interrupted after %v: no final round and no final checks", time.Since(r.start).Round(time.Second))
	} else {
		if err := c.waitServing(ctx, 90*time.Second); err != nil {
			r.problem("after healing: %v", err)
		}
		r.finalRound(ctx)
		r.quiesceAndCheck(ctx)
	}
	stopBG()
	r.wg.Wait()
	r.scanLogs(true)

	rep := r.rep
	rep.Seconds = time.Since(r.start).Seconds()
	rep.FaultRate = float64(rep.Injected) / rep.Seconds
	runs := 0
	for _, n := range rep.Restores {
		runs += n
	}
	rep.RestoreRate = float64(runs) / rep.Seconds
	rep.MaxRSS = r.maxRSS
	rep.Proxy = map[string]int64{}
	for _, ps := range c.proxies {
		for _, p := range ps {
			rep.Proxy["frames"] += p.Frames.Load()
			rep.Proxy["dropped"] += p.Dropped.Load()
			rep.Proxy["duplicated"] += p.Duplicated.Load()
			rep.Proxy["reordered"] += p.Reordered.Load()
			rep.Proxy["armed_expired"] += p.Expired.Load()
		}
		if len(ps) > 0 {
			rep.Proxy["cuts"] += ps[0].Cuts.Load() // a cut hits the whole set
		}
	}
	rep.Restarts, rep.Refused = map[string]int{}, map[string]int{}
	for _, p := range append(c.coordProcs(), c.ranks...) {
		p.mu.Lock()
		rep.Restarts[p.name] = p.starts
		if p.refusals > 0 {
			rep.Refused[p.name] = p.refusals
		}
		rep.Crashes = append(rep.Crashes, p.crashes...)
		p.mu.Unlock()
	}
	rep.judge()
	rep.Print(cfg.Out)
	return rep, nil
}

type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

func (r *runner) problem(format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	r.log.Error("campaign problem", zap.String("problem", s))
	r.mu.Lock()
	r.rep.Problems = append(r.rep.Problems, s)
	r.mu.Unlock()
}

// observe records every Removed event a rank published.
func (r *runner) observe(m *nats.Msg) {
	var b wire.Batch
	if err := b.UnmarshalBinary(m.Data); err != nil {
		return
	}
	now := time.Now()
	for _, e := range b.Events {
		if e.Kind == wire.Removed {
			r.led.remove(placementID{Key: e.Key.String(), Holder: b.Rank.String(), Tier: e.Tier}, now)
		}
	}
}

// ---- faults ----

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

// ---- workload ----

// The engine's request bounds. A message the proxies drop costs its
// request engineResend, not the run: the engine resends (enginesim
// ResendAfter). engineTimeout outlasts the longest stop (3 s) and a kill's
// down time (2 s) plus a restart, so a request to a daemon that comes
// back is answered instead of ending the run before a verdict.
const (
	engineTimeout = 6 * time.Second
	engineResend  = time.Second
)

func (r *runner) engineConfig(p *prompt, phase string, id string) enginesim.Config {
	cfg := enginesim.DefaultConfig()
	cfg.Host.Dir = r.c.hostD
	cfg.WaitPrefix = time.Second
	if phase == enginesim.PhaseRestore {
		cfg.WaitPrefix = 3 * time.Second
	}
	cfg.Scenario, cfg.Instance, cfg.Devices, cfg.Phase, cfg.Seed = p.scenario, Instance, []string{cuda.SpecHost}, phase, 1
	cfg.NATSURL, cfg.Creds, cfg.Tokens, cfg.RequestID, cfg.Out = r.c.natsURL(), auth.Client{Dir: r.c.creds}, p.tokens, id, r.elog
	cfg.Compute, cfg.RestoreDeadline, cfg.Timeout, cfg.ResendAfter = time.Millisecond, 3*time.Second, engineTimeout, engineResend
	return cfg
}

func newPrompt(scenario string, tokens []uint32) (*prompt, error) {
	sc, err := enginesim.LookupScenario(scenario)
	if err != nil {
		return nil, err
	}
	sc.Tokens, sc.Chunks, sc.TailTokens = tokens, len(tokens)/sc.Spec.ChunkTokens, len(tokens)%sc.Spec.ChunkTokens
	pl, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		return nil, err
	}
	return &prompt{scenario: scenario, tokens: tokens, ns: pl.R.Namespace, hashes: pl.Hashes}, nil
}

// workload replays trace requests until ctx ends: most iterations store,
// wipe and restore a new prompt; some restore an older one from the tiers.
func (r *runner) workload(ctx context.Context) {
	rng := rand.New(rand.NewPCG(r.cfg.Seed, 0x776f726b)) // "work"
	next := rng.IntN(len(r.trace))
	scen := []string{"tp4dcp4", "tp4dcp1"}
	for iter := 0; ctx.Err() == nil; iter++ {
		r.mu.Lock()
		old := len(r.prompts)
		r.mu.Unlock()
		if old > 0 && rng.IntN(3) == 0 {
			r.mu.Lock()
			p := r.prompts[rng.IntN(len(r.prompts))]
			r.mu.Unlock()
			r.runEngine(ctx, p, enginesim.PhaseRestore, fmt.Sprintf("c%d", iter), nil)
			continue
		}
		var toks []uint32
		for toks == nil {
			tr := r.trace[next%len(r.trace)]
			next++
			toks = PromptTokens(tr.InputLength, tr.HashIDs, r.cfg.MaxChunks)
		}
		p, err := newPrompt(scen[rng.IntN(len(scen))], toks)
		if err != nil {
			r.problem("prompt: %v", err)
			return
		}
		r.mu.Lock()
		r.prompts = append(r.prompts, p)
		r.mu.Unlock()
		r.runEngine(ctx, p, enginesim.PhaseAll, fmt.Sprintf("c%d", iter), nil)
	}
}

// runEngine runs one engine process's worth of work in this process and
// judges it; a failed verdict is followed by a re-store (the engine
// recomputes the chunks). tally, when set, receives the
// outcome instead of the report's restore counts.
func (r *runner) runEngine(ctx context.Context, p *prompt, phase, id string, tally map[Outcome]int) Outcome {
	// A killed coordinator takes the embedded NATS server with it: a run
	// started before it is back only fails to connect. Wait out its down
	// time (at most 2 s, then the restart) first.
	for deadline := time.Now().Add(5 * time.Second); !r.anyCoordinator() && time.Now().Before(deadline) && ctx.Err() == nil; {
		time.Sleep(50 * time.Millisecond)
	}
	t0 := time.Now()
	fmt.Fprintf(r.elog, "=== campaign: run %s %s %s at %.3fs\n", id, p.scenario, phase, time.Since(r.start).Seconds())
	res, err := enginesim.Run(context.WithoutCancel(ctx), r.engineConfig(p, phase, id))
	if time.Since(t0) < 200*time.Millisecond && err != nil {
		time.Sleep(250 * time.Millisecond) // the cluster is down: do not spin
	}
	o, prob := Classify(res)
	fmt.Fprintf(r.elog, "=== campaign: run %s: %s in %.3fs (err: %v)\n", id, o, time.Since(t0).Seconds(), err)
	r.mu.Lock()
	if tally != nil {
		tally[o]++
	} else {
		r.rep.Restores[o]++
	}
	switch o {
	case WrongComplete:
		r.rep.WrongComplete++
		r.rep.Wrong = append(r.rep.Wrong, prob)
	case WrongUnnamed:
		r.rep.WrongUnnamed++
		r.rep.Wrong = append(r.rep.Wrong, prob)
	}
	r.mu.Unlock()
	if o == WrongComplete || o == WrongUnnamed {
		r.log.Error("checker: wrong verdict", zap.String("problem", prob))
	}
	// The engine recomputes what a failed verdict named: it stores the
	// prompt again. (A run that ended before a verdict claimed nothing;
	// the next run of the workload stores on.)
	needStore := o == Failed
	if !needStore {
		return o
	}
	for attempt := range 2 {
		res, err := enginesim.Run(context.WithoutCancel(ctx), r.engineConfig(p, enginesim.PhaseStore, id+"-re"+strconv.Itoa(attempt)))
		fmt.Fprintf(r.elog, "=== campaign: re-store %s attempt %d: err %v\n", id, attempt, err)
		time.Sleep(250 * time.Millisecond)
		if err == nil && res != nil && res.OK {
			r.mu.Lock()
			r.rep.Recomputed++
			r.mu.Unlock()
			return o
		}
		if ctx.Err() != nil {
			break
		}
	}
	r.mu.Lock()
	r.rep.RecomputeFailed++
	r.mu.Unlock()
	return o
}

// finalRound runs, with every fault healed, a few new prompts and a few
// old ones: a correct and live cluster restores them.
func (r *runner) finalRound(ctx context.Context) {
	r.mu.Lock()
	olds := append([]*prompt(nil), r.prompts...)
	r.mu.Unlock()
	for i := range (r.cfg.FinalRuns + 1) / 2 {
		tr := r.trace[(i*997+int(r.cfg.Seed))%len(r.trace)]
		toks := PromptTokens(tr.InputLength, tr.HashIDs, r.cfg.MaxChunks)
		if toks == nil {
			continue
		}
		p, err := newPrompt([]string{"tp4dcp4", "tp4dcp1"}[i%2], toks)
		if err != nil {
			continue
		}
		r.mu.Lock()
		r.prompts = append(r.prompts, p)
		r.mu.Unlock()
		r.runEngine(ctx, p, enginesim.PhaseAll, fmt.Sprintf("final%d", i), r.rep.Final)
	}
	for i := 0; i < r.cfg.FinalRuns/2 && i < len(olds); i++ {
		r.runEngine(ctx, olds[len(olds)-1-i], enginesim.PhaseRestore, fmt.Sprintf("final-old%d", i), r.rep.Final)
	}
}

// ---- sampling and final checks ----

// sample records, every 2 s, the placements the index serves for recent
// prompts (acknowledged placements), the daemons' memory and new log
// lines.
func (r *runner) sample(ctx context.Context) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.mu.Lock()
		ps := r.prompts
		if len(ps) > 6 {
			ps = append(append([]*prompt(nil), ps[len(ps)-5:]...), ps[rand.IntN(len(ps)-5)])
		}
		r.mu.Unlock()
		for _, p := range ps {
			r.recordIndex(ctx, p)
		}
		r.sampleRaft(ctx)
		r.sampleRSS()
		r.scanLogs(false)
	}
}

// objects asks the coordinator for every copy of p's objects.
func (r *runner) objects(ctx context.Context, p *prompt) ([]wire.ObjectInfo, error) {
	rep, err := adminCall[wire.AdminObjectReply](ctx, r.c, wire.AdminObject,
		wire.AdminObjectRequest{Namespace: p.ns, Chunks: p.hashes, Instance: Instance})
	if err != nil {
		return nil, err
	}
	return rep.Objects, nil
}

func (r *runner) recordIndex(ctx context.Context, p *prompt) {
	objs, err := r.objects(ctx, p)
	if err != nil {
		return
	}
	now := time.Now()
	for _, o := range objs {
		for _, pl := range o.Placements {
			r.led.see(placementID{Key: o.Key.String(), Holder: pl.Holder.String(), Tier: pl.Tier}, pl.Incarnation, pl.Size, pl.Sum, now)
		}
	}
}

// sampleRaft reads every coordinator's raft state: two leaders of one
// term would be a split brain (a problem); the leader's commit index is
// reported.
func (r *runner) sampleRaft(ctx context.Context) {
	if !r.c.raftMode() {
		return
	}
	nodes, _ := coordinator.CollectRaft(ctx, r.c.admin, r.c.subj, 300*time.Millisecond)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.leaders == nil {
		r.leaders = map[uint64]string{}
	}
	for _, n := range nodes {
		if n.State != "Leader" {
			continue
		}
		if prev, ok := r.leaders[n.Term]; ok && prev != n.ID {
			r.rep.Problems = append(r.rep.Problems, fmt.Sprintf("raft term %d has two leaders: %s and %s", n.Term, prev, n.ID))
		}
		if _, ok := r.leaders[n.Term]; !ok {
			r.leaders[n.Term] = n.ID
			r.rep.Leaders++
		}
		r.rep.CommitIndex = n.CommitIndex
	}
}

func (r *runner) sampleRSS() {
	for _, p := range append(r.c.coordProcs(), r.c.ranks...) {
		v := p.rssBytes()
		r.mu.Lock()
		if v > r.maxRSS[p.name] {
			r.maxRSS[p.name] = v
		}
		over := v > r.cfg.MaxRSS
		r.mu.Unlock()
		if over {
			r.problemOnce("rss:"+p.name, "%s RSS %d MiB over the bound %d MiB", p.name, v>>20, r.cfg.MaxRSS>>20)
		}
	}
}

func (r *runner) problemOnce(key, format string, args ...any) {
	r.mu.Lock()
	if r.logOff["once:"+key] != 0 {
		r.mu.Unlock()
		return
	}
	r.logOff["once:"+key] = 1
	r.rep.RSSOver = append(r.rep.RSSOver, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

// panicMarkers are log lines no daemon may print.
var panicMarkers = []string{"panic:", "fatal error:", "DATA RACE", "[signal SIG"}

// scanLogs reads the new part of every daemon log for panics.
func (r *runner) scanLogs(final bool) {
	files, _ := filepath.Glob(filepath.Join(r.c.logD, "*.log"))
	for _, path := range files {
		if filepath.Base(path) == "engine.log" {
			continue
		}
		r.mu.Lock()
		off := r.logOff[path]
		r.mu.Unlock()
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		if _, err := f.Seek(off, io.SeekStart); err != nil {
			f.Close()
			continue
		}
		br := bufio.NewReaderSize(f, 1<<20)
		n := off
		for {
			line, err := br.ReadString('\n')
			if err != nil && (!final || line == "") {
				break // a partial last line is read again next time
			}
			n += int64(len(line))
			for _, m := range panicMarkers {
				if strings.Contains(line, m) {
					r.mu.Lock()
					r.rep.Panics = append(r.rep.Panics, filepath.Base(path)+": "+strings.TrimSpace(line))
					r.mu.Unlock()
				}
			}
			if err != nil {
				break
			}
		}
		f.Close()
		r.mu.Lock()
		r.logOff[path] = n
		r.mu.Unlock()
	}
}

// quiesceAndCheck waits until the index equals every rank's inventory
// (resyncs after the last faults finish), then runs the final checks.
func (r *runner) quiesceAndCheck(ctx context.Context) {
	deadline := time.Now().Add(r.cfg.Quiesce)
	var diffs []string
	var index, inv map[placementID]bool
	var incs map[string]uint64
	for {
		var err error
		index, inv, incs, diffs, err = r.compareIndex(ctx)
		if err == nil && len(diffs) == 0 {
			break
		}
		if err != nil {
			diffs = []string{err.Error()}
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Second)
	}
	r.rep.IndexEqualsInventory = len(diffs) == 0
	if len(diffs) > 20 {
		diffs = append(diffs[:20], fmt.Sprintf("... %d more", len(diffs)-20))
	}
	r.rep.InventoryDiffs = diffs
	if index != nil {
		lost, ex := r.led.judgePlacements(index, inv, incs)
		r.rep.LostAcked, r.rep.Explained = len(lost), ex
		if len(lost) > 50 {
			lost = lost[:50]
		}
		r.rep.Lost = lost
		r.led.mu.Lock()
		r.rep.AckedSeen = len(r.led.seen)
		r.led.mu.Unlock()
	} else {
		r.problem("no final index snapshot: the acknowledged placements were not judged")
	}
	// Verify is served by the raft leader alone: retried across an
	// election.
	var v *wire.AdminVerifyReply
	var err error
	for deadline := time.Now().Add(30 * time.Second); ; {
		v, err = adminCall[wire.AdminVerifyReply](ctx, r.c, wire.AdminVerify, struct{}{})
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(time.Second)
	}
	switch {
	case err != nil:
		r.rep.VerifyProblems = []string{err.Error()}
	default:
		r.rep.VerifyOK = v.OK
		r.rep.VerifyProblems = v.Mismatches
	}
}

// compareIndex takes the final index (every copy of every prompt's
// objects) and every rank's inventory and lists their differences.
func (r *runner) compareIndex(ctx context.Context) (index, inv map[placementID]bool, incs map[string]uint64, diffs []string, err error) {
	type val struct{ size, sum uint64 }
	idx := map[placementID]val{}
	r.mu.Lock()
	ps := append([]*prompt(nil), r.prompts...)
	r.mu.Unlock()
	done := map[string]bool{}
	for _, p := range ps {
		k := p.ns.String() + fmt.Sprint(p.hashes)
		if done[k] {
			continue
		}
		done[k] = true
		objs, err := r.objects(ctx, p)
		if err != nil {
			return nil, nil, nil, nil, fmt.Errorf("index objects: %w", err)
		}
		for _, o := range objs {
			for _, pl := range o.Placements {
				idx[placementID{Key: o.Key.String(), Holder: pl.Holder.String(), Tier: pl.Tier}] = val{pl.Size, pl.Sum}
			}
		}
	}
	ranks, err := adminCall[wire.AdminRanksReply](ctx, r.c, wire.AdminRanks, struct{}{})
	if err != nil {
		return nil, nil, nil, nil, fmt.Errorf("admin ranks: %w", err)
	}
	incs = map[string]uint64{}
	invs := map[placementID]val{}
	for t := range r.cfg.Ranks {
		in, err := r.c.inventory(ctx, t)
		if err != nil {
			return nil, nil, nil, nil, err
		}
		name := r.c.rank(t).String()
		incs[name] = in.Incarnation
		var n1, n2 int64
		for _, o := range in.Objects {
			invs[placementID{Key: o.Key.String(), Holder: name, Tier: o.Tier}] = val{o.Size, o.Sum}
			switch o.Tier {
			case wire.L1:
				n1++
			case wire.L2:
				n2++
			}
		}
		for _, ar := range ranks.Ranks {
			if ar.Rank.String() != name {
				continue
			}
			if ar.Incarnation != in.Incarnation || ar.L1Objects != n1 || ar.L2Objects != n2 {
				diffs = append(diffs, fmt.Sprintf("rank %s: index incarnation %d with %d L1 + %d L2 objects, inventory incarnation %d with %d + %d",
					name, ar.Incarnation, ar.L1Objects, ar.L2Objects, in.Incarnation, n1, n2))
			}
		}
	}
	for p, v := range idx {
		if w, ok := invs[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("index has %s on %s %s, the rank does not", p.Key, p.Holder, p.Tier))
		} else if w != v {
			diffs = append(diffs, fmt.Sprintf("%s on %s %s: index size %d sum %#x, rank %d %#x", p.Key, p.Holder, p.Tier, v.size, v.sum, w.size, w.sum))
		}
	}
	for p := range invs {
		if _, ok := idx[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("rank %s holds %s %s, the index does not", p.Holder, p.Key, p.Tier))
		}
	}
	index, inv = map[placementID]bool{}, map[placementID]bool{}
	for p := range idx {
		index[p] = true
	}
	for p := range invs {
		inv[p] = true
	}
	return index, inv, incs, diffs, nil
}

// findTrace looks for shared/data/traces/mooncake_conversation_trace.jsonl
// beside src and beside each of its parents ($KVTIER_TRACE first); ""
// when there is none (loadTrace then reads the built-in sample).
func findTrace(src string) string {
	const rel = "shared/data/traces/mooncake_conversation_trace.jsonl"
	if p := os.Getenv("KVTIER_TRACE"); p != "" {
		return p
	}
	d, err := filepath.Abs(src)
	if err != nil {
		d = src
	}
	for {
		p := filepath.Join(d, rel)
		if _, err := os.Stat(p); err == nil {
			return p
		}
		if filepath.Dir(d) == d {
			return "" // the built-in sample
		}
		d = filepath.Dir(d)
	}
}
