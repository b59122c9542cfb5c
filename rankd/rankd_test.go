package rankd

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

func TestMain(m *testing.M) {
	testutil.Main(m,
		// nats.go and memberlist leave short-lived goroutines behind on close.
		goleak.IgnoreTopFunction("github.com/nats-io/nats.go.(*Conn).doReconnect"),
		goleak.IgnoreTopFunction("time.Sleep"),
	)
}

// harness is an embedded NATS with a fake coordinator (acks every event
// batch, records restore reports) and one daemon on the host backend.
type harness struct {
	t       *testing.T
	srv     *server.Server
	nc      *nats.Conn
	d       *Daemon
	hostCfg cuda.HostConfig
	cfg     Config // the daemon's config (a restart reuses it)
	subj    wire.Subjects
	rank    wire.Rank

	mu      sync.Mutex
	events  []wire.Event
	reports []wire.RestoreReport
	// binaryReports counts the reports that arrived in the binary form.
	binaryReports int
	// refuseReports makes the fake coordinator answer every report with
	// code unavailable (the rankd retries); refused counts those answers.
	refuseReports bool
	refused       int
}

func newHarness(t *testing.T, opts ...func(*Config)) *harness {
	t.Helper()
	srv := testutil.NATS(t) // no auth: the engine API tests; auth is tested in auth/ and e2e/
	nc, err := bus.Connect(srv.ClientURL(), "test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	h := &harness{t: t, srv: srv, nc: nc, subj: wire.Subjects{Prefix: "kvt"}, rank: wire.Rank{Instance: "eng", TPRank: 1},
		hostCfg: cuda.HostConfig{Dir: t.TempDir(), UUID: "HOST-rankd-test"}}
	if err := os.Chmod(h.hostCfg.Dir, 0o700); err != nil { // the host backend wants a private dir
		t.Fatal(err)
	}
	if _, err := nc.Subscribe(h.subj.EventsAll(), func(m *nats.Msg) {
		var b wire.Batch
		if err := b.UnmarshalBinary(m.Data); err != nil {
			_ = bus.RespondError(m, wire.CodeBadRequest, err.Error())
			return
		}
		h.mu.Lock()
		h.events = append(h.events, b.Events...)
		h.mu.Unlock()
		_ = bus.Respond(m, &wire.EventAck{AppliedThrough: b.Events[len(b.Events)-1].Seq})
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Subscribe(h.subj.Report(h.rank), func(m *nats.Msg) {
		r, err := decodeReport(m)
		if err != nil {
			_ = bus.RespondError(m, wire.CodeBadRequest, err.Error())
			return
		}
		h.mu.Lock()
		if wire.IsBinaryReport(m.Data) {
			h.binaryReports++
		}
		if h.refuseReports {
			h.refused++
			h.mu.Unlock()
			_ = bus.RespondError(m, wire.CodeUnavailable, "test: reports refused")
			return
		}
		h.reports = append(h.reports, r)
		h.mu.Unlock()
		_ = bus.Respond(m, &wire.ReportAck{State: wire.VerdictPending})
	}); err != nil {
		t.Fatal(err)
	}

	cfg := DefaultConfig(h.rank)
	cfg.TPSize = 2
	cfg.Device, cfg.Host = "host", h.hostCfg
	cfg.L1Bytes = 64 << 20
	cfg.L2Dir = t.TempDir()
	// No free-space floor: its default (5 % of the file system) would make
	// these tests evict L2 objects on a machine whose disk is nearly full.
	cfg.L2FreeFloorBytes, cfg.L2FreeFloorPercent = 0, 0
	cfg.NATSURL = srv.ClientURL()
	cfg.Insecure = true
	cfg.Prefix = "kvt"
	cfg.BindAddr, cfg.BindPort = "127.0.0.1", 0
	cfg.HeartbeatInterval = 100 * time.Millisecond
	cfg.Logger = zaptest.NewLogger(t)
	for _, o := range opts {
		o(&cfg)
	}
	h.cfg = cfg
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.d = d
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.Start(ctx); err != nil {
		_ = d.Shutdown(context.Background())
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Shutdown(context.Background()) })
	return h
}

func (h *harness) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	h.t.Cleanup(cancel)
	return ctx
}

