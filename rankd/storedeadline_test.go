package rankd

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestStoreCarriesTheEnginesDeadline (issue 24, C11): a store whose
// wire.HeaderDeadline has passed when it arrives (the engine stopped
// waiting for the answer) is refused as unavailable, nothing stored, and
// counted in kvtier_rankd_store_deadline_total{outcome=expired_on_arrival};
// a malformed deadline is a bad request; one whose deadline is ahead is
// stored. Red without the arrival check: the late store answered ok.
func TestStoreCarriesTheEnginesDeadline(t *testing.T) {
	h := newHarness(t)
	e, reg := newStoringEngine(t, h)
	ctx := h.ctx()
	s := e.stream(t)
	e.uploadPage(t, s, 2)
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	store := func(id, deadline string) *wire.Reply[wire.StoreReply] {
		t.Helper()
		body, err := json.Marshal(wire.StoreRequest{RequestID: id, Namespace: e.res.Namespace, Session: reg.Session,
			Event: recordedEvent(t, e, s), Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return requestWithDeadline[wire.StoreReply](t, h, ctx, OpStore, body, deadline)
	}
	stored := func() uint64 { return h.d.eng.Stats().ObjectsStored }

	late := store("late", wire.FormatDeadline(time.Now().Add(-50*time.Millisecond)))
	if late.Error == nil || late.Error.Code != wire.CodeUnavailable {
		t.Fatalf("store past its deadline answered %+v, want unavailable", late)
	}
	if n := stored(); n != 0 {
		t.Fatalf("a store that arrived after the engine's deadline stored %d objects", n)
	}
	if n := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_store_deadline_total", "outcome", "expired_on_arrival"); n != 1 {
		t.Fatalf("kvtier_rankd_store_deadline_total{outcome=expired_on_arrival} %v, want 1", n)
	}

	if bad := store("bad", "soon"); bad.Error == nil || bad.Error.Code != wire.CodeBadRequest {
		t.Fatalf("malformed deadline answered %+v, want bad_request", bad)
	}
	if n := stored(); n != 0 {
		t.Fatalf("a store with a malformed deadline stored %d objects", n)
	}

	ok := store("ok", wire.FormatDeadline(time.Now().Add(time.Minute)))
	if ok.Error != nil || ok.OK.Stored != 1 {
		t.Fatalf("store within its deadline: %+v", ok)
	}
	if n := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_store_deadline_total", "outcome", "cut"); n != 0 {
		t.Fatalf("kvtier_rankd_store_deadline_total{outcome=cut} %v after a store within its deadline, want 0", n)
	}
}
