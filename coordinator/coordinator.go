package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	bolterr "go.etcd.io/bbolt/errors"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
)

// Coordinator is one running coordinator. New builds it, Start brings it up
// (index, NATS, membership, subscriptions, HTTP), Shutdown takes it down;
// Run does Start, waits for its context and shuts down.
//
// Goroutines it owns, all tracked in wg and stopped by Shutdown: the ingest
// workers, one resync worker per rank being resynced, the membership loop,
// the restore deadline loop and the HTTP server. NATS delivers requests on
// its own per-subscription goroutines, which Shutdown drains.
type Coordinator struct {
	cfg  Config
	log  *zap.Logger
	subj wire.Subjects
	reg  *prometheus.Registry
	met  *metrics

	lifeMu  sync.Mutex // guards started, closed
	started bool
	closed  bool
	done    chan struct{} // closed once Shutdown has finished

	// Set by Start, read-only afterwards.
	idx  *index.Index
	nsrv *bus.Embedded
	nc   *nats.Conn
	// lnc carries the lookups and their replies only, so a lookup never
	// waits behind the event stream in c.nc's socket, read loop or write
	// buffer (issue 12.1: under 8-rank ingest they shared one connection).
	lnc      *nats.Conn
	natsURL  string // what this process connects to
	member   *cluster.Cluster
	msub     *cluster.Subscription
	subs     []*nats.Subscription
	httpSrv  *http.Server
	httpAddr string
	ingest   []chan *nats.Msg

	ingestMu     sync.RWMutex // guards ingestClosed against sends in flight
	ingestClosed bool
	ingestWG     sync.WaitGroup // the ingest workers

	ctx    context.Context // ended by Shutdown: workers stop
	cancel context.CancelFunc
	wg     sync.WaitGroup // every goroutine this coordinator started
	// draining is set once Shutdown has begun: no new resyncs start.
	drainMu  sync.Mutex // guards draining and resyncing
	draining bool
	// resyncing holds the ranks with a resync worker running (at most one
	// per rank); true asks the worker for one more resync when it is done.
	resyncing map[wire.Rank]bool

	hb heartbeats

	fences fenceGates // per-rank fence epochs: see fence.go
	geo    geometries // registered namespaces' geometry: see limits.go
	// resyncLimit paces resync starts (ResyncRate, ResyncBurst); used
	// under drainMu.
	resyncLimit *rate.Limiter

	auth authState

	rs   *restores
	live *liveTable // the rankd incarnations seen in memberlist
	// repl is how the index is changed: standalone, or replicated through
	// raft (replicator.go). Set by New, never nil.
	repl replicator
	// phase is how far Start has come (phaseOpening, phaseIndex,
	// phaseServing): gate reads it before a handler touches the index or
	// the member, Health before it reads them.
	phase atomic.Int32
	// shut is set once Shutdown has begun (Health reads it without lifeMu,
	// which Start holds while it opens the index).
	shut atomic.Bool

	// startedAt is when Start began (set before any handler runs): the
	// startup grace of the reader liveness rule counts from it.
	startedAt time.Time
	// rebuilding: Start set a damaged index aside (RebuildIndex); every
	// rankd that joins is asked for its inventory. Written before any
	// handler runs.
	rebuilding bool
}

// ingestWorkers is the number of event-ingest workers. Batches of one rank
// always go to the same worker, so they are applied in arrival order;
// batches of different ranks are applied concurrently and meet in the
// index's group commit.
const ingestWorkers = 8

// ingestQueue is the per-worker queue of received batches; when full, the
// NATS delivery goroutine waits (back-pressure into NATS's own buffers).
const ingestQueue = 256

// lookupSubscribers is the number of subscriptions (one queue group, each
// with its own NATS delivery goroutine) that answer lookups and restore
// plans concurrently. They read the index's published state under its read
// lock; more than the cores of a small machine buys nothing.
const lookupSubscribers = 4

// lookupQueue is the NATS queue group of the lookup subscribers.
const lookupQueue = "kvtier-lookup"

