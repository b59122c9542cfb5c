package coordinator

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// kvRouter is a router subscribed to every instance's KV events, with a
// marker instance ("mark", TP1) whose stores serve as a barrier: the
// publisher handles index changes in the order they were acknowledged,
// so once the marker's event arrives every event of the changes before
// it has arrived too.
type kvRouter struct {
	t      *testing.T
	c      *Coordinator
	nc     *nats.Conn // the ranks' connection
	sub    *nats.Subscription
	markNS dcp.Namespace
	seq    uint64
	names  map[dcp.ChunkHash]string
}

func newKVRouter(t *testing.T, c *Coordinator, nc *nats.Conn) *kvRouter {
	rc := connect(t, c)
	sub, err := rc.SubscribeSync(c.subj.KVEventsAll())
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Flush(); err != nil {
		t.Fatal(err)
	}
	spec := testSpec(1)
	spec.Model = "marker"
	k := &kvRouter{t: t, c: c, nc: nc, sub: sub, markNS: register(t, nc, c.subj, spec), names: make(map[dcp.ChunkHash]string)}
	// The publisher's first act is its start-up snapshot (AllBlocksCleared
	// for every instance it knows and every share-group member), but on a
	// loaded host its worker may run it only now, after the subscription:
	// a first barrier consumes it, whenever it goes out, so each test sees
	// only the events of its own changes.
	k.barrierAll()
	return k
}

// next returns the next message's subject and events, rendered.
func (k *kvRouter) next() (string, []string) {
	k.t.Helper()
	m, err := k.sub.NextMsg(10 * time.Second)
	if err != nil {
		k.t.Fatalf("no KV event message: %v", err)
	}
	var b wire.KVEventBatch
	if err := json.Unmarshal(m.Data, &b); err != nil {
		k.t.Fatalf("decode %s: %v", m.Data, err)
	}
	out := make([]string, 0, len(b.Events))
	for _, e := range b.Events {
		out = append(out, k.render(e))
	}
	return m.Subject, out
}

// render writes an event as "BlockStored CPU 16 [c0]".
func (k *kvRouter) render(e wire.KVEvent) string {
	var medium, owner string
	var hashes []dcp.ChunkHash
	size := ""
	switch e := e.(type) {
	case *wire.BlockStored:
		medium, owner, hashes, size = e.Medium, e.Ownership, e.BlockHashes, fmt.Sprint(" ", e.BlockSize)
		if e.ParentBlockHash != nil || e.TokenIDs == nil || len(e.TokenIDs) != 0 {
			k.t.Fatalf("BlockStored with a parent %v or tokens %v", e.ParentBlockHash, e.TokenIDs)
		}
	case *wire.BlockRemoved:
		medium, owner, hashes = e.Medium, e.Ownership, e.BlockHashes
	default:
		return wire.KVEventType(e)
	}
	if owner != "" {
		medium += "/" + owner
	}
	names := make([]string, 0, len(hashes))
	for _, h := range hashes {
		n, ok := k.names[h]
		if !ok {
			n = h.String()
		}
		names = append(names, n)
	}
	return wire.KVEventType(e) + " " + medium + size + " [" + strings.Join(names, " ") + "]"
}

// barrierAll stores a new marker chunk and returns the events published
// for each instance but the marker before the marker's. The marker's
// chunk comes in an event of its own, or within a snapshot the publisher
// ran after the store (which then stands for the store's change).
func (k *kvRouter) barrierAll() map[string][]string {
	k.t.Helper()
	k.seq++
	ch := chain(k.markNS, 1, uint32(1000+k.seq))
	send(k.t, k.nc, k.c.subj, storeBatch(wire.Rank{Instance: "mark"}, 1, k.seq-1, k.markNS, ch, wire.L1))
	out := make(map[string][]string)
	for {
		subj, evs := k.next()
		inst := strings.TrimPrefix(subj, k.c.subj.KVEvents(""))
		if inst != "mark" {
			out[inst] = append(out[inst], evs...)
			continue
		}
		for _, ev := range evs {
			if hs, ok := strings.CutPrefix(ev, "BlockStored CPU 16 ["); ok &&
				slices.Contains(strings.Fields(strings.TrimSuffix(hs, "]")), ch[0].String()) {
				return out
			}
		}
	}
}

