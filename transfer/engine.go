package transfer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/group"
	"github.com/kvtier/kvtier/transfer/tier"
	"github.com/kvtier/kvtier/wire"
)

// Engine is one rank's store/retrieve engine. All methods are safe for
// concurrent use.
type Engine struct {
	cfg    Config
	log    *zap.Logger
	dev    cuda.Device
	l2     L2Tier  // nil: no L2
	l3     *L3Tier // nil: no L3
	l3c    l3Counters
	l3coll *l3Collector // registered with cfg.Registerer when L3 is set
	ctr    counters
	hooks  testHooks
	rankID string
	coll   *collector // registered with cfg.Registerer; unregistered by Close

	// life is canceled by Close once draining is over (or its context
	// expired): every goroutine of the engine watches it.
	life     context.Context
	stopLife context.CancelFunc
	// goroutines starts every goroutine of the engine (internal/group);
	// Close closes it once life is canceled (step 3) and waits for it.
	goroutines *group.Group

	storeStreams    *streamPool
	retrieveStreams *streamPool

	l1buf  cuda.HostBuf
	l1mem  []byte
	peers  *peerTable // nil unless Config.HostL1Dir
	closer sync.Once
	closed chan struct{} // closed when Close has finished
	cerr   error

	l1map   []byte      // bound private L1's mapping (Config.L1NUMA), unmapped after l1buf's release
	l1place L1Placement // where L1's pages are
	// rescanDone is closed when the background L2 rescan has ended;
	// rescanErr (written before) says why it stopped early.
	rescanDone chan struct{}
	rescanErr  error

	mu sync.Mutex // guards everything below
	// closing: Close has begun; new work is refused.
	closing bool
	sess    sessionTable
	reqs    map[string]*request
	futures int // store futures not yet finished
	// retrieves: Retrieve calls (and their reapers) not yet finished.
	retrieves int
	idle      chan struct{} // closed and replaced when futures+retrieves hits 0
	cat       catalog
	ev        eventLog
	l3s       l3State
}

// testHooks let tests observe and perturb the engine (package-internal).
type testHooks struct {
	// imported runs after a store imported its producer event.
	imported func(reqID string, ev cuda.Event)
	// releasing runs just before a store releases its producer event.
	releasing func(f *StoreFuture)
	// evicting runs under the engine lock for every evicted object.
	evicting func(key dcp.Key, pins int)
	// rescanned runs, outside the engine lock, after the rescan entered
	// each entry (copied from rescanHook at New).
	rescanned func(ScanEntry)
	// scatterEnqueued runs after a retrieve enqueued the scatter of a
	// batch (idx: the batch's items); scatterCompleted after it waited
	// for and verified it.
	scatterEnqueued, scatterCompleted func(restoreID string, idx []int)
	// retrieveTouched runs after a retrieve marked its objects used,
	// before its first batch is looked up.
	retrieveTouched func(restoreID string)
	// paceWaiting runs when a paced retrieve is about to wait before a
	// batch.
	paceWaiting func(restoreID string)
	// peerLeased runs after a retrieve leased an object in a peer's L1,
	// before its scatter (tests set it before the retrieve).
	peerLeased func(dcp.Key)
	// partialChecked runs after an item that skips blocks passed its
	// source check, before its scatter (src: the source object's bytes).
	partialChecked func(key dcp.Key, src []byte)
}

// rescanHook, when set (tests only, before New), becomes the new engine's
// hooks.rescanned.
var rescanHook func(ScanEntry)