// New validates cfg and builds a coordinator. It does no I/O.
func New(cfg Config) (*Coordinator, error) {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	c := &Coordinator{
		cfg:       cfg,
		log:       cfg.Logger.Named("coordinator"),
		subj:      wire.Subjects{Prefix: cfg.Prefix},
		reg:       cfg.Registry,
		met:       newMetrics(),
		done:      make(chan struct{}),
		resyncing: make(map[wire.Rank]bool),
		hb:        heartbeats{prev: make(map[wire.Rank]wire.Heartbeat)},
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.resyncLimit = rate.NewLimiter(rate.Limit(cfg.ResyncRate), cfg.ResyncBurst)
	c.rs = newRestores(c)
	c.live = newLiveTable()
	c.auth.refused = newRefused()
	if err := c.reg.Register(c.met); err != nil {
		return nil, fmt.Errorf("register coordinator metrics: %w: %w", ErrConfig, err)
	}
	if err := c.reg.Register(c.auth.refused); err != nil {
		return nil, fmt.Errorf("register coordinator metrics: %w: %w", ErrConfig, err)
	}
	c.repl = standalone{c}
	if cfg.Raft.Enabled() {
		r, err := newReplicated(c)
		if err != nil {
			return nil, err
		}
		c.repl = r
	}
	return c, nil
}

// Start starts or connects to NATS, serves HTTP, starts the workers and
// subscribes, then opens and verifies the index and joins the cluster. It
// returns once all of that is done; meanwhile, from the moment the
// subscriptions exist, every request is answered with code unavailable
// and a retry hint (gate), so a restart with a large index is not an
// outage of silence, and /healthz reports "starting". On error everything
// already started is shut down again.
func (c *Coordinator) Start() error {
	c.lifeMu.Lock()
	defer c.lifeMu.Unlock()
	switch {
	case c.closed:
		return ErrClosed
	case c.started:
		return ErrStarted
	}
	c.started = true
	if err := c.start(); err != nil {
		c.lifeMu.Unlock()
		c.Shutdown()
		c.lifeMu.Lock()
		return err
	}
	return nil
}

func (c *Coordinator) start() error {
	t0 := time.Now()
	c.startedAt = t0
	if err := os.MkdirAll(c.cfg.DataDir, 0o700); err != nil {
		return fmt.Errorf("create data dir %s: %w", c.cfg.DataDir, err)
	}

	// NATS first, so a restart serves at once (issue 12): until the index
	// is open and verified every request is answered with code
	// unavailable and a retry hint (see gate), never left unanswered, and
	// no batch is acknowledged.
	// NATS: embedded unless an external URL is configured.
	advertise := c.cfg.NATSURL
	var copts []nats.Option
	if c.cfg.Insecure {
		c.log.Warn("INSECURE: NATS without authentication; anyone who reaches the NATS port can read every plan and forge any rank's events and restore reports (C9)")
	} else {
		var err error
		if copts, err = c.loadAuth(); err != nil {
			return err
		}
	}
	if c.cfg.NATSURL == "" {
		ecfg := c.cfg.Embedded
		ecfg.Insecure = c.cfg.Insecure
		if !c.cfg.Insecure {
			ecfg.Users = c.auth.users
			ecfg.TLS = c.auth.tls
			ecfg.Cluster.Username, ecfg.Cluster.Password = c.auth.routeUser, c.auth.routePass
			ecfg.Cluster.TLS = c.auth.routeTLS
		}
		srv, err := bus.StartEmbedded(ecfg)
		if err != nil {
			return err
		}
		c.nsrv = srv
		// Connect over loopback when listening on every address: the
		// server certificate names real addresses, never 0.0.0.0.
		advertise = srv.ClientURL()
		c.natsURL = advertisedNATS(advertise, "127.0.0.1")
		c.log.Info("embedded NATS started", zap.String("url", c.natsURL), zap.String("cluster", srv.ClusterAddr()),
			zap.Strings("routes", ecfg.Cluster.Routes))
	} else {
		c.natsURL = c.cfg.NATSURL
	}
	nc, err := bus.Connect(c.natsURL, "kvtier-coordinator", copts...)
	if err != nil {
		return err
	}
	c.nc = nc
	nc.SetErrorHandler(c.natsError)
	lnc, err := bus.Connect(c.natsURL, "kvtier-coordinator-lookup", copts...)
	if err != nil {
		return err
	}
	c.lnc = lnc
	lnc.SetErrorHandler(c.natsError)

	// HTTP listener before membership, so its real address is in Meta.
	if c.cfg.HTTPAddr != "" {
		ln, err := net.Listen("tcp", c.cfg.HTTPAddr)
		if err != nil {
			return fmt.Errorf("listen for HTTP on %s: %w", c.cfg.HTTPAddr, err)
		}
		c.httpAddr = ln.Addr().String()
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(c.reg, promhttp.HandlerOpts{Registry: c.reg}))
		mux.HandleFunc("/healthz", c.healthz)
		c.httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		c.wg.Add(1)
		go func() {
			defer c.wg.Done()
			if err := c.httpSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				c.log.Error("HTTP server failed", zap.Error(err))
			}
		}()
	}

	// Workers before subscriptions, so nothing received waits for them.
	c.ingest = make([]chan *nats.Msg, ingestWorkers)
	for i := range c.ingest {
		ch := make(chan *nats.Msg, ingestQueue)
		c.ingest[i] = ch
		c.ingestWG.Add(1)
		go c.ingestWorker(ch)
	}
	c.wg.Add(1)
	go c.rs.deadlineLoop()

	leaderOnly, err := c.subscribe()
	if err != nil {
		return err
	}
	c.log.Info("serving (unavailable until the index is open)", zap.String("nats", c.natsURL),
		zap.Duration("took", time.Since(t0)))
	if err := c.openIndex(); err != nil {
		if !c.cfg.RebuildIndex || !errors.Is(err, ErrCorruptIndex) {
			return err
		}
		if err := c.setIndexAside(err); err != nil {
			return err
		}
		if err := c.openIndex(); err != nil {
			return fmt.Errorf("open an empty index after setting the damaged one aside: %w", err)
		}
		c.rebuilding = true
	} else if c.cfg.RebuildIndex {
		c.log.Info("--rebuild-index: the index opened and verified; kept as it is")
	}
	c.phase.Store(phaseIndex) // handlers see c.idx from here on

	if err := c.joinCluster(advertise); err != nil {
		return err
	}
	c.phase.Store(phaseServing)
	// Replicated: raft starts on the open index (its FSM); the leader-only
	// handlers are subscribed on winning an election (replicated.go).
	if err := c.repl.start(leaderOnly); err != nil {
		return err
	}
	if g := c.cfg.StartupFenceGrace; g > 0 {
		c.wg.Add(1)
		go c.startupFence(g)
	}
	if c.rebuilding {
		c.resyncAllRanks()
	}
	c.log.Info("coordinator started", zap.String("nats", c.natsURL), zap.String("http", c.httpAddr),
		zap.String("gossip", c.member.LocalMember().Addr), zap.String("prefix", c.subj.Prefix),
		zap.Duration("took", time.Since(t0)))
	return nil
}

