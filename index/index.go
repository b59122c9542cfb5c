package index

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/group"
	"github.com/kvtier/kvtier/wire"
	bolt "go.etcd.io/bbolt"
	"go.uber.org/zap"
)

// Bucket names (doc.go, "bbolt layout").
var (
	bucketMeta  = []byte("meta")
	bucketNS    = []byte("ns")
	bucketRanks = []byte("ranks")
	bucketSnap  = []byte("chunks")
	bucketLog   = []byte("log")
	keyVersion  = []byte("version")
	// keyID is the index's identity (idBytes random bytes), written when
	// the file is created (or first opened by a build that has it) and
	// never changed: a coordinator gossips it, so a lost index replaced by
	// an empty one is told apart from the one the ranks reported to.
	keyID = []byte("index_id")
)

// logValueKey is the one key of a change-log record's bucket. Each record
// is a bucket of its own (bucket log, key the record number) holding the
// record under this key: bbolt rewrites the whole leaf an appended key
// lands in, and a leaf keeps at least two of these large values, so plain
// values in one bucket wrote every record several times (7.1x its bytes
// for records of 32 KiB to 256 KiB, the group commits of an 8-rank
// ingest); a record in its own bucket is written once (1.1x at 256 KiB,
// 2.1x at 32 KiB with the commit's own pages). Files written before hold
// plain values in bucket log, still read and deleted.
var logValueKey = []byte{0}

// storeVersion is the file's format (meta "version"): 2 since chunk
// records are keyed by generation (codec.go, snapshot keys); Open
// upgrades a version-1 file in place.
const storeVersion = 2

// Index is the coordinator's durable placement index. Open it, drive it
// with Apply, ApplyInventory and FenceRank from any number of goroutines,
// query it with Lookup and friends, and Close it.
//
// Concurrency: every write is a request to one committer goroutine, which
// merges the requests waiting for it into one transaction (group commit)
// and hands it to a writer goroutine for bbolt (write and fsync); while
// the writer works, the committer stages the next group on top of it. Once
// a transaction is committed the committer publishes it into the in-memory
// state and only then answers its callers. The in-memory state is read by
// queries under a read lock and written only by the committer, under the
// write lock, after the commit. Queries never touch bbolt. The writer reads
// only what the committer handed it (and the rank table, which the
// committer changes only between two commits).
type Index struct {
	// id and created: the index's identity and whether Open created the
	// file (ID, Created); set by Open, never changed.
	id      string
	created bool
	cfg     Config
	log     *zap.Logger
	met     *metrics
	db      *bolt.DB

	// mu guards the published contents of st: the committer holds it for
	// writing while it publishes a committed group; queries hold it for
	// reading. The committer reads st without it (it is the only writer).
	mu sync.RWMutex
	st *state
	// view is what lookups read besides the chunk maps (chunkmap.go):
	// replaced by the committer, never modified once stored. Lookups take
	// neither mu nor any lock but a chunk shard's, one map read at a time.
	view atomic.Pointer[lookupView]

	reqs chan *request
	// closeMu guards closed: senders hold it for reading while they queue
	// a request, so once Close holds it for writing no request can arrive
	// after the committer's final drain.
	closeMu sync.RWMutex
	closed  bool
	stop    chan struct{}
	// goroutines starts every goroutine of the index (STYLE 21): the
	// committer and the writer, and the work they hand off (a fold's
	// sort, Verify's copy and comparison, a Dump's encoding, chunk-list
	// compactions). Close closes it first; work handed off after that
	// (by the committer's final drain) runs on the committer instead.
	goroutines *group.Group
	closeOnce  sync.Once
	closeErr   error

	// Owned by the committer goroutine (and Open, before it starts); the
	// writer reads nextLog and the flight it is handed.
	logBytes int64  // bytes in the change log since the last fold was cut
	nextLog  uint64 // key of the next log record
	// folding is the automatic fold being written in slices, nil if none.
	folding *foldJob
	failed  error // sticky commit failure
	// sticky mirrors failed for Failed, which any goroutine may call.
	sticky   atomic.Pointer[error]
	txns     [2]*txn
	encs     [2]opEncoder
	cur      *txn       // the txn being staged, nil if none
	curIdx   int        // which of txns/encs cur is
	pending  []*request // requests staged in cur, in order
	curN     int        // events staged in cur
	curStart time.Time  // when the first request of cur was staged
	flight   *flight    // the txn bbolt is committing, nil if none
	writes   chan *flight
	arena    []byte // owned by the writer goroutine
	logBuf   []byte // owned by the writer goroutine: the log record being committed

	// applied is the highest raft index staged (replicate.go); committer
	// only. appliedPub is the highest one committed and published.
	applied    uint64
	appliedPub atomic.Uint64
	// fences are the sliced FenceRanks in progress, oldest first (see
	// fenceJob); fencing counts those whose request is not answered yet
	// (a finished fence's last slice may still be in flight). No fold is
	// cut while fencing > 0.
	fences  []*fenceJob
	fencing int
	// invs are the sliced ApplyInventorys in progress, oldest first (see
	// invJob); fencing counts their requests too.
	invs []*invJob
}

