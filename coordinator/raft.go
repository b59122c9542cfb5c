package coordinator

// Replicated mode: several coordinators keep one index through
// hashicorp/raft (issue 16). With RaftConfig.ID empty none of this runs:
// a single coordinator takes exactly the path it always took (c.rn is nil;
// each mutation site tests that one pointer).
//
// # What is replicated
//
// Every request that mutates the index is a raft log entry, and nothing
// else writes it: event batches (the wire.Batch binary encoding), rank
// inventories (resyncs), fences (memberlist deaths and leaves, new
// incarnations' old L1 copies are fenced by the batch itself, the startup
// and leader sweeps), namespace registrations and operator rank resets.
// Restore state (plans, reports, verdicts) is not: it lives on the leader
// only, and restores in flight at a failover end failed (below). An entry
// is one command byte and its payload; it carries no time and no random
// value, and the index's apply (index/txn.go) reads neither, so every
// replica that applies the same entries in the same order holds the same
// index, byte for byte in index.Dump (rank ids are assigned in apply order).
//
// # Applying it
//
// The state machine is the index itself. raft hands committed entries to
// raftFSM.ApplyBatch (raft.BatchingFSM, up to MaxAppendEntries at once),
// which queues each into the index's committer (index.ApplyReplicated)
// without waiting: the committer's group commit merges many entries into
// one bbolt transaction, and while bbolt fsyncs one group raft already
// delivers the next, so a replica pays two fsyncs per group of batches
// (raft log, index), not per batch. The raft index of the last entry of a
// group is written in the same bbolt transaction as the group (meta
// "raft_applied"); on a restart raft replays its log from its last
// snapshot and the index skips every entry at or below that index, so no
// entry is applied twice (a replayed fence would otherwise fence a rank
// that has resynced since).
//
// # Snapshots
//
// raft's FSM.Snapshot takes an index.Snapshot at a barrier of the
// committer (a bbolt read transaction: a consistent copy of the whole file
// as of the last entry raft handed over), and Persist streams it with
// tx.WriteTo behind a header naming its raft index. Restore writes the
// stream beside the index file, fsyncs and load-checks it, and replaces
// and reopens the index; a snapshot no newer than the index (raft restores
// its latest snapshot at every start) is read and dropped. The log is
// compacted by raft after each snapshot (SnapshotThreshold,
// SnapshotInterval, TrailingLogs); a follower too far behind gets the
// snapshot (InstallSnapshot) and then the trailing log.
//
// # What an acknowledgement means (C7)
//
// An event batch is acknowledged only after raft committed its entry on a
// majority of the voters (each fsynced its raft log) AND the leader's
// index applied and committed it to its own bbolt: the acker waits on the
// raft future, then on the index request that entry became. A leader
// that loses its quorum cannot commit; raft deposes it after
// LeaderLeaseTimeout and every future still waiting fails (the sender gets
// code unavailable and resends to the new leader: a batch is idempotent by
// its sequence numbers).
//
// # Leadership
//
// Only the leader serves the subjects that mutate or decide: events,
// heartbeats, engine register/lookup/restore, restore reports and every
// admin subject but members and raft (which every coordinator answers).
// It subscribes them when raft makes it leader, after a barrier (its index
// holds every entry of earlier terms), and unsubscribes them when it loses
// leadership; so engines and rankds reach whichever coordinator leads
// through the same subjects, with no configuration change. A COMPLETE
// verdict is sent only after raft.VerifyLeader succeeded (a deposed leader
// that has not noticed yet cannot confirm a restore); memberlist deaths are
// acted on by the leader only, and the fence goes through raft. Restores
// in flight when a leader loses leadership get code unavailable on their
// waits; on the new leader their reports and waits get not_found: either
// way the engine recomputes. No restore completes without every report on
// the leader that decides it.

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// RaftKeyFile is the pre-shared key of the raft port in the credentials
// directory (one base64 key of 16, 24 or 32 bytes; mode 0600).
const RaftKeyFile = "raft.key"

// RaftPeer is one voter of the initial configuration.
type RaftPeer struct {
	ID   string
	Addr string // host:port of its raft port
}

// RaftConfig configures replicated mode. With ID empty (the default) the
// coordinator runs alone, exactly as without any of this.
type RaftConfig struct {
	// ID is this server's raft id, unique in the cluster. Default "" (off).
	ID string
	// Bind is the raft TCP listen address. Default "127.0.0.1:9480".
	Bind string
	// Advertise is the address peers reach this node at. Default "": the
	// bind address (which must then not be 0.0.0.0).
	Advertise string
	// Dir holds the raft log and stable store (raft.db) and the snapshots.
	// Created 0700; a symlink or a directory open to others is refused.
	// Required with ID; no default. Use a local disk with working fsync.
	Dir string
	// Peers is the initial voter set, this node included, used only with
	// Bootstrap on a node with no raft state. Give every node the same
	// list.
	Peers []RaftPeer
	// Bootstrap bootstraps the cluster from Peers when this node has no
	// raft state yet (ignored once it has). Default false. Safe to set on
	// every node of a new cluster with the same Peers.
	Bootstrap bool
	// Key authenticates the raft port (see raftnet.go); 16 to 64 bytes.
	// Default nil: read from KeyFile.
	Key []byte
	// KeyFile is read when Key is nil. Default "": <CredsDir>/raft.key.
	KeyFile string

	// HeartbeatTimeout and ElectionTimeout: a follower that hears nothing
	// from the leader this long starts an election. Defaults 500 ms each.
	// Shorter fails over sooner (the target is 2 s p99); too short on a
	// loaded machine causes needless elections.
	HeartbeatTimeout time.Duration
	ElectionTimeout  time.Duration
	// LeaderLeaseTimeout: a leader that cannot reach a quorum this long
	// steps down, and the acknowledgements it was waiting for fail.
	// Default 250 ms; must be <= HeartbeatTimeout.
	LeaderLeaseTimeout time.Duration
	// CommitTimeout is how long the leader waits before it sends a
	// heartbeat carrying the commit index. Default 5 ms: lower commit
	// latency for followers' state, more packets.
	CommitTimeout time.Duration
	// MaxAppendEntries bounds the entries per append and per batch handed
	// to the index. Default 256 (raft's maximum is 1024).
	MaxAppendEntries int
	// SnapshotThreshold is the number of log entries since the last
	// snapshot that triggers one; SnapshotInterval how often it is
	// checked; TrailingLogs how many entries are kept after a snapshot
	// (a follower behind by fewer catches up from the log, not the
	// snapshot). Defaults 8192, 30 s, 10240.
	SnapshotThreshold uint64
	SnapshotInterval  time.Duration
	TrailingLogs      uint64
	// SnapshotRetain is how many snapshots are kept on disk. Default 2.
	SnapshotRetain int
	// ApplyTimeout bounds the wait for raft to take an entry (not its
	// commit). Default 5 s.
	ApplyTimeout time.Duration
}

