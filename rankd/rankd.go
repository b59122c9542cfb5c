package rankd

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/group"
	"github.com/kvtier/kvtier/internal/numa"
	"github.com/kvtier/kvtier/objstore"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// Engine API operations, the last token of wire.Subjects.Engine.
const (
	OpRegister = "register"
	OpStore    = "store"
	OpRetrieve = "retrieve"
	OpRelease  = "release"
	OpStatus   = "status"
	// OpCut cuts the caller's stores of a request (CutRequest): served on
	// the NATS callback, outside the request slots, which the stores it
	// cuts may hold.
	OpCut = "cut"
)

// Daemon is one running rankd.
//
// Lifecycle: New (opens the device, builds the cluster member; no network,
// nothing written), Start (HTTP, memberlist join, the duplicate-rank
// check, then the incarnation file and the engine, which rescans L2; NATS,
// serving),
// Shutdown (stop accepting engine requests, drain in-flight ones and the
// stores, flush events, leave the cluster, close). Shutdown is idempotent
// and blocks until every goroutine the daemon started has exited.
type Daemon struct {
	cfg  Config
	log  *zap.Logger
	met  *metrics
	subj wire.Subjects
	inc  uint64

	dev cuda.Device
	// tc configures the engine Start builds, after the duplicate check, so
	// that a refused duplicate touches nothing of the live rank's L2.
	tc transfer.Config
	// l3 is the L3 object store Start opened (nil: none); closed by
	// Shutdown after the engine.
	l3 *objstore.Store
	// eng is nil until Start built it; written under mu, read under mu
	// where Start may run concurrently (status, Engine, Shutdown).
	eng *transfer.Engine
	// releaseWait bounds the wait, before a store's reply, for the device
	// to finish reading the engine's blocks.
	releaseWait time.Duration
	pub         *publisher
	invs        *inventoryServer // inventory snapshots being paged out
	regs        regDedup         // recent register requests (duplicate deliveries)
	clu         *cluster.Cluster

	slots chan struct{} // engine request slots (MaxInFlight)
	stop  chan struct{} // closed when Shutdown begins its final phase
	// life is canceled with stop: blocking calls of daemon goroutines
	// watch it.
	life     context.Context
	stopLife context.CancelFunc
	// requests starts the goroutine of each engine request being served
	// (api.go); Shutdown closes it with closing and waits for it (step 1).
	requests *group.Group
	// goroutines starts the daemon's other goroutines (the HTTP server,
	// the event publisher, the watch and heartbeat loops, inventory pages,
	// blocks-freed waits); Shutdown closes it with stopped and waits for
	// it (step 5).
	goroutines *group.Group

	httpSrv *http.Server
	httpLn  net.Listener

	trust trust      // NATS credentials and the coordinator key (auth.go)
	iw    indexWatch // the coordinators' index ids (indexwatch.go)

	// incUnsaved: Start could not store this start's incarnation (a
	// failing L2); the heartbeat loop retries until it succeeds.
	incUnsaved atomic.Bool
	// leaving is set once Shutdown has sent the leaving heartbeat
	// (wire.Heartbeat.Leaving); liveness probes then say so too.
	leaving atomic.Bool
	// reportJSON: the coordinator refused a binary report and took it as
	// JSON (it predates wire's KVT1): every later report goes as JSON.
	reportJSON atomic.Bool

	// cuts holds the stores in flight by (caller, request id), and the
	// recent cuts, for OpCut.
	cuts cutRegistry

	mu        sync.Mutex // guards the following
	started   bool
	closing   bool // Shutdown began: engine requests are refused
	stopped   bool // Shutdown's final phase: no new goroutines
	shutdown  bool
	nc        *nats.Conn
	subs      []*nats.Subscription
	natsURL   string
	shutErr   error
	shutDone  chan struct{}
	readyOnce bool
}