// barrier is barrierAll for changes that concern inst alone.
func (k *kvRouter) barrier(inst string) []string {
	k.t.Helper()
	all := k.barrierAll()
	for other, evs := range all {
		if other != inst {
			k.t.Fatalf("events for %s: %q", other, evs)
		}
	}
	return all[inst]
}

// expect checks the exact events published for inst since the last
// barrier.
func (k *kvRouter) expect(inst, what string, want ...string) {
	k.t.Helper()
	if got := k.barrier(inst); !slices.Equal(got, want) {
		k.t.Fatalf("%s: KV events of %s %q, want %q", what, inst, got, want)
	}
}

// send sends a batch and fails unless it was applied.
func send(t *testing.T, nc *nats.Conn, subj wire.Subjects, b *wire.Batch) {
	t.Helper()
	if ack, e := sendBatch(t, nc, subj, b); e != nil || ack.Resync || ack.Fenced {
		t.Fatalf("batch of %s: ack %+v, error %v", b.Rank, ack, e)
	}
}

// TestKVEvents (issue 26.4): a router subscribed to the KV events sees a
// TP2 chunk announced only once both shards are in L1, removed when one
// is evicted, announced in STORAGE/L2 once both are in L2, removed when
// its holder is fenced dead or reset, and after a coordinator restart
// AllBlocksCleared and then the snapshot. Every step checks the exact
// event list. Seen red with kvTiers announcing a tier on any one shard
// (`have` of the first expectation only): "shard 0 of c0 in L1: KV
// events of eng [\"BlockStored CPU 16 [c0]\"], want []".
func TestKVEvents(t *testing.T) {
	dir := t.TempDir()
	mod := func(cfg *Config) { cfg.KVEvents = true }
	cfg := testConfig(t, dir)
	mod(&cfg)
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Shutdown)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	k := newKVRouter(t, c, nc)
	r0, r1 := wire.Rank{Instance: "eng", TPRank: 0}, wire.Rank{Instance: "eng", TPRank: 1}
	ch := chain(ns, 2, 7)
	c0, c1 := ch[:1], ch[1:]
	k.names[c0[0]], k.names[c1[0]] = "c0", "c1"
	// The rank that dies is a memberlist member: gossip reports its death.
	m1 := startRankMemberInc(t, c, r1, 2, 1)

	send(t, nc, c.subj, storeBatch(r0, 1, 0, ns, c0, wire.L1))
	k.expect("eng", "shard 0 of c0 in L1")
	send(t, nc, c.subj, storeBatch(r1, 1, 0, ns, c0, wire.L1))
	k.expect("eng", "both shards of c0 in L1", "BlockStored CPU 16 [c0]")

	evict := storeBatch(r0, 1, 1, ns, c0, wire.L1)
	evict.Events[0].Kind = wire.Removed
	send(t, nc, c.subj, evict)
	k.expect("eng", "shard 0 of c0 evicted from L1", "BlockRemoved CPU [c0]")

	send(t, nc, c.subj, storeBatch(r0, 1, 2, ns, c0, wire.L2))
	k.expect("eng", "shard 0 of c0 in L2")
	send(t, nc, c.subj, storeBatch(r1, 1, 1, ns, c0, wire.L2))
	k.expect("eng", "both shards of c0 in L2", "BlockStored STORAGE/L2 16 [c0]")
	send(t, nc, c.subj, storeBatch(r0, 1, 3, ns, c1, wire.L1))
	send(t, nc, c.subj, storeBatch(r1, 1, 2, ns, c1, wire.L1))
	k.expect("eng", "both shards of c1 in L1", "BlockStored CPU 16 [c1]")

	// Rank 1 dies: its L1 copies are fenced (c1 goes), its L2 file stays
	// readable (c0 stays).
	_ = m1.Shutdown()
	testutil.Eventually(t, 20*time.Second, "rank 1 to be fenced", func() bool {
		ri, _ := c.idx.Rank(r1)
		return ri.Fenced
	})
	k.expect("eng", "rank 1 fenced dead", "BlockRemoved CPU [c1]")

	// An operator resets rank 0: its L2 copy of c0 goes.
	call[wire.AdminRankResetReply](t, nc, c.subj.Admin(wire.AdminRankReset), wire.AdminRankResetRequest{Rank: r0.String()})
	k.expect("eng", "rank 0 reset", "BlockRemoved STORAGE/L2 [c0]")

	// Rank 0 starts over and stores c0's shard in L2 again.
	send(t, nc, c.subj, storeBatch(r0, 1, 0, ns, c0, wire.L2))
	k.expect("eng", "shard 0 of c0 back in L2", "BlockStored STORAGE/L2 16 [c0]")

	// A restart: the router, connected before the new coordinator opens
	// its index, sees AllBlocksCleared and the snapshot of each instance.
	c.Shutdown()
	cfg = testConfig(t, dir)
	mod(&cfg)
	urls := make(chan struct{}, 1)
	release := make(chan struct{})
	cfg.indexOpenHook = func() { urls <- struct{}{}; <-release }
	c, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Shutdown)
	started := make(chan error, 1)
	go func() { started <- c.Start() }()
	<-urls
	rc := connect(t, c)
	sub, err := rc.SubscribeSync(c.subj.KVEventsAll())
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Flush(); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-started; err != nil {
		t.Fatal(err)
	}
	k.c, k.sub, k.nc = c, sub, connect(t, c)
	got := map[string][]string{}
	for len(got) < 2 {
		subj, evs := k.next()
		got[subj] = evs
	}
	want := []string{"AllBlocksCleared", "BlockStored STORAGE/L2 16 [c0]"}
	if g := got[c.subj.KVEvents("eng")]; !slices.Equal(g, want) {
		t.Fatalf("after a restart: KV events of eng %q, want %q", g, want)
	}
	if g := got[c.subj.KVEvents("mark")]; len(g) != 2 || g[0] != "AllBlocksCleared" {
		t.Fatalf("after a restart: KV events of mark %q, want AllBlocksCleared and its snapshot", g)
	}
	if n := testutil.Metric(t, c.reg, "kvtier_coord_kvevents_snapshots_total"); n != 1 {
		t.Fatalf("snapshots after the restart = %v, want 1", n)
	}
}