// DefaultRaftConfig returns replicated mode's defaults (ID "": off).
func DefaultRaftConfig() RaftConfig {
	return RaftConfig{
		Bind:               "127.0.0.1:9480",
		HeartbeatTimeout:   500 * time.Millisecond,
		ElectionTimeout:    500 * time.Millisecond,
		LeaderLeaseTimeout: 250 * time.Millisecond,
		CommitTimeout:      5 * time.Millisecond,
		MaxAppendEntries:   256,
		SnapshotThreshold:  8192,
		SnapshotInterval:   30 * time.Second,
		TrailingLogs:       10240,
		SnapshotRetain:     2,
		ApplyTimeout:       5 * time.Second,
	}
}

// Enabled reports whether replicated mode is on.
func (rc *RaftConfig) Enabled() bool { return rc.ID != "" }

// Validate checks the raft rules; nothing when replicated mode is off.
func (rc *RaftConfig) Validate() error {
	if !rc.Enabled() {
		return nil
	}
	if strings.ContainsAny(rc.ID, " \t\r\n,=") {
		return fmt.Errorf("raft id %q must not contain spaces, ',' or '=': %w", rc.ID, ErrConfig)
	}
	if rc.Dir == "" {
		return fmt.Errorf("raft dir must be set with a raft id: %w", ErrConfig)
	}
	for _, a := range []struct{ name, v string }{{"raft bind", rc.Bind}, {"raft advertise", rc.Advertise}} {
		if a.v == "" && a.name == "raft advertise" {
			continue
		}
		if _, _, err := net.SplitHostPort(a.v); err != nil {
			return fmt.Errorf("%s address %q must be host:port: %w", a.name, a.v, ErrConfig)
		}
	}
	seen := map[string]bool{}
	self := false
	for _, p := range rc.Peers {
		if p.ID == "" || seen[p.ID] {
			return fmt.Errorf("raft peer id %q is empty or listed twice: %w", p.ID, ErrConfig)
		}
		seen[p.ID] = true
		if _, _, err := net.SplitHostPort(p.Addr); err != nil {
			return fmt.Errorf("raft peer %s address %q must be host:port: %w", p.ID, p.Addr, ErrConfig)
		}
		self = self || p.ID == rc.ID
	}
	if rc.Bootstrap && !self {
		return fmt.Errorf("raft bootstrap: the peers %v must include this node %q: %w", rc.Peers, rc.ID, ErrConfig)
	}
	if rc.Key != nil && (len(rc.Key) < 16 || len(rc.Key) > 64) {
		return fmt.Errorf("raft key is %d bytes, want 16..64: %w", len(rc.Key), ErrConfig)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"raft heartbeat timeout", rc.HeartbeatTimeout}, {"raft election timeout", rc.ElectionTimeout},
		{"raft leader lease timeout", rc.LeaderLeaseTimeout}, {"raft commit timeout", rc.CommitTimeout},
		{"raft snapshot interval", rc.SnapshotInterval}, {"raft apply timeout", rc.ApplyTimeout},
	} {
		if d.v < 5*time.Millisecond {
			return fmt.Errorf("%s %v must be >= 5ms: %w", d.name, d.v, ErrConfig)
		}
	}
	if rc.LeaderLeaseTimeout > rc.HeartbeatTimeout {
		return fmt.Errorf("raft leader lease timeout %v exceeds heartbeat timeout %v: %w", rc.LeaderLeaseTimeout, rc.HeartbeatTimeout, ErrConfig)
	}
	if rc.ElectionTimeout < rc.HeartbeatTimeout {
		return fmt.Errorf("raft election timeout %v is below heartbeat timeout %v: %w", rc.ElectionTimeout, rc.HeartbeatTimeout, ErrConfig)
	}
	if rc.MaxAppendEntries < 1 || rc.MaxAppendEntries > 1024 {
		return fmt.Errorf("raft max append entries %d must be in [1, 1024]: %w", rc.MaxAppendEntries, ErrConfig)
	}
	if rc.SnapshotThreshold < 1 || rc.SnapshotRetain < 1 {
		return fmt.Errorf("raft snapshot threshold %d and retain %d must be >= 1: %w", rc.SnapshotThreshold, rc.SnapshotRetain, ErrConfig)
	}
	return nil
}

