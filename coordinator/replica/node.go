package replica

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/group"
	"github.com/kvtier/kvtier/wire"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Hooks are what the node's owner does when leadership changes. Both run
// on the node's leadership goroutine, one at a time, in raft's order.
type Hooks struct {
	// Lead runs once this node leads and its index holds every entry of
	// earlier terms (after a barrier) and has not failed. It returns
	// whether the owner now serves as leader; an error makes the node hand
	// leadership to another voter.
	Lead func() (serving bool, err error)
	// Follow runs when this node stops leading.
	Follow func()
}

// Options are a node's collaborators.
type Options struct {
	// Logger gets the node's logs (named "raft"). Default zap.NewNop().
	Logger *zap.Logger
	// Registerer gets the kvtier_raft_* metrics. Required.
	Registerer prometheus.Registerer
	// Hooks are called on leadership changes; nil hooks do nothing.
	Hooks Hooks
	// BeforeApply, when set (tests), runs on raft's state machine goroutine
	// before each batch of entries is queued into the index: a test holds
	// the state machine with it.
	BeforeApply func()
}

// Node is one raft server replicating an index: raft's state machine is
// the index (fsm.go), its log store raft.db (logstore.go), its transport
// the authenticated raft port (transport.go).
//
// New builds it without I/O, so its owner is in replicated mode from the
// start: until Start has run, the node neither leads nor commits, and
// every mutation answers ErrNotLeader. Goroutines it owns (the leadership
// and observation loops, started through its group, which Shutdown closes
// before it waits; the transport's accept loop and handshakes, in the
// transport's group; and raft's own) stop in Shutdown. The one exception:
// a goroutine await started on a future raft dropped at its shutdown
// stays parked on it (see await).
type Node struct {
	cfg   Config
	log   *zap.Logger
	met   *metrics
	hooks Hooks
	// beforeApply is Options.BeforeApply.
	beforeApply func()

	// Set by Start before ready; read only after ready.
	idx   *index.Index
	r     *raft.Raft
	store *LogStore
	trans *raft.NetworkTransport
	strm  *Transport

	// ready is set once Start has set idx, r and the stores.
	ready atomic.Bool
	// fsmLast is the last raft index ApplyBatch has queued into the index
	// in this process (0 after a start, until raft replays).
	fsmLast atomic.Uint64

	notify chan bool
	obs    chan raft.Observation
	// stop is closed and ctx cancelled by Shutdown: the loops and an index
	// sync in progress return.
	stop chan struct{}
	// down is closed by Shutdown once raft has shut down: await stops
	// waiting on raft's futures then.
	down   chan struct{}
	ctx    context.Context
	cancel context.CancelFunc
	g      *group.Group
}

// New builds a node and registers its metrics; it does no I/O (Start does).
func New(cfg Config, opts Options) (*Node, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		return nil, fmt.Errorf("raft node logger must be set (zap.NewNop() for none): %w", ErrConfig)
	}
	if opts.Registerer == nil {
		return nil, fmt.Errorf("raft node registerer must be set: %w", ErrConfig)
	}
	n := &Node{cfg: cfg, log: opts.Logger.Named("raft"), met: newMetrics(), hooks: opts.Hooks,
		notify: make(chan bool, 16), obs: make(chan raft.Observation, 64), stop: make(chan struct{}),
		down: make(chan struct{}), beforeApply: opts.BeforeApply, g: group.New("raft")}
	n.ctx, n.cancel = context.WithCancel(context.Background())
	for _, m := range n.met.collectors() {
		if err := opts.Registerer.Register(m); err != nil {
			return nil, fmt.Errorf("register raft metrics: %w: %w", ErrConfig, err)
		}
	}
	lag := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvtier_raft_apply_lag",
		Help: "Entries committed by raft (as this node knows) not yet committed to this node's index."},
		func() float64 {
			if !n.ready.Load() {
				return 0
			}
			return float64(n.r.CommitIndex()) - float64(n.idx.AppliedIndex())
		})
	if err := opts.Registerer.Register(lag); err != nil {
		return nil, fmt.Errorf("register raft metrics: %w: %w", ErrConfig, err)
	}
	return n, nil
}