// Start-up phases (Coordinator.phase): which handlers may run.
const (
	phaseOpening int32 = iota // NATS up, index opening: every request answered unavailable
	phaseIndex                // index open and verified: all but the membership admin requests served
	phaseServing              // cluster joined: everything served
)

// gate wraps a handler of operation op so that it runs only once the
// coordinator has reached phase need; before that the request is answered
// with code unavailable and the retry hint startupRetryMS (a message with
// no reply subject, a heartbeat, is dropped and counted as no_inbox).
func (c *Coordinator) gate(op string, need int32, fn nats.MsgHandler) nats.MsgHandler {
	return func(m *nats.Msg) {
		if c.phase.Load() < need {
			what := "index opening: the coordinator serves once it is open and verified; retry"
			if need == phaseServing && c.phase.Load() >= phaseIndex {
				what = "joining the cluster: membership is not known yet; retry"
			}
			c.met.startupRefused.Inc()
			c.sendErrorRetry(op, m, wire.CodeUnavailable, what, startupRetryMS, replyError)
			return
		}
		fn(m)
	}
}

// openIndex opens the index in DataDir and verifies it: a coordinator
// restarted after a crash must not serve from a damaged index. What that
// checks (index/doc.go): Open decodes every record and checks the CRC-32C
// of every sealed one, so a record damaged on disk refuses the start
// (ErrCorruptIndex); Verify then checks the invariants (counters against a
// recount of the chunks, incarnations and sequences of every placement
// against its rank, no fenced L1 copy). Its comparison of the live state
// with a second load of the same bytes cannot fail at startup; it is there
// for admin verify on a running index.
func (c *Coordinator) openIndex() error {
	icfg := index.DefaultConfig()
	icfg.Path = filepath.Join(c.cfg.DataDir, IndexFile)
	icfg.Logger = c.cfg.Logger
	icfg.Registerer = c.reg
	icfg.MaxFileBytes = c.cfg.IndexMaxFileBytes
	icfg.HostSharedL1 = c.cfg.HostSharedL1
	if c.cfg.indexOpenHook != nil {
		c.cfg.indexOpenHook()
	}
	t0 := time.Now()
	idx, err := index.Open(icfg)
	if err != nil {
		if errors.Is(err, index.ErrCorrupt) || errors.Is(err, bolterr.ErrInvalid) ||
			errors.Is(err, bolterr.ErrChecksum) || errors.Is(err, bolterr.ErrVersionMismatch) {
			return fmt.Errorf("index %s does not decode; refusing to start (move it aside to start empty, the ranks resync): %w: %w",
				icfg.Path, ErrCorruptIndex, err)
		}
		return fmt.Errorf("open index: %w", err)
	}
	c.idx = idx
	rep, err := idx.Verify(c.ctx)
	if err != nil {
		c.log.Error("index verification failed at start; refusing to start", zap.String("path", icfg.Path),
			zap.Error(err))
		if errors.Is(err, index.ErrInconsistent) {
			return fmt.Errorf("index %s failed verification; refusing to start (move it aside to start empty, the ranks resync): %w: %w",
				icfg.Path, ErrCorruptIndex, err)
		}
		return fmt.Errorf("verify index %s: %w", icfg.Path, err)
	}
	c.log.Info("index opened and verified", zap.String("path", icfg.Path), zap.Int("namespaces", rep.Namespaces),
		zap.Int("ranks", rep.Ranks), zap.Int64("chunks", rep.Chunks), zap.Int64("placements", rep.Placements),
		zap.Int("log_records_replayed", rep.LogRecords), zap.Duration("took", time.Since(t0)))
	return nil
}

