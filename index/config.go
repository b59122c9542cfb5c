package index

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Config configures an Index. Build it from DefaultConfig, set Path, then
// pass it to Open, which validates it.
type Config struct {
	// Path is the bbolt file. Required; created if missing.
	Path string

	// MaxGroupEvents caps the events (batch events plus inventory objects)
	// merged into one bbolt transaction by group commit. A single request
	// larger than the cap is committed alone. Larger groups amortize the
	// fsync and the transaction overhead; smaller ones bound the latency of
	// the requests in a group. Default 262144.
	MaxGroupEvents int
	// MaxGroupDelay is how long the committer waits for more requests after
	// the first of a group before committing, when the group is below
	// MaxGroupEvents. Default 0: commit as soon as the committer is free;
	// requests that arrive during a commit form the next group (natural
	// group commit, as in etcd). A delay trades latency for larger groups
	// when producers are few and each waits for its acknowledgement.
	MaxGroupDelay time.Duration
	// QueueDepth is the number of requests that may wait for the committer;
	// callers beyond it block (honouring their context). Default 4096.
	QueueDepth int

	// CheckpointBytes is the size of the change log, in bytes, at which the
	// committer folds it into the per-chunk snapshot bucket and truncates it
	// (see doc.go, "bbolt layout"). Larger values make ingest cheaper
	// (fewer, bigger folds) and Open slower (more log to replay; about 1 s
	// per 100 MB). Default 128 MiB. Close folds whatever is left.
	CheckpointBytes int64

	// FenceSliceChunks bounds the work FenceRank does in one group commit:
	// a rank whose chunk list is longer is fenced in slices of this many
	// of its chunks, one slice per group commit, so the acknowledgements
	// of other ranks wait for one slice, not for the whole rank (STYLE 24).
	// The fence is visible at once (from the first slice, lookups no longer
	// count the rank's L1 copies) and FenceRank returns once the last slice
	// is committed. Default 1024: about 2-4 ms of committer time per
	// slice (4096 held other ranks' acks up to 18-20 ms at 2 M placements,
	// BENCHMARKS.md). Larger finishes a big fence in fewer commits; smaller
	// stalls less.
	FenceSliceChunks int

	// InventorySlice bounds the work ApplyInventory does in one group
	// commit: an inventory whose rank's chunk list and objects add up to
	// more is applied in slices (index/inventory.go), this many of the
	// rank's chunks dropped or objects put per group commit, so other
	// ranks' acknowledgements wait for one slice, not for the whole
	// inventory. Lookups see none of the rank's placements from the first
	// slice to the last (never a half-applied inventory), and
	// ApplyInventory returns once the last slice is committed. Default
	// 2048 (about a millisecond of committer time). Larger finishes a
	// resync in fewer commits; smaller stalls less.
	InventorySlice int

	// FoldSliceChunks bounds the work an automatic fold (CheckpointBytes)
	// adds to one bbolt transaction: the chunks changed since the last
	// fold are written this many per commit, riding along with group
	// commits (or alone when no group waits), and the change log records
	// the fold covers are deleted with its last slice, so no
	// acknowledgement waits for a whole fold (STYLE 24). Default 4096.
	FoldSliceChunks int

	// PublishFan is how many goroutines the committer uses to install a
	// group's chunks into the in-memory maps once it is committed, and to
	// read the current values of a batch's chunks before staging it: the
	// committer's two map-bound steps, which bound durable ingest (issue
	// 26.5). 1 does both on the committer alone. Default 8, which
	// BenchmarkCommitterIngest measured fastest even with 2 processors
	// (the committer's processor runs a part while it waits for the
	// others).
	PublishFan int

	// NoSync skips fsync on commit. Only for tests: with it set, an
	// acknowledged write can be lost to a crash, breaking C7.
	NoSync bool
	// InitialMmapSize is bbolt's initial memory map, in bytes; a larger map
	// avoids remaps while the file grows. Default 256 MiB (address space
	// only; it is not allocated).
	InitialMmapSize int
	// MaxFileBytes caps the bbolt file (bbolt's MaxSize): a commit that
	// would grow it further fails, and the index then refuses writes
	// (ErrFailed) until it is reopened with more room. Default 0: no cap.
	MaxFileBytes int
	// HostSharedL1 says that the rankds of every instance run on one host
	// with host-shared L1 (rankd --host-l1-dir): an L1 copy is then usable
	// by every reader of its holder's instance, not only by the holder,
	// since a peer rankd restores it straight from the holder's shared
	// segment. Lookups prefer the reader's own L1, then the L1 of another
	// rank of the instance (lowest TP rank first), then L2. Default false:
	// an L1 copy serves its holder only. Set it only when every instance's
	// ranks share a host: a reader on another host that is sent to a peer's
	// L1 fails the chunk (or reads the L2 copy when one exists), and the
	// engine recomputes it.
	HostSharedL1 bool
	// SharedL3 makes LookupSharedInto use the L3 copies of the reader's
	// share-group members too, after every other copy (the reader
	// instance's own L3 first): set it when every member's rankds read
	// the others' objects in one bucket and prefix (rankd
	// --l3-shared-with; docs/sharing.md). Default false: a member's L3
	// copies serve its own instance only.
	SharedL3 bool
	// SharedL1 makes LookupSharedInto, with HostSharedL1, use the L1
	// copies of the reader's share-group members too, after the L1 copies
	// of the reader's own instance and before any L2 copy, under the same
	// fence rule: set it when every member's rankds share the host and
	// the host L1 directory and read each other's segments (rankd
	// --host-l1-shared-with). Default false. Ignored without HostSharedL1.
	SharedL1 bool

	// OpenTimeout bounds the wait for bbolt's file lock at Open (another
	// process holding the file). Default 5 s.
	OpenTimeout time.Duration

	// AfterCommit, when set, is called on the writer goroutine after each
	// group commit's bbolt transaction has committed (written and, unless
	// NoSync, fsynced) and before any of its requests is answered: the
	// seam through which tests observe the commit-before-ack order (C7).
	// It must return promptly; the next commit waits for it. Default nil.
	AfterCommit func()

	// Logger receives lifecycle and fault logs. Default zap.NewNop().
	Logger *zap.Logger
	// Registerer, when non-nil, gets the index's metrics (metrics.go); Close
	// unregisters them. Default nil (not exported).
	Registerer prometheus.Registerer
}