// Start opens the raft store and snapshot store in Dir, starts the mutual
// TLS transport (with creds, Config.LoadTLS) and the raft server over idx,
// bootstraps when asked, and starts the leadership and observation loops.
// Hooks.Lead runs when this node becomes leader.
func (n *Node) Start(idx *index.Index, creds *auth.RaftTLS) error {
	if n.g.Closed() {
		return fmt.Errorf("start raft after Shutdown: %w", ErrClosed)
	}
	rc := n.cfg
	n.idx = idx
	if err := PrivateDir(rc.Dir); err != nil {
		return err
	}
	store, err := OpenLogStore(filepath.Join(rc.Dir, "raft.db"))
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
	if creds == nil || creds.ID != rc.ID {
		return fmt.Errorf("raft TLS material for server %q is missing or names another server: %w", rc.ID, ErrConfig)
	}
	n.met.certNotAfter.Set(float64(creds.NotAfter.Unix()))
	strm, err := NewTransport(TransportConfig{Bind: rc.Bind, Advertise: adv, TLS: creds, Peers: rc.Peers, Logger: n.log,
		Refused: n.met.refused.Inc, Broken: n.met.broken.Inc})
	if err != nil {
		return err
	}
	n.strm = strm
	n.trans = raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{Stream: strm, MaxPool: 3,
		Timeout: 10 * time.Second, Logger: hl, MaxRPCsInFlight: noPipelining})
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
	r, err := raft.NewRaft(conf, fsm{n}, logs, store, snaps, n.trans)
	if err != nil {
		return fmt.Errorf("start raft: %w", err)
	}
	n.r = r
	strm.SetServers(func() []raft.Server { return r.GetConfiguration().Configuration().Servers })
	r.RegisterObserver(raft.NewObserver(n.obs, false, func(o *raft.Observation) bool {
		switch o.Data.(type) {
		case raft.LeaderObservation, raft.RaftState:
			return true
		}
		return false
	}))
	n.ready.Store(true)
	// Refused only when Shutdown came first (it is to be called after
	// Start or instead of it): raft is then shut down with the node.
	if !n.g.Go("raft-leadership", n.leaderLoop) || !n.g.Go("raft-observe", n.observeLoop) {
		return fmt.Errorf("start raft: %w", ErrClosed)
	}
	n.log.Info("raft started", zap.String("id", rc.ID), zap.Stringer("addr", strm.Addr()),
		zap.Uint64("index_applied", idx.AppliedIndex()))
	return nil
}

// noPipelining is the raft transport's MaxRPCsInFlight: 1 turns raft's
// pipelined replication off (each follower gets one AppendEntries at a
// time). raft 1.8's pipeline can deadlock: when a follower answers an
// append with Success=false the pipeline's decoder returns, and a send
// already under way, or the next one, waits forever to hand its request
// to the transport's response reader, which itself waits forever for the
// decoder; the pipeline is closed only by that sender. The follower then
// never gets another entry (heartbeats go on, so no election heals it),
// and raft's Shutdown waits forever for the sender: stop 59's CI hung 17
// minutes in a test's cleanup, and a loaded stress of the raft tests hung
// the same way (BENCHMARKS.md, "Stop 60"). raft's own documentation finds
// pipelining of little benefit beside its batching.
const noPipelining = 1

// zapWriter turns hclog's lines into zap warnings.
type zapWriter struct{ log *zap.Logger }

func (w zapWriter) Write(p []byte) (int, error) {
	w.log.Warn(strings.TrimSpace(string(p)))
	return len(p), nil
}