// engine is a minimal engine worker: one MLA group at DCP1 with 561-byte
// rows and a 37-byte pad, two layers.
type engine struct {
	dev   cuda.Device
	pools []cuda.Mem
	spec  dcp.Spec
	res   *dcp.Resolved
	g     dcp.PageGeometry
}

const blocks = 8

// recordedEvent records a new event on s and exports it, as an engine
// hands its producer event to a store; the event lives until the test
// ends (a rankd may still wait on it after its reply).
func recordedEvent(t *testing.T, e *engine, s cuda.Stream) wire.EventHandle {
	t.Helper()
	ev, err := e.dev.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ev.Release() })
	if err := s.Record(ev); err != nil {
		t.Fatal(err)
	}
	evh, err := e.dev.ExportEvent(ev)
	if err != nil {
		t.Fatal(err)
	}
	return evh
}

func newEngine(t *testing.T, h *harness) *engine {
	dev, err := cuda.OpenHost(h.hostCfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dev.Close() })
	e := &engine{dev: dev, spec: testSpec()}
	if e.res, err = e.spec.Resolve(); err != nil {
		t.Fatal(err)
	}
	e.g = e.res.Geometry[0]
	for l := range 2 {
		m, err := dev.Alloc(e.g.PoolBytes(blocks))
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, m.Size())
		for i := range buf {
			buf[i] = 0xEE
		}
		if err := dev.Write(m, 0, buf); err != nil {
			t.Fatal(err)
		}
		_ = l
		e.pools = append(e.pools, m)
	}
	return e
}

func (e *engine) registerReq(t *testing.T) wire.RegisterRequest {
	req := wire.RegisterRequest{Spec: e.spec, DeviceUUID: e.dev.Info().UUID}
	for l, m := range e.pools {
		hdl, err := e.dev.ExportMem(m, 0, m.Size())
		if err != nil {
			t.Fatal(err)
		}
		req.Pools = append(req.Pools, wire.PoolRegistration{Group: 0, Layer: l, Handle: hdl})
	}
	return req
}

// newStoringEngine is newEngine with its group made non-MLA, so that
// rank 1 stores its own shard of every chunk, registered with h's rankd.
func newStoringEngine(t *testing.T, h *harness) (*engine, *wire.RegisterReply) {
	t.Helper()
	e := newEngine(t, h)
	e.spec.Groups[0].MLA = false
	var err error
	if e.res, err = e.spec.Resolve(); err != nil {
		t.Fatal(err)
	}
	reg, err := bus.Call[wire.RegisterReply](h.ctx(), h.nc, h.subj.Engine(h.rank, OpRegister), e.registerReq(t))
	if err != nil {
		t.Fatal(err)
	}
	return e, reg
}

// storeFirstChunk stores the chunk of 16 zero tokens from block 2 under
// session (a producer event recorded on no stream: nothing to wait for).
func (e *engine) storeFirstChunk(t *testing.T, h *harness, session string) (wire.StoreReply, error) {
	t.Helper()
	ev, err := e.dev.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Release()
	evh, err := e.dev.ExportEvent(ev)
	if err != nil {
		t.Fatal(err)
	}
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	st, err := bus.Call[wire.StoreReply](h.ctx(), h.nc, h.subj.Engine(h.rank, OpStore), wire.StoreRequest{
		RequestID: "r", Namespace: e.res.Namespace, Session: session, Event: evh,
		Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}})
	if err != nil {
		return wire.StoreReply{}, err
	}
	return *st, nil
}

// stream is a new stream on e's device, closed when the test ends.
func (e *engine) stream(t *testing.T) cuda.Stream {
	t.Helper()
	s, err := e.dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// uploadPage fills block of every layer's pool with its pageOf on s, as
// an engine's forward pass fills a block, and returns the pages in layer
// order: the object a store of that block holds.
func (e *engine) uploadPage(t *testing.T, s cuda.Stream, block int64) []byte {
	t.Helper()
	var pages []byte
	for l, m := range e.pools {
		page := pageOf(l, block, e.g.PageBytes)
		if _, err := s.Upload(m, uint64(block)*e.g.StrideBytes, page); err != nil {
			t.Fatal(err)
		}
		pages = append(pages, page...)
	}
	return pages
}

func pageOf(layer int, block int64, n uint64) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(uint64(layer)*131 + uint64(block)*7 + uint64(i)*13 + uint64(i>>8))
	}
	return b
}