// ParseRaftPeers parses "id=host:port,id=host:port".
func ParseRaftPeers(s string) ([]RaftPeer, error) {
	var out []RaftPeer
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		id, addr, ok := strings.Cut(f, "=")
		if !ok || id == "" {
			return nil, fmt.Errorf("raft peer %q must be id=host:port: %w", f, ErrConfig)
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return nil, fmt.Errorf("raft peer %q must be id=host:port: %w", f, ErrConfig)
		}
		out = append(out, RaftPeer{ID: id, Addr: addr})
	}
	return out, nil
}

// errNotLeader: this coordinator is not (or no longer) the raft leader, so
// it cannot commit: the request was not applied by it (code unavailable;
// the sender retries and reaches the new leader).
var errNotLeader = errors.New("not the raft leader")

// Commands: one byte of version, one of kind, the payload.
const (
	raftCmdVersion  = 1
	raftCmdBatch    = 1 // wire.Batch binary
	raftCmdInv      = 2 // wire.Inventory JSON
	raftCmdFence    = 3 // raftFence JSON
	raftCmdRegister = 4 // dcp.Spec JSON
	raftCmdReset    = 5 // wire.Rank JSON
)

type raftFence struct {
	Rank wire.Rank `json:"rank"`
	UpTo uint64    `json:"up_to"`
}

func decodeRaftCmd(data []byte) (index.Op, error) {
	var op index.Op
	if len(data) < 2 || data[0] != raftCmdVersion {
		return op, fmt.Errorf("raft command of %d B does not start with version %d: %w", len(data), raftCmdVersion, index.ErrInvalid)
	}
	p := data[2:]
	var err error
	switch data[1] {
	case raftCmdBatch:
		var b wire.Batch
		err = b.UnmarshalBinary(p)
		op.Batch = &b
	case raftCmdInv:
		var inv wire.Inventory
		err = json.Unmarshal(p, &inv)
		op.Inventory = &inv
	case raftCmdFence:
		var f raftFence
		err = json.Unmarshal(p, &f)
		op.Fence, op.UpTo = &f.Rank, f.UpTo
	case raftCmdRegister:
		var s dcp.Spec
		err = json.Unmarshal(p, &s)
		op.Register = &s
	case raftCmdReset:
		var r wire.Rank
		err = json.Unmarshal(p, &r)
		op.Reset = &r
	default:
		return op, fmt.Errorf("raft command kind %d unknown: %w", data[1], index.ErrInvalid)
	}
	if err != nil {
		return op, fmt.Errorf("raft command kind %d: %w: %w", data[1], index.ErrInvalid, err)
	}
	return op, nil
}

// raftFSM is raft's state machine: the index (see the note above).
type raftFSM struct{ n *raftNode }

func (f raftFSM) Apply(l *raft.Log) any { return f.ApplyBatch([]*raft.Log{l})[0] }

// ApplyBatch queues every command entry into the index in log order and
// returns their index requests (*index.Pending) without waiting: the
// leader's acker waits on them. raft calls it on one goroutine, in order.
func (f raftFSM) ApplyBatch(logs []*raft.Log) []any {
	out := make([]any, len(logs))
	ix := f.n.c.idx
	for i, l := range logs {
		if l.Type != raft.LogCommand {
			continue
		}
		op, err := decodeRaftCmd(l.Data)
		if err != nil {
			// The leader encoded it: every replica refuses it alike.
			f.n.log.Error("raft entry does not decode; skipped on every replica", zap.Uint64("raft_index", l.Index), zap.Error(err))
			out[i] = err
			continue
		}
		op.RaftIndex = l.Index
		p, err := ix.ApplyReplicated(context.Background(), op)
		if err != nil {
			f.n.log.Error("raft entry not applied to the index; this replica diverges until it is rebuilt",
				zap.Uint64("raft_index", l.Index), zap.Error(err))
			out[i] = err
			continue
		}
		out[i] = p
	}
	if len(logs) > 0 {
		f.n.fsmLast.Store(logs[len(logs)-1].Index)
	}
	return out
}

func (f raftFSM) Snapshot() (raft.FSMSnapshot, error) {
	s, err := f.n.c.idx.Snapshot(context.Background())
	if err != nil {
		return nil, err
	}
	return raftSnapshot{s}, nil
}

func (f raftFSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	ok, err := f.n.c.idx.Restore(context.Background(), rc)
	if err != nil {
		return err
	}
	if ok {
		f.n.met.restores.Inc()
	}
	if a := f.n.c.idx.AppliedIndex(); a > f.n.fsmLast.Load() {
		f.n.fsmLast.Store(a)
	}
	return nil
}

type raftSnapshot struct{ s *index.Snapshot }

func (s raftSnapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := s.s.WriteTo(sink); err != nil {
		_ = sink.Cancel()
		return err
	}
	return sink.Close()
}

func (s raftSnapshot) Release() { s.s.Release() }

// raftMetrics are replicated mode's metrics, in the coordinator's registry.
type raftMetrics struct {
	isLeader      prometheus.Gauge
	leaderChanges prometheus.Counter
	elections     prometheus.Counter
	commitSecs    prometheus.Histogram
	refused       prometheus.Counter
	notLeader     prometheus.Counter
	withheld      prometheus.Counter
	restores      prometheus.Counter
	abandoned     prometheus.Counter
}

