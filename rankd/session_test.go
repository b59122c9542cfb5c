package rankd

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// testIdentityHeader stands in for the connection layer's authenticated
// identity in these tests.
const testIdentityHeader = "Kvtier-Test-Engine"

// callAs sends an engine API request as the given engine identity and
// returns the reply's error (nil on success) and its raw body.
func callAs(t *testing.T, h *harness, ctx context.Context, who, op string, req any) (*wire.Error, []byte) {
	t.Helper()
	msg := nats.NewMsg(h.subj.Engine(h.rank, op))
	msg.Header.Set(testIdentityHeader, who)
	msg.Data = mustJSON(t, req)
	rep, err := h.nc.RequestMsgWithContext(ctx, msg)
	if err != nil {
		t.Fatalf("%s as %s: %v", op, who, err)
	}
	var r wire.Reply[json.RawMessage]
	if err := json.Unmarshal(rep.Data, &r); err != nil {
		t.Fatalf("%s reply %s: %v", op, rep.Data, err)
	}
	return r.Error, rep.Data
}

func registerAs(t *testing.T, h *harness, ctx context.Context, who string, e *engine) wire.RegisterReply {
	t.Helper()
	we, data := callAs(t, h, ctx, who, OpRegister, e.registerReq(t))
	if we != nil {
		t.Fatalf("register as %s: %v", who, we)
	}
	var r wire.Reply[wire.RegisterReply]
	if err := json.Unmarshal(data, &r); err != nil || r.OK == nil {
		t.Fatalf("register reply %s: %v", data, err)
	}
	return *r.OK
}