// engineBody is req as the engine sends it: JSON (bus.Call encodes it)
// or, with binary, its binary form (wire/reqbin.go).
func engineBody(t *testing.T, asBinary bool, req interface{ MarshalBinary() ([]byte, error) }) any {
	t.Helper()
	if !asBinary {
		return req
	}
	b, err := req.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	return bus.Raw(b)
}

// requestWithDeadline sends body to h's rank as the engine's op, with
// wire.HeaderDeadline set to deadline unless it is empty, and returns the
// decoded reply.
func requestWithDeadline[T any](t *testing.T, h *harness, ctx context.Context, op string, body []byte, deadline string) *wire.Reply[T] {
	t.Helper()
	return requestWithHeader[T](t, h, ctx, op, body, wire.HeaderDeadline, deadline)
}

// requestWithHeader sends body to h's rank as the engine's op, with the
// NATS header name set to value unless it is empty, and returns the
// decoded reply.
func requestWithHeader[T any](t *testing.T, h *harness, ctx context.Context, op string, body []byte, name, value string) *wire.Reply[T] {
	t.Helper()
	m := nats.NewMsg(h.subj.Engine(h.rank, op))
	m.Data = body
	if value != "" {
		m.Header.Set(name, value)
	}
	rep, err := h.nc.RequestMsgWithContext(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	var r wire.Reply[T]
	if err := json.Unmarshal(rep.Data, &r); err != nil {
		t.Fatal(err)
	}
	return &r
}

// TestDaemonStoreRetrieveReport: stores, a retrieve and its report, bad
// input refused with stable codes, with the store and retrieve requests
// as JSON and as binary.
func TestDaemonStoreRetrieveReport(t *testing.T) {
	for _, form := range []string{"json", "binary"} {
		t.Run(form, func(t *testing.T) { testDaemonStoreRetrieveReport(t, form == "binary") })
	}
}

func testDaemonStoreRetrieveReport(t *testing.T, asBinary bool) {
	h := newHarness(t)
	e := newEngine(t, h)
	ctx := h.ctx()
	call := func(op string, data []byte) ([]byte, error) {
		m, err := h.nc.RequestWithContext(ctx, h.subj.Engine(h.rank, op), data)
		if err != nil {
			return nil, err
		}
		return m.Data, nil
	}

	reg, err := bus.Call[wire.RegisterReply](ctx, h.nc, h.subj.Engine(h.rank, OpRegister), e.registerReq(t))
	if err != nil {
		t.Fatal(err)
	}
	if reg.Namespace != e.res.Namespace {
		t.Fatalf("namespace %s, want %s", reg.Namespace, e.res.Namespace)
	}

	// Store chunk 0 from block 2, written by a stream behind a delay, with
	// the producer event recorded behind the writes.
	s, err := e.dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Delay(30 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	for l, m := range e.pools {
		if _, err := s.Upload(m, 2*e.g.StrideBytes, pageOf(l, 2, e.g.PageBytes)); err != nil {
			t.Fatal(err)
		}
	}
	ev, err := e.dev.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Record(ev); err != nil {
		t.Fatal(err)
	}
	evh, err := e.dev.ExportEvent(ev)
	if err != nil {
		t.Fatal(err)
	}
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	st, err := bus.Call[wire.StoreReply](ctx, h.nc, h.subj.Engine(h.rank, OpStore), engineBody(t, asBinary, &wire.StoreRequest{
		RequestID: "r", Namespace: e.res.Namespace, Session: reg.Session, Event: evh,
		Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}}))
	if err != nil {
		t.Fatal(err)
	}
	_ = ev.Release()
	// TP rank 1 does not store the MLA shard at DCP1 (rank 0 does).
	if st.Stored != 0 || len(st.Failed) != 0 {
		t.Fatalf("store reply %+v; rank 1 stores no MLA shard", st)
	}

	// Make rank 1 a storer: a non-MLA spec of its own.
	e.spec.Groups[0].MLA = false
	if e.res, err = e.spec.Resolve(); err != nil {
		t.Fatal(err)
	}
	reg2, err := bus.Call[wire.RegisterReply](ctx, h.nc, h.subj.Engine(h.rank, OpRegister), e.registerReq(t))
	if err != nil {
		t.Fatal(err)
	}
	if wire.CheckSessionID(reg2.Session) != nil || reg2.Session == reg.Session || reg2.Superseded != "" {
		t.Fatalf("register of a second namespace: %+v (first session %s)", reg2, reg.Session)
	}
	ev2, _ := e.dev.NewEvent(true)
	defer ev2.Release()
	if err := s.Record(ev2); err != nil {
		t.Fatal(err)
	}
	evh2, _ := e.dev.ExportEvent(ev2)
	chunk = dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	st, err = bus.Call[wire.StoreReply](ctx, h.nc, h.subj.Engine(h.rank, OpStore), engineBody(t, asBinary, &wire.StoreRequest{
		RequestID: "r", Namespace: e.res.Namespace, Session: reg2.Session, Event: evh2,
		Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}}))
	if err != nil {
		t.Fatal(err)
	}
	if st.Stored != 1 {
		t.Fatalf("store reply %+v, want 1 stored", st)
	}
	var want []byte
	for l := range e.pools {
		want = append(want, pageOf(l, 2, e.g.PageBytes)...)
	}
	key := dcp.Key{NS: e.res.Namespace, Chunk: chunk, Shard: 1, Group: 0}

	// Retrieve into block 5 as part of restore "R1": the report reaches the
	// coordinator with the checksum of the bytes placed.
	rr, err := bus.Call[wire.RetrieveReply](ctx, h.nc, h.subj.Engine(h.rank, OpRetrieve), engineBody(t, asBinary, &wire.RetrieveRequest{
		RestoreID: "R1", Namespace: e.res.Namespace, Session: reg2.Session,
		Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key, Sum: checksum.Sum(want), Blocks: []int64{5}}}}))
	if err != nil {
		t.Fatal(err)
	}
	if len(rr.Results) != 1 || !rr.Results[0].OK || rr.Results[0].Sum != checksum.Sum(want) {
		t.Fatalf("retrieve results %+v", rr.Results)
	}
	for l, m := range e.pools {
		got := make([]byte, m.Size())
		if err := e.dev.Read(m, 0, got); err != nil {
			t.Fatal(err)
		}
		for b := int64(0); b < blocks; b++ {
			off := uint64(b) * e.g.StrideBytes
			page := got[off : off+e.g.PageBytes]
			switch b {
			case 2, 5:
				if !bytes.Equal(page, pageOf(l, 2, e.g.PageBytes)) {
					t.Fatalf("layer %d block %d differs", l, b)
				}
			default:
				if bytes.Count(page, []byte{0xEE}) != len(page) {
					t.Fatalf("layer %d block %d was written", l, b)
				}
			}
			if b < blocks-1 && bytes.Count(got[off+e.g.PageBytes:off+e.g.StrideBytes], []byte{0xEE}) != int(e.g.Padding()) {
				t.Fatalf("layer %d padding after block %d was written", l, b)
			}
		}
	}
	// The report goes out beside the reply, so it may land just after it.
	var reports []wire.RestoreReport
	testutil.Eventually(t, 10*time.Second, "the retrieve's report", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		reports = append([]wire.RestoreReport(nil), h.reports...)
		return len(reports) > 0
	})
	if len(reports) != 1 || reports[0].RestoreID != "R1" || reports[0].Rank != h.rank ||
		!reports[0].Results[0].OK || reports[0].Results[0].Sum != checksum.Sum(want) {
		t.Fatalf("reports %+v", reports)
	}

	// An engine that reads the verdict asks for the failed items only
	// (wire.HeaderResults); the report still carries every item.
	missing := dcp.Key{NS: e.res.Namespace, Chunk: dcp.ChunkHash{9}, Shard: 1, Group: 0}
	rr, err = bus.Call[wire.RetrieveReply](ctx, h.nc, h.subj.Engine(h.rank, OpRetrieve), bus.Headed{
		Header: nats.Header{wire.HeaderResults: []string{wire.ResultsFailed}},
		Body: engineBody(t, asBinary, &wire.RetrieveRequest{RestoreID: "R2", Namespace: e.res.Namespace, Session: reg2.Session,
			Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key, Sum: checksum.Sum(want), Blocks: []int64{5}},
				{Chunk: 1, Group: 0, Key: missing, Sum: 7, Blocks: []int64{6}}}})})
	if err != nil {
		t.Fatal(err)
	}
	if len(rr.Results) != 1 || rr.Results[0].OK || rr.Results[0].Chunk != 1 {
		t.Fatalf("retrieve asking for failed results only answered %+v", rr.Results)
	}
	testutil.Eventually(t, 10*time.Second, "the second retrieve's report", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		reports = append([]wire.RestoreReport(nil), h.reports...)
		return len(reports) > 1
	})
	if r := reports[1]; r.RestoreID != "R2" || len(r.Results) != 2 || !r.Results[0].OK || r.Results[1].OK {
		t.Fatalf("report of the second retrieve %+v, want both items", r)
	}

	// Bad input: clear errors with stable codes; the daemon keeps serving.
	for _, c := range []struct {
		op, body, code string
	}{
		{OpStore, `{garbage`, wire.CodeBadRequest},
		{OpStore, `{"request_id":"x","bogus":1}`, wire.CodeBadRequest},
		{OpRetrieve, `{"namespace":"09000000000000000000000000000000","items":[{"key":"09000000000000000000000000000000.00000000000000000000000000000000.1.0","blocks":[1]}]}`, wire.CodeUnknownNamespace},
		{OpRetrieve, `{"namespace":` + nsJSON(e.res.Namespace) + `,"session":"` + reg2.Session + `","items":[{"key":"` + key.String() + `","blocks":[99]}]}`, wire.CodeBadRequest},
		{OpRetrieve, `{"namespace":` + nsJSON(e.res.Namespace) + `,"items":[{"key":"` + key.String() + `","blocks":[1]}]}`, wire.CodeUnknownSession},
		{OpRetrieve, `{"namespace":` + nsJSON(e.res.Namespace) + `,"session":"` + reg.Session + `","items":[{"key":"` + key.String() + `","blocks":[1]}]}`, wire.CodeBadRequest},
		{OpRegister, string(mustJSON(t, func() wire.RegisterRequest {
			r := e.registerReq(t)
			r.Spec.Groups[0].StrideBytes = 100
			return r
		}())), wire.CodeGeometry},
		{OpStatus, `{"x":1}`, wire.CodeBadRequest},
	} {
		data, err := call(c.op, []byte(c.body))
		if err != nil {
			t.Fatalf("%s %s: %v", c.op, c.body, err)
		}
		var rep wire.Reply[struct{}]
		if err := json.Unmarshal(data, &rep); err != nil || rep.Error == nil || rep.Error.Code != c.code {
			t.Fatalf("%s %.60s: reply %s, want code %s", c.op, c.body, data, c.code)
		}
	}
	// The same refusals of binary requests.
	bin := func(req interface{ MarshalBinary() ([]byte, error) }) []byte {
		b, err := req.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	ns9 := dcp.Namespace{9}
	overItems := bin(&wire.RetrieveRequest{Namespace: e.res.Namespace, Session: reg2.Session})
	binary.BigEndian.PutUint32(overItems[len(overItems)-4:], MaxItemsPerRetrieve+1)
	for _, c := range []struct {
		name, op string
		body     []byte
		code     string
	}{
		{"version", OpStore, []byte("KVS9\x04"), wire.CodeBadRequest},
		{"truncated", OpStore, bin(&wire.StoreRequest{RequestID: "x", Namespace: e.res.Namespace})[:20], wire.CodeBadRequest},
		{"no event", OpStore, bin(&wire.StoreRequest{RequestID: "x", Namespace: e.res.Namespace, Session: reg2.Session,
			Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}}), wire.CodeBadRequest},
		{"unknown namespace", OpRetrieve, bin(&wire.RetrieveRequest{Namespace: ns9, Items: []wire.RetrieveItem{
			{Key: dcp.Key{NS: ns9, Shard: 1}, Blocks: []int64{1}}}}), wire.CodeUnknownNamespace},
		{"block outside the pool", OpRetrieve, bin(&wire.RetrieveRequest{Namespace: e.res.Namespace, Session: reg2.Session,
			Items: []wire.RetrieveItem{{Key: key, Blocks: []int64{99}}}}), wire.CodeBadRequest},
		{"no blocks", OpRetrieve, bin(&wire.RetrieveRequest{Namespace: e.res.Namespace, Session: reg2.Session,
			Items: []wire.RetrieveItem{{Key: key}}}), wire.CodeBadRequest},
		{"items over the limit", OpRetrieve, overItems, wire.CodeTooLarge},
	} {
		data, err := call(c.op, c.body)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		var rep wire.Reply[struct{}]
		if err := json.Unmarshal(data, &rep); err != nil || rep.Error == nil || rep.Error.Code != c.code {
			t.Fatalf("binary %s %s: reply %s, want code %s", c.op, c.name, data, c.code)
		}
	}
	big := `{"request_id":"` + strings.Repeat("y", MaxRequestBytes) + `"}`
	if data, err := call(OpStore, []byte(big)); err != nil || !strings.Contains(string(data), wire.CodeTooLarge) {
		t.Fatalf("oversize store: %v %.100s", err, data)
	}

	var we *wire.Error
	stat, err := bus.Call[StatusReply](ctx, h.nc, h.subj.Engine(h.rank, OpStatus), struct{}{})
	if err != nil || stat.Incarnation != h.d.Incarnation() || !stat.Accepting || stat.Engine.ObjectsStored != 1 {
		t.Fatalf("status %+v, %v", stat, err)
	}
	inv, err := bus.FetchInventory(ctx, h.nc, h.subj.Inventory(h.rank), 0, 0)
	if err != nil || inv.Incarnation != h.d.Incarnation() {
		t.Fatalf("inventory %+v, %v", inv, err)
	}
	found := false
	for _, o := range inv.Objects {
		found = found || (o.Key == key && o.Tier == wire.L1)
	}
	if !found {
		t.Fatalf("inventory lacks %s in L1: %+v", key, inv.Objects)
	}

	// Release: the pools are gone, the objects stay.
	if _, err := bus.Call[ReleaseReply](ctx, h.nc, h.subj.Engine(h.rank, OpRelease), ReleaseRequest{Namespace: e.res.Namespace, Session: reg2.Session}); err != nil {
		t.Fatal(err)
	}
	_, err = bus.Call[wire.RetrieveReply](ctx, h.nc, h.subj.Engine(h.rank, OpRetrieve), wire.RetrieveRequest{
		Namespace: e.res.Namespace, Session: reg2.Session, Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key, Blocks: []int64{6}}}})
	if !errors.As(err, &we) || we.Code != wire.CodeStaleSession {
		t.Fatalf("retrieve after release: %v, want %s", err, wire.CodeStaleSession)
	}
	if inv, err := bus.FetchInventory(ctx, h.nc, h.subj.Inventory(h.rank), 0, 0); err != nil || len(inv.Objects) == 0 {
		t.Fatalf("inventory after release: %+v, %v", inv, err)
	}

	// Health and metrics.
	for _, path := range []string{"/healthz", "/readyz", "/metrics", "/status"} {
		resp, err := http.Get("http://" + h.d.HTTPAddr() + path)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("GET %s: %v %v", path, err, resp)
		}
		resp.Body.Close()
	}

	// Shutdown flushes every event: the coordinator saw the L1 and L2
	// placements in sequence order without gaps.
	if err := h.d.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var l2 bool
	for i, ev := range h.events {
		if ev.Seq != uint64(i+1) {
			t.Fatalf("event %d has seq %d", i, ev.Seq)
		}
		l2 = l2 || (ev.Key == key && ev.Tier == wire.L2 && ev.Kind == wire.Stored)
	}
	if !l2 {
		t.Fatalf("no L2 placement event among %d events", len(h.events))
	}
	// After shutdown, engine requests get no answer (or unavailable).
	sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer scancel()
	_, err = bus.Call[StatusReply](sctx, h.nc, h.subj.Engine(h.rank, OpStatus), struct{}{})
	if err == nil || (errors.As(err, &we) && we.Code != wire.CodeUnavailable) {
		t.Fatalf("status after shutdown: %v", err)
	}
}