// setIndexAside renames the damaged index file (why says what failed)
// to IndexFile.damaged-<UTC time> in DataDir, durably, so the next open
// starts empty. The file is never deleted: an operator may inspect it.
func (c *Coordinator) setIndexAside(why error) error {
	if c.idx != nil { // opened, then failed verification
		_ = c.idx.Close()
		c.idx = nil
	}
	path := filepath.Join(c.cfg.DataDir, IndexFile)
	aside := path + ".damaged-" + time.Now().UTC().Format("20060102T150405.000000000Z")
	if err := os.Rename(path, aside); err != nil {
		return fmt.Errorf("--rebuild-index: set the damaged index %s aside: %w", path, err)
	}
	if d, err := os.Open(c.cfg.DataDir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	c.met.indexRebuilds.Inc()
	c.log.Warn("--rebuild-index: the damaged index was set aside; starting empty, every rank resyncs its inventory",
		zap.String("damaged", aside), zap.Error(why))
	return nil
}

// resyncAllRanks starts a resync of every live rankd member (after a
// rebuild of the index: the ranks' inventories refill it).
func (c *Coordinator) resyncAllRanks() {
	n := 0
	for _, m := range c.member.Members() {
		if m.Meta.Role != cluster.RoleRankd || m.State != cluster.StateAlive {
			continue
		}
		c.startResync(memberRank(m))
		n++
	}
	c.log.Info("--rebuild-index: resync asked of every live rankd", zap.Int("ranks", n))
}

// advertisedNATS turns the URL this process uses into one other hosts can
// use: an unspecified listen host (0.0.0.0) is replaced by host.
func advertisedNATS(u, host string) string {
	p, err := url.Parse(u)
	if err != nil || host == "" {
		return u
	}
	if ip := net.ParseIP(p.Hostname()); ip != nil && ip.IsUnspecified() {
		p.Host = net.JoinHostPort(host, p.Port())
		return p.String()
	}
	return u
}

// joinCluster starts the memberlist member with role coordinator and the
// NATS URL in its Meta, so a rankd needs only one seed address, and joins
// the seeds.
func (c *Coordinator) joinCluster(natsURL string) error {
	cc := c.cfg.Cluster
	cc.Insecure = cc.Insecure || c.cfg.Insecure // --insecure also allows plaintext gossip off loopback
	if cc.Logger == nil {
		cc.Logger = c.cfg.Logger
	}
	if cc.Registerer == nil {
		cc.Registerer = c.reg
	}
	var urls []string
	for _, u := range strings.Split(natsURL, ",") {
		host := cc.AdvertiseAddr
		if host == "" {
			if ip := net.ParseIP(cc.BindAddr); ip != nil && !ip.IsUnspecified() {
				host = cc.BindAddr
			}
		}
		urls = append(urls, advertisedNATS(strings.TrimSpace(u), host))
	}
	cc.Meta = cluster.Meta{Role: cluster.RoleCoordinator, NATS: urls, Admin: c.httpAddr, Incarnation: cluster.NewIncarnation()}
	cc.Meta.NATSSig = c.signNATS(cc.Meta.Incarnation, urls)
	if a := c.httpAddr; a != "" {
		if h, p, err := net.SplitHostPort(a); err == nil {
			if ip := net.ParseIP(h); ip != nil && ip.IsUnspecified() && cc.AdvertiseAddr != "" {
				cc.Meta.Admin = net.JoinHostPort(cc.AdvertiseAddr, p)
			}
		}
	}
	m, err := cluster.New(cc)
	if err != nil {
		return fmt.Errorf("cluster member: %w", err)
	}
	c.member = m
	c.msub = m.Subscribe(0)
	if err := m.Start(); err != nil {
		return err
	}
	// With a wildcard bind and no advertise address, the gossip address
	// memberlist picked is the best guess of the address others reach us at.
	if changed := c.fixAdvertisedNATS(urls); changed != nil {
		ctx, cancel := context.WithTimeout(c.ctx, c.cfg.JoinTimeout)
		err := m.UpdateMeta(ctx, func(meta *cluster.Meta) {
			meta.NATS, meta.NATSSig = changed, c.signNATS(meta.Incarnation, changed)
		})
		cancel()
		if err != nil && !errors.Is(err, cluster.ErrTimeout) {
			return fmt.Errorf("advertise NATS URL: %w", err)
		}
	}
	c.wg.Add(1)
	go c.membershipLoop()
	ctx, cancel := context.WithTimeout(c.ctx, c.cfg.JoinTimeout)
	defer cancel()
	n, err := m.Join(ctx)
	if err != nil {
		if errors.Is(err, cluster.ErrClosed) {
			return fmt.Errorf("join cluster: %w", err)
		}
		// The ranks find us anyway: a rankd rejoins its seeds whenever it
		// sees no live coordinator. Serving beats refusing to start.
		c.log.Error("no seed reachable; serving as a cluster of one until members join", zap.Strings("seeds", cc.Seeds),
			zap.Error(err))
	}
	c.log.Info("cluster joined", zap.Int("seeds_reached", n), zap.Strings("nats_advertised", m.LocalMember().Meta.NATS))
	return nil
}

// fixAdvertisedNATS returns urls with unspecified hosts replaced by the
// member's gossip host, or nil when none needed it.
func (c *Coordinator) fixAdvertisedNATS(urls []string) []string {
	host, _, err := net.SplitHostPort(c.member.LocalMember().Addr)
	if err != nil {
		return nil
	}
	var out []string
	changed := false
	for _, u := range urls {
		v := advertisedNATS(u, host)
		changed = changed || v != u
		out = append(out, v)
	}
	if !changed {
		return nil
	}
	return out
}

// subscribe registers every NATS handler. In replicated mode it
// subscribes only what every coordinator serves (admin members and raft)
// and returns the rest, which the raft leader subscribes (replicated.go).
func (c *Coordinator) subscribe() ([]leaderHandler, error) {
	type handler struct {
		subject string
		op      string
		fn      nats.MsgHandler
	}
	hs := []handler{
		{c.subj.EventsAll(), opEvents, c.dispatchBatch},
		{c.subj.HeartbeatAll(), "heartbeat", c.handleHeartbeat},
		// Engine subjects scoped to the caller's instance and per-rank
		// reports (C9): the NATS permissions say who may publish there.
		{c.subj.EngineCoordAll(wire.CoordRegister), wire.CoordRegister, c.handleRegister},
		{c.subj.EngineCoordAll(wire.CoordLookup), wire.CoordLookup, c.handleLookup},
		{c.subj.EngineCoordAll(wire.CoordRestoreBegin), wire.CoordRestoreBegin, c.rs.handleBegin},
		{c.subj.ReportAll(), wire.CoordRestoreReport, c.rs.handleReport},
		{c.subj.EngineCoordAll(wire.CoordRestoreWait), wire.CoordRestoreWait, c.rs.handleWait},
		{c.subj.Admin(wire.AdminMembers), wire.AdminMembers, c.handleMembers},
		{c.subj.Admin(wire.AdminRanks), wire.AdminRanks, c.handleRanks},
		{c.subj.Admin(wire.AdminObject), wire.AdminObject, c.handleObject},
		{c.subj.Admin(wire.AdminNamespaces), wire.AdminNamespaces, c.handleNamespaces},
		{c.subj.Admin(wire.AdminRestores), wire.AdminRestores, c.rs.handleHistory},
		{c.subj.Admin(wire.AdminVerify), wire.AdminVerify, c.handleVerify},
		{c.subj.Admin(wire.AdminRankReset), wire.AdminRankReset, c.handleRankReset},
	}
	if r, ok := c.repl.(*replicated); ok {
		hs = append(hs, []handler{
			{c.subj.Admin(wire.AdminRaft), wire.AdminRaft, r.handleRaftStatus},
			{c.subj.Admin(wire.AdminRaftVerify), wire.AdminRaftVerify, r.handleRaftVerify},
			{c.subj.Admin(wire.AdminRaftAddVoter), wire.AdminRaftAddVoter, r.handleRaftChange(wire.AdminRaftAddVoter)},
			{c.subj.Admin(wire.AdminRaftRemove), wire.AdminRaftRemove, r.handleRaftChange(wire.AdminRaftRemove)},
		}...)
	}
	everyNode := map[string]bool{c.subj.Admin(wire.AdminMembers): true, c.subj.Admin(wire.AdminRaft): true,
		c.subj.Admin(wire.AdminRaftVerify): true}
	var leaderOnly []leaderHandler
	if c.cfg.Insecure {
		// Clients from before C9 use the unscoped subjects.
		hs = append(hs, []handler{
			{c.subj.Coord(wire.CoordRegister), wire.CoordRegister, c.handleRegister},
			{c.subj.Coord(wire.CoordLookup), wire.CoordLookup, c.handleLookup},
			{c.subj.Coord(wire.CoordRestoreBegin), wire.CoordRestoreBegin, c.rs.handleBegin},
			{c.subj.Coord(wire.CoordRestoreReport), wire.CoordRestoreReport, c.rs.handleReport},
			{c.subj.Coord(wire.CoordRestoreWait), wire.CoordRestoreWait, c.rs.handleWait},
		}...)
	}
	lookups := map[string]bool{c.subj.EngineCoordAll(wire.CoordLookup): true, c.subj.Coord(wire.CoordLookup): c.cfg.Insecure}
	for range lookupSubscribers - 1 {
		for subject, on := range lookups {
			if on {
				hs = append(hs, handler{subject, wire.CoordLookup, c.handleLookup})
			}
		}
	}
	// The membership admin requests read the member, which exists only
	// once the cluster is joined; the rest need the index.
	needs := map[string]int32{wire.AdminMembers: phaseServing, wire.AdminRanks: phaseServing}
	for _, h := range hs {
		need := phaseIndex
		if n, ok := needs[h.op]; ok {
			need = n
		}
		fn := c.gate(h.op, need, h.fn)
		if c.cfg.Raft.Enabled() && !everyNode[h.subject] {
			lh := leaderHandler{subject: h.subject, fn: fn}
			if lookups[h.subject] {
				lh.queue = lookupQueue
			}
			leaderOnly = append(leaderOnly, lh)
			continue
		}
		var sub *nats.Subscription
		var err error
		if lookups[h.subject] {
			sub, err = c.lnc.QueueSubscribe(h.subject, lookupQueue, fn)
		} else {
			sub, err = c.nc.Subscribe(h.subject, fn)
		}
		if err != nil {
			return nil, fmt.Errorf("subscribe %s: %w", h.subject, err)
		}
		// Bursts of event batches wait in NATS's client buffer rather than
		// being dropped as a slow consumer: up to 1 GiB, unbounded count.
		if err := sub.SetPendingLimits(-1, 1<<30); err != nil {
			return nil, fmt.Errorf("pending limits of %s: %w", h.subject, err)
		}
		c.subs = append(c.subs, sub)
	}
	if err := c.lnc.Flush(); err != nil {
		return nil, fmt.Errorf("flush the lookup connection: %w", err)
	}
	return leaderOnly, c.nc.Flush()
}

// natsError counts and logs NATS asynchronous errors: a slow consumer
// drops messages, and each one is a request that gets no reply (C8). A
// reply refused by the requester's allow_responses window (C9) loses
// nothing: the request was delivered twice and its first answer went out,
// or the requester had given up. It is counted by its kind and logged at
// Warn.
func (c *Coordinator) natsError(_ *nats.Conn, sub *nats.Subscription, err error) {
	kind := natsErrorKind(err)
	c.met.natsErrors.WithLabelValues(kind).Inc()
	subject := ""
	if sub != nil {
		subject = sub.Subject
	}
	if kind == natsErrReplyPermission {
		c.log.Warn("NATS refused a reply: the request was already answered (a duplicate) or its response window expired",
			zap.String("kind", kind), zap.Error(err))
		return
	}
	c.met.dropped.Inc()
	c.log.Error("NATS error; requests may have been dropped", zap.String("subject", subject), zap.String("kind", kind), zap.Error(err))
}

// Kinds of NATS asynchronous errors (natsErrorKind), the kind label of
// kvtier_coord_nats_errors_total.
const (
	natsErrReplyPermission = "reply_permission"
	natsErrPermission      = "permission"
	natsErrSlowConsumer    = "slow_consumer"
	natsErrOther           = "other"
)

// natsErrorKind classifies a NATS asynchronous error. A permission
// violation whose refused publish went to a reply inbox ("_INBOX." and
// more: the server's text is "Permissions Violation for Publish to
// \"<subject>\"") is reply_permission; any other violation is permission.
func natsErrorKind(err error) string {
	switch {
	case err == nil:
		return natsErrOther
	case errors.Is(err, nats.ErrSlowConsumer):
		return natsErrSlowConsumer
	case !errors.Is(err, nats.ErrPermissionViolation):
		return natsErrOther
	}
	const marker = "publish to "
	msg := err.Error()
	i := strings.LastIndex(strings.ToLower(msg), marker)
	if i < 0 {
		return natsErrPermission
	}
	quoted := msg[i+len(marker):]
	q, qerr := strconv.QuotedPrefix(quoted)
	if qerr != nil || q != quoted { // unquoted, or more follows ("using reply subject ...")
		return natsErrPermission
	}
	subject, qerr := strconv.Unquote(q)
	if qerr != nil || !strings.HasPrefix(subject, "_INBOX.") || len(subject) == len("_INBOX.") {
		return natsErrPermission
	}
	return natsErrReplyPermission
}

// Health is what /healthz reports: one word or line per dependency, and
// Status "ok" only when every one of them is well.
type Health struct {
	Status string `json:"status"` // "ok" or "unavailable"
	// Serving: "serving", or "starting", "shut down".
	Serving string `json:"serving"`
	// Index: "ok", or "failed: <the commit error>" once the index refuses
	// writes for good (every batch gets code internal until a restart).
	Index string `json:"index"`
	// NATS: "connected", or the connection's state.
	NATS string `json:"nats"`
	// Cluster: "alive" while this coordinator's memberlist member is alive
	// (it gossips, sees deaths and fences), or its state.
	Cluster string `json:"cluster"`
	// Raft, in replicated mode only: "leader", "follower of <id>", or
	// "no leader" / "candidate" / "shutdown" (unavailable: the cluster
	// cannot commit, as far as this node can tell).
	Raft string `json:"raft,omitempty"`
}

// Health checks the coordinator's dependencies (issue 11.6).
func (c *Coordinator) Health() Health {
	h := Health{Serving: "serving", Index: "ok", NATS: "connected", Cluster: "alive"}
	// Atomics, not lifeMu: Start holds that while the index opens, and
	// /healthz answers meanwhile.
	phase := c.phase.Load()
	ok := true
	switch {
	case c.shut.Load():
		h.Serving, ok = "shut down", false
	case phase < phaseServing:
		h.Serving, ok = "starting", false
	}
	switch {
	case phase < phaseIndex:
		h.Index, ok = "opening", false
	case c.idx == nil:
		h.Index, ok = "not open", false
	case c.idx.Failed() != nil:
		h.Index, ok = "failed: "+c.idx.Failed().Error(), false
	}
	switch {
	case c.nc == nil:
		h.NATS, ok = "not connected", false
	case !c.nc.IsConnected():
		h.NATS, ok = natsStatus(c.nc.Status()), false
	}
	switch {
	case phase < phaseServing || c.member == nil:
		h.Cluster, ok = "not joined", false
	default:
		if st := c.member.LocalMember().State; st != cluster.StateAlive {
			h.Cluster, ok = st.String(), false
		}
	}
	raftLine, well := c.repl.health()
	h.Raft, ok = raftLine, ok && well
	h.Status = "ok"
	if !ok {
		h.Status = "unavailable"
	}
	return h
}

func natsStatus(s nats.Status) string {
	switch s {
	case nats.DISCONNECTED:
		return "disconnected"
	case nats.RECONNECTING:
		return "reconnecting"
	case nats.CLOSED:
		return "closed"
	case nats.DRAINING_SUBS, nats.DRAINING_PUBS:
		return "draining"
	case nats.CONNECTING:
		return "connecting"
	}
	return fmt.Sprintf("status %d", s)
}

// healthz answers 200 with Health as JSON while every dependency is well,
// 503 with the same body otherwise.
func (c *Coordinator) healthz(w http.ResponseWriter, _ *http.Request) {
	h := c.Health()
	body, _ := json.Marshal(h)
	w.Header().Set("Content-Type", "application/json")
	if h.Status != "ok" {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_, _ = w.Write(append(body, '\n'))
}

// Run starts the coordinator unless it is started, serves until ctx ends,
// then shuts it down.
func (c *Coordinator) Run(ctx context.Context) error {
	c.lifeMu.Lock()
	started := c.started
	c.lifeMu.Unlock()
	if !started {
		if err := c.Start(); err != nil {
			return err
		}
	}
	select {
	case <-ctx.Done():
	case <-c.done:
	}
	c.Shutdown()
	return nil
}

// Shutdown stops the coordinator, in this order:
//
//  1. stop accepting requests: drain every NATS subscription, which waits
//     for the handlers already running, so in-flight index commits finish
//     and are acknowledged;
//  2. answer restore waiters still pending with code unavailable;
//  3. stop the workers (ingest, resync, deadline) and wait for them;
//  4. leave the memberlist cluster (bounded by LeaveTimeout), so the ranks
//     see "left", not "dead", then stop the member and the membership loop;
//  5. close the NATS connection and stop the HTTP server;
//  6. close the index (it commits what is queued and folds its log);
//  7. shut down the embedded NATS server.
//
// It is idempotent and blocks until every goroutine has exited.
func (c *Coordinator) Shutdown() {
	c.lifeMu.Lock()
	if c.closed {
		c.lifeMu.Unlock()
		<-c.done
		return
	}
	c.closed = true
	c.shut.Store(true)
	c.lifeMu.Unlock()
	defer close(c.done)
	t0 := time.Now()

	// 1. Drain subscriptions (in replicated mode the leader's too, and no
	// more are made).
	subs := append(slices.Clip(c.subs), c.repl.closeGate()...)
	for _, s := range subs {
		if err := s.Drain(); err != nil {
			c.log.Warn("drain subscription", zap.String("subject", s.Subject), zap.Error(err))
		}
	}
	for _, s := range subs {
		if !waitDrained(s, 10*time.Second) {
			c.log.Warn("subscription did not drain in time; unsubscribing", zap.String("subject", s.Subject))
			_ = s.Unsubscribe()
		}
	}
	// Every batch received is queued; let the ingest workers apply and
	// acknowledge all of it.
	c.ingestMu.Lock()
	c.ingestClosed = true
	for _, ch := range c.ingest {
		close(ch)
	}
	c.ingestMu.Unlock()
	c.ingestWG.Wait()
	c.drainMu.Lock()
	c.draining = true
	c.drainMu.Unlock()
	// Replicated: raft stops here (it does not leave the configuration),
	// before the index it applies to closes. A fence or resync still
	// waiting on it fails.
	c.repl.shutdown()

	// 2. Pending restore waits.
	c.rs.close()

	// 3. Workers.
	c.cancel()
	// The membership loop ends when the member shuts down (step 4); wait
	// for everything else first by stopping the member before wg.Wait.

	// 4. Membership.
	if c.member != nil {
		if err := c.member.Leave(c.cfg.LeaveTimeout); err != nil {
			c.log.Warn("leave cluster", zap.Error(err))
		}
		if err := c.member.Shutdown(); err != nil {
			c.log.Warn("shut down cluster member", zap.Error(err))
		}
	}

	// 5. NATS connections, HTTP.
	if c.lnc != nil {
		if err := c.lnc.Flush(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
			c.log.Debug("final NATS flush of the lookup connection", zap.Error(err))
		}
		c.lnc.Close()
	}
	if c.nc != nil {
		if err := c.nc.Flush(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
			c.log.Debug("final NATS flush", zap.Error(err))
		}
		c.nc.Close()
	}
	if c.httpSrv != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if err := c.httpSrv.Shutdown(ctx); err != nil {
			c.log.Warn("HTTP shutdown", zap.Error(err))
		}
		cancel()
	}
	c.wg.Wait()

	// 6. Index.
	if c.idx != nil {
		if err := c.idx.Close(); err != nil {
			c.log.Error("close index", zap.Error(err))
		}
	}
	// 7. Embedded NATS.
	if c.nsrv != nil {
		c.nsrv.Shutdown()
	}
	c.reg.Unregister(c.met)
	c.log.Info("coordinator shut down", zap.Duration("took", time.Since(t0)))
}

// waitDrained waits until a draining subscription has delivered everything
// it had and closed; false after timeout.
func waitDrained(s *nats.Subscription, timeout time.Duration) bool {
	ch := s.StatusChanged(nats.SubscriptionClosed)
	if !s.IsValid() {
		return true
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-ch:
		return true
	case <-t.C:
		return !s.IsValid()
	}
}

// NATSURL is the NATS URL the coordinator uses (the embedded server's, or
// the configured external one). Valid after Start.
func (c *Coordinator) NATSURL() string { return c.natsURL }

// HTTPAddr is the address /metrics and /healthz are served on, "" when
// disabled. Valid after Start.
func (c *Coordinator) HTTPAddr() string { return c.httpAddr }

// GossipAddr is the memberlist address (host:port) ranks use as their
// seed. Valid after Start.
func (c *Coordinator) GossipAddr() string {
	if c.member == nil {
		return ""
	}
	return c.member.LocalMember().Addr
}

// Index is the coordinator's placement index, for in-process inspection
// (tests, benchmarks). Valid after Start, until Shutdown.
func (c *Coordinator) Index() *index.Index { return c.idx }

// Done is closed once Shutdown has finished.
func (c *Coordinator) Done() <-chan struct{} { return c.done }
