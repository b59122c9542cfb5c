package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/wire"
)

// Phases of a run.
const (
	PhaseStore   = "store"   // compute, register, store; wait until the index has it
	PhaseRestore = "restore" // register fresh pools, restore, compare
	PhaseAll     = "all"     // store, wipe, restore, compare in one process
)

// Config configures one simulation run. Start from DefaultConfig, which
// holds every default; Run validates exactly what it is given (zero means
// zero: a zero Timeout is an error, not 60 s).
type Config struct {
	// Scenario is a name from ScenarioNames. Exactly one of Scenario and
	// SpecFile is required (DefaultConfig: "tp4dcp4").
	Scenario string
	// SpecFile is a model spec file (JSON, or YAML by its .yaml/.yml
	// extension; docs/enginesim.md), or the name of a spec shipped in
	// SpecDir (LoadSpec). It replaces Scenario.
	SpecFile string
	// Instance is the engine instance the rankds serve (DefaultConfig:
	// "engine0").
	Instance string
	// Devices is one device spec per TP rank, or one for all ranks
	// ("host", "cuda:N", "auto" or a GPU UUID). DefaultConfig: ["host"].
	Devices []string
	// Host configures the host backend; its Dir must be the rankds'.
	Host cuda.HostConfig
	// NATSURL is the coordinator's NATS, comma-separated for a NATS
	// cluster (several coordinators): the simulator moves to a surviving
	// server when its server dies. Required.
	NATSURL string
	// Creds authenticates the simulator as the engine identity of
	// Instance (auth.Client: CredsDir with engine-<instance>.nk, or a seed
	// file; Insecure for none). Its Identity is set by Run.
	Creds auth.Client
	// Prefix is the subject prefix (DefaultConfig: "kvtier").
	Prefix string
	// Phase is store, restore or all (DefaultConfig: all).
	Phase string
	// Seed varies the prompt and block tables; the same seed regenerates
	// the same content in a new process (DefaultConfig: 1).
	Seed uint64
	// Chunks overrides the scenario's chunk count when > 0.
	Chunks int
	// Tokens, when set, is the prompt (its full chunks replace the
	// scenario's chunk count, the rest is the tail); Chunks is ignored.
	// Default: a prompt drawn from Seed.
	Tokens []uint32
	// RequestID names the store requests. Default prompt-<scenario>-<seed>.
	RequestID string
	// ExpectFail: the restore must not restore the whole prompt (a failed
	// verdict, or a plan that covers only a prefix); every chunk it does
	// not list as failed must still be byte-exact.
	ExpectFail bool
	// FailOpen makes the run behave as an engine must when the cache is
	// down or failing (C11): a kvtier that cannot be reached or registered
	// with (retried for AttachWait), a store that fails, a restore that
	// cannot begin or has no verdict in time is a recompute, not an error:
	// the engine writes the chunks kvtier did not confirm itself, and every
	// byte of every rank must then equal the prompt's KV. A COMPLETE
	// verdict with a wrong byte still fails the run. Result.Recomputed and
	// Result.CacheProblems say what was recomputed and why.
	FailOpen bool
	// AttachWait is how long a FailOpen run keeps trying to reach kvtier
	// and register before it serves without it (0: one attempt).
	AttachWait time.Duration
	// Compute is the simulated compute time per chunk before its pages are
	// written (the rankd must wait on the producer event); 0: none
	// (DefaultConfig: 5 ms).
	Compute time.Duration
	// RestoreDeadline is asked of the coordinator in restore.begin; > 0
	// (DefaultConfig: 10 s).
	RestoreDeadline time.Duration
	// Timeout bounds each request; > 0 (DefaultConfig: 60 s).
	Timeout time.Duration
	// ResendAfter, when > 0, resends a request that got no reply within
	// this long, until Timeout ends: the engine's registration with each
	// rankd, its stores, lookups, restore.begin and restore.wait (which
	// waits ResendAfter on top of RestoreDeadline). Each of them may be
	// handled twice: a registration is resent as the same message (same
	// reply subject), which the rankd answers with the first delivery's
	// session, a second store of a chunk dedupes against the
	// first (its event and pages stay untouched until a reply, C1/C10), a
	// second restore.begin starts a second restore and the first expires
	// unclaimed, a second restore.wait reads the same verdict. Retrieves
	// are never resent (a retrieve without a reply claims nothing: the
	// verdict decides). Default 0: only a request nobody received is
	// resent, so a lost message costs the request its Timeout (a fault
	// campaign, which drops messages on purpose, sets it).
	ResendAfter time.Duration
	// WaitPrefix is how long a restore first waits for the coordinator's
	// lookup to cover the whole prompt (after restarts the ranks' L2
	// placements arrive as their first events). The restore begins after
	// it either way. Zero or negative: no wait (DefaultConfig: 15 s).
	WaitPrefix time.Duration
	// HoldBeforeRetrieve, when set, makes the run print a HOLD line after
	// the restore plan arrived and wait until this file exists (tests kill
	// a rankd in the gap).
	HoldBeforeRetrieve string
	// HoldBeforeStore, when set, makes the run print a HOLD line after
	// its registration and wait until this file exists before storing
	// (tests start another engine process in the gap).
	HoldBeforeStore string
	// KeepRegistered leaves the pools registered with the rankds at exit
	// (tests that poke at a registered namespace afterwards). Default
	// false: the engine releases its pools before freeing them.
	KeepRegistered bool
	// Out receives progress lines and the final table. Required
	// (DefaultConfig: os.Stdout).
	Out io.Writer
	// ResultFile, when set, receives the Result as JSON.
	ResultFile string

	// JSONRequests sends store and retrieve requests as JSON, as engines
	// before the binary form did (wire/reqbin.go); default false: binary.
	// rankd reads both.
	JSONRequests bool

	// Bench runs the daemon-path benchmark (bench.go) instead of one
	// store and restore: BenchReps repetitions (>= 1; DefaultConfig 5) of a timed
	// store and a timed restore with fresh content, against a plain copy
	// of the same bytes. Phase must be all.
	Bench     bool
	BenchReps int
	// BenchChunksPerStore is the number of chunks in one store request
	// (>= 1; 1: one request per chunk). An engine stores what one forward
	// step completed in one request with one producer event: the vLLM
	// connector sends one store per request and step with every chunk the
	// step filled, so a chunked prefill of 16,384 tokens per step stores
	// 8 chunks of 2,048 tokens per request (DefaultConfig), a
	// prefill without chunking the whole prompt.
	BenchChunksPerStore int
	// BenchGB, when > 0, sizes the prompt so that the rank storing the
	// most stores at least this many GB (1e9 B); it overrides Chunks.
	BenchGB float64
}

