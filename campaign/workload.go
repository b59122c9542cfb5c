package campaign

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/enginesim"
)

// Trace geometry: the Mooncake trace names one hash id per 512-token
// block; the engine scenarios store 2048-token chunks.
const (
	traceBlockTokens = 512
	chunkTokens      = 2048
	vocab            = 151936
)

// traceRequest is one line of the Mooncake trace.
type traceRequest struct {
	InputLength int      `json:"input_length"`
	HashIDs     []uint64 `json:"hash_ids"`
}

// sampleTrace is the first 1,000 requests of the Mooncake trace
// (testdata/README.md), used when the full trace is not found.
//
//go:embed testdata/mooncake_sample.jsonl
var sampleTrace []byte

// sampleTraceName names sampleTrace in errors and reports.
const sampleTraceName = "built-in sample (first 1,000 requests of the Mooncake trace)"

// loadTrace reads the requests of the trace at path; path "" reads the
// built-in sample.
func loadTrace(path string) ([]traceRequest, error) {
	var rd io.Reader = bytes.NewReader(sampleTrace)
	if path != "" {
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("trace: %w", err)
		}
		defer f.Close()
		rd = f
	} else {
		path = sampleTraceName
	}
	var out []traceRequest
	sc := bufio.NewScanner(rd)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for line := 1; sc.Scan(); line++ {
		var r traceRequest
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("trace %s line %d: %w", path, line, err)
		}
		out = append(out, r)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("trace %s: %w", path, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("trace %s: no requests", path)
	}
	return out, nil
}

func mix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// PromptTokens turns a trace request into token ids: the 512 tokens of a
// block are a function of its hash id alone, so requests whose hash ids
// agree on a prefix agree on those tokens (and so on their chunk keys).
// The prompt keeps at most maxChunks full 2048-token chunks and a tail of
// at most 511 tokens; nil when the request has no full chunk.
func PromptTokens(input int, hashIDs []uint64, maxChunks int) []uint32 {
	n := min(input, len(hashIDs)*traceBlockTokens)
	full := min(n/chunkTokens, maxChunks)
	if full == 0 {
		return nil
	}
	tail := min(n-full*chunkTokens, traceBlockTokens-1)
	out := make([]uint32, 0, full*chunkTokens+tail)
	for i := range full*chunkTokens + tail {
		h := hashIDs[i/traceBlockTokens]
		out = append(out, uint32(mix64(h<<9|uint64(i%traceBlockTokens))%vocab))
	}
	return out
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