func newRaftMetrics() *raftMetrics {
	return &raftMetrics{
		isLeader: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvtier_raft_is_leader",
			Help: "1 while this coordinator is the raft leader."}),
		leaderChanges: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_leader_changes_total",
			Help: "Leader changes this coordinator observed (including to no leader)."}),
		elections: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_elections_total",
			Help: "Elections this coordinator started (became candidate)."}),
		commitSecs: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvtier_raft_commit_seconds",
			Help:    "Leader: entry proposed to committed on a quorum and handed to the index.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 18)}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_refused_connections_total",
			Help: "Connections to the raft port refused: the peer failed the key handshake, or too many handshakes."}),
		notLeader: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_not_leader_total",
			Help: "Requests answered unavailable because leadership was lost before their entry committed."}),
		withheld: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_verdicts_withheld_total",
			Help: "COMPLETE verdicts not sent because leadership could not be verified (the waiter got unavailable)."}),
		restores: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_snapshots_installed_total",
			Help: "Raft snapshots installed into the index (a follower catching up)."}),
		abandoned: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_restores_abandoned_total",
			Help: "Active restores abandoned when this coordinator lost leadership."}),
	}
}

func (m *raftMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.isLeader, m.leaderChanges, m.elections, m.commitSecs, m.refused, m.notLeader,
		m.withheld, m.restores, m.abandoned}
}

// leaderHandler is a subscription only the leader holds.
type leaderHandler struct {
	subject string
	queue   string // "" for a plain subscription
	fn      nats.MsgHandler
}

// raftNode is this coordinator's raft server and the leader gate.
type raftNode struct {
	c     *Coordinator
	cfg   RaftConfig
	log   *zap.Logger
	met   *raftMetrics
	r     *raft.Raft
	store *raftStore
	trans *raft.NetworkTransport
	strm  *authStream

	// ready is set once startRaft has set r and the stores; r, store,
	// trans and strm are read only after it.
	ready atomic.Bool
	// fsmLast is the last raft index ApplyBatch has queued into the index
	// in this process (0 after a start, until raft replays).
	fsmLast atomic.Uint64

	notify chan bool
	obs    chan raft.Observation
	stop   chan struct{}
	wg     sync.WaitGroup

	// mu guards the following: the leader-only subscriptions and whether
	// the gate is closed (Shutdown: no more subscribing).
	mu       sync.Mutex
	handlers []leaderHandler
	subs     []*nats.Subscription
	closed   bool
}

// startRaft opens the raft store and snapshot store in Dir, starts the
// authenticated transport and the raft server, bootstraps when asked, and
// starts the leadership and observation loops. The leader-only handlers
// are subscribed when this node becomes leader.
//
// c.rn exists from New on (newRaftNode), so the membership loop and the
// handlers, which start before raft does, see replicated mode: until
// ready is set, this node neither leads nor acts on membership, and every
// mutation answers errNotLeader; nothing writes the index outside raft.
func (c *Coordinator) startRaft(handlers []leaderHandler) error {
	rc := c.cfg.Raft
	n := c.rn
	n.handlers = handlers
	key := rc.Key
	if key == nil {
		path := rc.KeyFile
		if path == "" {
			if c.cfg.CredsDir == "" {
				return fmt.Errorf("raft needs a key: set --raft-key-file or --creds-dir with %s: %w", RaftKeyFile, ErrConfig)
			}
			path = filepath.Join(c.cfg.CredsDir, RaftKeyFile)
		}
		k, _, err := auth.LoadGossipKeys(path)
		if err != nil {
			return fmt.Errorf("raft key: %w (make one: 'coordinator init' writes %s)", err, RaftKeyFile)
		}
		key = k
	}
	if err := privateDir(rc.Dir); err != nil {
		return err
	}
	if c.idx.AppliedIndex() == 0 && c.idx.Stats().Ranks > 0 {
		return fmt.Errorf("index %s holds %d ranks written outside raft; a replicated coordinator starts from an empty data dir (move it aside; the ranks resync): %w",
			c.cfg.DataDir, c.idx.Stats().Ranks, ErrConfig)
	}
	store, err := openRaftStore(filepath.Join(rc.Dir, "raft.db"))
	if err != nil {
		return err
	}
	n.store = store
	hl := hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Warn, Output: zapWriter{n.log}})
	snaps, err := raft.NewFileSnapshotStoreWithLogger(rc.Dir, rc.SnapshotRetain, hl)
	if err != nil {
		return fmt.Errorf("raft snapshot store in %s: %w", rc.Dir, err)
	}
	var adv net.Addr
	if rc.Advertise != "" {
		if adv, err = net.ResolveTCPAddr("tcp", rc.Advertise); err != nil {
			return fmt.Errorf("raft advertise %q: %w: %w", rc.Advertise, ErrConfig, err)
		}
	}
	strm, err := newAuthStream(rc.Bind, adv, key, n.log, n.met.refused.Inc)
	if err != nil {
		return err
	}
	n.strm = strm
	n.trans = raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{Stream: strm, MaxPool: 3,
		Timeout: 10 * time.Second, Logger: hl})
	conf := raft.DefaultConfig()
	conf.LocalID = raft.ServerID(rc.ID)
	conf.HeartbeatTimeout, conf.ElectionTimeout = rc.HeartbeatTimeout, rc.ElectionTimeout
	conf.LeaderLeaseTimeout, conf.CommitTimeout = rc.LeaderLeaseTimeout, rc.CommitTimeout
	conf.MaxAppendEntries, conf.BatchApplyCh = rc.MaxAppendEntries, true
	conf.SnapshotThreshold, conf.SnapshotInterval, conf.TrailingLogs = rc.SnapshotThreshold, rc.SnapshotInterval, rc.TrailingLogs
	conf.NotifyCh = n.notify
	conf.Logger = hl
	if err := raft.ValidateConfig(conf); err != nil {
		return fmt.Errorf("raft config: %w: %w", ErrConfig, err)
	}
	logs, err := raft.NewLogCache(1024, store)
	if err != nil {
		return err
	}
	if rc.Bootstrap {
		has, err := raft.HasExistingState(logs, store, snaps)
		if err != nil {
			return fmt.Errorf("raft state in %s: %w", rc.Dir, err)
		}
		if !has {
			var cfg raft.Configuration
			for _, p := range rc.Peers {
				cfg.Servers = append(cfg.Servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.ID), Address: raft.ServerAddress(p.Addr)})
			}
			if err := raft.BootstrapCluster(conf, logs, store, snaps, n.trans, cfg); err != nil {
				return fmt.Errorf("raft bootstrap: %w", err)
			}
			n.log.Info("raft cluster bootstrapped", zap.Any("peers", rc.Peers))
		}
	}
	r, err := raft.NewRaft(conf, raftFSM{n}, logs, store, snaps, n.trans)
	if err != nil {
		return fmt.Errorf("start raft: %w", err)
	}
	n.r = r
	r.RegisterObserver(raft.NewObserver(n.obs, false, func(o *raft.Observation) bool {
		switch o.Data.(type) {
		case raft.LeaderObservation, raft.RaftState:
			return true
		}
		return false
	}))
	n.ready.Store(true)
	n.wg.Add(2)
	go n.leaderLoop()
	go n.observeLoop()
	n.log.Info("raft started", zap.String("id", rc.ID), zap.Stringer("addr", strm.Addr()),
		zap.Uint64("index_applied", c.idx.AppliedIndex()))
	return nil
}