// Result is the outcome of a run, as printed and as written to ResultFile.
type Result struct {
	Scenario  string `json:"scenario"`
	Phase     string `json:"phase"`
	Namespace string `json:"namespace"`
	Chunks    int    `json:"chunks"`
	Stores    int    `json:"stores"` // store requests sent
	Stored    int    `json:"stored"` // objects committed
	Deduped   int    `json:"deduped"`
	// Sessions are the rankd sessions of this process's registration, by
	// TP rank.
	Sessions  []string     `json:"sessions,omitempty"`
	RestoreID string       `json:"restore_id,omitempty"`
	Prefix    int          `json:"prefix"`
	Verdict   string       `json:"verdict,omitempty"`
	Failed    []int        `json:"failed,omitempty"`
	Reasons   []string     `json:"reasons,omitempty"`
	Ranks     []RankResult `json:"ranks,omitempty"`
	// OK is the run's overall pass/fail (what the exit code says).
	OK      bool   `json:"ok"`
	Problem string `json:"problem,omitempty"`
	// Seconds per phase step.
	StoreSeconds   float64 `json:"store_seconds,omitempty"`
	RestoreSeconds float64 `json:"restore_seconds,omitempty"`
	// Recomputed lists the chunks the engine computed itself because
	// kvtier did not confirm them (FailOpen); CacheProblems says why.
	Recomputed    []int    `json:"recomputed,omitempty"`
	CacheProblems []string `json:"cache_problems,omitempty"`
	// Attached is false when a FailOpen run never reached kvtier.
	Attached bool `json:"attached"`
	// AttachSeconds is how long the run tried to reach kvtier and register
	// (bounded by AttachWait plus one attempt when FailOpen).
	AttachSeconds float64 `json:"attach_seconds"`
	// Bench is the benchmark's outcome (Config.Bench).
	Bench *BenchResult `json:"bench,omitempty"`
}

// RankResult is one rank's row of the final table.
type RankResult struct {
	Rank       int    `json:"rank"`
	Items      int    `json:"items"`      // objects planned for this rank
	Chunks     int    `json:"chunks"`     // distinct chunks planned
	ChunkList  []int  `json:"chunk_list"` // those chunks
	Bytes      uint64 `json:"bytes"`      // declared bytes planned
	Tier       string `json:"tier"`       // L1, L2, L1+L2 or -
	Placed     int    `json:"placed"`     // items the rankd reported ok
	FailedItem []int  `json:"failed_items,omitempty"`
	Error      string `json:"error,omitempty"` // retrieve request error
	Compare    string `json:"compare"`         // ok, or what differed
	Mismatch   uint64 `json:"mismatch_bytes"`
	Outside    uint64 `json:"outside_bytes"`
	// Seconds is the time from restore.begin to this rank's retrieve reply.
	Seconds float64 `json:"seconds,omitempty"`
}

// DefaultConfig returns the defaults cmd/enginesim starts from, the only
// place they live (STYLE 23). NATSURL and Creds are left for the caller.
func DefaultConfig() Config {
	return Config{
		Scenario: "tp4dcp4", Instance: "engine0", Devices: []string{cuda.SpecHost}, Host: cuda.DefaultHostConfig(),
		Prefix: wire.DefaultPrefix, Phase: PhaseAll, Seed: 1, Compute: 5 * time.Millisecond,
		RestoreDeadline: 10 * time.Second, Timeout: 60 * time.Second, WaitPrefix: 15 * time.Second, Out: os.Stdout,
		BenchReps: 5, BenchChunksPerStore: 8,
	}
}