// New validates cfg exactly as given (no default is filled in here: see
// DefaultConfig), opens the device, reads (never writes) the stored
// incarnation and builds the cluster member. It does not touch the
// network, nor L2: Start builds the engine once no other live rankd
// serves the rank.
func New(cfg Config) (*Daemon, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	d := &Daemon{
		cfg:      cfg,
		log:      cfg.Logger.Named("rankd").With(zap.Stringer("rank", cfg.Rank)),
		met:      newMetrics(cfg.Rank.String()),
		subj:     wire.Subjects{Prefix: cfg.Prefix},
		slots:    make(chan struct{}, cfg.MaxInFlight),
		stop:     make(chan struct{}),
		shutDone: make(chan struct{}),

		requests:   group.New("rankd.requests"),
		goroutines: group.New("rankd"),
	}
	inc, err := peekIncarnation(cfg.L2Dir, cfg.Rank)
	if err != nil {
		return nil, fmt.Errorf("rankd %s: %w", cfg.Rank, err)
	}
	d.inc = inc
	d.invs = &inventoryServer{snaps: newSnapshots(cfg.InventorySnapshotTTL, cfg.MaxInventorySnapshots),
		pageSize: cfg.InventoryPageSize, inventory: func(index string) wire.Inventory { d.inventoryTaken(index); return d.eng.Inventory() }, log: d.log,
		probe: func() wire.RankProbe {
			return wire.RankProbe{Rank: cfg.Rank, Incarnation: d.inc, Leaving: d.leaving.Load()}
		}}
	storageKey, err := loadStorageKey(cfg, d.log)
	if err != nil {
		return nil, fmt.Errorf("rankd %s: %w", cfg.Rank, err)
	}
	d.life, d.stopLife = context.WithCancel(context.Background())
	dev, err := cuda.Open(cfg.Device, cfg.Host)
	if err != nil {
		return nil, fmt.Errorf("rankd %s: open device %q: %w", cfg.Rank, cfg.Device, err)
	}
	if cfg.CopyPath != "" && cfg.CopyPath != "auto" {
		if err := cuda.ForceCopyPath(dev, cfg.CopyPath); err != nil {
			_ = dev.Close()
			return nil, fmt.Errorf("rankd %s: %w", cfg.Rank, err)
		}
	}
	if err := cuda.TuneDMA(dev, cfg.DMA); err != nil {
		_ = dev.Close()
		return nil, fmt.Errorf("rankd %s: %w", cfg.Rank, err)
	}
	d.dev = dev
	d.met.watchCopyEngine(dev)
	d.pub = newEventPublisher(d.subj.Events(cfg.Rank), cfg.EventAckTimeout, cfg.EventWindow, d.log.Named("events"), d.met)

	tc := transfer.DefaultConfig()
	tc.Rank = cfg.Rank
	tc.TPSize = cfg.TPSize
	tc.Incarnation = d.inc
	tc.Device = dev
	if cfg.wrapDevice != nil {
		tc.Device = cfg.wrapDevice(dev)
	}
	tc.L1Bytes = cfg.L1Bytes
	tc.L1SlabBytes = cfg.L1SlabBytes
	if tc.L1SlabBytes == 0 {
		tc.L1SlabBytes = transfer.SlabFor(cfg.L1Bytes) // small objects do not waste L1 (issue 18.1)
	}
	tc.L2Dir = cfg.L2Dir
	tc.StorageKey = storageKey
	tc.HostL1Dir = cfg.HostL1Dir
	tc.L1NUMA, _ = numa.ParseSpec(cfg.L1NUMA) // Validate checked it
	tc.L2Policy = cfg.L2Policy
	tc.L2Bytes, tc.L2FreeFloorBytes = cfg.L2Bytes, l2FreeFloor(&cfg)
	tc.L2CollectGrace, tc.L2VerifyOnScan = cfg.L2CollectGrace, cfg.L2VerifyOnScan
	tc.L2SharedWith, tc.KeepSharedInL1 = cfg.L2SharedWith, cfg.KeepSharedInL1
	tc.L3SharedWith, tc.HostL1SharedWith = cfg.L3SharedWith, cfg.HostL1SharedWith
	tc.KeepEvents = true // the publisher pulls them (setSource in Start)
	tc.Logger = cfg.Logger
	tc.Registerer = d.met.reg
	tc.StoreTimeout = cfg.StoreTimeout
	tc.RetrieveSerialBatches = cfg.RetrieveSerialBatches
	tc.RetrieveBatchBytes = cfg.RetrieveBatchBytes
	tc.RetrievePaceWindow = cfg.RestorePaceWindow
	tc.RetrieveRamp = cfg.RetrieveRamp
	tc.RetrieveTailRamp = cfg.RetrieveTailRamp
	tc.Streams = cfg.Streams
	d.releaseWait = cfg.StoreTimeout
	d.tc = tc

	cc := cluster.DefaultConfig()
	cc.NodeName = cfg.NodeName
	cc.BindAddr, cc.BindPort = cfg.BindAddr, cfg.BindPort
	cc.AdvertiseAddr, cc.AdvertisePort = cfg.AdvertiseAddr, cfg.AdvertisePort
	cc.Seeds = cfg.Join
	cc.Detector = cfg.Detector
	cc.Logger = cfg.Logger
	cc.Registerer = d.met.reg
	cc.Meta = cluster.Meta{
		Role:        cluster.RoleRankd,
		Engine:      cfg.Rank.Instance,
		TPRank:      cfg.Rank.TPRank,
		TPSize:      cfg.TPSize,
		DCPRank:     cfg.Rank.TPRank % cfg.DCPSize,
		DCPSize:     cfg.DCPSize,
		Incarnation: d.inc,
		L1CapBytes:  cfg.L1Bytes,
	}
	cc.SecretKey, cc.SecondaryKeys, cc.Insecure = cfg.GossipKey, cfg.GossipSecondaryKeys, cfg.Insecure
	if err := d.initIndexWatch(); err != nil {
		_ = dev.Close()
		return nil, fmt.Errorf("rankd %s: %w", cfg.Rank, err)
	}
	if err := d.loadAuth(); err != nil {
		_ = dev.Close()
		return nil, fmt.Errorf("rankd %s: %w", cfg.Rank, err)
	}
	clu, err := cluster.New(cc)
	if err != nil {
		_ = dev.Close()
		return nil, fmt.Errorf("rankd %s: %w", cfg.Rank, err)
	}
	d.clu = clu
	return d, nil
}