// zapWriter turns hclog's lines into zap warnings.
type zapWriter struct{ log *zap.Logger }

func (w zapWriter) Write(p []byte) (int, error) {
	w.log.Warn(strings.TrimSpace(string(p)))
	return len(p), nil
}

// leaderLoop follows raft's leadership notifications: it opens the gate
// (subscribes the leader-only subjects) on gaining leadership, after a
// barrier, and closes it on losing it.
func (n *raftNode) leaderLoop() {
	defer n.wg.Done()
	for {
		select {
		case <-n.stop:
			return
		case leader := <-n.notify:
			if leader {
				n.gainLeadership()
			} else {
				n.loseLeadership()
			}
		}
	}
}

func (n *raftNode) gainLeadership() {
	t0 := time.Now()
	if err := n.r.Barrier(10 * time.Second).Error(); err != nil {
		n.log.Warn("leadership gained but the barrier failed; not serving", zap.Error(err))
		return
	}
	if err := n.c.idx.Failed(); err != nil {
		n.stepDown("this coordinator's index refuses writes: " + err.Error())
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed || n.r.State() != raft.Leader || len(n.subs) > 0 {
		return
	}
	for _, h := range n.handlers {
		var sub *nats.Subscription
		var err error
		if h.queue == lookupQueue {
			sub, err = n.c.lnc.QueueSubscribe(h.subject, h.queue, h.fn)
		} else if h.queue != "" {
			sub, err = n.c.nc.QueueSubscribe(h.subject, h.queue, h.fn)
		} else {
			sub, err = n.c.nc.Subscribe(h.subject, h.fn)
		}
		if err == nil {
			err = sub.SetPendingLimits(-1, 1<<30)
		}
		if err != nil {
			n.log.Error("leader subscription failed; stepping down", zap.String("subject", h.subject), zap.Error(err))
			n.unsubscribeLocked()
			_ = n.r.LeadershipTransfer()
			return
		}
		n.subs = append(n.subs, sub)
	}
	if err := n.c.nc.Flush(); err != nil {
		n.log.Warn("flush after leader subscriptions", zap.Error(err))
	}
	if err := n.c.lnc.Flush(); err != nil {
		n.log.Warn("flush the lookup connection after leader subscriptions", zap.Error(err))
	}
	n.met.isLeader.Set(1)
	n.log.Info("raft leader: serving", zap.Uint64("term", n.r.CurrentTerm()), zap.Uint64("index_applied", n.c.idx.AppliedIndex()),
		zap.Duration("barrier", time.Since(t0)))
	n.c.afterGainLeadership()
}

func (n *raftNode) loseLeadership() {
	n.mu.Lock()
	had := len(n.subs) > 0
	n.unsubscribeLocked()
	n.mu.Unlock()
	n.met.isLeader.Set(0)
	if had {
		a := n.c.rs.abandonAll("coordinator lost raft leadership before the verdict; recompute")
		n.met.abandoned.Add(float64(a))
		n.log.Warn("raft leadership lost: not serving", zap.Int("restores_abandoned", a))
	}
}

func (n *raftNode) unsubscribeLocked() {
	for _, s := range n.subs {
		if err := s.Unsubscribe(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
			n.log.Warn("unsubscribe", zap.String("subject", s.Subject), zap.Error(err))
		}
	}
	n.subs = nil
}

// closeGate stops the gate for Shutdown and returns the leader
// subscriptions to drain.
func (n *raftNode) closeGate() []*nats.Subscription {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.closed = true
	subs := n.subs
	n.subs = nil
	return subs
}

func (n *raftNode) observeLoop() {
	defer n.wg.Done()
	for {
		select {
		case <-n.stop:
			return
		case o := <-n.obs:
			switch d := o.Data.(type) {
			case raft.LeaderObservation:
				n.met.leaderChanges.Inc()
				n.log.Info("raft leader observed", zap.String("leader_id", string(d.LeaderID)), zap.String("leader_addr", string(d.LeaderAddr)))
			case raft.RaftState:
				if d == raft.Candidate {
					n.met.elections.Inc()
				}
			}
		}
	}
}

// shutdown stops raft (without leaving the configuration: a restarted node
// rejoins as itself), the loops, the transport and the store.
func (n *raftNode) shutdown() {
	if n.r != nil {
		if err := n.r.Shutdown().Error(); err != nil {
			n.log.Warn("raft shutdown", zap.Error(err))
		}
	}
	close(n.stop)
	n.wg.Wait()
	if n.trans != nil {
		_ = n.trans.Close()
	}
	if n.strm != nil {
		_ = n.strm.Close()
	}
	if n.store != nil {
		if err := n.store.Close(); err != nil {
			n.log.Warn("close raft store", zap.Error(err))
		}
	}
	n.met.isLeader.Set(0)
}

// propose hands a command to raft.
func (n *raftNode) propose(kind byte, payload []byte) raft.ApplyFuture {
	data := make([]byte, 0, 2+len(payload))
	data = append(data, raftCmdVersion, kind)
	return n.r.Apply(append(data, payload...), n.cfg.ApplyTimeout)
}

// result waits until the entry is committed and the leader's index has
// applied it.
func (n *raftNode) result(f raft.ApplyFuture, t0 time.Time) index.Result {
	if err := f.Error(); err != nil {
		n.met.notLeader.Inc()
		return index.Result{Err: fmt.Errorf("entry not committed by this coordinator: %w: %w", errNotLeader, err)}
	}
	n.met.commitSecs.Observe(time.Since(t0).Seconds())
	var res index.Result
	switch v := f.Response().(type) {
	case *index.Pending:
		res = v.Result(n.c.idx)
	case error:
		res = index.Result{Err: v}
	default:
		return index.Result{Err: fmt.Errorf("raft entry %d has no index result: %w", f.Index(), index.ErrInvalid)}
	}
	if errors.Is(res.Err, index.ErrFailed) {
		n.stepDown("this coordinator's index refuses writes")
	}
	return res
}

// stepDown hands leadership to another voter: a leader whose index has
// failed (it refuses every write until restarted) would otherwise keep the
// cluster from acknowledging anything. The replicas with healthy indexes
// carry on; this one is rebuilt by a restart (raft replays or sends a
// snapshot).
func (n *raftNode) stepDown(why string) {
	if !n.isLeader() {
		return
	}
	n.log.Error("raft leader stepping down", zap.String("why", why))
	_ = n.r.LeadershipTransfer() // asynchronous; its outcome shows in the leadership notifications
}

func (n *raftNode) do(kind byte, v any) index.Result {
	if !n.ready.Load() {
		return index.Result{Err: fmt.Errorf("raft is starting: %w", errNotLeader)}
	}
	payload, err := json.Marshal(v)
	if err != nil {
		return index.Result{Err: fmt.Errorf("encode raft command: %w: %w", index.ErrInvalid, err)}
	}
	return n.result(n.propose(kind, payload), time.Now())
}

// isLeader reports whether raft says this node leads.
func (n *raftNode) isLeader() bool { return n.ready.Load() && n.r.State() == raft.Leader }

// newRaftNode is New's part of replicated mode: the node and its metrics,
// no I/O (startRaft does that).
func newRaftNode(c *Coordinator) (*raftNode, error) {
	n := &raftNode{c: c, cfg: c.cfg.Raft, log: c.log.Named("raft"), met: newRaftMetrics(),
		notify: make(chan bool, 16), obs: make(chan raft.Observation, 64), stop: make(chan struct{})}
	for _, m := range n.met.collectors() {
		if err := c.reg.Register(m); err != nil {
			return nil, fmt.Errorf("register raft metrics: %w: %w", ErrConfig, err)
		}
	}
	lag := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvtier_raft_apply_lag",
		Help: "Entries committed by raft (as this node knows) not yet committed to this node's index."},
		func() float64 {
			if !n.ready.Load() {
				return 0
			}
			return float64(n.r.CommitIndex()) - float64(c.idx.AppliedIndex())
		})
	if err := c.reg.Register(lag); err != nil {
		return nil, fmt.Errorf("register raft metrics: %w: %w", ErrConfig, err)
	}
	return n, nil
}