// TestKVEventsShareGroup: a member's L2 copy is announced for every
// member of its group (they may read it), its L1 copy for itself only,
// and its L2 eviction removes the chunk for the whole group.
func TestKVEventsShareGroup(t *testing.T) {
	c := startCoord(t, func(cfg *Config) {
		cfg.KVEvents = true
		cfg.ShareGroups = []ShareGroup{{Name: "chat", Instances: []string{"chat-a", "chat-b"}}}
	})
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	k := newKVRouter(t, c, nc)
	a := wire.Rank{Instance: "chat-a"}
	c0 := chain(ns, 1, 3)
	k.names[c0[0]] = "c0"
	send(t, nc, c.subj, storeBatch(a, 1, 0, ns, c0, wire.L1))
	k.expect("chat-a", "c0 in chat-a's L1", "BlockStored CPU 16 [c0]")
	send(t, nc, c.subj, storeBatch(a, 1, 1, ns, c0, wire.L2))
	stored := []string{"BlockStored STORAGE/L2 16 [c0]"}
	if got := k.barrierAll(); len(got) != 2 || !slices.Equal(got["chat-a"], stored) || !slices.Equal(got["chat-b"], stored) {
		t.Fatalf("c0 in chat-a's L2: events %q, want %q for chat-a and chat-b", got, stored)
	}
	evict := storeBatch(a, 1, 2, ns, c0, wire.L2)
	evict.Events[0].Kind = wire.Removed
	send(t, nc, c.subj, evict)
	removed := []string{"BlockRemoved STORAGE/L2 [c0]"}
	if got := k.barrierAll(); len(got) != 2 || !slices.Equal(got["chat-a"], removed) || !slices.Equal(got["chat-b"], removed) {
		t.Fatalf("c0 evicted from chat-a's L2: events %q, want %q for chat-a and chat-b", got, removed)
	}
}

