package rankd

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// cutFixture: a rankd whose device holds gathers (stallDevice), an engine
// with one page uploaded, and helpers that store that page's chunk and
// cut a request.
type cutFixture struct {
	t     *testing.T
	h     *harness
	dev   *stallDevice
	store func(id string, deadline time.Time) <-chan cutAnswer
}

type cutAnswer struct {
	rep  *wire.Reply[wire.StoreReply]
	took time.Duration
}

func newCutFixture(t *testing.T) *cutFixture {
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
	// store sends a store of the chunk from page 2 (with the engine
	// deadline when set) and answers on the channel.
	store := func(id string, deadline time.Time) <-chan cutAnswer {
		m := nats.NewMsg(h.subj.Engine(h.rank, OpStore))
		var err error
		m.Data, err = json.Marshal(wire.StoreRequest{RequestID: id, Namespace: e.res.Namespace, Session: reg.Session,
			Event: recordedEvent(t, e, s), Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}})
		if err != nil {
			t.Fatal(err)
		}
		if !deadline.IsZero() {
			m.Header.Set(wire.HeaderDeadline, wire.FormatDeadline(deadline))
		}
		ch := make(chan cutAnswer, 1)
		start := time.Now()
		go func() {
			r, err := h.nc.RequestMsg(m, 10*time.Second)
			var rep wire.Reply[wire.StoreReply]
			if err == nil {
				err = json.Unmarshal(r.Data, &rep)
			}
			if err != nil {
				rep.Error = &wire.Error{Code: "transport", Message: err.Error()}
			}
			ch <- cutAnswer{&rep, time.Since(start)}
		}()
		return ch
	}
	return &cutFixture{t: t, h: h, dev: dev, store: store}
}

// cut cuts request id as caller ("": the engine's own identity), bounded
// by through when set, and returns the stores cut at once.
func (x *cutFixture) cut(id, caller string, through time.Time) int {
	x.t.Helper()
	m := nats.NewMsg(x.h.subj.Engine(x.h.rank, OpCut))
	req := CutRequest{RequestID: id}
	if !through.IsZero() {
		req.Through = through.UnixNano()
	}
	m.Data, _ = json.Marshal(req)
	if caller != "" {
		m.Header.Set("Test-Caller", caller)
	}
	rep, err := x.h.nc.RequestMsg(m, 5*time.Second)
	if err != nil {
		x.t.Fatal(err)
	}
	var r wire.Reply[CutReply]
	if err := bus.Decode(rep, &r); err != nil || r.Error != nil || r.OK == nil {
		x.t.Fatalf("cut %s: %s (%v)", id, rep.Data, err)
	}
	return r.OK.Stores
}