// verifyLeader confirms with a quorum that this node still leads.
func (n *raftNode) verifyLeader() error {
	if !n.ready.Load() {
		return fmt.Errorf("raft is starting: %w", errNotLeader)
	}
	if err := n.r.VerifyLeader().Error(); err != nil {
		return fmt.Errorf("%w: %w", errNotLeader, err)
	}
	return nil
}

// The index mutations, raft or not. Standalone (c.rn nil) they are the
// index's own calls.

func (c *Coordinator) applyInventory(ctx context.Context, inv wire.Inventory) (index.InventoryOutcome, error) {
	if c.rn == nil {
		return c.idx.ApplyInventory(ctx, inv)
	}
	if err := index.ValidateInventory(&inv); err != nil {
		return index.InventoryOutcome{}, err
	}
	res := c.rn.do(raftCmdInv, &inv)
	return res.Inventory, res.Err
}

func (c *Coordinator) fenceRank(ctx context.Context, r wire.Rank, upTo uint64) (int, error) {
	if c.rn == nil {
		return c.idx.FenceRank(ctx, r, upTo)
	}
	res := c.rn.do(raftCmdFence, raftFence{Rank: r, UpTo: upTo})
	return res.Fenced, res.Err
}

func (c *Coordinator) registerNamespace(ctx context.Context, spec dcp.Spec) (*dcp.Resolved, error) {
	if c.rn == nil {
		return c.idx.RegisterNamespace(ctx, spec)
	}
	if _, err := spec.Resolve(); err != nil {
		return nil, fmt.Errorf("register namespace: %w: %w", index.ErrInvalid, err)
	}
	res := c.rn.do(raftCmdRegister, spec)
	return res.Spec, res.Err
}

func (c *Coordinator) resetRank(ctx context.Context, r wire.Rank) (int, error) {
	if c.rn == nil {
		return c.idx.ResetRank(ctx, r)
	}
	res := c.rn.do(raftCmdReset, r)
	return res.Fenced, res.Err
}