type reqKind uint8

const (
	reqBatch reqKind = iota + 1
	reqInventory
	reqFence
	reqRegister
	reqVerify
	reqCheckpoint
	reqReset
	reqSkip     // a replicated request refused by validation: only its raft index counts
	reqSnapshot // replicate.go
	reqRestore
	reqDump
	reqSlice   // a slice of a sliced fence, staged by the committer itself
	reqSync    // replicate.go
	reqInvStep // a step of a streamed inventory (stream.go)
)

// request is one call waiting for the committer. The committer fills in
// the result fields and closes done.
type request struct {
	kind  reqKind
	ctx   context.Context
	batch *wire.Batch
	inv   *wire.Inventory
	step  *InventoryStep // reqInvStep
	rank  wire.Rank
	upTo  uint64 // reqFence: the incarnation that died
	// reqInventory: the rank's fence generation the inventory was
	// requested under, when genChecked (ApplyInventoryAt, Op.FenceGen).
	fenceGen   uint64
	genChecked bool
	spec       *dcp.Resolved
	json       []byte
	n          int // events, for group sizing
	done       chan struct{}

	out    Outcome
	invOut InventoryOutcome
	fenced int
	report VerifyReport
	err    error

	// Replicated requests (replicate.go).
	raftIndex uint64
	skipped   bool
	snap      *Snapshot
	src       io.Reader
	restored  bool
	dump      Dump
	// slice: a sliced fence's request (or one that joined it), answered
	// with its last slice; Index.fencing counts it until then.
	slice bool
}

// Open opens (creating if needed) the index at cfg.Path, rebuilds the
// in-memory state from bbolt and starts the committer.
func Open(cfg Config) (*Index, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	start := time.Now()
	db, err := openBolt(cfg)
	if err != nil {
		return nil, err
	}
	ix := &Index{
		cfg:        cfg,
		log:        cfg.Logger.Named("index"),
		met:        newMetrics(),
		db:         db,
		reqs:       make(chan *request, cfg.QueueDepth),
		stop:       make(chan struct{}),
		goroutines: group.New("index"),
	}
	fail := func(err error) (*Index, error) {
		_ = db.Close()
		return nil, err
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		var err error
		ix.id, ix.created, err = initBuckets(tx)
		return err
	}); err != nil {
		return fail(fmt.Errorf("open %s: %w", cfg.Path, err))
	}
	var ld loaded
	if err := db.View(func(tx *bolt.Tx) error {
		var err error
		ld, err = load(tx)
		return err
	}); err != nil {
		return fail(fmt.Errorf("open %s: %w", cfg.Path, err))
	}
	ix.st, ix.logBytes, ix.nextLog = ld.st, ld.logBytes, ld.nextLog
	ix.st.bg = ix.goroutines // compactions off the committer from now on
	ix.st.fan = ix.cfg.PublishFan
	ix.view.Store(ix.st.buildView(nil))
	ix.applied = ld.applied
	ix.appliedPub.Store(ld.applied)
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(ix.met); err != nil {
			return fail(fmt.Errorf("register metrics: %w: %w", ErrConfig, err))
		}
	}
	ix.gauges()
	ix.log.Info("index opened", zap.String("path", cfg.Path), zap.Int64("chunks", ix.st.chunks),
		zap.Int64("objects", ix.st.objects), zap.Int("ranks", len(ix.st.ranks)-1),
		zap.Int("log_records", ld.logRecords), zap.Int64("log_bytes", ld.logBytes),
		zap.Duration("took", time.Since(start)))
	ix.writes = make(chan *flight)
	ix.goroutines.Go("committer", ix.run) // a new group refuses nothing
	ix.goroutines.Go("writer", ix.writer)
	return ix, nil
}

func openBolt(cfg Config) (*bolt.DB, error) {
	_, statErr := os.Stat(cfg.Path)
	db, err := bolt.Open(cfg.Path, 0o600, &bolt.Options{
		Timeout:         cfg.OpenTimeout,
		NoSync:          cfg.NoSync,
		NoFreelistSync:  true, // rebuilt by scanning at Open: commits write less
		FreelistType:    bolt.FreelistMapType,
		InitialMmapSize: cfg.InitialMmapSize,
		MaxSize:         cfg.MaxFileBytes,
	})
	if err != nil {
		return nil, fmt.Errorf("open %s: %w: %w", cfg.Path, ErrStore, err)
	}
	// bbolt fsyncs a file it creates, never its directory: until the
	// directory is fsynced, a power cut can lose the new file's name and
	// with it every batch acknowledged since. (The name of a file that was
	// there is durable already: its creator, or Restore, synced it.)
	if errors.Is(statErr, fs.ErrNotExist) {
		if err := syncDir(filepath.Dir(cfg.Path)); err != nil {
			_ = db.Close()
			return nil, fmt.Errorf("open %s: %w", cfg.Path, err)
		}
	}
	return db, nil
}