func nsJSON(ns dcp.Namespace) string {
	b, _ := json.Marshal(ns)
	return string(b)
}

// TestRejectedRetrieveReportsItsRestore: a retrieve of a restore that
// fails validation after its restore id and items were decoded reports
// every item failed to the coordinator before the error reply, so the
// restore fails now rather than at its deadline.
// The same for a binary request.
func TestRejectedRetrieveReportsItsRestore(t *testing.T) {
	for _, form := range []string{"json", "binary"} {
		t.Run(form, func(t *testing.T) { testRejectedRetrieveReportsItsRestore(t, form == "binary") })
	}
}

func testRejectedRetrieveReportsItsRestore(t *testing.T, asBinary bool) {
	h := newHarness(t)
	ctx := h.ctx()
	ns := "0a000000000000000000000000000000"
	key := ns + ".00000000000000000000000000000000.1.0"
	body := `{"restore_id":"R-bad","namespace":"` + ns + `","items":[` +
		`{"chunk":0,"group":0,"key":"` + key + `","blocks":[1]},` +
		`{"chunk":1,"group":0,"key":"` + key + `","blocks":[]}]}`
	var req any = json.RawMessage(body)
	if asBinary {
		var r wire.RetrieveRequest
		if err := json.Unmarshal([]byte(body), &r); err != nil {
			t.Fatal(err)
		}
		req = engineBody(t, true, &r)
	}
	rep, rerr := bus.Call[wire.RetrieveReply](ctx, h.nc, h.subj.Engine(h.rank, OpRetrieve), req)
	if rerr == nil {
		t.Fatalf("invalid retrieve answered %+v", rep)
	}
	h.mu.Lock()
	reports := append([]wire.RestoreReport(nil), h.reports...)
	h.mu.Unlock()
	if len(reports) != 1 || reports[0].RestoreID != "R-bad" || reports[0].Rank != h.rank || len(reports[0].Results) != 2 {
		t.Fatalf("reports %+v (reply error %v), want one of restore R-bad with 2 items", reports, rerr)
	}
	for i, r := range reports[0].Results {
		if r.OK || r.Chunk != i || r.Group != 0 || r.Reason != "rejected: "+wire.CodeBadRequest {
			t.Errorf("item %d reported %+v, want failed, rejected: %s", i, r, wire.CodeBadRequest)
		}
	}
}

