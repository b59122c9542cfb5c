package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

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
	// trafficOnly: restore checks the verdict only (the bench's restore
	// loop, Config.BenchTraffic).
	trafficOnly bool
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
		w.stateEvery = s.cfg.StateEvery
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
		m, err := w.verify(nil, nil)
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
	if prefix, err := s.waitPrefix(ctx, s.cfg.Timeout); err != nil || prefix != s.wantPrefix() {
		if err == nil {
			err = fmt.Errorf("lookup prefix %d of %d, want %d", prefix, len(p.Hashes), s.wantPrefix())
		}
		return fmt.Errorf("index did not show the stored prompt within %v: %w", s.cfg.Timeout, err)
	}
	s.res.StoreSeconds = time.Since(start).Seconds()
	s.logf("coordinator lookup: %d of %d chunks restorable", s.wantPrefix(), len(p.Hashes))
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
			wire.LookupRequest{Namespace: p.R.Namespace, Chunks: p.Hashes, Instance: s.cfg.Instance, StateAtEnd: s.cfg.StateAtEnd},
			s.lookupRetry())
		cancel()
		prefix := 0
		if err == nil {
			prefix = lr.Prefix
			if prefix == s.wantPrefix() {
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