// New starts an engine: it allocates L1, opens L2 and starts its
// goroutines, among them the rescan of L2, which rebuilds this rank's L2
// inventory from the files' headers in the background (quarantining files
// whose headers fail, announcing every object it finds) while the engine
// serves: retrieves read any object from L2 whether or not the rescan
// reached it, verifying it (C5). WaitRescan waits for the rescan.
func New(cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Incarnation == 0 {
		// Incarnations are ordered (C7: a larger one supersedes a smaller
		// one), so a later start must get a larger value: wall-clock ns.
		cfg.Incarnation = uint64(time.Now().UnixNano())
	}
	e := &Engine{
		cfg:    cfg,
		dev:    cfg.Device,
		rankID: cfg.Rank.String(),
		reqs:   make(map[string]*request),
		idle:   make(chan struct{}),
		closed: make(chan struct{}),

		goroutines: group.New("transfer"),
		rescanDone: make(chan struct{}),
	}
	e.sess.init()
	e.hooks.rescanned = rescanHook
	e.log = cfg.Logger.Named("transfer").With(zap.Stringer("rank", cfg.Rank), zap.Uint64("incarnation", cfg.Incarnation))
	e.ctr.storeLatency = newLatency("store_seconds", "Store latency, request to commit.", e.rankID)
	e.ctr.retrieveLatency = newLatency("retrieve_seconds", "Retrieve latency, request to verified answer.", e.rankID)

	nslabs := int(cfg.L1Bytes / cfg.L1SlabBytes)
	size := uint64(nslabs) * cfg.L1SlabBytes
	e.cat.init(nslabs, cfg.L1SlabBytes)
	if cfg.HostL1Dir != "" {
		if err := e.openHostL1(nslabs); err != nil {
			return nil, err
		}
	} else {
		if err := e.allocL1(size); err != nil {
			return nil, err
		}
	}
	e.ctr.l1CapacityBytes = size
	e.cat.l2acct.hdr = tier.HeaderBytes(cfg.Rank.Instance)
	e.cat.l2acct.gauge = &e.ctr.l2Bytes
	e.ev.init(cfg.KeepEvents)

	var mac *MACKey
	if cfg.StorageKey != nil {
		k, err := NewMACKey(cfg.StorageKey)
		if err != nil {
			e.releaseL1()
			return nil, err
		}
		mac = k
	}
	e.l2 = cfg.L2
	if e.l2 == nil && cfg.L2Dir != "" {
		ft, err := OpenFileTier(cfg.L2Dir, mac)
		if err != nil {
			e.releaseL1()
			return nil, err
		}
		e.l2 = ft
	}
	switch {
	case cfg.L3 != nil && cfg.L3Encrypt:
		l3, err := NewEncryptingL3Tier(cfg.L3, cfg.Rank.Instance, mac)
		if err != nil {
			e.releaseL1()
			return nil, err
		}
		e.l3 = l3
	case cfg.L3 != nil:
		e.l3 = NewL3Tier(cfg.L3, cfg.Rank.Instance, mac)
	}
	e.l3Init()
	e.life, e.stopLife = context.WithCancel(context.Background())
	e.storeStreams = newStreamPool(cfg.Device, cfg.Streams)
	e.retrieveStreams = newStreamPool(cfg.Device, cfg.Streams)

	if cfg.Registerer != nil {
		e.coll = newCollector(&e.ctr, e.rankID)
		if err := cfg.Registerer.Register(e.coll); err != nil {
			e.stopLife()
			e.releaseL1()
			return nil, fmt.Errorf("transfer: register metrics: %w", errors.Join(err, ErrConfig))
		}
		if e.l3 != nil {
			e.l3coll = newL3Collector(&e.l3c, e.rankID)
			if err := cfg.Registerer.Register(e.l3coll); err != nil {
				cfg.Registerer.Unregister(e.coll)
				e.stopLife()
				e.releaseL1()
				return nil, fmt.Errorf("transfer: register L3 metrics: %w", errors.Join(err, ErrConfig))
			}
		}
	}
	// The group is new, so nothing New starts can be refused.
	e.goroutines.Go("l1-evict", e.evictLoop)
	if e.l2 != nil {
		for range cfg.L2Writers {
			e.goroutines.Go("l2-write", e.l2WriteLoop)
		}
		e.goroutines.Go("l2-collect", e.collectLoop)
		// Start-up serves at once (issue 15.2): the rescan reads headers in
		// the background, announcing what it finds; Get verifies every read.
		e.ctr.l2Rescanning.Store(true)
		e.goroutines.Go("l2-rescan", func() {
			defer close(e.rescanDone)
			defer e.ctr.l2Rescanning.Store(false)
			e.rescanErr = e.rescan()
			if e.rescanErr != nil && e.life.Err() == nil {
				e.log.Error("L2 rescan stopped early; serving the objects it found", zap.Error(e.rescanErr))
			}
		})
	} else {
		close(e.rescanDone)
	}
	if e.l3 != nil {
		e.l3Start()
	}
	e.log.Info("engine started",
		zap.Uint64("l1_bytes", size), zap.Int("l1_slabs", nslabs), zap.Uint64("l1_slab_bytes", cfg.L1SlabBytes),
		zap.Bool("l2", e.l2 != nil), zap.Stringer("l2_policy", cfg.L2Policy), zap.Bool("l3", e.l3 != nil),
		zap.Int64("l2_objects", e.ctr.l2Objects.Load()))
	return e, nil
}