// Incarnation returns this run's incarnation (in events, inventories and
// the member metadata).
func (d *Daemon) Incarnation() uint64 { return d.inc }

// Engine returns the transfer engine (tests); nil until Start built it.
func (d *Daemon) Engine() *transfer.Engine {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.eng
}

// HTTPAddr returns the address of the metrics/health listener, "" if none.
func (d *Daemon) HTTPAddr() string {
	if d.httpLn == nil {
		return ""
	}
	return d.httpLn.Addr().String()
}

// GossipAddr returns the memberlist address of this daemon.
func (d *Daemon) GossipAddr() string { return d.clu.LocalMember().Addr }

// NATSURL returns the NATS URL in use ("" before Start connected).
func (d *Daemon) NATSURL() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.natsURL
}

// Start starts the HTTP listener, joins the cluster, finds the
// coordinator's NATS, connects and starts serving. On error the daemon
// must still be shut down.
func (d *Daemon) Start(ctx context.Context) error {
	d.mu.Lock()
	if d.started || d.shutdown {
		d.mu.Unlock()
		return ErrStarted
	}
	d.started = true
	d.mu.Unlock()

	if d.cfg.HTTPAddr != "" {
		ln, err := net.Listen("tcp", d.cfg.HTTPAddr)
		if err != nil {
			return fmt.Errorf("rankd %s: HTTP listener: %w", d.cfg.Rank, err)
		}
		d.httpLn = ln
		d.httpSrv = &http.Server{Handler: d.httpHandler(), ReadHeaderTimeout: 5 * time.Second}
		srv := d.httpSrv
		if !d.goroutines.Go("http", func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				d.log.Error("HTTP server stopped", zap.Error(err))
			}
		}) {
			_ = ln.Close()
			return fmt.Errorf("rankd %s: shut down while starting: %w", d.cfg.Rank, ErrClosed)
		}
		// The address is not gossiped (issue 28.2: every gossip key holder
		// would read it); operators find it in the start log line.
	}

	if err := d.clu.Start(); err != nil {
		return fmt.Errorf("rankd %s: %w", d.cfg.Rank, err)
	}
	jctx, cancel := context.WithTimeout(ctx, d.cfg.JoinTimeout)
	defer cancel()
	if len(d.cfg.Join) > 0 {
		if _, err := d.clu.Join(jctx); err != nil {
			return fmt.Errorf("rankd %s: %w", d.cfg.Rank, err)
		}
	}
	// Before anything is published: a second rankd for a live rank would
	// supersede it (issue 18.3).
	if err := d.refuseDuplicate(ctx); err != nil {
		return err
	}
	// Only now the rank's files: the incarnation, then L2 (rescanned by
	// the engine).
	if err := saveIncarnation(d.cfg.L2Dir, d.cfg.Rank, d.inc); err != nil {
		// Another start overtook this one, or the file is damaged: refuse.
		// A write that fails (ENOSPC, EIO, a read-only L2) is a failing
		// L2, and a failing L2 never keeps L1 from serving (issue 11.3):
		// start with the incarnation drawn (already above the stored one),
		// count, warn, and store it from the heartbeat loop once the L2
		// takes writes again. Until then only a clock stepped back below
		// this start could give a later start a smaller incarnation.
		if errors.Is(err, ErrDuplicateRank) || errors.Is(err, ErrConfig) {
			return fmt.Errorf("rankd %s: %w", d.cfg.Rank, err)
		}
		d.met.incarnationSaveFailures.Inc()
		d.incUnsaved.Store(true)
		d.log.Warn("cannot store this start's incarnation in the L2 directory; serving anyway (a failing L2 degrades, L1 serves), retried every heartbeat",
			zap.Uint64("incarnation", d.inc), zap.String("l2_dir", d.cfg.L2Dir), zap.Error(err))
	}
	tc := d.tc
	if d.cfg.L3.Endpoint != "" {
		st, err := objstore.Open(ctx, d.cfg.L3)
		if err != nil {
			return fmt.Errorf("rankd %s: L3: %w", d.cfg.Rank, err)
		}
		d.l3 = st
		tc.L3, tc.L3Bytes, tc.L3Encrypt = st, d.cfg.L3Bytes, d.cfg.L3Encrypt
		d.log.Info("L3 object store", zap.Stringer("store", st))
	}
	eng, err := transfer.New(tc)
	if err != nil {
		if d.l3 != nil {
			_ = d.l3.Close()
		}
		return fmt.Errorf("rankd %s: %w", d.cfg.Rank, err)
	}
	d.mu.Lock()
	d.eng = eng
	d.mu.Unlock()
	d.pub.setSource(eng)
	d.met.noteL1Placement(eng.L1Placement())
	url := d.cfg.NATSURL
	if url == "" {
		var err error
		if url, err = d.discoverNATS(jctx); err != nil {
			return err
		}
	}
	nc, err := bus.Connect(url, "rankd-"+d.cfg.Rank.Instance+"-"+fmt.Sprint(d.cfg.Rank.TPRank), d.natsOpts()...)
	if err != nil {
		return fmt.Errorf("rankd %s: %w", d.cfg.Rank, err)
	}
	d.mu.Lock()
	d.nc, d.natsURL = nc, url
	d.mu.Unlock()
	nc.SetReconnectHandler(func(*nats.Conn) { d.pub.reconnected() })
	d.pub.setConn(nc)
	for _, g := range []struct {
		name string
		f    func()
	}{
		{"events", func() { d.pub.run(d.stop) }},
		{"watch", d.watchLoop},
		{"heartbeat", d.heartbeatLoop},
	} {
		if !d.goroutines.Go(g.name, g.f) {
			return fmt.Errorf("rankd %s: shut down while starting: %w", d.cfg.Rank, ErrClosed)
		}
	}

	if err := d.subscribe(nc); err != nil {
		return err
	}
	d.mu.Lock()
	d.readyOnce = true
	d.mu.Unlock()
	d.log.Info("rankd serving", zap.String("nats", url), zap.String("gossip", d.clu.LocalMember().Addr),
		zap.String("http", d.HTTPAddr()), zap.Uint64("incarnation", d.inc),
		zap.String("device", d.dev.Info().Backend+" "+d.dev.Info().UUID), zap.Uint64("l2_free_floor", d.tc.L2FreeFloorBytes),
		zap.String("copy_path", cmp.Or(d.cfg.CopyPath, "auto")), zap.Bool("copy_engine_batching", batching(d.dev)))
	return nil
}

