package coordinator

import (
	"bytes"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

var testRaftKey = []byte("0123456789abcdef0123456789abcdef")

// raftCluster is n coordinators replicating one index, all on one shared
// NATS server (in-process; the NATS cluster of several servers is
// natsha's), each with its own data and raft dirs.
type raftCluster struct {
	t     *testing.T
	nats  *bus.Embedded
	nc    *nats.Conn
	subj  wire.Subjects
	peers []RaftPeer
	dirs  []string
	nodes []*Coordinator // nil: stopped
	mod   func(*Config)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func newRaftCluster(t *testing.T, n int, mod func(*Config)) *raftCluster {
	t.Helper()
	ecfg := bus.DefaultEmbeddedConfig()
	ecfg.Port, ecfg.Insecure = 0, true
	srv, err := bus.StartEmbedded(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	rc := &raftCluster{t: t, nats: srv, subj: wire.Subjects{Prefix: "kvtier"}, mod: mod}
	for i := range n {
		rc.peers = append(rc.peers, RaftPeer{ID: "n" + strconv.Itoa(i+1), Addr: freeAddr(t)})
		rc.dirs = append(rc.dirs, t.TempDir())
	}
	rc.nodes = make([]*Coordinator, n)
	for i := range n {
		rc.start(i)
	}
	nc, err := bus.Connect(srv.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	rc.nc = nc
	t.Cleanup(func() {
		for i := range rc.nodes {
			rc.stop(i)
		}
	})
	return rc
}

func (rc *raftCluster) config(i int) Config {
	cfg := testConfig(rc.t, rc.dirs[i])
	cfg.NATSURL = rc.nats.ClientURL()
	cfg.HTTPAddr = ""
	cfg.Cluster.NodeName = "coord-" + rc.peers[i].ID
	cfg.Raft.ID = rc.peers[i].ID
	cfg.Raft.Bind = rc.peers[i].Addr
	cfg.Raft.Dir = rc.dirs[i] + "/raft"
	cfg.Raft.Peers = rc.peers
	cfg.Raft.Bootstrap = true
	cfg.Raft.Key = testRaftKey
	cfg.Raft.HeartbeatTimeout = 300 * time.Millisecond
	cfg.Raft.ElectionTimeout = 300 * time.Millisecond
	cfg.Raft.LeaderLeaseTimeout = 150 * time.Millisecond
	if rc.mod != nil {
		rc.mod(&cfg)
	}
	return cfg
}

func (rc *raftCluster) start(i int) *Coordinator {
	rc.t.Helper()
	c, err := New(rc.config(i))
	if err != nil {
		rc.t.Fatalf("New %s: %v", rc.peers[i].ID, err)
	}
	if err := c.Start(); err != nil {
		rc.t.Fatalf("Start %s: %v", rc.peers[i].ID, err)
	}
	rc.nodes[i] = c
	return c
}

// stop shuts node i down without leaving the raft configuration (a
// crash, as far as raft is concerned).
func (rc *raftCluster) stop(i int) {
	if c := rc.nodes[i]; c != nil {
		c.Shutdown()
		rc.nodes[i] = nil
	}
}

// serving reports whether c leads and has its leader subscriptions.
func serving(c *Coordinator) bool {
	if c == nil || c.rn == nil || !c.rn.isLeader() {
		return false
	}
	c.rn.mu.Lock()
	defer c.rn.mu.Unlock()
	return len(c.rn.subs) > 0
}

// leader waits for exactly one serving leader among the running nodes.
func (rc *raftCluster) leader() int {
	rc.t.Helper()
	at := -1
	waitFor(rc.t, 20*time.Second, "a serving raft leader", func() bool {
		at = -1
		for i, c := range rc.nodes {
			if serving(c) {
				if at >= 0 {
					return false
				}
				at = i
			}
		}
		return at >= 0
	})
	return at
}

// converged waits until every running node's index has applied what the
// leader's has, then checks their dumps are byte-identical and Verify is
// clean on each.
func (rc *raftCluster) converged(leader int) []byte {
	rc.t.Helper()
	want := rc.nodes[leader].idx.AppliedIndex()
	for i, c := range rc.nodes {
		if c == nil {
			continue
		}
		waitFor(rc.t, 20*time.Second, fmt.Sprintf("%s to apply through %d", rc.peers[i].ID, want), func() bool {
			return c.idx.AppliedIndex() >= want
		})
	}
	var ref []byte
	for i, c := range rc.nodes {
		if c == nil {
			continue
		}
		if _, err := c.idx.Verify(tctx(rc.t)); err != nil {
			rc.t.Fatalf("%s: verify: %v", rc.peers[i].ID, err)
		}
		d, err := c.idx.Dump(tctx(rc.t))
		if err != nil {
			rc.t.Fatal(err)
		}
		if ref == nil {
			ref = d.Bytes
			continue
		}
		if !bytes.Equal(ref, d.Bytes) {
			rc.t.Fatalf("%s's index differs from the first node's: %d B vs %d B at raft index %d", rc.peers[i].ID,
				len(d.Bytes), len(ref), d.RaftIndex)
		}
	}
	return ref
}

// retryCall calls until a coordinator answers (no responders while a
// leader is being elected).
func retryCall[T any](t *testing.T, nc *nats.Conn, subject string, req any) *T {
	t.Helper()
	var out *T
	waitFor(t, 20*time.Second, "an answer on "+subject, func() bool {
		rep, err := bus.Call[T](tctx(t), nc, subject, req)
		if err != nil {
			return false
		}
		out = rep
		return true
	})
	return out
}

// TestRaftReplicatesAndFailsOver: batches acknowledged by the leader are
// in every follower's index, byte-identical; after the leader is killed a
// new one is elected, every acknowledged placement is in its index, and it
// acknowledges new batches.
func TestRaftReplicatesAndFailsOver(t *testing.T) {
	rc := newRaftCluster(t, 3, nil)
	l := rc.leader()
	ns := retryCall[wire.RegisterReply](t, rc.nc, rc.subj.Coord(wire.CoordRegister), testSpec(2)).Namespace
	chunks := chain(ns, 40, 3)
	var acked []dcp.Key
	for tp := range 2 {
		r := wire.Rank{Instance: "eng", TPRank: tp}
		for part := range 4 {
			b := storeBatch(r, 1, uint64(part*10), ns, chunks[part*10:(part+1)*10], wire.L1)
			ack, werr := sendBatch(t, rc.nc, rc.subj, b)
			if werr != nil || ack.AppliedThrough != uint64((part+1)*10) {
				t.Fatalf("batch %d of %s: ack %+v err %v", part, r, ack, werr)
			}
			for _, e := range b.Events {
				acked = append(acked, e.Key)
			}
		}
	}
	rc.converged(l)
	for i, c := range rc.nodes {
		for _, k := range acked {
			if len(c.idx.Get(k)) != 1 {
				t.Fatalf("%s: acknowledged %s not held", rc.peers[i].ID, k)
			}
		}
	}

	rc.stop(l)
	l2 := rc.leader()
	if l2 == l {
		t.Fatalf("stopped node %d still leads", l)
	}
	for _, k := range acked {
		if len(rc.nodes[l2].idx.Get(k)) != 1 {
			t.Fatalf("new leader %s lost acknowledged %s", rc.peers[l2].ID, k)
		}
	}
	r := wire.Rank{Instance: "eng", TPRank: 0}
	more := chain(ns, 50, 9)[40:]
	b := storeBatch(r, 1, 40, ns, more, wire.L1)
	if ack, werr := sendBatch(t, rc.nc, rc.subj, b); werr != nil || ack.AppliedThrough != 50 {
		t.Fatalf("batch to the new leader: ack %+v err %v", ack, werr)
	}
	rc.converged(l2)
	// The old leader comes back as a follower and catches up.
	rc.start(l)
	rc.converged(rc.leader())
}