// DefaultConfig returns a Config with every default filled in except Path.
func DefaultConfig() Config {
	return Config{
		MaxGroupEvents:   1 << 18,
		PublishFan:       8,
		QueueDepth:       4096,
		CheckpointBytes:  128 << 20,
		FenceSliceChunks: 1024,
		InventorySlice:   2048,
		FoldSliceChunks:  4096,
		InitialMmapSize:  256 << 20,
		OpenTimeout:      5 * time.Second,
		Logger:           zap.NewNop(),
	}
}

// Validate checks every rule of the config; the error names the rule and
// the numbers.
func (c *Config) Validate() error {
	switch {
	case c.Path == "":
		return fmt.Errorf("path must be set: %w", ErrConfig)
	case c.MaxGroupEvents < 1:
		return fmt.Errorf("max group events %d must be >= 1: %w", c.MaxGroupEvents, ErrConfig)
	case c.MaxGroupDelay < 0:
		return fmt.Errorf("max group delay %v must be >= 0: %w", c.MaxGroupDelay, ErrConfig)
	case c.PublishFan < 1 || c.PublishFan > 64:
		return fmt.Errorf("publish fan %d must be 1 to 64: %w", c.PublishFan, ErrConfig)
	case c.QueueDepth < 1:
		return fmt.Errorf("queue depth %d must be >= 1: %w", c.QueueDepth, ErrConfig)
	case c.CheckpointBytes < 1:
		return fmt.Errorf("checkpoint bytes %d must be >= 1: %w", c.CheckpointBytes, ErrConfig)
	case c.FenceSliceChunks < 1:
		return fmt.Errorf("fence slice chunks %d must be >= 1: %w", c.FenceSliceChunks, ErrConfig)
	case c.InventorySlice < 1:
		return fmt.Errorf("inventory slice %d must be >= 1: %w", c.InventorySlice, ErrConfig)
	case c.FoldSliceChunks < 1:
		return fmt.Errorf("fold slice chunks %d must be >= 1: %w", c.FoldSliceChunks, ErrConfig)
	case c.MaxFileBytes < 0:
		return fmt.Errorf("max file bytes %d must be >= 0: %w", c.MaxFileBytes, ErrConfig)
	case c.InitialMmapSize < 0:
		return fmt.Errorf("initial mmap size %d must be >= 0: %w", c.InitialMmapSize, ErrConfig)
	case c.OpenTimeout <= 0:
		return fmt.Errorf("open timeout %v must be > 0: %w", c.OpenTimeout, ErrConfig)
	case c.Logger == nil:
		return fmt.Errorf("logger must be set (zap.NewNop() for none): %w", ErrConfig)
	}
	return nil
}
