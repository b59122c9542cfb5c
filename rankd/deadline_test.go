package rankd

import (
	"bytes"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// TestRetrieveAfterTheEnginesDeadlinePlacesNothing: a retrieve whose
// wire.HeaderDeadline has passed when it arrives (the engine gave up on
// the load and took its blocks back: vLLM recomputes them or hands them
// to another request) is refused and writes no byte; one whose deadline
// is ahead is served; a malformed deadline is a bad request. Red without
// the check: the late retrieve placed its page into block 5.
func TestRetrieveAfterTheEnginesDeadlinePlacesNothing(t *testing.T) {
	h := newHarness(t)
	e, body := storedPageRetrieve(t, h)
	ctx := h.ctx()
	retrieve := func(deadline string) *wire.Reply[wire.RetrieveReply] {
		t.Helper()
		return requestWithDeadline[wire.RetrieveReply](t, h, ctx, OpRetrieve, body, deadline)
	}
	block5 := func() bool { // true when every layer's block 5 holds the page
		t.Helper()
		for l, m := range e.pools {
			got := make([]byte, e.g.PageBytes)
			if err := e.dev.Read(m, 5*e.g.StrideBytes, got); err != nil {
				t.Fatal(err)
			}
			switch {
			case bytes.Equal(got, pageOf(l, 2, e.g.PageBytes)):
			case bytes.Count(got, []byte{0xEE}) == len(got):
				return false
			default:
				t.Fatalf("layer %d block 5 holds neither the page nor the fill", l)
			}
		}
		return true
	}

	late := retrieve(wire.FormatDeadline(time.Now().Add(-50 * time.Millisecond)))
	if late.Error == nil || late.Error.Code != wire.CodeUnavailable {
		t.Fatalf("retrieve past its deadline answered %+v, want unavailable", late)
	}
	if block5() {
		t.Fatal("a retrieve that arrived after the engine's deadline placed its page")
	}
	if n := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_retrieve_deadline_total", "outcome", "expired_on_arrival"); n != 1 {
		t.Fatalf("kvtier_rankd_retrieve_deadline_total{outcome=expired_on_arrival} %v, want 1", n)
	}

	if bad := retrieve("soon"); bad.Error == nil || bad.Error.Code != wire.CodeBadRequest {
		t.Fatalf("malformed deadline answered %+v, want bad_request", bad)
	}
	if block5() {
		t.Fatal("a retrieve with a malformed deadline placed its page")
	}

	ok := retrieve(wire.FormatDeadline(time.Now().Add(time.Minute)))
	if ok.Error != nil || len(ok.OK.Results) != 1 || !ok.OK.Results[0].OK {
		t.Fatalf("retrieve within its deadline: %+v", ok)
	}
	if !block5() {
		t.Fatal("a retrieve within its deadline did not place its page")
	}
}

// storedPageRetrieve stores block 2's page (storedPage) and returns its
// engine and the JSON retrieve request that places it into block 5.
func storedPageRetrieve(t *testing.T, h *harness) (*engine, []byte) {
	t.Helper()
	e, reg, want, key := storedPage(t, h)
	body, err := json.Marshal(wire.RetrieveRequest{Namespace: e.res.Namespace, Session: reg.Session,
		Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key, Sum: checksum.Sum(want), Blocks: []int64{5}}}})
	if err != nil {
		t.Fatal(err)
	}
	return e, body
}

// storedPage stores block 2's page (uploaded on a stream of a new storing
// engine) as the first chunk of 16 zero tokens through the daemon of h:
// the engine, its registration, the page and the object's key (shard 1:
// the harness's TP rank).
func storedPage(t *testing.T, h *harness) (*engine, *wire.RegisterReply, []byte, dcp.Key) {
	t.Helper()
	e, reg := newStoringEngine(t, h)
	s := e.stream(t)
	want := e.uploadPage(t, s, 2)
	evh := recordedEvent(t, e, s)
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	st, err := bus.Call[wire.StoreReply](h.ctx(), h.nc, h.subj.Engine(h.rank, OpStore), wire.StoreRequest{
		RequestID: "r", Namespace: e.res.Namespace, Session: reg.Session, Event: evh,
		Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}})
	if err != nil || st.Stored != 1 {
		t.Fatalf("store: %+v %v", st, err)
	}
	return e, reg, want, dcp.Key{NS: e.res.Namespace, Chunk: chunk, Shard: 1, Group: 0}
}

// TestRetrieveCarriesTheEnginesPace: a retrieve's wire.HeaderPace reaches
// the engine as its pace: a malformed one and one under transfer.MinPace
// are bad requests that place nothing; one at MinPace is served and its
// retrieve records the pace stage (kvtier_rankd_stage_seconds{stage=
// "pace"}), which an unpaced retrieve does not.
func TestRetrieveCarriesTheEnginesPace(t *testing.T) {
	h := newHarness(t)
	e, body := storedPageRetrieve(t, h)
	ctx := h.ctx()
	retrieve := func(pace string) *wire.Reply[wire.RetrieveReply] {
		t.Helper()
		return requestWithHeader[wire.RetrieveReply](t, h, ctx, OpRetrieve, body, wire.HeaderPace, pace)
	}
	placed := func() bool {
		t.Helper()
		got := make([]byte, e.g.PageBytes)
		if err := e.dev.Read(e.pools[0], 5*e.g.StrideBytes, got); err != nil {
			t.Fatal(err)
		}
		return bytes.Equal(got, pageOf(0, 2, e.g.PageBytes))
	}
	paced := func() float64 {
		return testutil.MetricSum(t, h.d.met.reg, "kvtier_rankd_stage_seconds", "op", OpRetrieve, "stage", "pace")
	}

	for _, bad := range []string{"fast", "-1", strconv.Itoa(transfer.MinPace - 1)} {
		if r := retrieve(bad); r.Error == nil || r.Error.Code != wire.CodeBadRequest {
			t.Fatalf("pace %q answered %+v, want bad_request", bad, r)
		}
		if placed() {
			t.Fatalf("a retrieve with pace %q placed its page", bad)
		}
	}
	if r := retrieve(""); r.Error != nil || len(r.OK.Results) != 1 || !r.OK.Results[0].OK {
		t.Fatalf("unpaced retrieve: %+v", r)
	}
	if r := retrieve(strconv.Itoa(transfer.MinPace)); r.Error != nil || len(r.OK.Results) != 1 || !r.OK.Results[0].OK || !placed() {
		t.Fatalf("retrieve paced at %d B/s: %+v, placed %v", transfer.MinPace, r, placed())
	}
	deadline := time.Now().Add(10 * time.Second)
	for paced() != 1 { // observed once the reply is out
		if time.Now().After(deadline) {
			t.Fatalf("kvtier_rankd_stage_seconds{stage=pace} counts %v retrieves, want 1 (the paced one)", paced())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