// heartbeatLoop announces the engine's last event sequence every
// HeartbeatInterval (see wire.Heartbeat): the coordinator resyncs this rank
// when its index stays behind, so an event lost in transit is noticed even
// when no later batch comes. The heartbeats also keep a gossip death
// notice from being acted on while this process is alive (a forged
// notice, or a probe timeout on a starved host): the coordinator fences
// only once they have stopped for a few intervals, or the NATS connection
// is gone. A failed publish is logged at debug level: the next beat
// repeats it.
func (d *Daemon) heartbeatLoop() {
	t := time.NewTicker(d.cfg.HeartbeatInterval)
	defer t.Stop()
	subject := d.subj.Heartbeat(d.cfg.Rank)
	defer func() {
		if d.incUnsaved.Load() {
			d.log.Warn("shut down without having stored this start's incarnation", zap.Uint64("incarnation", d.inc))
		}
	}()
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
		}
		d.retryIncarnation()
		if err := d.publishHeartbeat(subject, d.leaving.Load()); err != nil {
			d.log.Debug("heartbeat not sent", zap.Error(err))
		}
	}
}

// publishHeartbeat sends one heartbeat on the rank's own subject.
func (d *Daemon) publishHeartbeat(subject string, leaving bool) error {
	d.mu.Lock()
	nc, eng := d.nc, d.eng
	d.mu.Unlock()
	if nc == nil || eng == nil {
		return nats.ErrConnectionClosed
	}
	capacity := declaredCapacity(&d.cfg)
	p, err := json.Marshal(wire.Heartbeat{Rank: d.cfg.Rank, Incarnation: d.inc, Seq: eng.Stats().LastSeq,
		IntervalMS: d.cfg.HeartbeatInterval.Milliseconds(), Leaving: leaving, Capacity: &capacity,
		OfferIndex: d.indexOffer(time.Now())})
	if err != nil {
		return err
	}
	return nc.Publish(subject, p)
}

