package rankd

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// TestCutStoresOfAPreemptedRequest: a store waiting before its gather (for
// another store's fill of the same object, whose gather the device holds)
// answers at once when its engine cuts the request (OpCut, on the NATS
// callback, outside the request slots), its object failed and not stored;
// a cut by another engine identity, or of another request, cuts nothing;
// the store being gathered is not cut by its sibling's cut and stores.
// Red without the cut (the waiting store answered only after the 4 s
// gather it waited on).
func TestCutStoresOfAPreemptedRequest(t *testing.T) {
	dev := &stallDevice{}
	h := newHarness(t, func(c *Config) {
		c.wrapDevice = func(d cuda.Device) cuda.Device { dev.Device = d; return dev }
		c.EngineIdentity = func(m *nats.Msg) string {
			if id := m.Header.Get("Test-Caller"); id != "" {
				return id
			}
			return "engine/" + c.Rank.Instance
		}
	})
	e, reg := newStoringEngine(t, h)
	s := e.stream(t)
	e.uploadPage(t, s, 2)
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	type answer struct {
		rep  *wire.Reply[wire.StoreReply]
		took time.Duration
	}
	store := func(id string) <-chan answer {
		body, err := json.Marshal(wire.StoreRequest{RequestID: id, Namespace: e.res.Namespace, Session: reg.Session,
			Event: recordedEvent(t, e, s), Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}})
		if err != nil {
			t.Fatal(err)
		}
		ch := make(chan answer, 1)
		start := time.Now()
		go func() {
			m, err := h.nc.Request(h.subj.Engine(h.rank, OpStore), body, 10*time.Second)
			var rep wire.Reply[wire.StoreReply]
			if err == nil {
				err = json.Unmarshal(m.Data, &rep)
			}
			if err != nil {
				rep.Error = &wire.Error{Code: "transport", Message: err.Error()}
			}
			ch <- answer{&rep, time.Since(start)}
		}()
		return ch
	}
	cut := func(id, caller string) int {
		t.Helper()
		m := nats.NewMsg(h.subj.Engine(h.rank, OpCut))
		m.Data, _ = json.Marshal(CutRequest{RequestID: id})
		if caller != "" {
			m.Header.Set("Test-Caller", caller)
		}
		rep, err := h.nc.RequestMsg(m, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var r wire.Reply[CutReply]
		if err := bus.Decode(rep, &r); err != nil || r.Error != nil || r.OK == nil {
			t.Fatalf("cut %s: %s (%v)", id, rep.Data, err)
		}
		return r.OK.Stores
	}

	dev.gstall.Store(int64(4 * time.Second))
	first := store("first") // gathers, held by the device
	time.Sleep(200 * time.Millisecond)
	second := store("preempted") // the same object: waits for first's fill
	time.Sleep(200 * time.Millisecond)
	if n := cut("preempted", "engine/someone-else"); n != 0 {
		t.Fatalf("another identity's cut cut %d stores", n)
	}
	if n := cut("no-such-request", ""); n != 0 {
		t.Fatalf("a cut of another request cut %d stores", n)
	}
	cutAt := time.Now()
	if n := cut("preempted", ""); n != 1 {
		t.Fatalf("the cut cut %d stores, want 1", n)
	}
	a := <-second
	if since := time.Since(cutAt); since > 2500*time.Millisecond {
		t.Fatalf("the cut store answered %v after the cut (the gather it waited on takes 4 s)", since)
	}
	if a.rep.Error != nil || a.rep.OK.Stored != 0 || len(a.rep.OK.Failed) != 1 {
		t.Fatalf("the cut store answered %+v (%+v), want its object failed", a.rep.OK, a.rep.Error)
	}
	b := <-first
	if b.rep.Error != nil || b.rep.OK.Stored != 1 {
		t.Fatalf("the store the device gathered: %+v (%+v), want stored", b.rep.OK, b.rep.Error)
	}
	if n := cut("first", ""); n != 0 {
		t.Fatalf("a cut after the store answered cut %d", n)
	}
	// Malformed: no request id, an unknown field, an oversized body.
	for _, body := range [][]byte{[]byte(`{}`), []byte(`{"request_id":"x","all":true}`),
		[]byte(`{"request_id":"` + strings.Repeat("x", MaxRequestBytes) + `"}`)} {
		rep, err := h.nc.Request(h.subj.Engine(h.rank, OpCut), body, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var r wire.Reply[CutReply]
		if err := json.Unmarshal(rep.Data, &r); err != nil || r.Error == nil || r.Error.Code == "" || r.OK != nil {
			t.Fatalf("cut %.40s answered %s, want an error", body, rep.Data)
		}
	}
}