// proposeBatch validates a batch and proposes it; the acker waits on the
// future with rn.result.
func (c *Coordinator) proposeBatch(b *wire.Batch) (raft.ApplyFuture, error) {
	if err := index.ValidateBatch(b); err != nil {
		return nil, err
	}
	data, err := b.AppendBinary(make([]byte, 0, 64+len(b.Events)*64))
	if err != nil {
		return nil, fmt.Errorf("encode batch: %w: %w", index.ErrInvalid, err)
	}
	return c.rn.propose(raftCmdBatch, data), nil
}

// actsOnMembership: only the leader fences on memberlist news.
func (c *Coordinator) actsOnMembership() bool { return c.rn == nil || c.rn.isLeader() }

// afterGainLeadership runs the absent-rank sweep a new leader owes: deaths
// memberlist reported while this node followed were the old leader's to
// fence, and may not have been.
func (c *Coordinator) afterGainLeadership() {
	g := c.cfg.StartupFenceGrace
	if g <= 0 || time.Since(c.startedAt) < g {
		return // the startup fence runs at the grace, on the leader
	}
	c.drainMu.Lock()
	defer c.drainMu.Unlock()
	if c.draining {
		return
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		c.fenceAbsent("leader")
	}()
}

// confirmComplete is called before a COMPLETE verdict leaves: standalone
// it is nil at once; replicated it is raft's leadership check.
func (c *Coordinator) confirmComplete() error {
	if c.rn == nil {
		return nil
	}
	if err := c.rn.verifyLeader(); err != nil {
		c.rn.met.withheld.Inc()
		return err
	}
	return nil
}

// abandonAll drops every active restore, answering its waiters with code
// unavailable, and returns how many there were.
func (rs *restores) abandonAll(reason string) int {
	rs.mu.Lock()
	var waiters []*nats.Msg
	n := len(rs.active)
	for id, a := range rs.active {
		waiters = append(waiters, a.waiters...)
		delete(rs.active, id)
	}
	rs.byDL = rs.byDL[:0]
	rs.perInstance = make(map[string]int)
	rs.waiters = 0
	rs.c.met.active.Set(0)
	rs.mu.Unlock()
	for _, w := range waiters {
		rs.c.replyError(wire.CoordRestoreWait, w, wire.CodeUnavailable, reason)
	}
	return n
}

// raftStatus is this node's AdminRaftNode.
func (n *raftNode) raftStatus() wire.AdminRaftNode {
	st := n.r.Stats()
	_, lid := n.r.LeaderWithID()
	out := wire.AdminRaftNode{ID: n.cfg.ID, Addr: n.strm.Addr().String(), State: n.r.State().String(),
		Term: n.r.CurrentTerm(), LeaderID: string(lid), LastLogIndex: n.r.LastIndex(), CommitIndex: n.r.CommitIndex(),
		AppliedIndex: n.r.AppliedIndex(), IndexApplied: n.c.idx.AppliedIndex(), Servers: []wire.AdminRaftServer{}}
	_, _ = fmt.Sscan(st["last_snapshot_index"], &out.SnapshotIndex)
	if f := n.r.GetConfiguration(); f.Error() == nil {
		out.Servers = raftServers(f.Configuration())
	}
	return out
}

func raftServers(cfg raft.Configuration) []wire.AdminRaftServer {
	out := []wire.AdminRaftServer{}
	for _, s := range cfg.Servers {
		out = append(out, wire.AdminRaftServer{ID: string(s.ID), Addr: string(s.Address), Suffrage: s.Suffrage.String()})
	}
	slices.SortFunc(out, func(a, b wire.AdminRaftServer) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// handleRaftStatus answers admin.raft with this node's raft state (every
// coordinator answers).
func (c *Coordinator) handleRaftStatus(m *nats.Msg) {
	if !c.decodeAdmin(m, wire.AdminRaft) {
		return
	}
	if !c.rn.ready.Load() {
		c.replyError(wire.AdminRaft, m, wire.CodeUnavailable, "raft is starting")
		return
	}
	st := c.rn.raftStatus()
	c.reply(wire.AdminRaft, m, &st)
}

// handleRaftChange answers admin.raft.add_voter and raft.remove_server
// (admin-write, leader only).
func (c *Coordinator) handleRaftChange(op string) nats.MsgHandler {
	return func(m *nats.Msg) {
		if !c.rn.ready.Load() {
			c.replyError(op, m, wire.CodeUnavailable, "raft is starting")
			return
		}
		var req wire.AdminRaftChangeRequest
		if err := json.Unmarshal(m.Data, &req); err != nil || req.ID == "" {
			c.badRequest(m, op, fmt.Errorf("raft change wants {\"id\": ..., \"addr\": ...}: %w", wire.ErrMalformed))
			return
		}
		var f raft.IndexFuture
		switch op {
		case wire.AdminRaftAddVoter:
			if _, _, err := net.SplitHostPort(req.Addr); err != nil {
				c.badRequest(m, op, fmt.Errorf("raft add-voter address %q must be host:port: %w", req.Addr, wire.ErrMalformed))
				return
			}
			f = c.rn.r.AddVoter(raft.ServerID(req.ID), raft.ServerAddress(req.Addr), 0, requestTimeout)
		default:
			f = c.rn.r.RemoveServer(raft.ServerID(req.ID), 0, requestTimeout)
		}
		if err := f.Error(); err != nil {
			if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) {
				c.replyError(op, m, wire.CodeUnavailable, "not the raft leader: "+err.Error())
				return
			}
			c.internalError(m, op, "raft membership change", err, zap.String("id", req.ID))
			return
		}
		rep := &wire.AdminRaftChangeReply{Index: f.Index(), Servers: []wire.AdminRaftServer{}}
		if cf := c.rn.r.GetConfiguration(); cf.Error() == nil {
			rep.Servers = raftServers(cf.Configuration())
		}
		c.log.Warn("raft membership changed", zap.String("op", op), zap.String("id", req.ID), zap.String("addr", req.Addr),
			zap.Uint64("index", f.Index()))
		c.reply(op, m, rep)
	}
}

// WriteRaftKey writes a new random raft key to path (0600, O_EXCL).
func WriteRaftKey(path string) error {
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("write raft key: %w", err)
	}
	if _, err := f.WriteString(base64.StdEncoding.EncodeToString(k) + "\n"); err != nil {
		_ = f.Close()
		return fmt.Errorf("write raft key %s: %w", path, err)
	}
	return f.Close()
}