// announceLeaving tells the coordinator, on the rank's own authenticated
// heartbeat subject, that this incarnation is leaving (Shutdown step 4,
// before the gossip leave): the coordinator acts on the gossip leave that
// follows only with this word of the rank's own, its heartbeats stopped,
// or its NATS connection gone (issue 28.2). Bounded by ctx.
func (d *Daemon) announceLeaving(ctx context.Context) {
	d.mu.Lock()
	nc := d.nc
	d.mu.Unlock()
	if nc == nil {
		return
	}
	d.leaving.Store(true)
	err := d.publishHeartbeat(d.subj.Heartbeat(d.cfg.Rank), true)
	if err == nil {
		err = nc.FlushWithContext(ctx)
	}
	if err != nil {
		// The coordinator then confirms the leave when the heartbeats stop
		// or the NATS connection closes, a few seconds later.
		d.log.Warn("leaving notice not sent to the coordinator", zap.Error(err))
		return
	}
	d.log.Debug("leaving notice sent")
}

// retryIncarnation stores the incarnation Start could not (incUnsaved).
// A later start that overtook this one meanwhile is logged at Error (it
// supersedes this one) and not retried.
func (d *Daemon) retryIncarnation() {
	if !d.incUnsaved.Load() {
		return
	}
	err := saveIncarnation(d.cfg.L2Dir, d.cfg.Rank, d.inc)
	switch {
	case err == nil:
		d.incUnsaved.Store(false)
		d.log.Info("incarnation stored in the L2 directory after all", zap.Uint64("incarnation", d.inc))
	case errors.Is(err, ErrDuplicateRank) || errors.Is(err, ErrConfig):
		d.incUnsaved.Store(false)
		d.log.Error("incarnation not stored: the file moved on without this start", zap.Uint64("incarnation", d.inc), zap.Error(err))
	default:
		d.met.incarnationSaveFailures.Inc()
		d.log.Debug("incarnation still not stored", zap.Error(err))
	}
}

