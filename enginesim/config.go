package enginesim

import (
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/kvtier/kvtier/auth"
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
	// StateAtEnd asks restore.begin for the recurrent groups' objects of
	// the restored prefix's last chunk only (wire.RestoreBeginRequest
	// StateAtEnd), as an engine that resumes from the state at the
	// prefix's end does (vLLM with a Mamba group); the check then wants
	// the inner chunks' recurrent pages left as the wipe. Default false.
	StateAtEnd bool
	// StateEvery, when > 0, stores a recurrent group's pages (in a spec
	// with other groups) only for every StateEvery-th chunk (chunks k-1,
	// 2k-1, ...), the others without a state, as vLLM keeps a Mamba state
	// only where its retention interval says; the restore (StateAtEnd,
	// required) then covers the chunks up to the last one with a state.
	// Default 0: every chunk with its state.
	StateEvery int
	// KeepRegistered leaves the pools registered with the rankds at exit
	// (tests that poke at a registered namespace afterwards). Default
	// false: the engine releases its pools before freeing them.
	KeepRegistered bool
	// Out receives progress lines and the final table. Required
	// (DefaultConfig: os.Stdout).
	Out io.Writer
	// ResultFile, when set, receives the Result as JSON.
	ResultFile string

	// JSONRequests sends store, retrieve and restore.begin requests as
	// JSON, as engines before the binary forms did (wire/reqbin.go,
	// wire/beginreport.go); default false: binary. rankd and the
	// coordinator read both (a coordinator from before the binary begin
	// reads JSON only).
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
	// BenchTraffic, when > 0, restores the last repetition's prompt again
	// and again for this long after the repetitions (verdicts checked,
	// bytes not compared): kvtier's restores at full speed with none of
	// the bench's own work, for an interference measurement.
	BenchTraffic time.Duration
	// BenchDuplex, when > 0, adds this many repetitions of a store and a
	// restore at once after the repetitions (duplex.go): both copy
	// directions in use, against the plain copies both ways. Needs a
	// scenario whose store and restore tables share no block.
	BenchDuplex int
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
	if c.StateEvery < 0 {
		bad("state-every %d: negative", c.StateEvery)
	}
	if c.StateEvery > 0 && (!c.StateAtEnd || c.Bench) {
		bad("state-every %d needs state-at-end (a restore reads a state at its last chunk only) and no bench", c.StateEvery)
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
	if c.BenchTraffic < 0 || c.BenchTraffic > 0 && !c.Bench {
		bad("bench traffic %v: want a duration > 0, with bench", c.BenchTraffic)
	}
	if c.BenchDuplex < 0 || c.BenchDuplex > 0 && !c.Bench {
		bad("bench duplex %d: want repetitions > 0, with bench", c.BenchDuplex)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("enginesim config: %w", err)
	}
	return nil
}