// Validate reports every setting of c that Run cannot use, as one error.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	switch {
	case c.Scenario == "" && c.SpecFile == "":
		bad("no scenario and no spec file")
	case c.Scenario != "" && c.SpecFile != "":
		bad("scenario %q and spec file %q: give one", c.Scenario, c.SpecFile)
	}
	if c.Instance == "" {
		bad("no instance")
	}
	if len(c.Devices) == 0 {
		bad("no device spec")
	}
	if c.NATSURL == "" {
		bad("no NATS URL (the coordinator's)")
	}
	if c.Prefix == "" {
		bad("no subject prefix")
	}
	switch c.Phase {
	case PhaseStore, PhaseRestore, PhaseAll:
	default:
		bad("phase %q: want store, restore or all", c.Phase)
	}
	if c.Compute < 0 {
		bad("compute %v: negative", c.Compute)
	}
	if c.RestoreDeadline <= 0 {
		bad("restore deadline %v: want > 0", c.RestoreDeadline)
	}
	if c.Timeout <= 0 {
		bad("timeout %v: want > 0", c.Timeout)
	}
	if c.AttachWait < 0 {
		bad("attach wait %v: negative", c.AttachWait)
	}
	if c.AttachWait > 0 && !c.FailOpen {
		bad("attach wait %v without fail-open: a run that is not fail-open needs kvtier at once", c.AttachWait)
	}
	if c.FailOpen && c.Bench {
		bad("fail-open with bench: the benchmark measures kvtier and needs it")
	}
	if c.ResendAfter < 0 {
		bad("resend-after %v: negative", c.ResendAfter)
	}
	if c.Out == nil {
		bad("no output writer (Out)")
	}
	if c.Bench && c.BenchReps < 1 {
		bad("bench repetitions %d: want >= 1", c.BenchReps)
	}
	if c.Bench && c.BenchChunksPerStore < 1 {
		bad("bench chunks per store %d: want >= 1", c.BenchChunksPerStore)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("enginesim config: %w", err)
	}
	return nil
}

// Run runs one simulation. It returns the result and an error when the run
// failed (a mismatch, a verdict that is not the expected one, or an error
// talking to kvtier); the result is filled as far as the run got.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var sc Scenario
	var err error
	if cfg.SpecFile != "" {
		sc, err = LoadSpec(cfg.SpecFile)
	} else {
		sc, err = LookupScenario(cfg.Scenario)
	}
	if err != nil {
		return nil, err
	}
	if cfg.Chunks > 0 {
		sc.Chunks = cfg.Chunks
	}
	if cfg.Bench {
		if cfg.Phase != PhaseAll {
			return nil, fmt.Errorf("bench: phase %q, the benchmark stores and restores (phase all)", cfg.Phase)
		}
		if cfg.BenchGB > 0 {
			if sc.Chunks, err = BenchChunks(sc, cfg.BenchGB); err != nil {
				return nil, err
			}
		}
	}
	if cfg.Tokens != nil {
		ct := sc.Spec.ChunkTokens
		if ct <= 0 || len(cfg.Tokens) < ct {
			return nil, fmt.Errorf("prompt of %d tokens has no full chunk of %d tokens", len(cfg.Tokens), ct)
		}
		sc.Tokens, sc.Chunks, sc.TailTokens = cfg.Tokens, len(cfg.Tokens)/ct, len(cfg.Tokens)%ct
	}
	tp := sc.Spec.Layout.TP
	if len(cfg.Devices) != 1 && len(cfg.Devices) != tp {
		return nil, fmt.Errorf("%d device specs for TP %d: give one for all ranks or one per rank", len(cfg.Devices), tp)
	}
	plan, err := NewPlan(sc, cfg.Seed)
	if err != nil {
		return nil, err
	}
	s := &sim{cfg: cfg, plan: plan, subj: wire.Subjects{Prefix: cfg.Prefix},
		res: &Result{Scenario: sc.Name, Phase: cfg.Phase, Namespace: plan.R.Namespace.String(), Chunks: sc.Chunks}}
	err = s.run(ctx)
	s.res.OK = err == nil
	if err != nil {
		s.res.Problem = err.Error()
	}
	if cfg.ResultFile != "" {
		if b, jerr := json.MarshalIndent(s.res, "", "  "); jerr == nil {
			if werr := os.WriteFile(cfg.ResultFile, append(b, '\n'), 0o644); werr != nil && err == nil {
				err = werr
			}
		}
	}
	return s.res, err
}

type sim struct {
	cfg     Config
	plan    *Plan
	subj    wire.Subjects
	nc      *nats.Conn
	workers []*worker
	res     *Result
	outMu   sync.Mutex
	// quiet leaves out the per-rank restore table (bench repetitions
	// before the last).
	quiet bool
	// rc is what the last restore saw of its stages (timeline.go).
	rc restoreClock
}