// CollectRaft asks every coordinator on nc for its raft state (admin.raft,
// one request, one reply per coordinator) and returns the replies that
// arrive within window, sorted by id; none (nil) from a cluster without
// raft.
func CollectRaft(ctx context.Context, nc *nats.Conn, subj wire.Subjects, window time.Duration) ([]wire.AdminRaftNode, error) {
	out, err := collect[wire.AdminRaftNode](ctx, nc, subj.Admin(wire.AdminRaft), window)
	slices.SortFunc(out, func(a, b wire.AdminRaftNode) int { return strings.Compare(a.ID, b.ID) })
	return out, err
}

// health is /healthz's raft line and whether it is well.
func (n *raftNode) health() (string, bool) {
	switch st := n.r.State(); st {
	case raft.Leader:
		return "leader", true
	case raft.Follower:
		if _, id := n.r.LeaderWithID(); id != "" {
			return "follower of " + string(id), true
		}
		return "no leader", false
	default:
		return strings.ToLower(st.String()), false
	}
}

// handleRaftVerify answers admin.raft.verify on every coordinator: its own
// index verified, then the digest of its canonical dump and the raft index
// that dump is at.
func (c *Coordinator) handleRaftVerify(m *nats.Msg) {
	if !c.decodeAdmin(m, wire.AdminRaftVerify) {
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, 5*time.Minute)
	defer cancel()
	rep, err := c.idx.Verify(ctx)
	if err != nil && !errors.Is(err, index.ErrInconsistent) {
		c.internalError(m, wire.AdminRaftVerify, "verify index", err)
		return
	}
	d, err := c.idx.Dump(ctx)
	if err != nil {
		c.internalError(m, wire.AdminRaftVerify, "dump index", err)
		return
	}
	sum := sha256.Sum256(d.Bytes)
	c.reply(wire.AdminRaftVerify, m, &wire.AdminRaftVerifyReply{ID: c.cfg.Raft.ID, RaftIndex: d.RaftIndex,
		Digest: hex.EncodeToString(sum[:]), Verify: *verifyReply(rep)})
}

// collect sends one request on subject and gathers the replies of every
// coordinator that arrive within window.
func collect[T any](ctx context.Context, nc *nats.Conn, subject string, window time.Duration) ([]T, error) {
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", inbox, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest(subject, inbox, []byte("{}")); err != nil {
		return nil, fmt.Errorf("request %s: %w", subject, err)
	}
	deadline := time.Now().Add(window)
	var out []T
	for {
		left := time.Until(deadline)
		if left <= 0 || ctx.Err() != nil {
			return out, nil
		}
		msg, err := sub.NextMsg(left)
		if err != nil {
			return out, nil // the window closed (or no responders)
		}
		var rep wire.Reply[T]
		if err := json.Unmarshal(msg.Data, &rep); err != nil || rep.OK == nil {
			continue
		}
		out = append(out, *rep.OK)
	}
}

// CollectRaftVerify asks every coordinator to verify its index and digest
// its state (admin.raft.verify) and returns the replies that arrive within
// window, sorted by id.
func CollectRaftVerify(ctx context.Context, nc *nats.Conn, subj wire.Subjects, window time.Duration) ([]wire.AdminRaftVerifyReply, error) {
	out, err := collect[wire.AdminRaftVerifyReply](ctx, nc, subj.Admin(wire.AdminRaftVerify), window)
	slices.SortFunc(out, func(a, b wire.AdminRaftVerifyReply) int { return strings.Compare(a.ID, b.ID) })
	return out, err
}

// ReplicasAgree reports whether every replica's index verified clean and
// replicas at the same raft index have the same digest; the error names
// the first disagreement.
func ReplicasAgree(reps []wire.AdminRaftVerifyReply) error {
	at := map[uint64]wire.AdminRaftVerifyReply{}
	for _, r := range reps {
		if !r.Verify.OK {
			return fmt.Errorf("replica %s: index verification found %d problems: %w", r.ID, len(r.Verify.Mismatches), index.ErrInconsistent)
		}
		if o, ok := at[r.RaftIndex]; ok && o.Digest != r.Digest {
			return fmt.Errorf("replicas %s and %s at raft index %d hold different states (digest %.12s vs %.12s): %w",
				o.ID, r.ID, r.RaftIndex, o.Digest, r.Digest, index.ErrInconsistent)
		}
		at[r.RaftIndex] = r
	}
	return nil
}

// WriteRaftVerifyTable writes one row per replica.
func WriteRaftVerifyTable(w io.Writer, reps []wire.AdminRaftVerifyReply) error {
	t := newTable(w, "RAFT_ID", "OK", "RAFT_INDEX", "PLACEMENTS", "CHUNKS", "DIGEST")
	for _, r := range reps {
		t.row(r.ID, yes(r.Verify.OK), u64(r.RaftIndex), i64(r.Verify.Placements), i64(r.Verify.Chunks), r.Digest[:min(16, len(r.Digest))])
	}
	return t.flush()
}
