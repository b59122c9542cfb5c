package campaign

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
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
