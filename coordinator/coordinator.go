package coordinator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/durable"
	"github.com/kvtier/kvtier/internal/group"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
)

// Coordinator is one running coordinator. New builds it, Start brings it up
// (index, NATS, membership, subscriptions, HTTP), Shutdown takes it down;
// Run does Start, waits for its context and shuts down.
//
// Goroutines it owns, all started through one of its two groups
// (internal/group) and stopped by Shutdown: ingestGroup holds the ingest
// workers and their ackers, which Shutdown drains first; goroutines holds
// the rest, one resync worker per rank being resynced, the membership
// loop, the restore deadline loop, the death check (with its liveness
// probes), the leader's fence sweep, the KV event publisher (kvevents.go,
// with Config.KVEvents) and the HTTP server. Both refuse to
// start anything once Shutdown has closed them. NATS delivers requests on
// its own per-subscription goroutines, which Shutdown drains.
type Coordinator struct {
	cfg  Config
	log  *zap.Logger
	subj wire.Subjects
	reg  *prometheus.Registry
	met  *metrics
	// share is the share groups' state (share.go); read-only.
	share *shareState

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
	// ingestGroup starts the ingest workers and their ackers; Shutdown
	// closes and waits for it once the queues are closed (step 1).
	ingestGroup *group.Group

	ctx    context.Context // ended by Shutdown: workers stop
	cancel context.CancelFunc
	// goroutines starts every other goroutine of this coordinator;
	// Shutdown closes it with draining (step 1) and waits for it (step 5).
	goroutines *group.Group
	// draining is set once Shutdown has begun: no new resyncs start.
	drainMu  sync.Mutex // guards draining and resyncing
	draining bool
	// resyncing holds the ranks with a resync worker running (at most one
	// per rank); true asks the worker for one more resync when it is done.
	resyncing map[wire.Rank]bool
	// testInvStep, when set by a test, sees the objects of every page a
	// resync hands to the index, before it does (resync.go).
	testInvStep func(objects int)

	hb heartbeats
	// hbSub is the heartbeat subscription (standalone: from the start;
	// replicated: the leader's, the last one made): deaths.go reads its
	// backlog.
	hbSub atomic.Pointer[nats.Subscription]
	// lookups answers lookups and restore begins (made by subscribe,
	// closed by Shutdown once the subscriptions are drained).
	lookups *lookupWorkPool
	// deaths holds the ranks gossip reports gone, until NATS confirms it
	// (deaths.go).
	deaths *deaths

	geo geometries // registered namespaces' geometry: see limits.go
	// budgets: per-rank placement budgets and event rates (budget.go).
	budgets rankBudgets
	// resyncLimit paces resync starts (ResyncRate, ResyncBurst); used
	// under drainMu.
	resyncLimit *rate.Limiter

	auth authState

	// kv is the KV event publisher for routers (kvevents.go); nil unless
	// Config.KVEvents.
	kv *kvEvents

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
	// rebuilding: Start set a damaged index aside (RebuildIndex) or
	// created a new one (a lost data directory); every rankd that joins is
	// asked for its inventory. Written before any handler runs.
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

// lookupWorkers is the number of goroutines (lookupWorkPool) that answer
// lookups and restore plans concurrently. They read the index's published
// state under its read lock; more than the cores of a small machine buys
// nothing.
const lookupWorkers = 4

// lookupQueue is the NATS queue group of the lookup subscriptions (raft:
// a leader that has just lost the lead and its successor may both hold
// one for a moment; each request goes to one).
const lookupQueue = "kvtier-lookup"

// New validates cfg exactly as given (build it from DefaultConfig: zero
// means zero, nothing is filled in behind Validate's back) and builds a
// coordinator. It does no I/O. A nil Registry is not a default but a
// registry of the coordinator's own (Config.Registry).
func New(cfg Config) (*Coordinator, error) {
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
		hb:        newHeartbeats(),
		deaths:    newDeaths(),

		ingestGroup: group.New("coordinator.ingest"),
		goroutines:  group.New("coordinator"),
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.resyncLimit = rate.NewLimiter(rate.Limit(cfg.ResyncRate), cfg.ResyncBurst)
	c.rs = newRestores(c)
	c.live = newLiveTable()
	c.auth.refused = newRefused()
	c.share = newShareState(cfg.ShareGroups)
	if err := c.reg.Register(c.share.met); err != nil {
		return nil, fmt.Errorf("register coordinator metrics: %w: %w", ErrConfig, err)
	}
	if err := c.reg.Register(c.met); err != nil {
		return nil, fmt.Errorf("register coordinator metrics: %w: %w", ErrConfig, err)
	}
	if err := c.reg.Register(c.auth.refused); err != nil {
		return nil, fmt.Errorf("register coordinator metrics: %w: %w", ErrConfig, err)
	}
	if err := c.reg.Register(c.deaths.met); err != nil {
		return nil, fmt.Errorf("register coordinator metrics: %w: %w", ErrConfig, err)
	}
	if cfg.KVEvents {
		c.kv = newKVEvents(cfg.KVEventsQueue)
		if err := c.reg.Register(c.kv.met); err != nil {
			return nil, fmt.Errorf("register coordinator metrics: %w: %w", ErrConfig, err)
		}
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
	if err := durable.MkdirAll(c.cfg.DataDir, 0o700); err != nil { // a first start's index.db must not lose its directory
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
	lopts, lurl := copts, c.natsURL
	if c.nsrv != nil {
		// The lookups' connection to its embedded server goes through
		// memory: no TCP and no TLS for each lookup and its reply (issue
		// 26.5: on the H200's host, idle p99 1.47-1.50x a bare
		// request/reply over TLS before, 1.19-1.23x in process), the
		// credentials still checked by the server. Not the main
		// connection, which carries the ingest: its volume measured 3-7 %
		// lower through the in-process pipe (a synchronous handoff) than
		// over loopback on the VM. The URL only names the server: a
		// tls:// one would make the client insist on TLS over the pipe
		// and fail its handshake (inProcessWriteBound).
		lopts = []nats.Option{nats.InProcessServer(c.nsrv), nats.FlusherTimeout(inProcessWriteBound)}
		lurl = inProcessURL
		if !c.cfg.Insecure {
			lopts = append(lopts, auth.ClientOptions(auth.Identity{Role: auth.RoleCoordinator}, c.auth.seed)...)
		}
	}
	lnc, err := bus.Connect(lurl, "kvtier-coordinator-lookup", lopts...)
	if err != nil {
		return fmt.Errorf("the lookups' connection: %w", err)
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
		// Start holds lifeMu, so Shutdown cannot have closed the group:
		// a refusal here is a bug, reported as the coordinator closed.
		if !c.goroutines.Go("http", func() {
			if err := c.httpSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				c.log.Error("HTTP server failed", zap.Error(err))
			}
		}) {
			_ = ln.Close()
			return fmt.Errorf("start the HTTP server: %w", ErrClosed)
		}
	}

	// Workers before subscriptions, so nothing received waits for them.
	c.ingest = make([]chan *nats.Msg, ingestWorkers)
	for i := range c.ingest {
		ch := make(chan *nats.Msg, ingestQueue)
		c.ingest[i] = ch
		acks := make(chan ingestJob, ingestQueue)
		if !c.ingestGroup.Go("ingest-acker", func() { c.ingestAcker(acks) }) {
			return fmt.Errorf("start the ingest workers: %w", ErrClosed)
		}
		if !c.ingestGroup.Go("ingest-worker", func() { c.ingestWorker(ch, acks) }) {
			close(acks) // its acker ends
			return fmt.Errorf("start the ingest workers: %w", ErrClosed)
		}
	}
	if !c.goroutines.Go("restore-deadlines", c.rs.deadlineLoop) {
		return fmt.Errorf("start the restore deadline loop: %w", ErrClosed)
	}

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
	} else if c.idx.Created() && c.cfg.Raft.ID == "" {
		// A new index: a first start, or a lost data directory (issue
		// 29.2). Every live rankd is asked for its inventory, as after a
		// rebuild: on a first start there is nothing to ask for and each
		// inventory is empty. (A replica's index is filled by raft.)
		c.log.Warn("new empty index: every live rankd is asked for its inventory", zap.String("index_id", c.idx.ID()),
			zap.String("path", filepath.Join(c.cfg.DataDir, IndexFile)))
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
		if !c.goroutines.Go("startup-fence", func() { c.startupFence(g) }) {
			return fmt.Errorf("start the startup fence: %w", ErrClosed)
		}
	}
	if !c.goroutines.Go("death-check", c.deathLoop) {
		return fmt.Errorf("start the death check: %w", ErrClosed)
	}
	if c.kv != nil {
		if !c.goroutines.Go("kv-events", c.kvWorker) {
			return fmt.Errorf("start the KV event publisher: %w", ErrClosed)
		}
		c.kvWake() // the first snapshot, once this coordinator serves
	}
	if c.rebuilding {
		c.resyncAllRanks()
	}
	c.log.Info("coordinator started", zap.String("nats", c.natsURL), zap.String("http", c.httpAddr),
		zap.String("gossip", c.member.LocalMember().Addr), zap.String("prefix", c.subj.Prefix),
		zap.Duration("took", time.Since(t0)))
	return nil
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
//     and are acknowledged; drain the ingest workers; from here on no
//     goroutine starts (both groups are closed) and no resync begins;
//  2. answer restore waiters still pending with code unavailable;
//  3. stop the workers (resync, deadline, death check);
//  4. leave the memberlist cluster (bounded by LeaveTimeout), so the ranks
//     see "left", not "dead", then stop the member and the membership loop;
//  5. close the NATS connection and stop the HTTP server, then wait for
//     every goroutine of the coordinator;
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
	if c.lookups != nil {
		c.lookups.close() // what the subscriptions handed it is answered
	}
	// Every batch received is queued; let the ingest workers apply and
	// acknowledge all of it.
	c.ingestMu.Lock()
	c.ingestClosed = true
	for _, ch := range c.ingest {
		close(ch)
	}
	c.ingestMu.Unlock()
	c.ingestGroup.CloseAndWait()
	c.drainMu.Lock()
	c.draining = true
	c.drainMu.Unlock()
	// No goroutine starts from here on: a resync, a fence sweep or a
	// liveness probe asked for now is refused (and dropped: the next
	// leader or the restarted coordinator does it), never left running
	// past the wait in step 5.
	c.goroutines.Close()
	// Replicated: raft stops here (it does not leave the configuration),
	// before the index it applies to closes. A fence or resync still
	// waiting on it fails.
	c.repl.shutdown()

	// 2. Pending restore waits.
	c.rs.close()

	// 3. Workers.
	c.cancel()
	// The membership loop ends when the member shuts down (step 4); wait
	// for everything else first by stopping the member before the wait.

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
	c.goroutines.Wait()

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
	c.reg.Unregister(c.deaths.met)
	if c.kv != nil {
		c.reg.Unregister(c.kv.met)
	}
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

// inProcessURL names the embedded server to the lookups' in-process
// connection: nats://, whatever the server's own scheme (a tls:// one makes
// nats.go insist on TLS over the pipe). A variable for the test that
// proves a bad handshake over the pipe fails Start promptly.
var inProcessURL = "nats://in-process"

// inProcessWriteBound bounds each write on the lookups' in-process pipe
// (nats.go's FlusherTimeout, a minute by default). A pipe is synchronous:
// when a connect fails, nats.go's close flushes into a pipe whose server
// end is itself blocked writing (seen with a TLS handshake over it), so
// Start stalled for that minute without a word; a write that takes this
// long in process means the server is stuck anyway.
var inProcessWriteBound = 5 * time.Second
