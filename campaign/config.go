package campaign

import (
	"errors"
	"fmt"
	"io"
	"time"

	"go.uber.org/zap"
)

// ErrConfig is wrapped by every Config.Validate error.
var ErrConfig = errors.New("campaign: invalid config")

// Config configures one campaign.
type Config struct {
	// Seed draws the fault schedule (and the workload). Default 1; the
	// same seed replays the same schedule.
	Seed uint64
	// Faults is the number of faults to inject. Default 30.
	Faults int
	// Rate is faults per second. Default 2. Higher rates reach more faults
	// in the time but leave the cluster less time to recover between them.
	Rate float64
	// Coordinators is 1 (one coordinator, its embedded NATS server) or 3
	// (replicated through raft, each embedding one server of a NATS
	// cluster; coordinator faults then hit the raft leader half of the
	// time). Default 1.
	Coordinators int
	// Ranks is the TP size of the engine instance (one rankd per rank).
	// Default 4.
	Ranks int
	// SourceDir is the repository root the daemons are built from when
	// BinDir is empty. Default ".".
	SourceDir string
	// BinDir holds prebuilt coordinator and rankd binaries. Default "":
	// build them into the work directory.
	BinDir string
	// WorkDir holds credentials, logs, L2, the index and the report's
	// fault log. Default "": a new temporary directory, removed at the end
	// unless Keep is set.
	WorkDir string
	// Keep leaves WorkDir in place at the end. Default false.
	Keep bool
	// TracePath is the Mooncake conversation trace. Default
	// $KVTIER_TRACE, else shared/data/traces/mooncake_conversation_trace.jsonl
	// in the nearest of SourceDir and its parents that has it.
	TracePath string
	// Netns runs every rankd in its own network namespace when the
	// campaign runs as root. Default true; without root it falls back to
	// loopback (said in the report).
	Netns bool
	// L2Bytes is the size of the L2 tmpfs (root only). Default 768 MiB: a
	// full file system is a fault, not the steady state.
	L2Bytes int64
	// L3 gives every rankd an L3 tier: an S3 server (gofakes3) in the
	// campaign's process, with L3 object faults. Default true.
	L3 bool
	// L1 is each rankd's --l1-bytes. Default "96MiB" (small: eviction
	// happens).
	L1 string
	// MaxChunks caps the chunks of one replayed prompt (2048 tokens each).
	// Default 4.
	MaxChunks int
	// MaxRSS is the memory bound per daemon (VmRSS). Default 1.5 GiB.
	MaxRSS uint64
	// FinalRuns is the number of engine runs after every fault healed
	// (half new prompts, half restores of old ones). Default 6.
	FinalRuns int
	// Quiesce bounds the wait, after the last fault is healed, for the
	// index to equal every inventory. Default 60 s.
	Quiesce time.Duration
	// Log receives the fault log and lifecycle lines. Default zap.NewNop().
	Log *zap.Logger
	// Out receives the printed report table. Default io.Discard.
	Out io.Writer
}

// DefaultConfig returns the defaults documented on Config.
func DefaultConfig() Config {
	return Config{Seed: 1, Faults: 30, Rate: 2, Coordinators: 1, Ranks: 4, SourceDir: ".", Netns: true, L3: true, L2Bytes: 768 << 20,
		L1: "96MiB", MaxChunks: 4, MaxRSS: 3 << 29, Quiesce: 60 * time.Second, FinalRuns: 6, Log: zap.NewNop(), Out: io.Discard}
}

// Validate checks c as given.
func (c Config) Validate() error {
	switch {
	case c.Faults < 0:
		return fmt.Errorf("%w: %d faults, want >= 0", ErrConfig, c.Faults)
	case c.Rate <= 0 || c.Rate > 1000:
		return fmt.Errorf("%w: rate %g faults/s, want (0, 1000]", ErrConfig, c.Rate)
	case c.Coordinators != 1 && c.Coordinators != 3:
		return fmt.Errorf("%w: %d coordinators, want 1 or 3 (raft)", ErrConfig, c.Coordinators)
	case c.Ranks != 4:
		return fmt.Errorf("%w: %d ranks; the engine scenarios are TP4, want 4", ErrConfig, c.Ranks)
	case c.SourceDir == "" && c.BinDir == "":
		return fmt.Errorf("%w: neither a source dir nor a binary dir", ErrConfig)
	case c.L2Bytes < 64<<20:
		return fmt.Errorf("%w: L2 tmpfs %d B, want >= 64 MiB", ErrConfig, c.L2Bytes)
	case c.MaxChunks < 1:
		return fmt.Errorf("%w: max chunks %d, want >= 1", ErrConfig, c.MaxChunks)
	case c.MaxRSS == 0:
		return fmt.Errorf("%w: RSS bound 0", ErrConfig)
	case c.FinalRuns < 0:
		return fmt.Errorf("%w: %d final runs, want >= 0", ErrConfig, c.FinalRuns)
	case c.Quiesce <= 0:
		return fmt.Errorf("%w: quiesce wait %v, want > 0", ErrConfig, c.Quiesce)
	case c.Log == nil || c.Out == nil:
		return fmt.Errorf("%w: nil logger or output", ErrConfig)
	}
	return nil
}