// TestSessionRefusals covers every refusal path of the session protocol
// over NATS: a superseded session (stale_session, counted, and a restore's
// retrieve reported failed at once), a session never issued
// (unknown_session), another engine identity (unauthorized, for register,
// store, retrieve and release), and a released session (stale_session).
// Nothing is ever written into the engine's pools.
func TestSessionRefusals(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.EngineIdentity = func(m *nats.Msg) string { return m.Header.Get(testIdentityHeader) }
	})
	ctx := h.ctx()
	ea, eb := newEngine(t, h), newEngine(t, h)
	for _, e := range []*engine{ea, eb} {
		e.spec.Groups[0].MLA = false // rank 1 stores every chunk
		var err error
		if e.res, err = e.spec.Resolve(); err != nil {
			t.Fatal(err)
		}
	}
	ns := ea.res.Namespace
	ra := registerAs(t, h, ctx, "engine/a", ea)
	rb := registerAs(t, h, ctx, "engine/a", eb) // the same engine identity, a second process
	if rb.Superseded != ra.Session || rb.Session == ra.Session || wire.CheckSessionID(rb.Session) != nil {
		t.Fatalf("second registration %+v, first session %s", rb, ra.Session)
	}
	if v := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_engine_sessions_superseded_total"); v != 1 {
		t.Fatalf("supersessions metric %v, want 1", v)
	}
	if st := h.d.Status(); st.Sessions != 1 {
		t.Fatalf("status: %d live sessions, want 1", st.Sessions)
	}

	evh := func(e *engine) wire.StoreRequest {
		ev, err := e.dev.NewEvent(true)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ev.Release() })
		s, err := e.dev.NewStream()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if err := s.Record(ev); err != nil {
			t.Fatal(err)
		}
		hdl, err := e.dev.ExportEvent(ev)
		if err != nil {
			t.Fatal(err)
		}
		chunk := dcp.ChunkHashes(ns, make([]uint32, 16), 16)[0]
		return wire.StoreRequest{RequestID: "r", Namespace: ns, Event: hdl,
			Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{3}}}}}
	}
	key := dcp.Key{NS: ns, Chunk: dcp.ChunkHashes(ns, make([]uint32, 16), 16)[0], Shard: 1, Group: 0}
	retrieve := func(session, restore string) wire.RetrieveRequest {
		return wire.RetrieveRequest{RestoreID: restore, Namespace: ns, Session: session,
			Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key, Blocks: []int64{4}}}}
	}

	cases := []struct {
		name, who, op string
		req           any
		code, want    string
	}{
		{"store of the superseded session", "engine/a", OpStore, func() any { r := evh(ea); r.Session = ra.Session; return r }(),
			wire.CodeStaleSession, "superseded by session " + rb.Session},
		{"retrieve of the superseded session", "engine/a", OpRetrieve, retrieve(ra.Session, "R-stale"),
			wire.CodeStaleSession, "superseded"},
		{"release of the superseded session", "engine/a", OpRelease, ReleaseRequest{Namespace: ns, Session: ra.Session},
			wire.CodeStaleSession, "superseded"},
		{"store of a session never issued", "engine/a", OpStore, func() any { r := evh(eb); r.Session = strings.Repeat("5a", 16); return r }(),
			wire.CodeUnknownSession, "never issued"},
		{"store naming no session", "engine/a", OpStore, evh(eb), wire.CodeUnknownSession, "names no session"},
		{"register by another identity", "engine/b", OpRegister, ea.registerReq(t),
			wire.CodeUnauthorized, `of engine "engine/a", the caller is "engine/b"`},
		{"store by another identity", "engine/b", OpStore, func() any { r := evh(eb); r.Session = rb.Session; return r }(),
			wire.CodeUnauthorized, `belongs to engine "engine/a", the caller is "engine/b"`},
		{"retrieve by another identity", "engine/b", OpRetrieve, retrieve(rb.Session, "R-other"),
			wire.CodeUnauthorized, "the caller is"},
		{"release by another identity", "engine/b", OpRelease, ReleaseRequest{Namespace: ns, Session: rb.Session},
			wire.CodeUnauthorized, "the caller is"},
	}
	for _, c := range cases {
		we, data := callAs(t, h, ctx, c.who, c.op, c.req)
		if we == nil || we.Code != c.code || !strings.Contains(we.Message, c.want) {
			t.Errorf("%s: reply %s, want code %s naming %q", c.name, data, c.code, c.want)
		}
	}
	// Refused retrieves of a restore are reported failed at once.
	h.mu.Lock()
	reports := append([]wire.RestoreReport(nil), h.reports...)
	h.mu.Unlock()
	got := map[string]string{}
	for _, r := range reports {
		if len(r.Results) == 1 && !r.Results[0].OK {
			got[r.RestoreID] = r.Results[0].Reason
		}
	}
	if got["R-stale"] != "rejected: "+wire.CodeStaleSession || got["R-other"] != "rejected: "+wire.CodeUnauthorized {
		t.Fatalf("reports of refused retrieves: %v", got)
	}

	// The owner releases the live session; it is stale afterwards.
	if we, data := callAs(t, h, ctx, "engine/a", OpRelease, ReleaseRequest{Namespace: ns, Session: rb.Session}); we != nil {
		t.Fatalf("release by the owner: %s", data)
	}
	r := evh(eb)
	r.Session = rb.Session
	if we, data := callAs(t, h, ctx, "engine/a", OpStore, r); we == nil || we.Code != wire.CodeStaleSession || !strings.Contains(we.Message, "released") {
		t.Fatalf("store after release: %s", data)
	}
	// Once no session is live, another identity may register the namespace.
	rc := registerAs(t, h, ctx, "engine/b", eb)
	if rc.Superseded != "" {
		t.Fatalf("registration after release superseded %s", rc.Superseded)
	}

	for _, e := range []*engine{ea, eb} {
		for l, m := range e.pools {
			got := make([]byte, m.Size())
			if err := e.dev.Read(m, 0, got); err != nil {
				t.Fatal(err)
			}
			if n := bytes.Count(got, []byte{0xEE}); n != len(got) {
				t.Fatalf("layer %d: %d of %d bytes were written", l, len(got)-n, len(got))
			}
		}
	}
}
