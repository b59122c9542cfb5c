package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) {
	// A raft future that raft dropped at its shutdown is never answered.
	testutil.Main(m, testutil.IgnoreRaftAwait)
}

// testLogger logs at KVTIER_TEST_LOG's level (default info) to t.
func testLogger(tb testing.TB) *zap.Logger {
	lvl := zap.InfoLevel
	if l, err := zapcore.ParseLevel(os.Getenv("KVTIER_TEST_LOG")); err == nil {
		lvl = l
	}
	return zaptest.NewLogger(tb, zaptest.Level(lvl))
}

// testConfig is a coordinator on loopback with free ports and a short
// restore deadline.
func testConfig(tb testing.TB, dir string) Config {
	cfg := DefaultConfig()
	if dir == "" {
		dir = tb.TempDir()
	}
	cfg.DataDir = dir
	// The protocol tests run without NATS auth (and use the unscoped
	// subjects it serves); auth_test.go and e2e/ test with it on.
	cfg.Insecure = true
	cfg.Embedded.Port = 0
	cfg.HTTPAddr = "127.0.0.1:0"
	cfg.Cluster.NodeName = "coord"
	cfg.Cluster.BindAddr = "127.0.0.1"
	cfg.Cluster.BindPort = 0
	cfg.Cluster.JoinRetry = 50 * time.Millisecond
	cfg.RestoreDeadline = 400 * time.Millisecond
	cfg.ResyncBackoff = 20 * time.Millisecond
	cfg.ResyncMaxBackoff = 200 * time.Millisecond
	cfg.ResyncTimeout = 2 * time.Second
	cfg.LeaveTimeout = 500 * time.Millisecond
	cfg.StartupFenceGrace = 0
	// Test ranks mostly send no heartbeats: a gossip death of one is
	// confirmed by silence after 3 x 100 ms (or at once when nothing
	// subscribes its inventory subject); deaths_test.go sends heartbeats.
	cfg.Death.AssumedInterval = 100 * time.Millisecond
	// Tests drive ranks over NATS without memberlist members.
	cfg.RequireMemberIncarnation = false
	cfg.Logger = testLogger(tb)
	return cfg
}

// startCoord starts a coordinator, shut down at the end of the test.
func startCoord(tb testing.TB, mod func(*Config)) *Coordinator {
	tb.Helper()
	cfg := testConfig(tb, "")
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	if err := c.Start(); err != nil {
		tb.Fatalf("Start: %v", err)
	}
	tb.Cleanup(c.Shutdown)
	return c
}