func (s *sim) logf(format string, args ...any) {
	s.outMu.Lock()
	defer s.outMu.Unlock()
	fmt.Fprintf(s.cfg.Out, "enginesim: "+format+"\n", args...)
}

// retryIdempotent resends the requests the coordinator may answer twice
// (registering the spec, a lookup) also after a lost reply: with the
// engine or the coordinator moving to another NATS server of a cluster, a
// reply in flight to the dead one is lost. Every other request is resent
// only when nobody received it (bus.NoResponders).
var retryIdempotent = bus.Retry{Idempotent: true, Attempt: 3 * time.Second, For: 10 * time.Second, Backoff: bus.DefaultBackoff()}

// resend is the retry policy of the requests ResendAfter names; extra is
// added to each attempt (a long poll's own wait).
func (s *sim) resend(extra time.Duration) bus.Retry {
	if s.cfg.ResendAfter <= 0 {
		return bus.NoResponders()
	}
	return bus.Retry{Idempotent: true, Attempt: s.cfg.ResendAfter + extra, Backoff: bus.DefaultBackoff()}
}

// lookupRetry is the lookups' policy: idempotent always, resent after
// ResendAfter when set.
func (s *sim) lookupRetry() bus.Retry {
	if s.cfg.ResendAfter <= 0 {
		return retryIdempotent
	}
	return s.resend(0)
}

func (s *sim) callCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.cfg.Timeout)
}

func (s *sim) run(ctx context.Context) error {
	p := s.plan
	s.logf("scenario %s: %s", p.Scenario.Name, p.Scenario.Describe)
	if p.Scenario.Source != "" {
		s.logf("spec file %s: model %q, TP %d x DCP %d, interleave %d", p.Scenario.Source, p.R.Model,
			p.R.Layout.TP, p.R.Layout.DCP, p.R.Layout.Interleave)
	}
	if p.BlockBase > 0 {
		s.logf("block ids from %d: every pool holds %d blocks below them that must stay untouched", p.BlockBase, p.BlockBase)
	}
	s.logf("namespace %s, %d chunks of %d tokens (+%d tail tokens), %d groups:", p.R.Namespace, p.Scenario.Chunks,
		p.Scenario.Spec.ChunkTokens, p.Scenario.TailTokens, len(p.R.Groups))
	for gi, g := range p.R.Geometry {
		s.logf("  group %d %-13s %-9s mla=%-5v page %7d B (semantic %7d) stride %7d slots %3d x %6d B, %d blocks/chunk x %d layers",
			gi, g.Name, g.Kind, g.MLA, g.PageBytes, g.SemanticBytes, g.StrideBytes, g.Slots, g.SlotBytes, p.BPC[gi], g.Layers)
	}
	cl := s.cfg.Creds
	cl.Identity = auth.Engine(s.cfg.Instance)
	opts, err := cl.Options()
	if err != nil {
		return err
	}
	if s.cfg.FailOpen {
		// A server that is down is not an error: nats.go keeps trying in
		// the background and the attach below waits for it, bounded.
		opts = append(opts, nats.RetryOnFailedConnect(true))
	}
	nc, err := bus.Connect(s.cfg.NATSURL, "enginesim-"+s.cfg.Instance, opts...)
	if err != nil {
		return err
	}
	s.nc = nc
	defer nc.Close()

	// Open every worker's device and pools, register them with its rankd.
	for t := range p.R.Layout.TP {
		spec := s.cfg.Devices[0]
		if len(s.cfg.Devices) > 1 {
			spec = s.cfg.Devices[t]
		}
		w, err := openWorker(t, s.cfg.Instance, p, spec, s.cfg.Host, nc, s.subj, s.logf)
		if err != nil {
			return err
		}
		w.resend, w.resendEvery = s.resend(0), s.cfg.ResendAfter
		w.jsonRequests = s.cfg.JSONRequests
		s.workers = append(s.workers, w)
	}
	registered := false
	defer func() {
		if registered && !s.cfg.KeepRegistered {
			// The engine goes away: release the pools before freeing them.
			_ = s.each(func(w *worker) error {
				cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				defer cancel()
				if err := w.release(cctx); err != nil {
					s.logf("rank %d: release: %v", w.t, err)
				}
				return nil
			})
		}
		for _, w := range s.workers {
			w.close()
		}
	}()
	attachStart := time.Now()
	attachErr := s.attach(ctx)
	s.res.AttachSeconds = time.Since(attachStart).Seconds()
	if attachErr != nil && !s.cfg.FailOpen {
		return attachErr
	}
	registered = attachErr == nil
	if attachErr != nil {
		s.logf("kvtier unavailable, serving without it (fail-open): %v", attachErr)
		s.res.CacheProblems = append(s.res.CacheProblems, attachErr.Error())
		return s.recomputeAll(ctx)
	}
	s.res.Attached = true
	for _, w := range s.workers {
		s.res.Sessions = append(s.res.Sessions, w.session)
	}
	s.logf("registered %d ranks' pools (%s device %s)", len(s.workers), s.workers[0].dev.Info().Backend, s.workers[0].dev.Info().UUID)

	if s.cfg.Bench {
		return s.bench(ctx)
	}
	if s.cfg.Phase != PhaseRestore {
		if err := s.hold(ctx, "store", s.cfg.HoldBeforeStore); err != nil {
			return err
		}
		if err := s.store(ctx); err != nil {
			if !s.cfg.FailOpen {
				return err
			}
			s.logf("store failed, going on without it (fail-open): %v", err)
			s.res.CacheProblems = append(s.res.CacheProblems, err.Error())
		}
	}
	if s.cfg.Phase == PhaseStore {
		s.logf("RESULT scenario=%s phase=store stored=%d deduped=%d ok=true", p.Scenario.Name, s.res.Stored, s.res.Deduped)
		return nil
	}
	if s.cfg.Phase == PhaseAll {
		if err := s.each(func(w *worker) error { return w.wipe() }); err != nil {
			return err
		}
		s.logf("wiped every page on every rank (prefix cache reset)")
	}
	return s.restore(ctx)
}