// goFunc runs f, a store's own work (store.go: runStore; storerun.go:
// reapStore), on a goroutine of the engine's group. Each completes a store
// future, so it must run even when the group refuses: that happens only
// once Close has reached step 3 with the store still in flight (Close's
// context ended before the store finished), and then f runs on the
// caller's goroutine, where it fails promptly because life is canceled,
// and the future is answered.
func (e *Engine) goFunc(f func()) {
	if !e.goroutines.Go("store", f) {
		f()
	}
}

// Incarnation returns this run's incarnation.
func (e *Engine) Incarnation() uint64 { return e.cfg.Incarnation }

// Rank returns the rank's identity.
func (e *Engine) Rank() wire.Rank { return e.cfg.Rank }

// L2 returns the L2 tier, nil without one.
func (e *Engine) L2() L2Tier { return e.l2 }

// rescan rebuilds this rank's L2 inventory at New.
func (e *Engine) rescan() error {
	start := time.Now()
	var found, bad, skipped, unverified int
	err := e.l2.Scan(e.life, e.cfg.Rank, e.cfg.L2VerifyOnScan, func(s ScanEntry) {
		if e.hooks.rescanned != nil {
			defer e.hooks.rescanned(s)
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		if s.Skipped != "" {
			skipped++
			e.ctr.l2ScanSkipped.Add(1)
			e.log.Warn("L2 rescan: skipped an entry that is not a regular file or directory", zap.String("why", s.Skipped))
			return
		}
		if errors.Is(s.Err, ErrUnverified) {
			// C12: its header's sum is not one this cluster recorded; it
			// must never become a placement. Logged once, with the count.
			unverified++
			e.ctr.unverifiedL2.Add(1)
			e.ctr.quarantined.Add(1)
			e.log.Debug("L2 rescan: quarantined an object whose header MAC does not verify", zap.Error(s.Err))
			if s.KeyKnown {
				e.emitLocked(wire.Removed, wire.L2, s.Object.Key, s.Object.Size, s.Object.Sum)
			}
			return
		}
		if s.Err != nil {
			bad++
			e.ctr.quarantined.Add(1)
			if errors.Is(s.Err, ErrCorrupt) {
				e.ctr.checksumL2.Add(1)
			}
			e.log.Warn("L2 rescan: quarantined a bad object file", zap.Error(s.Err))
			if s.KeyKnown {
				// The coordinator may hold it from our previous incarnation.
				e.emitLocked(wire.Removed, wire.L2, s.Object.Key, s.Object.Size, s.Object.Sum)
			}
			return
		}
		found++
		if _, ok := e.cat.l2[s.Object.Key]; ok {
			return // written (or read) since the start: that entry is newer
		}
		if o := e.cat.objs[s.Object.Key]; o != nil && o.writing {
			return // being written again: its write announces it
		}
		e.cat.l2Set(s.Object.Key, l2Entry{size: s.Object.Size, sum: s.Object.Sum, fp: s.Object.Fingerprint},
			uint64(max(s.Object.Created.UnixNano(), 1)))
		e.ctr.l2Objects.Store(int64(len(e.cat.l2)))
		e.emitLocked(wire.Stored, wire.L2, s.Object.Key, s.Object.Size, s.Object.Sum)
	})
	if unverified > 0 {
		e.log.Warn("L2 rescan: objects whose header MAC does not verify with this cluster's storage key were quarantined, not announced (another cluster's or a rotated key, written before storage MACs, or replaced by someone who can write the L2 directory); they are recomputed when needed",
			zap.Int("objects", unverified))
	}
	if err != nil {
		return fmt.Errorf("transfer: rescan L2: %w", err)
	}
	e.log.Info("L2 rescanned", zap.Int("objects", found), zap.Int("quarantined", bad), zap.Int("unverified", unverified), zap.Int("skipped", skipped),
		zap.Duration("took", time.Since(start)))
	return nil
}

// Close drains in-flight stores and retrieves, flushes writes to L2
// (queued writes; with WriteBackOnEvict also every object only L1 holds),
// and stops every goroutine; the events emitted until it returns stay held
// for the consumer (EventSource works after Close). When ctx ends
// first it stops anyway: in-flight device work is cut short (its futures
// fail), unwritten objects are counted as lost, and ctx's error is
// returned. Close is idempotent; later calls wait for the first and return
// its result.
func (e *Engine) Close(ctx context.Context) error {
	e.closer.Do(func() {
		e.cerr = e.close(ctx)
		close(e.closed)
	})
	select {
	case <-e.closed:
		return e.cerr
	default:
	}
	select {
	case <-e.closed:
		return e.cerr
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *Engine) close(ctx context.Context) error {
	e.mu.Lock()
	e.closing = true
	e.mu.Unlock()
	var errs []error

	// 1. In-flight stores and retrieves finish (or ctx ends).
	if err := e.waitIdle(ctx); err != nil {
		errs = append(errs, fmt.Errorf("transfer: close: drain in-flight work: %w", err))
	}
	// 2. Writes to L2 finish; with write-back, every dirty object is
	// written.
	if e.l2 != nil && len(errs) == 0 {
		if err := e.flushL2(ctx); err != nil {
			errs = append(errs, fmt.Errorf("transfer: close: flush L2: %w", err))
		}
	}
	// 2b. The L3 write-behind queue drains (or ctx ends: what is left is
	// not written, and L3 misses those objects).
	if e.l3 != nil && len(errs) == 0 {
		if err := e.flushL3(ctx, true); err != nil {
			e.log.Warn("closing before the L3 write-behind queue drained", zap.Error(err))
		}
	}
	// 3. Stop: goroutines see life canceled; stream waits are cut short.
	e.mu.Lock()
	lost := e.cat.countDirty()
	e.mu.Unlock()
	if lost > 0 {
		e.ctr.lostObjects.Add(uint64(lost))
		e.log.Error("objects only in L1 were not written to L2 before shutdown", zap.Int("objects", lost))
	}
	// No goroutine starts from here on (a store's own work then runs on
	// its caller: goFunc; a retrieve's L2 readers on the retrieve).
	e.stopLife()
	e.goroutines.Close()
	e.wakeAll()
	e.goroutines.Wait()
	// 4. Release memory. The events emitted until now stay held for the
	// consumer, which may take them after Close (EventSource).
	e.storeStreams.closeAll()
	e.retrieveStreams.closeAll()
	e.mu.Lock()
	for _, sp := range e.sess.byID {
		e.sess.retireLocked(sp, "closed with its engine")
	}
	e.mu.Unlock()
	if e.coll != nil {
		// A later engine of the same rank (a restart in-process) registers
		// its own.
		e.cfg.Registerer.Unregister(e.coll)
		if e.l3coll != nil {
			e.cfg.Registerer.Unregister(e.l3coll)
		}
	}
	// A Retrieve runs on its caller's goroutine; canceled by life, it ends
	// promptly unless stuck in file I/O. L1 is freed only when none is left.
	grace, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.waitIdle(grace); err != nil {
		e.log.Error("retrieves still running after shutdown; L1 is left allocated")
		return errors.Join(append(errs, fmt.Errorf("transfer: close: retrieves still running: %w", err))...)
	}
	e.releaseL1()
	e.log.Info("engine closed", zap.Uint64("last_seq", e.ctr.lastSeq.Load()),
		zap.Uint64("published_through", e.ctr.publishedThrough.Load()))
	return errors.Join(errs...)
}

// waitIdle waits until no store future or retrieve is in flight.
func (e *Engine) waitIdle(ctx context.Context) error {
	for {
		e.mu.Lock()
		if e.futures == 0 && e.retrieves == 0 {
			e.mu.Unlock()
			return nil
		}
		ch := e.idle
		e.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// workDoneLocked updates the idle signal after a future or retrieve ended.
func (e *Engine) workDoneLocked() {
	if e.futures == 0 && e.retrieves == 0 {
		close(e.idle)
		e.idle = make(chan struct{})
	}
}

// wakeAll wakes every goroutine that waits on a kick channel.
func (e *Engine) wakeAll() {
	e.mu.Lock()
	e.cat.notifyLocked()
	e.mu.Unlock()
	kick(e.cat.evictKick)
	kick(e.cat.writeKick)
	kick(e.l3s.kick)
}

// kick does a non-blocking send on a 1-buffered channel.
func kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// streamPool hands out streams exclusively: a store holds its stream from
// its WaitEvent until its gather completed, so one slow producer never
// delays another store, and a stream failed by a bad event is discarded
// rather than poisoning later work.
type streamPool struct {
	dev  cuda.Device
	sem  chan struct{}
	free chan cuda.Stream
}

func newStreamPool(dev cuda.Device, n int) *streamPool {
	return &streamPool{dev: dev, sem: make(chan struct{}, n), free: make(chan cuda.Stream, n)}
}

func (p *streamPool) get(ctx context.Context) (cuda.Stream, error) {
	select {
	case p.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return p.take()
}

// tryGet is get without waiting: nil, nil when every stream is taken.
func (p *streamPool) tryGet() (cuda.Stream, error) {
	select {
	case p.sem <- struct{}{}:
	default:
		return nil, nil
	}
	return p.take()
}

// take returns a free stream or a new one; the caller holds a slot of
// p.sem, given back if no stream can be made.
func (p *streamPool) take() (cuda.Stream, error) {
	select {
	case s := <-p.free:
		return s, nil
	default:
	}
	s, err := p.dev.NewStream()
	if err != nil {
		<-p.sem
		return nil, fmt.Errorf("new stream: %w", errors.Join(err, ErrDevice))
	}
	return s, nil
}

// put returns s; a stream that failed (or might still run work) is closed.
func (p *streamPool) put(s cuda.Stream, healthy bool) {
	if healthy {
		p.free <- s
	} else {
		_ = s.Close()
	}
	<-p.sem
}

func (p *streamPool) closeAll() {
	for {
		select {
		case s := <-p.free:
			_ = s.Close()
		default:
			return
		}
	}
}

// Flush writes every object only L1 holds to L2 (with WriteBackOnEvict,
// all of them; with WriteThrough, the ones still queued or whose write
// failed) and waits until no L2 write is pending. Without an L2 it returns
// at once.
func (e *Engine) Flush(ctx context.Context) error {
	if e.l2 == nil {
		return nil
	}
	e.mu.Lock()
	closing := e.closing
	e.mu.Unlock()
	if closing {
		return ErrClosed
	}
	if err := e.flushL2(ctx); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if n := e.cat.countDirty(); n > 0 {
		return fmt.Errorf("flush: %d objects could not be written to L2: %w", n, ErrIO)
	}
	return nil
}

// WaitRescan waits until the L2 rescan New started in the background has
// ended (or ctx, or the engine, ended first) and returns its error: nil
// when it went through, or why it stopped early (the objects it found
// before are served and announced). Without L2 it returns nil at once.
func (e *Engine) WaitRescan(ctx context.Context) error {
	select {
	case <-e.rescanDone:
		return e.rescanErr
	case <-ctx.Done():
		return ctx.Err()
	case <-e.closed:
		select {
		case <-e.rescanDone:
			return e.rescanErr
		default:
			return ErrClosed
		}
	}
}