// connect dials the coordinator's NATS.
func connect(tb testing.TB, c *Coordinator) *nats.Conn {
	tb.Helper()
	nc, err := bus.Connect(c.NATSURL(), tb.Name())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

func tctx(tb testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	tb.Cleanup(cancel)
	return ctx
}

// call is bus.Call with a 10 s timeout, failing the test on error.
func call[T any](tb testing.TB, nc *nats.Conn, subject string, req any) *T {
	tb.Helper()
	rep, err := bus.Call[T](tctx(tb), nc, subject, req)
	if err != nil {
		tb.Fatalf("%s: %v", subject, err)
	}
	return rep
}

// callErr is bus.Call expecting an error reply with code.
func callErr[T any](tb testing.TB, nc *nats.Conn, subject string, req any, code string) *wire.Error {
	tb.Helper()
	_, err := bus.Call[T](tctx(tb), nc, subject, req)
	var we *wire.Error
	if !errors.As(err, &we) || we.Code != code {
		tb.Fatalf("%s: err = %v, want code %s", subject, err, code)
	}
	return we
}

// sendBatch sends a binary batch on its rank's subject and decodes the ack
// or error.
func sendBatch(tb testing.TB, nc *nats.Conn, subj wire.Subjects, b *wire.Batch) (*wire.EventAck, *wire.Error) {
	tb.Helper()
	p, err := b.MarshalBinary()
	if err != nil {
		tb.Fatal(err)
	}
	return sendRaw(tb, nc, subj.Events(b.Rank), p)
}

func sendRaw(tb testing.TB, nc *nats.Conn, subject string, p []byte) (*wire.EventAck, *wire.Error) {
	tb.Helper()
	msg, err := nc.RequestWithContext(tctx(tb), subject, p)
	if err != nil {
		tb.Fatalf("request %s: %v", subject, err)
	}
	var rep wire.Reply[wire.EventAck]
	if err := json.Unmarshal(msg.Data, &rep); err != nil {
		tb.Fatalf("decode ack %q: %v", msg.Data, err)
	}
	return rep.OK, rep.Error
}

// testSpec is a non-MLA attention model with TP tp: every rank stores and
// restores its own shard.
func testSpec(tp int) dcp.Spec {
	return dcp.Spec{
		Model: "test-model", Layout: dcp.Layout{TP: tp, DCP: 1, Interleave: 1, PP: 1}, ChunkTokens: 16,
		Groups: []dcp.Group{{Name: "attn", Kind: dcp.Attention, BlockSize: 16, Layers: 2, KVFormat: "bf16",
			SemanticBytes: 16 * 64, PageBytes: 16 * 64, StrideBytes: 16 * 64}},
	}
}

// register registers spec over NATS and returns its namespace.
func register(tb testing.TB, nc *nats.Conn, subj wire.Subjects, spec dcp.Spec) dcp.Namespace {
	tb.Helper()
	return call[wire.RegisterReply](tb, nc, subj.Coord(wire.CoordRegister), spec).Namespace
}

// chain returns n chunk hashes of a token run.
func chain(ns dcp.Namespace, n int, seed uint32) []dcp.ChunkHash {
	toks := make([]uint32, n*16)
	for i := range toks {
		toks[i] = seed*1000003 + uint32(i)
	}
	return dcp.ChunkHashes(ns, toks, 16)
}

// sumOf is the checksum a test rank records for a key.
func sumOf(k dcp.Key) uint64 {
	var h uint64 = 0xcbf29ce484222325
	for _, c := range k.Bytes() {
		h = (h ^ uint64(c)) * 0x100000001b3
	}
	return h
}

// storeBatch is a batch storing shard tp of every chunk in tier, from
// sequence seq+1.
func storeBatch(r wire.Rank, inc, seq uint64, ns dcp.Namespace, chunks []dcp.ChunkHash, tier wire.Tier) *wire.Batch {
	b := &wire.Batch{Rank: r, Incarnation: inc}
	for _, ch := range chunks {
		seq++
		k := dcp.Key{NS: ns, Chunk: ch, Shard: uint16(r.TPRank), Group: 0}
		b.Events = append(b.Events, wire.Event{Seq: seq, Kind: wire.Stored, Tier: tier, Key: k, Size: 2048, Sum: sumOf(k)})
	}
	return b
}

// startRankMember starts a rankd cluster member for rank r joined to the
// coordinator; the caller kills or shuts it down.
func startRankMember(tb testing.TB, c *Coordinator, r wire.Rank, tpSize int) *cluster.Cluster {
	return startRankMemberInc(tb, c, r, tpSize, 0)
}

// startRankMemberInc is startRankMember with a given incarnation (0: new).
func startRankMemberInc(tb testing.TB, c *Coordinator, r wire.Rank, tpSize int, inc uint64) *cluster.Cluster {
	tb.Helper()
	cc := cluster.DefaultConfig()
	cc.NodeName = "rankd-" + r.Instance + "-" + string(rune('0'+r.TPRank))
	cc.BindAddr, cc.BindPort = "127.0.0.1", 0
	cc.JoinRetry = 50 * time.Millisecond
	cc.Logger = testLogger(tb).Named(cc.NodeName)
	cc.Meta = cluster.Meta{Role: cluster.RoleRankd, Engine: r.Instance, TPRank: r.TPRank, TPSize: tpSize,
		DCPSize: 1, DCPRank: 0, NATS: []string{c.NATSURL()}, Incarnation: inc}
	m, err := cluster.New(cc)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = m.Shutdown() })
	if err := m.Start(); err != nil {
		tb.Fatal(err)
	}
	if _, err := m.Join(tctx(tb), c.GossipAddr()); err != nil {
		tb.Fatal(err)
	}
	return m
}