// attach registers the spec with the coordinator (the scheduler's job)
// and every worker's pools with its rankd. A fail-open run retries with
// backoff for AttachWait, each attempt only while NATS is connected;
// otherwise one attempt, each request retried as before (a coordinator
// still opening its index answers unavailable).
func (s *sim) attach(ctx context.Context) error {
	deadline := time.Now().Add(s.cfg.AttachWait)
	bo := bus.DefaultBackoff()
	for attempt := 0; ; attempt++ {
		err := s.attachOnce(ctx)
		if err == nil || !s.cfg.FailOpen || !time.Now().Before(deadline) {
			return err
		}
		if attempt == 0 {
			s.logf("kvtier not attached yet (%v); retrying for %v", err, time.Until(deadline).Round(time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(min(bo.Delay(attempt), time.Until(deadline))):
		}
	}
}

func (s *sim) attachOnce(ctx context.Context) error {
	p := s.plan
	if s.cfg.FailOpen && !s.nc.IsConnected() {
		return fmt.Errorf("NATS at %s: not connected", s.cfg.NATSURL)
	}
	cctx, cancel := s.callCtx(ctx)
	rep, err := callRetrying[wire.RegisterReply](cctx, s.nc, s.subj.EngineCoord(s.cfg.Instance, wire.CoordRegister), p.Scenario.Spec, retryIdempotent)
	cancel()
	if err != nil {
		return fmt.Errorf("register spec with the coordinator: %w", err)
	}
	if rep.Namespace != p.R.Namespace {
		return fmt.Errorf("coordinator registered namespace %s, the spec's is %s", rep.Namespace, p.R.Namespace)
	}
	return s.each(func(w *worker) error {
		cctx, cancel := s.callCtx(ctx)
		defer cancel()
		return w.register(cctx)
	})
}

// recomputeAll is a fail-open run's answer to a cache it could not use:
// the engine computes every chunk of the prompt itself.
func (s *sim) recomputeAll(ctx context.Context) error {
	all := make([]int, len(s.plan.Hashes))
	for i := range all {
		all[i] = i
	}
	if err := s.each(func(w *worker) error { return w.wipe() }); err != nil {
		return err
	}
	return s.recompute(all)
}

// recompute writes the given chunks' pages on every rank, as the engine's
// own prefill would, then checks every byte of every rank: the chunks
// kvtier confirmed and the recomputed ones.
func (s *sim) recompute(chunks []int) error {
	if err := s.each(func(w *worker) error { return w.recompute(chunks) }); err != nil {
		return err
	}
	s.res.Recomputed = chunks
	var problems []string
	for _, w := range s.workers {
		m, err := w.verify(nil)
		if err != nil {
			return err
		}
		if len(m.Chunks) > 0 || m.Outside > 0 {
			problems = append(problems, fmt.Sprintf("rank %d after the recompute: %s", w.t, m.First))
		}
	}
	s.logf("RESULT scenario=%s phase=%s recomputed=%s cache=%q ok=%v", s.plan.Scenario.Name, s.cfg.Phase,
		intList(chunks), strings.Join(s.res.CacheProblems, "; "), len(problems) == 0)
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// hold prints a HOLD line and waits until file exists ("" : no hold).
func (s *sim) hold(ctx context.Context, before, file string) error {
	if file == "" {
		return nil
	}
	s.logf("HOLD before %s: waiting for %s", before, file)
	for {
		if _, err := os.Stat(file); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	s.logf("HOLD released")
	return nil
}

// each runs f for every worker concurrently and joins the errors.
func (s *sim) each(f func(w *worker) error) error {
	errs := make([]error, len(s.workers))
	var wg sync.WaitGroup
	for i, w := range s.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(w)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (s *sim) store(ctx context.Context) error {
	p := s.plan
	start := time.Now()
	reqID := s.cfg.RequestID
	if reqID == "" {
		reqID = fmt.Sprintf("prompt-%s-%d", p.Scenario.Name, s.cfg.Seed)
	}
	var mu sync.Mutex
	err := s.each(func(w *worker) error {
		cctx, cancel := s.callCtx(ctx)
		defer cancel()
		rs, err := w.computeAndStore(cctx, reqID, s.cfg.Compute)
		mu.Lock()
		for _, r := range rs {
			s.res.Stores++
			s.res.Stored += r.stored
			s.res.Deduped += r.deduped
		}
		mu.Unlock()
		if err == nil {
			s.logf("rank %d: %d stores of request %s committed", w.t, len(rs), reqID)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("store: %w", err)
	}
	s.logf("stored %d chunks: %d store requests, %d objects committed, %d already held (%.2fs)",
		p.Scenario.Chunks, s.res.Stores, s.res.Stored, s.res.Deduped, time.Since(start).Seconds())

	// Wait until the coordinator's index shows every chunk restorable: the
	// events travel asynchronously.
	if prefix, err := s.waitPrefix(ctx, s.cfg.Timeout); err != nil || prefix != len(p.Hashes) {
		if err == nil {
			err = fmt.Errorf("lookup prefix %d of %d", prefix, len(p.Hashes))
		}
		return fmt.Errorf("index did not show the stored prompt within %v: %w", s.cfg.Timeout, err)
	}
	s.res.StoreSeconds = time.Since(start).Seconds()
	s.logf("coordinator lookup: all %d chunks restorable", len(p.Hashes))
	return nil
}

// waitPrefix polls the coordinator's lookup until it covers the whole
// prompt or wait passes; it returns the last prefix seen.
func (s *sim) waitPrefix(ctx context.Context, wait time.Duration) (int, error) {
	p := s.plan
	deadline := time.Now().Add(wait)
	for {
		cctx, cancel := s.callCtx(ctx)
		lr, err := bus.CallRetry[wire.LookupReply](cctx, s.nc, s.subj.EngineCoord(s.cfg.Instance, wire.CoordLookup),
			wire.LookupRequest{Namespace: p.R.Namespace, Chunks: p.Hashes, Instance: s.cfg.Instance}, s.lookupRetry())
		cancel()
		prefix := 0
		if err == nil {
			prefix = lr.Prefix
			if prefix == len(p.Hashes) {
				return prefix, nil
			}
		}
		if time.Now().After(deadline) {
			return prefix, err
		}
		select {
		case <-ctx.Done():
			return prefix, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (s *sim) restore(ctx context.Context) error {
	p := s.plan
	if s.cfg.WaitPrefix > 0 {
		prefix, err := s.waitPrefix(ctx, s.cfg.WaitPrefix)
		if err != nil {
			s.logf("lookup before the restore: %v", err)
		}
		s.logf("coordinator lookup: %d of %d chunks restorable", prefix, len(p.Hashes))
	}
	start := time.Now()
	s.rc = restoreClock{begun: start, sent: make([]time.Time, len(s.workers)), replied: make([]time.Time, len(s.workers))}
	cctx, cancel := s.callCtx(ctx)
	plan, err := beginRestore(cctx, s.nc, s.subj.EngineCoord(s.cfg.Instance, wire.CoordRestoreBegin), s.resend(0), wire.RestoreBeginRequest{
		Instance: s.cfg.Instance, PlanEncoding: wire.PlanEncodingBinary, RestoreBegin: wire.RestoreBegin{
			Namespace: p.R.Namespace, Chunks: p.Hashes, DeadlineMS: int(s.cfg.RestoreDeadline / time.Millisecond)}})
	cancel()
	if err != nil {
		if s.cfg.FailOpen {
			s.res.CacheProblems = append(s.res.CacheProblems, "restore.begin: "+err.Error())
			s.logf("restore.begin failed, recomputing the prompt (fail-open): %v", err)
			return s.recomputeAll(ctx)
		}
		return fmt.Errorf("restore.begin: %w", err)
	}
	s.rc.planned = time.Now()
	s.res.RestoreID, s.res.Prefix = plan.RestoreID, plan.Prefix
	s.logf("restore %s: plan covers %d of %d chunks on %d ranks", plan.RestoreID, plan.Prefix, len(p.Hashes), len(plan.Ranks))

	if err := s.hold(ctx, "retrieve", s.cfg.HoldBeforeRetrieve); err != nil {
		return err
	}

	rows := make([]RankResult, len(s.workers))
	_ = s.each(func(w *worker) error {
		row := &rows[w.t]
		row.Rank = w.t
		items := plan.Ranks[w.rank.String()]
		tiers := map[wire.Tier]bool{}
		chunks := map[int]bool{}
		for _, it := range items {
			tiers[it.Source.Tier] = true
			chunks[it.Chunk] = true
			row.Bytes += p.ChunkBytes(it.Group)
		}
		row.Items, row.Chunks, row.Tier, row.ChunkList = len(items), len(chunks), tierString(tiers), sortedKeys(chunks)
		if len(items) == 0 {
			return nil
		}
		cctx, cancel := s.callCtx(ctx)
		defer cancel()
		s.rc.sent[w.t] = time.Now()
		rep, err := w.retrieve(cctx, plan.RestoreID, items)
		s.rc.replied[w.t] = time.Now()
		row.Seconds = s.rc.replied[w.t].Sub(start).Seconds()
		if err != nil {
			row.Error = err.Error()
			s.logf("rank %d: retrieve failed: %v", w.t, err)
			return nil
		}
		for _, r := range rep.Results {
			if r.OK {
				row.Placed++
			} else {
				row.FailedItem = append(row.FailedItem, r.Chunk)
				s.logf("rank %d: chunk %d group %d not placed: %s", w.t, r.Chunk, r.Group, r.Reason)
			}
		}
		s.logf("rank %d: placed %d of %d objects", w.t, row.Placed, len(items))
		return nil
	})

	cctx, cancel = s.callCtx(ctx)
	s.rc.verdictFrom = time.Now()
	v, err := bus.CallRetry[wire.RestoreVerdict](cctx, s.nc, s.subj.EngineCoord(s.cfg.Instance, wire.CoordRestoreWait), wire.RestoreWait{RestoreID: plan.RestoreID}, s.resend(s.cfg.RestoreDeadline))
	cancel()
	if err != nil {
		if !s.cfg.FailOpen {
			return fmt.Errorf("restore.wait: %w", err)
		}
		// No verdict: nothing the rankds wrote is trusted.
		s.res.CacheProblems = append(s.res.CacheProblems, "restore.wait: "+err.Error())
		s.logf("no verdict, recomputing the prompt (fail-open): %v", err)
		return s.recomputeAll(ctx)
	}
	s.rc.ended = time.Now()
	s.res.Verdict, s.res.Failed, s.res.Reasons = v.State, v.Failed, v.Reasons
	s.res.RestoreSeconds = s.rc.ended.Sub(start).Seconds()
	s.logf("verdict %s for restore %s: prefix %d, failed chunks %v %v (%.3fs)", v.State, v.RestoreID, v.Prefix, v.Failed, v.Reasons, s.res.RestoreSeconds)

	// Chunks the engine must recompute: failed ones and those beyond the
	// planned prefix. Everything else must be byte-exact.
	skip := map[int]bool{}
	for _, c := range v.Failed {
		skip[c] = true
	}
	for c := plan.Prefix; c < len(p.Hashes); c++ {
		skip[c] = true
	}
	if v.State != wire.VerdictComplete {
		// Nothing of a failed restore is trusted beyond what the verdict
		// lists as good; still, what it does not list must be exact.
		s.logf("chunks to recompute: %v", sortedKeys(skip))
	}
	var problems []string
	for _, w := range s.workers {
		row := &rows[w.t]
		m, err := w.verify(skip)
		if err != nil {
			return err
		}
		for _, n := range m.Chunks {
			row.Mismatch += n
		}
		row.Outside = m.Outside
		if row.Mismatch == 0 && row.Outside == 0 {
			row.Compare = fmt.Sprintf("ok (%d B)", m.Bytes)
		} else {
			row.Compare = fmt.Sprintf("MISMATCH %d B in chunks %v, %d B outside", row.Mismatch, mismatchChunks(m), row.Outside)
			problems = append(problems, fmt.Sprintf("rank %d: %s", w.t, m.First))
			s.logf("rank %d: %s", w.t, m.First)
		}
	}
	s.res.Ranks = rows
	if !s.quiet {
		s.printTable(v)
	}

	if err := v.Validate(); err != nil {
		problems = append(problems, err.Error())
	}
	switch {
	case s.cfg.FailOpen && len(problems) == 0:
		// The confirmed chunks were exact; the engine computes the rest.
		if len(skip) > 0 {
			s.res.CacheProblems = append(s.res.CacheProblems, fmt.Sprintf("verdict %s, plan %d of %d chunks",
				v.State, plan.Prefix, len(p.Hashes)))
			if err := s.recompute(sortedKeys(skip)); err != nil {
				return err
			}
		}
	case s.cfg.ExpectFail && v.State == wire.VerdictComplete && plan.Prefix == len(p.Hashes):
		problems = append(problems, "expected a failed verdict or a partial plan, got a complete restore of every chunk")
	case !s.cfg.ExpectFail && v.State != wire.VerdictComplete:
		problems = append(problems, fmt.Sprintf("verdict %s, failed chunks %v (%v)", v.State, v.Failed, v.Reasons))
	case !s.cfg.ExpectFail && plan.Prefix != len(p.Hashes):
		problems = append(problems, fmt.Sprintf("plan covers %d of %d chunks", plan.Prefix, len(p.Hashes)))
	}
	ok := len(problems) == 0
	s.logf("RESULT scenario=%s phase=%s verdict=%s failed=%s compare=%s ok=%v",
		p.Scenario.Name, s.cfg.Phase, v.State, intList(v.Failed), compareWord(rows), ok)
	if !ok {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

func (s *sim) printTable(v *wire.RestoreVerdict) {
	s.outMu.Lock()
	defer s.outMu.Unlock()
	fmt.Fprintf(s.cfg.Out, "\n%s  restore %s  verdict %s\n", s.plan.Scenario.Name, v.RestoreID, strings.ToUpper(v.State))
	tw := tabwriter.NewWriter(s.cfg.Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "RANK\tCHUNKS\tOBJECTS\tBYTES\tTIER\tPLACED\tVERDICT\tBYTE-COMPARE")
	failed := map[int]bool{}
	for _, c := range v.Failed {
		failed[c] = true
	}
	for _, r := range s.res.Ranks {
		verdict := v.State
		if v.State != wire.VerdictComplete {
			bad := map[int]bool{}
			for _, c := range r.ChunkList {
				if failed[c] {
					bad[c] = true
				}
			}
			for _, c := range r.FailedItem {
				bad[c] = true
			}
			switch {
			case r.Error != "":
				verdict = "failed: no reply " + intList(sortedKeys(bad))
			case len(bad) > 0:
				verdict = "failed " + intList(sortedKeys(bad))
			default:
				verdict = "ok (others failed)"
			}
		}
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%s\t%d/%d\t%s\t%s\n", r.Rank, r.Chunks, r.Items, human(r.Bytes), r.Tier,
			r.Placed, r.Items, verdict, r.Compare)
	}
	tw.Flush()
	fmt.Fprintln(s.cfg.Out)
}

func tierString(t map[wire.Tier]bool) string {
	var parts []string
	for _, tier := range []wire.Tier{wire.L1, wire.L2, wire.L3} {
		if t[tier] {
			parts = append(parts, tier.String())
		}
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, "+")
}

func human(n uint64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func intList(v []int) string {
	parts := make([]string, len(v))
	for i, x := range v {
		parts[i] = fmt.Sprint(x)
	}
	return "[" + strings.Join(parts, ",") + "]"
}

func sortedKeys(m map[int]bool) []int {
	out := make([]int, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Ints(out)
	return out
}

func mismatchChunks(m Mismatch) []int {
	out := make([]int, 0, len(m.Chunks))
	for c := range m.Chunks {
		out = append(out, c)
	}
	sort.Ints(out)
	return out
}

func compareWord(rows []RankResult) string {
	for _, r := range rows {
		if r.Mismatch != 0 || r.Outside != 0 {
			return "MISMATCH"
		}
	}
	return "ok"
}

// beginRestore asks for a restore plan. With PlanEncodingBinary the plan
// comes back in the compact binary form (wire/plan.go), which refers to
// req.Chunks by index; an error reply is JSON either way.
func beginRestore(ctx context.Context, nc *nats.Conn, subject string, retry bus.Retry, req wire.RestoreBeginRequest) (*wire.RestorePlan, error) {
	if req.PlanEncoding != wire.PlanEncodingBinary {
		return bus.CallRetry[wire.RestorePlan](ctx, nc, subject, req, retry)
	}
	data, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode request for %s: %w", subject, err)
	}
	var msg *nats.Msg
	if err := retry.Do(ctx, func(ctx context.Context) error {
		msg, err = nc.RequestWithContext(ctx, subject, data)
		return err
	}); err != nil {
		return nil, fmt.Errorf("request %s: %w", subject, err)
	}
	if wire.IsBinaryPlan(msg.Data) {
		return wire.DecodePlanBinary(msg.Data, req.Chunks)
	}
	var rep wire.Reply[wire.RestorePlan]
	if err := json.Unmarshal(msg.Data, &rep); err != nil {
		return nil, fmt.Errorf("decode reply from %s: %w", subject, errors.Join(err, wire.ErrMalformed))
	}
	if rep.Error != nil {
		return nil, rep.Error
	}
	return nil, fmt.Errorf("reply from %s is neither a binary plan nor an error: %w", subject, wire.ErrMalformed)
}

// retryPause is the pause between two tries of callRetrying when the
// answer carries no retry hint.
const retryPause = 100 * time.Millisecond

// callRetrying is bus.Call sent again while the answer is retryable
// (wire.Error.Retryable: code unavailable, as from a coordinator still
// opening its index, or internal), after the answer's retry hint
// (wire.Error.RetryAfter, else retryPause), until ctx ends. Any other
// answer, success or error, is returned as it came.
func callRetrying[T any](ctx context.Context, nc *nats.Conn, subject string, req any, r bus.Retry) (*T, error) {
	for {
		rep, err := bus.CallRetry[T](ctx, nc, subject, req, r)
		var we *wire.Error
		if err == nil || !errors.As(err, &we) || !we.Retryable() {
			return rep, err
		}
		t := time.NewTimer(we.RetryAfter(retryPause))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("%s still answering %w when the call ended: %w", subject, err, ctx.Err())
		case <-t.C:
		}
	}
}