// leaderLoop follows raft's leadership notifications: Hooks.Lead on
// gaining leadership, after a barrier, and Hooks.Follow on losing it.
func (n *Node) leaderLoop() {
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

func (n *Node) gainLeadership() {
	t0 := time.Now()
	if err := n.await(n.r.Barrier(10 * time.Second)); err != nil {
		n.log.Warn("leadership gained but the barrier failed; not serving", zap.Error(err))
		return
	}
	// The barrier says the state machine has queued every earlier entry
	// into the index; its committer commits them asynchronously. Serving
	// before they are committed could plan a restore from a copy an entry
	// already fenced (issue 29.5), so wait until the index holds them all.
	t1 := time.Now()
	if err := n.syncIndex(); err != nil {
		n.stepDown("this coordinator's index did not commit the entries before the barrier: " + err.Error())
		return
	}
	indexWait := time.Since(t1)
	if err := n.idx.Failed(); err != nil {
		n.stepDown("this coordinator's index refuses writes: " + err.Error())
		return
	}
	if n.hooks.Lead == nil {
		return
	}
	serving, err := n.hooks.Lead()
	if err != nil {
		n.log.Error("cannot serve as leader; stepping down", zap.Error(err))
		_ = n.r.LeadershipTransfer()
		return
	}
	if !serving {
		return
	}
	n.met.isLeader.Set(1)
	n.log.Info("raft leader: serving", zap.Uint64("term", n.r.CurrentTerm()), zap.Uint64("index_applied", n.idx.AppliedIndex()),
		zap.Duration("barrier", time.Since(t0)), zap.Duration("index_wait", indexWait))
}

// syncIndex waits until the index has committed everything queued into it
// (index.Sync), or the node stops.
func (n *Node) syncIndex() error {
	return n.idx.Sync(n.ctx)
}

func (n *Node) loseLeadership() {
	n.met.isLeader.Set(0)
	if n.hooks.Follow != nil {
		n.hooks.Follow()
	}
}

func (n *Node) observeLoop() {
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

// Shutdown stops raft (without leaving the configuration: a restarted node
// rejoins as itself), the loops, the transport and the store. Call it
// once, after Start or instead of it.
func (n *Node) Shutdown() {
	if n.r != nil {
		if err := n.r.Shutdown().Error(); err != nil {
			n.log.Warn("raft shutdown", zap.Error(err))
		}
	}
	close(n.down) // raft answers no future from here on
	n.g.Close()
	close(n.stop)
	n.cancel()
	n.g.Wait()
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
func (n *Node) propose(kind byte, payload []byte) raft.ApplyFuture {
	return n.r.Apply(appendCommand(kind, payload), n.cfg.ApplyTimeout)
}

// await returns f's error, or raft.ErrRaftShutdown once this node's raft
// has shut down without answering f. Raft (1.8) never answers an Apply's
// or a Barrier's future that still sat in its apply channel (buffered:
// BatchApplyCh) or its state machine's channel when it shut down, and
// those futures watch no shutdown channel: waiting on one alone could hang
// forever. The leadership loop did at stop 52 (its barrier), and Shutdown,
// waiting for that loop, with it: CI's coordinator tests hung 20 minutes.
//
// The goroutine that waits on f is not in the node's group: Shutdown
// must not wait for it. Once raft is down it stays parked on a future
// nothing answers; the process is stopping.
func (n *Node) await(f raft.Future) error {
	errc := make(chan error, 1)
	go func() { errc <- f.Error() }()
	select {
	case err := <-errc:
		return err
	case <-n.down:
		select {
		case err := <-errc:
			return err
		default:
			return raft.ErrRaftShutdown
		}
	}
}

// result waits until the entry is committed and the leader's index has
// applied it.
func (n *Node) result(f raft.ApplyFuture, t0 time.Time) index.Result {
	if err := n.await(f); err != nil {
		n.met.notLeader.Inc()
		return index.Result{Err: fmt.Errorf("entry not committed by this coordinator: %w: %w", ErrNotLeader, err)}
	}
	n.met.commitSecs.Observe(time.Since(t0).Seconds())
	var res index.Result
	switch v := f.Response().(type) {
	case *index.Pending:
		res = v.Result(n.idx)
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
func (n *Node) stepDown(why string) {
	if !n.IsLeader() {
		return
	}
	n.log.Error("raft leader stepping down", zap.String("why", why))
	_ = n.r.LeadershipTransfer() // asynchronous; its outcome shows in the leadership notifications
}

func (n *Node) do(kind byte, v any) index.Result {
	if !n.ready.Load() {
		return index.Result{Err: fmt.Errorf("raft is starting: %w", ErrNotLeader)}
	}
	payload, err := json.Marshal(v)
	if err != nil {
		return index.Result{Err: fmt.Errorf("encode raft command: %w: %w", index.ErrInvalid, err)}
	}
	return n.result(n.propose(kind, payload), time.Now())
}

// Ready reports whether Start has run.
func (n *Node) Ready() bool { return n.ready.Load() }

// IsLeader reports whether raft says this node leads.
func (n *Node) IsLeader() bool { return n.ready.Load() && n.r.State() == raft.Leader }

// VerifyLeader confirms with a quorum that this node still leads. A
// failure is counted as a withheld verdict: the caller sends none.
func (n *Node) VerifyLeader() error {
	if !n.ready.Load() {
		n.met.withheld.Inc()
		return fmt.Errorf("raft is starting: %w", ErrNotLeader)
	}
	if err := n.r.VerifyLeader().Error(); err != nil {
		n.met.withheld.Inc()
		return fmt.Errorf("%w: %w", ErrNotLeader, err)
	}
	return nil
}

// NoteAbandoned counts restores abandoned on losing leadership.
func (n *Node) NoteAbandoned(restores int) { n.met.abandoned.Add(float64(restores)) }

// The index mutations through raft: each validates what the index would,
// proposes one entry and returns once the leader's index has applied it.

// ApplyInventory replaces a rank's placements with its inventory.
func (n *Node) ApplyInventory(_ context.Context, inv wire.Inventory) (index.InventoryOutcome, error) {
	if err := index.ValidateInventory(&inv); err != nil {
		return index.InventoryOutcome{}, err
	}
	res := n.do(raftCmdInv, &inv)
	return res.Inventory, res.Err
}

// ApplyInventoryAt replaces a rank's placements with an inventory
// requested under fence generation gen (index.ApplyInventoryAt): dropped
// on every replica (fenced_since) if a fence committed before it in the
// log moved the generation, whichever leader committed that fence.
func (n *Node) ApplyInventoryAt(_ context.Context, inv wire.Inventory, gen uint64) (index.InventoryOutcome, error) {
	if err := index.ValidateInventory(&inv); err != nil {
		return index.InventoryOutcome{}, err
	}
	res := n.do(raftCmdInvAt, invAtCmd{Inventory: inv, FenceGen: gen})
	return res.Inventory, res.Err
}

// ApplyInventoryStep applies one step of a streamed inventory
// (index.ApplyInventoryStep), one entry per step: a page's entry holds that
// page alone, so no entry, and no replica's apply, holds a whole large
// inventory (issue 28.3).
func (n *Node) ApplyInventoryStep(_ context.Context, s index.InventoryStep) (index.InventoryOutcome, error) {
	if err := index.ValidateInventoryStep(&s); err != nil {
		return index.InventoryOutcome{}, err
	}
	res := n.do(raftCmdInvStep, &s)
	return res.Inventory, res.Err
}

// TransferLeadership hands this leader's leadership to voter id at addr
// and returns once raft has done so, or failed to.
func (n *Node) TransferLeadership(id, addr string) error {
	if !n.ready.Load() {
		return fmt.Errorf("raft is starting: %w", ErrNotLeader)
	}
	if err := n.await(n.r.LeadershipTransferToServer(raft.ServerID(id), raft.ServerAddress(addr))); err != nil {
		return fmt.Errorf("leadership transfer to %s at %s: %w", id, addr, err)
	}
	return nil
}

// FenceRank fences a rank's L1 placements up to incarnation upTo.
func (n *Node) FenceRank(_ context.Context, r wire.Rank, upTo uint64) (int, error) {
	res := n.do(raftCmdFence, fenceCmd{Rank: r, UpTo: upTo})
	return res.Fenced, res.Err
}

// RegisterNamespace registers a namespace spec.
func (n *Node) RegisterNamespace(_ context.Context, spec dcp.Spec) (*dcp.Resolved, error) {
	if _, err := spec.Resolve(); err != nil {
		return nil, fmt.Errorf("register namespace: %w: %w", index.ErrInvalid, err)
	}
	res := n.do(raftCmdRegister, spec)
	return res.Spec, res.Err
}

// ResetRank drops a rank's placements and forgets its incarnation.
func (n *Node) ResetRank(_ context.Context, r wire.Rank) (int, error) {
	res := n.do(raftCmdReset, r)
	return res.Fenced, res.Err
}

// BatchFuture is an event batch proposed to raft.
type BatchFuture struct {
	n  *Node
	f  raft.ApplyFuture
	t0 time.Time
}

// ProposeBatch validates a batch and proposes it without waiting.
func (n *Node) ProposeBatch(b *wire.Batch) (*BatchFuture, error) {
	if !n.ready.Load() {
		return nil, fmt.Errorf("raft is starting: %w", ErrNotLeader)
	}
	if err := index.ValidateBatch(b); err != nil {
		return nil, err
	}
	data, err := b.AppendBinary(make([]byte, 0, 64+len(b.Events)*64))
	if err != nil {
		return nil, fmt.Errorf("encode batch: %w: %w", index.ErrInvalid, err)
	}
	return &BatchFuture{n: n, f: n.propose(raftCmdBatch, data), t0: time.Now()}, nil
}

// Wait returns once the batch's entry is committed and the leader's index
// has applied it.
func (f *BatchFuture) Wait() (index.Outcome, error) {
	res := f.n.result(f.f, f.t0)
	return res.Outcome, res.Err
}

// Health is /healthz's raft line and whether it is well: "leader",
// "follower of <id>", or "no leader", "candidate", "shutdown" (not well).
// Before Start: "" and well.
func (n *Node) Health() (string, bool) {
	if !n.ready.Load() {
		return "", true
	}
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

// Status is this node's admin.raft answer; false before Start.
func (n *Node) Status() (wire.AdminRaftNode, bool) {
	if !n.ready.Load() {
		return wire.AdminRaftNode{}, false
	}
	st := n.r.Stats()
	_, lid := n.r.LeaderWithID()
	out := wire.AdminRaftNode{ID: n.cfg.ID, Addr: n.strm.Addr().String(), State: n.r.State().String(),
		Term: n.r.CurrentTerm(), LeaderID: string(lid), LastLogIndex: n.r.LastIndex(), CommitIndex: n.r.CommitIndex(),
		AppliedIndex: n.r.AppliedIndex(), IndexApplied: n.idx.AppliedIndex(), Servers: []wire.AdminRaftServer{}}
	_, _ = fmt.Sscan(st["last_snapshot_index"], &out.SnapshotIndex)
	if f := n.r.GetConfiguration(); f.Error() == nil {
		out.Servers = servers(f.Configuration())
	}
	return out, true
}

func servers(cfg raft.Configuration) []wire.AdminRaftServer {
	out := []wire.AdminRaftServer{}
	for _, s := range cfg.Servers {
		out = append(out, wire.AdminRaftServer{ID: string(s.ID), Addr: string(s.Address), Suffrage: s.Suffrage.String()})
	}
	slices.SortFunc(out, func(a, b wire.AdminRaftServer) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// ChangeVoters adds voter id at addr (add) or removes server id, and returns
// the configuration after the change. Only the leader changes it; on a
// follower or a deposed leader the error wraps ErrNotLeader.
func (n *Node) ChangeVoters(id, addr string, add bool, timeout time.Duration) (*wire.AdminRaftChangeReply, error) {
	if !n.ready.Load() {
		return nil, fmt.Errorf("raft is starting: %w", ErrNotLeader)
	}
	var f raft.IndexFuture
	if add {
		f = n.r.AddVoter(raft.ServerID(id), raft.ServerAddress(addr), 0, timeout)
	} else {
		f = n.r.RemoveServer(raft.ServerID(id), 0, timeout)
	}
	if err := n.await(f); err != nil {
		if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) {
			return nil, fmt.Errorf("%w: %w", ErrNotLeader, err)
		}
		return nil, err
	}
	rep := &wire.AdminRaftChangeReply{Index: f.Index(), Servers: []wire.AdminRaftServer{}}
	if cf := n.r.GetConfiguration(); cf.Error() == nil {
		rep.Servers = servers(cf.Configuration())
	}
	return rep, nil
}

// Test and fault seams.

// FSMLast is the last raft index handed to the index in this process.
func (n *Node) FSMLast() uint64 { return n.fsmLast.Load() }

// Snapshot takes a raft snapshot now (which compacts the log).
func (n *Node) Snapshot() error { return n.r.Snapshot().Error() }

// FirstLogIndex is the first index the raft log store holds.
func (n *Node) FirstLogIndex() (uint64, error) { return n.store.FirstIndex() }

// Partition cuts (true) or heals (false) this node's raft transport, as if
// it were partitioned from its peers.
func (n *Node) Partition(on bool) { n.strm.Partition(on) }
