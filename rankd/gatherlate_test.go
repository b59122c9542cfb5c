package rankd

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestStoreGatherLimitFromTheEngine (issue 24, C11): a store's
// wire.HeaderGatherLimit reaches the transfer engine. The producer holds
// the gather 600 ms, past the limit 300 ms away (the engine had stopped
// waiting and may have reused the blocks): the store answers with its
// object failed, nothing stored, counted in
// kvtier_rankd_store_deadline_total{outcome=gather_late} and not as cut.
// A malformed limit is a bad request. Red when serveStore ignores the
// header: the object was stored.
func TestStoreGatherLimitFromTheEngine(t *testing.T) {
	h := newHarness(t)
	e, reg := newStoringEngine(t, h)
	ctx := h.ctx()
	s := e.stream(t)
	e.uploadPage(t, s, 2)
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	store := func(id string, deadline, limit time.Time, rawLimit string) *wire.Reply[wire.StoreReply] {
		t.Helper()
		body, err := json.Marshal(wire.StoreRequest{RequestID: id, Namespace: e.res.Namespace, Session: reg.Session,
			Event: recordedEvent(t, e, s), Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}})
		if err != nil {
			t.Fatal(err)
		}
		m := nats.NewMsg(h.subj.Engine(h.rank, OpStore))
		m.Data = body
		m.Header.Set(wire.HeaderDeadline, wire.FormatDeadline(deadline))
		if rawLimit == "" {
			rawLimit = wire.FormatDeadline(limit)
		}
		m.Header.Set(wire.HeaderGatherLimit, rawLimit)
		rep, err := h.nc.RequestMsgWithContext(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		var r wire.Reply[wire.StoreReply]
		if err := json.Unmarshal(rep.Data, &r); err != nil {
			t.Fatal(err)
		}
		return &r
	}
	stored := func() uint64 { return h.d.eng.Stats().ObjectsStored }

	if err := s.Delay(600 * time.Millisecond); err != nil { // the forward still writes the pages
		t.Fatal(err)
	}
	now := time.Now()
	late := store("late", now.Add(100*time.Millisecond), now.Add(300*time.Millisecond), "")
	if late.Error != nil || late.OK.Stored != 0 || len(late.OK.Failed) != 1 {
		t.Fatalf("a store whose gather ended after its limit answered %+v, want its object failed", late)
	}
	if n := stored(); n != 0 {
		t.Fatalf("a gather that ended after the engine stopped waiting stored %d objects", n)
	}
	if n := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_store_deadline_total", "outcome", "gather_late"); n != 1 {
		t.Fatalf("kvtier_rankd_store_deadline_total{outcome=gather_late} %v, want 1", n)
	}
	if n := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_store_deadline_total", "outcome", "cut"); n != 0 {
		t.Fatalf("kvtier_rankd_store_deadline_total{outcome=cut} %v after a late gather, want 0", n)
	}

	now = time.Now()
	ok := store("ok", now.Add(time.Minute), now.Add(time.Minute), "")
	if ok.Error != nil || ok.OK.Stored != 1 {
		t.Fatalf("store within its limit: %+v", ok)
	}

	if bad := store("bad", time.Now().Add(time.Minute), time.Time{}, "soon"); bad.Error == nil || bad.Error.Code != wire.CodeBadRequest {
		t.Fatalf("malformed gather limit answered %+v, want bad_request", bad)
	}
}