// initBuckets creates what a new file lacks and returns the index's
// identity and whether the file was created by this call (it had no
// format version).
func initBuckets(tx *bolt.Tx) (id string, created bool, err error) {
	for _, name := range [][]byte{bucketMeta, bucketNS, bucketRanks, bucketSnap, bucketLog} {
		if _, err := tx.CreateBucketIfNotExists(name); err != nil {
			return "", false, fmt.Errorf("create bucket %s: %w: %w", name, ErrStore, err)
		}
	}
	m := tx.Bucket(bucketMeta)
	switch v := m.Get(keyVersion); {
	case len(v) == 1 && v[0] == storeVersion:
	case v == nil || (len(v) == 1 && v[0] == 1):
		// New, or of the older snapshot layout (33-byte chunk keys, read
		// as generation 0): from now on it may hold keys of the new one,
		// which builds that read only version 1 must not open.
		created = v == nil
		if err := m.Put(keyVersion, []byte{storeVersion}); err != nil {
			return "", false, fmt.Errorf("write format version: %w: %w", ErrStore, err)
		}
	default:
		return "", false, fmt.Errorf("store format version %v, this build reads 1 and %d: %w", v, storeVersion, ErrCorrupt)
	}
	if v := m.Get(keyID); v != nil {
		if len(v) != idBytes {
			return "", false, fmt.Errorf("index id is %d B, want %d: %w", len(v), idBytes, ErrCorrupt)
		}
		return hex.EncodeToString(v), created, nil
	}
	b := make([]byte, idBytes)
	if _, err := rand.Read(b); err != nil {
		return "", false, fmt.Errorf("new index id: %w: %w", ErrStore, err)
	}
	if err := m.Put(keyID, b); err != nil {
		return "", false, fmt.Errorf("write index id: %w: %w", ErrStore, err)
	}
	return hex.EncodeToString(b), created, nil
}

// idBytes is the length of an index's identity.
const idBytes = 16

// ID is the index's identity: 32 hex digits, random, written when the
// file was created and kept for its life (meta "index_id"). A new empty
// index has a new one.
func (ix *Index) ID() string { return ix.id }

// Created reports whether this Open created the file: the index is new
// and empty (a first start, or a lost data directory).
func (ix *Index) Created() bool { return ix.created }

// Close stops accepting requests, commits the ones already queued, folds
// the change log into the snapshot, stops the committer and closes bbolt.
// It is idempotent; later calls return the first call's result.
func (ix *Index) Close() error {
	ix.closeOnce.Do(func() {
		ix.closeMu.Lock()
		ix.closed = true
		ix.closeMu.Unlock()
		ix.goroutines.Close()
		close(ix.stop)
		ix.goroutines.Wait()
		if err := ix.db.Close(); err != nil && ix.closeErr == nil {
			ix.closeErr = fmt.Errorf("close %s: %w: %w", ix.cfg.Path, ErrStore, err)
		}
		if ix.cfg.Registerer != nil {
			ix.cfg.Registerer.Unregister(ix.met)
		}
		ix.log.Info("index closed", zap.Error(ix.closeErr))
	})
	return ix.closeErr
}

// submit queues r and waits for the committer's answer. ctx is honoured
// while the request waits in the queue: a request whose context has ended
// by the time the committer reaches it is not applied and gets ctx's
// error. Once the committer has taken a request, submit waits for it (one
// group commit at most), so a returned context error always means "not
// applied" and the caller's batch is never read after submit returns.
func (ix *Index) submit(ctx context.Context, r *request) error {
	if err := ix.enqueue(ctx, r); err != nil {
		return err
	}
	<-r.done
	return r.err
}

// enqueue hands r to the committer; requests are processed in the order
// enqueue returns.
func (ix *Index) enqueue(ctx context.Context, r *request) error {
	if ctx == nil {
		ctx = context.Background()
	}
	r.ctx = ctx
	r.done = make(chan struct{})
	ix.closeMu.RLock()
	defer ix.closeMu.RUnlock()
	if ix.closed {
		return ErrClosed
	}
	select {
	case ix.reqs <- r:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Durability is how the bbolt file is opened, as far as acknowledged
// writes surviving a crash or power cut depend on it.
type Durability struct {
	NoSync         bool // no fsync on commit: acknowledged writes can be lost (C7 broken)
	NoGrowSync     bool // no fsync after growing the file
	NoFreelistSync bool // freelist not written; rebuilt by a scan at Open (safe)
}

// Durability reports the open bbolt file's durability options.
func (ix *Index) Durability() Durability {
	return Durability{NoSync: ix.db.NoSync, NoGrowSync: ix.db.NoGrowSync, NoFreelistSync: ix.db.NoFreelistSync}
}

// Failed returns nil while the index accepts writes, or, once a commit or
// checkpoint has failed, an error wrapping ErrFailed and the failure: the
// index refuses every write until it is closed and reopened. Safe for
// concurrent use; health checks call it.
func (ix *Index) Failed() error {
	if p := ix.sticky.Load(); p != nil {
		return *p
	}
	return nil
}