// The daemon announces its incarnation's last event sequence, so the
// coordinator can notice events lost while the rank is idle.
func TestHeartbeatAnnouncesLastSeq(t *testing.T) {
	h := newHarness(t)
	beats := make(chan wire.Heartbeat, 16)
	sub, err := h.nc.Subscribe(h.subj.Heartbeat(h.rank), func(m *nats.Msg) {
		var hb wire.Heartbeat
		if err := json.Unmarshal(m.Data, &hb); err == nil {
			select {
			case beats <- hb:
			default:
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case hb := <-beats:
			if hb.Rank != h.rank || hb.Incarnation != h.d.inc {
				t.Fatalf("heartbeat %+v, want rank %s incarnation %d", hb, h.rank, h.d.inc)
			}
			if hb.Seq == h.d.eng.Stats().LastSeq {
				return
			}
		case <-deadline:
			t.Fatal("no heartbeat announcing the engine's last sequence within 10 s")
		}
	}
}

// TestL1SlabBytesReachesTheEngine: Config.L1SlabBytes is L1's allocation
// unit, an object taking whole slabs (a small one wastes the rest); 0
// keeps transfer.SlabFor's (4 KiB for the harness's 64 MiB L1).
func TestL1SlabBytesReachesTheEngine(t *testing.T) {
	for _, tc := range []struct{ slab, want uint64 }{{0, 4096}, {1 << 20, 1 << 20}} {
		h := newHarness(t, func(c *Config) { c.L1SlabBytes = tc.slab })
		e, reg := newStoringEngine(t, h) // rank 1 stores
		if st, err := e.storeFirstChunk(t, h, reg.Session); err != nil || st.Stored != 1 {
			t.Fatalf("slab %d: store %+v, %v", tc.slab, st, err)
		}
		size := uint64(len(e.pools)) * e.g.PageBytes // one page a layer
		want := (size + tc.want - 1) / tc.want * tc.want
		if got := h.d.Engine().Stats().L1OccupiedBytes; size >= 1<<20 || got != want {
			t.Fatalf("slab %d: a %d B object occupies %d B of L1, want %d (slabs of %d B)", tc.slab, size, got, want, tc.want)
		}
	}
}