// inventoryOf is rank r's inventory holding exactly the placements of evs.
func inventoryOf(r wire.Rank, inc, seq uint64, evs []wire.Event) wire.Inventory {
	inv := wire.Inventory{Rank: r, Incarnation: inc, Seq: seq}
	for _, e := range evs {
		inv.Objects = append(inv.Objects, wire.Placement{Key: e.Key, Tier: e.Tier, Size: e.Size, Sum: e.Sum})
	}
	return inv
}

// serveInventory answers rank r's paged inventory requests with inv (pages
// of two objects) until the test ends and returns the count of snapshots
// taken (requests without a snapshot id).
func serveInventory(tb testing.TB, c *Coordinator, r wire.Rank, inv wire.Inventory) *atomic.Int32 {
	tb.Helper()
	var requests atomic.Int32
	srv := newInventoryServer(2)
	sub, err := connect(tb, c).Subscribe(c.subj.Inventory(r), func(m *nats.Msg) {
		if srv.fresh(m) {
			requests.Add(1)
		}
		srv.serve(m, func() wire.Inventory { return inv })
	})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = sub.Unsubscribe() })
	return &requests
}

// inventoryServer is a fake rank's side of the paged inventory protocol
// (wire.InventoryRequest): a request without a snapshot id takes a new
// snapshot, later ones are served from it.
type inventoryServer struct {
	pageSize int

	mu    sync.Mutex // guards the following
	n     int
	snaps map[string][]wire.InventoryPage
}

func newInventoryServer(pageSize int) *inventoryServer {
	return &inventoryServer{pageSize: pageSize, snaps: make(map[string][]wire.InventoryPage)}
}

func decodeInventoryRequest(m *nats.Msg) (wire.InventoryRequest, error) {
	var req wire.InventoryRequest
	err := json.Unmarshal(m.Data, &req)
	return req, err
}

// fresh reports whether m asks for a new snapshot.
func (s *inventoryServer) fresh(m *nats.Msg) bool {
	req, err := decodeInventoryRequest(m)
	return err == nil && req.Snapshot == "" && !req.Probe
}

// serve answers m; take gives the inventory of a new snapshot.
func (s *inventoryServer) serve(m *nats.Msg, take func() wire.Inventory) {
	req, err := decodeInventoryRequest(m)
	if err != nil {
		_ = bus.RespondError(m, wire.CodeBadRequest, err.Error())
		return
	}
	if req.Probe {
		// As a rankd from before: its identity is there, its incarnation
		// unknown (the death check then waits for silence).
		_ = bus.RespondError(m, wire.CodeBadRequest, "unknown field \"probe\"")
		return
	}
	s.mu.Lock()
	pages, ok := s.snaps[req.Snapshot]
	if req.Snapshot == "" {
		s.n++
		id := "snap-" + strconv.Itoa(s.n)
		inv := take()
		pages, ok = wire.PageInventory(&inv, id, s.pageSize), true
		s.snaps[id] = pages
	}
	s.mu.Unlock()
	switch {
	case !ok:
		_ = bus.RespondError(m, wire.CodeNotFound, "no snapshot "+req.Snapshot)
	case req.Page < 0 || req.Page >= len(pages):
		_ = bus.RespondError(m, wire.CodeBadRequest, "no page "+strconv.Itoa(req.Page))
	default:
		_ = bus.Respond(m, &pages[req.Page])
	}
}