// cuts is kvtier_rankd_store_cuts_total{when}.
func (x *cutFixture) cuts(when string) float64 {
	var m dto.Metric
	if err := x.h.d.met.storeCuts.WithLabelValues(when).Write(&m); err != nil {
		x.t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// checkCut checks that the store cut (named what) answered well before
// the 4 s gather it waited on, its object failed, and that the store
// being gathered then stored.
func (x *cutFixture) checkCut(cut, gathered <-chan cutAnswer, cutAt time.Time, what string) {
	x.t.Helper()
	a := <-cut
	if since := time.Since(cutAt); since > 2500*time.Millisecond {
		x.t.Fatalf("%s answered %v after the cut (the gather it waited on takes 4 s)", what, since)
	}
	if a.rep.Error != nil || a.rep.OK.Stored != 0 || len(a.rep.OK.Failed) != 1 {
		x.t.Fatalf("%s answered %+v (%+v), want its object failed", what, a.rep.OK, a.rep.Error)
	}
	b := <-gathered
	if b.rep.Error != nil || b.rep.OK.Stored != 1 {
		x.t.Fatalf("the store the device gathered: %+v (%+v), want stored", b.rep.OK, b.rep.Error)
	}
}

// TestCutStoresOfAPreemptedRequest: a store waiting before its gather (for
// another store's fill of the same object, whose gather the device holds)
// answers at once when its engine cuts the request (OpCut, on the NATS
// callback, outside the request slots), its object failed and not stored;
// a cut by another engine identity, or of another request, cuts nothing;
// the store being gathered is not cut by its sibling's cut and stores.
// Red without the cut (the waiting store answered only after the 4 s
// gather it waited on).
func TestCutStoresOfAPreemptedRequest(t *testing.T) {
	x := newCutFixture(t)
	h, dev := x.h, x.dev
	store := func(id string) <-chan cutAnswer { return x.store(id, time.Time{}) }
	cut := func(id, caller string) int { return x.cut(id, caller, time.Time{}) }

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
	x.checkCut(second, first, cutAt, "the cut store")
	if n := x.cuts("in_flight"); n != 1 {
		t.Fatalf("kvtier_rankd_store_cuts_total{when=in_flight} = %v, want 1", n)
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

// TestCutBeforeItsStoreArrives: a cut with a deadline bound (Through) that
// arrives before the store it is meant for (they come on different
// subscriptions) cuts that store when it registers, if the store's engine
// deadline is at or before the bound; a store of the same request sent
// after the cut (a later deadline: vLLM resumed the request) is not cut,
// nor is another identity's. Red without the remembered cut (the store
// waited for the 4 s gather), and red cutting every later store (the
// resumed one failed).
func TestCutBeforeItsStoreArrives(t *testing.T) {
	x := newCutFixture(t)
	x.dev.gstall.Store(int64(4 * time.Second))
	first := x.store("first", time.Time{}) // gathers, held by the device
	time.Sleep(200 * time.Millisecond)

	now := time.Now()
	// The deadline of a store the engine sent before its cut: after the
	// gather it waits on, so only the cut can end its wait early.
	sentBefore := now.Add(6 * time.Second)
	if n := x.cut("preempted", "", sentBefore); n != 0 {
		t.Fatalf("a cut before any store cut %d stores", n)
	}
	if n := x.cut("preempted", "engine/someone-else", now.Add(time.Hour)); n != 0 {
		t.Fatalf("another identity's cut cut %d stores", n)
	}
	cutAt := time.Now()
	late := x.store("preempted", sentBefore) // the same object: would wait for first's fill
	resumed := x.store("preempted", now.Add(9*time.Second))
	x.checkCut(late, first, cutAt, "the store sent before the cut")
	if n := x.cuts("on_arrival"); n != 1 {
		t.Fatalf("kvtier_rankd_store_cuts_total{when=on_arrival} = %v, want 1", n)
	}
	c := <-resumed
	if c.rep.Error != nil || len(c.rep.OK.Failed) != 0 {
		t.Fatalf("the store sent after the cut answered %+v (%+v), want nothing failed", c.rep.OK, c.rep.Error)
	}
	// A bound in the past remembers nothing; a negative one is refused.
	if n := x.cut("old", "", time.Unix(1, 0)); n != 0 || x.h.d.cuts.marked() != 2 {
		t.Fatalf("a cut bounded in the past: cut %d, %d cuts remembered (want 0 and the 2 above)", n, x.h.d.cuts.marked())
	}
	rep, err := x.h.nc.Request(x.h.subj.Engine(x.h.rank, OpCut), []byte(`{"request_id":"x","through":-1}`), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var r wire.Reply[CutReply]
	if err := json.Unmarshal(rep.Data, &r); err != nil || r.Error == nil || r.OK != nil {
		t.Fatalf("a negative bound answered %s, want an error", rep.Data)
	}
}

// TestCutRegistryBoundsItsMarks: remembered cuts expire, two cuts of one
// key keep the later bound, and an engine sending cuts without end holds at
// most maxCutMarks (the one expiring first is dropped). Red without the
// bound (the map grows to every cut).
func TestCutRegistryBoundsItsMarks(t *testing.T) {
	var r cutRegistry
	t0 := time.Unix(1000, 0)
	k := cutKey{"e", "r"}
	r.cut(k, t0.Add(5*time.Second), t0.Add(5*time.Second), t0)
	r.cut(k, t0.Add(3*time.Second), t0.Add(3*time.Second), t0)
	if m := r.marks[k]; !m.through.Equal(t0.Add(5 * time.Second)) {
		t.Fatalf("two cuts of one key remember %v, want the later bound", m.through)
	}
	for i := range 2 * maxCutMarks {
		at := t0.Add(time.Duration(i) * time.Millisecond)
		r.cut(cutKey{"e", strconv.Itoa(i)}, at.Add(time.Hour), at.Add(time.Hour), at)
	}
	if n := r.marked(); n != maxCutMarks {
		t.Fatalf("%d cuts remembered, want at most %d", n, maxCutMarks)
	}
	if _, ok := r.marks[cutKey{"e", "0"}]; ok {
		t.Fatal("the cut expiring first was kept over later ones")
	}
	if _, ok := r.marks[cutKey{"e", strconv.Itoa(2*maxCutMarks - 1)}]; !ok {
		t.Fatal("the latest cut was not remembered")
	}
	// Past its expiry a mark cuts nothing and is forgotten.
	var q cutRegistry
	q.cut(k, t0.Add(time.Hour), t0.Add(time.Second), t0)
	release, cut := q.track(k, &transfer.StoreFuture{}, t0.Add(30*time.Second), t0.Add(2*time.Second))
	release()
	if cut || q.marked() != 0 {
		t.Fatalf("an expired mark: cut %v, %d remembered", cut, q.marked())
	}
	// Within its expiry it cuts a store with an earlier deadline, not one
	// with a later deadline or none.
	q.cut(k, t0.Add(time.Minute), t0.Add(time.Minute), t0)
	for _, c := range []struct {
		dl   time.Time
		want bool
	}{{t0.Add(time.Minute), true}, {t0.Add(time.Minute + 1), false}, {time.Time{}, false}} {
		release, cut := q.track(k, &transfer.StoreFuture{}, c.dl, t0.Add(time.Second))
		release()
		if cut != c.want {
			t.Fatalf("a store with deadline %v: cut %v, want %v", c.dl, cut, c.want)
		}
	}
	if len(q.stores) != 0 {
		t.Fatalf("released stores still tracked: %v", q.stores)
	}
}