// TestKVEventsResync: an inventory that no longer lists a copy removes
// the chunk.
func TestKVEventsResync(t *testing.T) {
	c := startCoord(t, func(cfg *Config) { cfg.KVEvents = true })
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	k := newKVRouter(t, c, nc)
	r := wire.Rank{Instance: "eng"}
	c0 := chain(ns, 1, 5)
	k.names[c0[0]] = "c0"
	send(t, nc, c.subj, storeBatch(r, 1, 0, ns, c0, wire.L2))
	k.expect("eng", "c0 in L2", "BlockStored STORAGE/L2 16 [c0]")
	serveInventory(t, c, r, wire.Inventory{Rank: r, Incarnation: 1, Seq: 1})
	c.startResync(r)
	testutil.Eventually(t, 10*time.Second, "the empty inventory to be applied", func() bool {
		return testutil.Metric(t, c.reg, "kvtier_coord_resyncs_total", "outcome", "ok") >= 1
	})
	k.expect("eng", "an inventory without c0", "BlockRemoved STORAGE/L2 [c0]")
}

// TestKVEventsOverflow: when the publisher's queue is full it does not
// drop the change silently: it counts the overflow and sends
// AllBlocksCleared and a fresh snapshot.
func TestKVEventsOverflow(t *testing.T) {
	c := startCoord(t, func(cfg *Config) { cfg.KVEvents, cfg.KVEventsQueue = true, 1 })
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	k := newKVRouter(t, c, nc)
	c0 := chain(ns, 1, 9)
	k.names[c0[0]] = "c0"
	send(t, nc, c.subj, storeBatch(wire.Rank{Instance: "eng"}, 1, 0, ns, c0, wire.L1))
	k.expect("eng", "c0 in L1", "BlockStored CPU 16 [c0]")
	for i := 0; testutil.Metric(t, c.reg, "kvtier_coord_kvevents_queue_overflows_total") == 0; i++ {
		if i == 100000 {
			t.Fatal("the queue of one never overflowed")
		}
		c.kvEnqueue(kvJob{inst: "nobody"})
	}
	got := k.barrierAll()
	// After the overflow the router sees the state again from scratch: a
	// cleared-and-stored pair, nothing else. A make test run saw the pair
	// twice (under load the start's snapshot can land after the router
	// subscribed), so one or more pairs pass; a missing pair or any other
	// event fails.
	pair := []string{"AllBlocksCleared", "BlockStored CPU 16 [c0]"}
	ev := got["eng"]
	ok := len(ev) >= 2 && len(ev)%2 == 0
	for i := 0; ok && i < len(ev); i += 2 {
		ok = slices.Equal(ev[i:i+2], pair)
	}
	if !ok {
		t.Fatalf("after an overflow: events of eng %q, want one or more %q", ev, pair)
	}
	if n := testutil.Metric(t, c.reg, "kvtier_coord_kvevents_snapshots_total"); n < 2 {
		t.Fatalf("snapshots = %v, want at least 2 (start, overflow)", n)
	}
}

// TestKVEventsRaftLeaderChange: in a replicated cluster only the leader
// publishes (one BlockStored, not one per replica), and a new leader
// starts with AllBlocksCleared and the snapshot, so a router follows the
// failover.
func TestKVEventsRaftLeaderChange(t *testing.T) {
	rc := newRaftCluster(t, 3, func(cfg *Config) { cfg.KVEvents = true })
	l := rc.leader()
	testutil.Eventually(t, 10*time.Second, "the leader's first snapshot", func() bool {
		return testutil.Metric(t, rc.nodes[l].reg, "kvtier_coord_kvevents_snapshots_total") >= 1
	})
	ns := retryCall[wire.RegisterReply](t, rc.nc, rc.subj.Coord(wire.CoordRegister), testSpec(2)).Namespace
	k := newKVRouter(t, rc.nodes[l], rc.nc)
	c0 := chain(ns, 1, 4)
	k.names[c0[0]] = "c0"
	for tp := range 2 {
		send(t, rc.nc, rc.subj, storeBatch(wire.Rank{Instance: "eng", TPRank: tp}, 1, 0, ns, c0, wire.L1))
	}
	k.expect("eng", "both shards of c0 in L1, three replicas", "BlockStored CPU 16 [c0]")

	rc.stop(l)
	if l2 := rc.leader(); l2 == l {
		t.Fatalf("stopped node %d still leads", l)
	}
	for {
		subj, evs := k.next()
		if subj != rc.subj.KVEvents("eng") {
			continue // the marker's snapshot
		}
		if want := []string{"AllBlocksCleared", "BlockStored CPU 16 [c0]"}; !slices.Equal(evs, want) {
			t.Fatalf("after the leader change: KV events of eng %q, want %q", evs, want)
		}
		return
	}
}