// refuseDuplicate returns ErrDuplicateRank, naming the live member, when
// another incarnation of this rank is still alive in memberlist after
// DuplicateWait; nil as soon as there is none.
func (d *Daemon) refuseDuplicate(ctx context.Context) error {
	self := d.clu.LocalMember().ID
	deadline := time.Now().Add(d.cfg.DuplicateWait)
	for {
		var live *cluster.Member
		for _, m := range d.clu.Members() {
			if m.ID != self && m.Meta.Role == cluster.RoleRankd && m.State == cluster.StateAlive &&
				m.Meta.Engine == d.cfg.Rank.Instance && m.Meta.TPRank == d.cfg.Rank.TPRank {
				live = &m
				break
			}
		}
		if live == nil {
			return nil
		}
		if !time.Now().Before(deadline) {
			d.log.Error("refusing to start: the rank is served by another live rankd", zap.Stringer("rank", d.cfg.Rank),
				zap.String("live_member", live.ID), zap.Uint64("live_incarnation", live.Meta.Incarnation),
				zap.String("live_addr", live.Addr), zap.Duration("waited", d.cfg.DuplicateWait))
			return fmt.Errorf("rank %s is served by live member %s (incarnation %d, gossip %s), still alive after %v; stop it, or wait until it is declared dead: %w",
				d.cfg.Rank, live.ID, live.Meta.Incarnation, live.Addr, d.cfg.DuplicateWait, ErrDuplicateRank)
		}
		d.log.Warn("another rankd serves this rank; waiting for it to die or leave", zap.Stringer("rank", d.cfg.Rank),
			zap.String("live_member", live.ID), zap.Duration("until", time.Until(deadline)))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// discoverNATS waits for a coordinator member that gossips a NATS URL and
// returns the URLs of every coordinator that does (clusterNATS).
func (d *Daemon) discoverNATS(ctx context.Context) (string, error) {
	for {
		if urls := clusterNATS(d.clu.Members(), d.trustedNATS); urls != "" {
			return urls, nil
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("rankd %s: no alive coordinator with a NATS URL in the cluster: %w: %w", d.cfg.Rank, ErrNoCoordinator, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// watchLoop keeps the daemon attached to the coordinator:
//   - it joins the seeds again whenever no coordinator is alive in the
//     member table (a restarted coordinator starts a cluster of its own and
//     only learns of the ranks when they contact it);
//   - when the NATS URL was discovered (not configured) and the connection
//     has been down for NATSSwitchAfter while the alive coordinators
//     gossip other URLs (one moved or restarted on another port), it
//     connects there, subscribes again and hands the publisher the new
//     connection. A rank holding several URLs (a NATS cluster) normally
//     never gets here: nats.go moves it to a surviving server first.
func (d *Daemon) watchLoop() {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	var downSince time.Time
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
		}
		var coord *cluster.Member
		members := d.clu.Members()
		d.watchIndex(members, time.Now())
		for _, m := range members {
			// Only the coordinator that signed its NATS URLs counts (C9): a
			// member merely claiming the role neither moves this rank nor
			// keeps it from rejoining the real one.
			if m.Meta.Role == cluster.RoleCoordinator && m.State == cluster.StateAlive && d.trustedNATS(m) {
				coord = &m
				break
			}
		}
		if coord == nil && len(d.cfg.Join) > 0 {
			ctx, cancel := context.WithTimeout(d.life, time.Second)
			if _, err := d.clu.Join(ctx); err == nil {
				d.log.Info("rejoined the cluster through the seeds (no coordinator was alive)")
			}
			cancel()
		}
		if d.cfg.NATSURL != "" {
			continue
		}
		d.mu.Lock()
		nc, cur := d.nc, d.natsURL
		d.mu.Unlock()
		if nc == nil || nc.IsConnected() {
			downSince = time.Time{}
			continue
		}
		if downSince.IsZero() {
			downSince = time.Now()
		}
		if coord == nil || len(coord.Meta.NATS) == 0 || time.Since(downSince) < d.cfg.NATSSwitchAfter {
			continue
		}
		if url := clusterNATS(d.clu.Members(), d.trustedNATS); url != "" && url != cur {
			d.switchNATS(url)
			downSince = time.Time{}
		}
	}
}

// switchNATS moves the daemon to another NATS URL.
func (d *Daemon) switchNATS(url string) {
	nc, err := bus.Connect(url, "rankd-"+d.cfg.Rank.Instance+"-"+fmt.Sprint(d.cfg.Rank.TPRank), d.natsOpts()...)
	if err != nil {
		d.log.Warn("the coordinator gossips another NATS URL, which does not answer", zap.String("url", url), zap.Error(err))
		return
	}
	d.mu.Lock()
	if d.stopped {
		d.mu.Unlock()
		nc.Close()
		return
	}
	old, oldSubs, oldURL := d.nc, d.subs, d.natsURL
	d.nc, d.subs, d.natsURL = nc, nil, url
	d.mu.Unlock()
	if err := d.subscribe(nc); err != nil {
		d.log.Error("subscribe on the new NATS connection", zap.Error(err))
	}
	nc.SetReconnectHandler(func(*nats.Conn) { d.pub.reconnected() })
	d.pub.setConn(nc)
	for _, s := range oldSubs {
		_ = s.Unsubscribe()
	}
	old.Close()
	d.log.Warn("moved to the coordinator's new NATS URL", zap.String("from", oldURL), zap.String("to", url))
}

func (d *Daemon) subscribe(nc *nats.Conn) error {
	type route struct {
		subject string
		handle  func(*nats.Msg)
	}
	routes := []route{{d.subj.Inventory(d.cfg.Rank), d.onInventory}}
	for _, op := range []string{OpRegister, OpStore, OpRetrieve, OpRelease, OpStatus} {
		routes = append(routes, route{d.subj.Engine(d.cfg.Rank, op), d.engineHandler(op)})
	}
	routes = append(routes, route{d.subj.Engine(d.cfg.Rank, OpCut), d.serveCut})
	for _, r := range routes {
		sub, err := nc.Subscribe(r.subject, r.handle)
		if err != nil {
			return fmt.Errorf("rankd %s: subscribe %s: %w", d.cfg.Rank, r.subject, err)
		}
		// Requests wait in the client while a handler runs; the limits
		// bound memory, not concurrency (handlers return at once).
		_ = sub.SetPendingLimits(65536, 256<<20)
		d.mu.Lock()
		d.subs = append(d.subs, sub)
		d.mu.Unlock()
	}
	return nc.Flush()
}

// Shutdown stops the daemon gracefully within ShutdownTimeout (or ctx):
// engine requests are refused with code unavailable, in-flight requests
// and stores drain, the engine closes (L2 write-through finished), the
// events it emitted are flushed to the coordinator, the member leaves
// the cluster, then everything closes. Idempotent; later calls wait for
// the first and return its result.
func (d *Daemon) Shutdown(ctx context.Context) error {
	d.mu.Lock()
	if d.closing {
		d.mu.Unlock()
		select {
		case <-d.shutDone:
		case <-ctx.Done():
			return ctx.Err()
		}
		return d.shutErr
	}
	d.closing = true
	connected := d.nc != nil
	eng := d.eng
	d.mu.Unlock()
	d.requests.Close()

	ctx, cancel := context.WithTimeout(ctx, d.cfg.ShutdownTimeout)
	defer cancel()
	var errs []error
	start := time.Now()

	// 1. In-flight engine requests finish (new ones get unavailable).
	drained := make(chan struct{})
	go func() { d.requests.Wait(); close(drained) }()
	select {
	case <-drained:
	case <-ctx.Done():
		errs = append(errs, fmt.Errorf("drain engine requests: %w", ctx.Err()))
	}
	// 2. The engine drains its stores and finishes L2 writes (under
	// write-back: every object only L1 holds, issue 18.2); the events
	// they emit stay in its buffer for the publisher, which keeps pulling.
	// Bounded by FlushTimeout on its own. Not built when Start never got
	// past the duplicate check.
	if eng != nil {
		fctx, fcancel := context.WithTimeout(context.Background(), d.cfg.FlushTimeout)
		if err := eng.Close(fctx); err != nil {
			errs = append(errs, fmt.Errorf("close transfer engine: %w", err))
		}
		fcancel()
		if d.l3 != nil {
			_ = d.l3.Close()
		}
		if st := eng.Stats(); st.LostObjects > 0 {
			d.log.Error("objects only L1 held were not flushed to L2 before shutdown; they are lost",
				zap.Uint64("unflushed", st.LostObjects), zap.Duration("flush_timeout", d.cfg.FlushTimeout))
			errs = append(errs, fmt.Errorf("%d objects only L1 held were not flushed to L2", st.LostObjects))
		}
	}
	// 3. Every event the engine emitted reaches the coordinator (durably)
	// or is counted lost (flush logs it; the coordinator will resync).
	if connected {
		if n := d.pub.flush(ctx); n > 0 {
			errs = append(errs, fmt.Errorf("%d event batches not acknowledged", n))
		}
	} else {
		done, cancelDone := context.WithCancel(ctx)
		cancelDone()
		d.pub.flush(done) // never connected: nothing can be sent
	}
	// 4. Say so on NATS, then leave the cluster, so the coordinator sees
	// a graceful exit it can trust.
	d.mu.Lock()
	started := d.started
	d.mu.Unlock()
	if connected {
		actx, acancel := context.WithTimeout(ctx, time.Second)
		d.announceLeaving(actx)
		acancel()
	}
	if started {
		if err := d.clu.Leave(2 * time.Second); err != nil && !errors.Is(err, cluster.ErrNotStarted) {
			d.log.Warn("leave", zap.Error(err))
		}
	}
	// 5. Stop the daemon's goroutines, then close what they used.
	d.mu.Lock()
	d.stopped = true
	d.mu.Unlock()
	d.goroutines.Close()
	close(d.stop)
	d.stopLife()
	if d.httpSrv != nil {
		sctx, scancel := context.WithTimeout(context.Background(), time.Second)
		_ = d.httpSrv.Shutdown(sctx)
		scancel()
	}
	d.goroutines.Wait()
	d.mu.Lock()
	subs, nc := d.subs, d.nc
	d.subs = nil
	d.mu.Unlock()
	for _, s := range subs {
		_ = s.Unsubscribe()
	}
	if err := d.clu.Shutdown(); err != nil {
		errs = append(errs, err)
	}
	if nc != nil {
		nc.Close()
	}
	if err := d.dev.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close device: %w", err))
	}
	err := errors.Join(errs...)
	d.mu.Lock()
	d.shutdown = true
	d.shutErr = err
	d.mu.Unlock()
	close(d.shutDone)
	d.log.Info("rankd shut down", zap.Duration("took", time.Since(start)), zap.Error(err))
	return err
}

// batching is cuda.CopyEngineBatching's answer alone: whether auto may
// pick the copy engine on this device.
func batching(dev cuda.Device) bool {
	ok, _ := cuda.CopyEngineBatching(dev)
	return ok
}
