package coordinator

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestBeginAsLookup: a restore.begin with Lookup is the engine's lookup
// and its begin in one round trip. It counts its tokens as a lookup does
// (once); a hit is planned and judged like any begin; a miss is answered a
// plan of prefix 0 that leaves no restore in the history, counts no
// "empty" restore and is answered even when every restore slot is taken.
func TestBeginAsLookup(t *testing.T) {
	f := newRestoreFixture(t, 5) // chunk_tokens 16, stored by both ranks
	tokens := float64(testSpec(2).ChunkTokens)
	lookupBegin := func(t *testing.T, chunks int, from uint32) *wire.RestorePlan {
		t.Helper()
		ask := f.chunks[:min(chunks, 5)]
		if chunks > 5 {
			ask = append(slices.Clone(f.chunks), chain(f.ns, chunks, 99)[5:]...)
		}
		if from != 0 {
			ask = chain(f.ns, chunks, from)
		}
		return call[wire.RestorePlan](t, f.nc, f.c.subj.Coord(wire.CoordRestoreBegin),
			wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: f.ns, Chunks: ask}, Lookup: true})
	}
	empty := func() float64 {
		return testutil.Metric(t, f.c.reg, "kvtier_coord_restores_total", "outcome", wire.VerdictComplete, "cause", "empty")
	}

	// A hit of 5 of 8 chunks: tokens counted once, the restore planned and
	// judged as any other.
	plan := lookupBegin(t, 8, 0)
	if plan.Prefix != 5 || len(plan.Ranks) != 2 {
		t.Fatalf("plan %+v, want prefix 5 over 2 ranks", plan)
	}
	if got, want := testutil.Metric(t, f.c.reg, "kvtier_coord_lookup_tokens_total"), 8*tokens; got != want {
		t.Errorf("tokens looked up = %v, want %v", got, want)
	}
	if got, want := testutil.Metric(t, f.c.reg, "kvtier_coord_lookup_hit_tokens_total"), 5*tokens; got != want {
		t.Errorf("tokens hit = %v, want %v", got, want)
	}
	w := f.waitAsync(t, plan.RestoreID)
	f.report(t, plan.RestoreID, 0, results(plan.Ranks["eng/0"]))
	f.report(t, plan.RestoreID, 1, results(plan.Ranks["eng/1"]))
	if v := recv(t, w); v.State != wire.VerdictComplete || v.Prefix != 5 {
		t.Fatalf("verdict %+v, want complete over 5", v)
	}
	if n := len(history(t, f.c, f.nc).Restores); n != 1 {
		t.Fatalf("history holds %d restores, want 1", n)
	}

	// A miss: prefix 0, nothing recorded, no empty restore counted, its
	// tokens counted as looked up and not hit.
	if p := lookupBegin(t, 3, 42); p.Prefix != 0 || len(p.Ranks) != 0 {
		t.Fatalf("a miss planned %+v", p)
	}
	if n := len(history(t, f.c, f.nc).Restores); n != 1 {
		t.Errorf("history holds %d restores after a miss, want 1", n)
	}
	if got := empty(); got != 0 {
		t.Errorf("empty restores = %v after a lookup's miss, want 0", got)
	}
	if got, want := testutil.Metric(t, f.c.reg, "kvtier_coord_lookup_tokens_total"), 11*tokens; got != want {
		t.Errorf("tokens looked up = %v, want %v", got, want)
	}
	// A plain begin that finds nothing is still an empty restore.
	f.begin(t, chain(f.ns, 2, 43))
	if got := empty(); got != 1 {
		t.Errorf("empty restores = %v after a plain begin's miss, want 1", got)
	}

	// Every slot taken: a lookup's miss is still answered, a hit refused.
	f.c.rs.mu.Lock()
	f.c.cfg.MaxActiveRestores = 0 // read under this lock (admit)
	f.c.rs.mu.Unlock()
	if p := lookupBegin(t, 3, 44); p.Prefix != 0 {
		t.Errorf("a miss with the table full planned %+v", p)
	}
	callErr[wire.RestorePlan](t, f.nc, f.c.subj.Coord(wire.CoordRestoreBegin), wire.RestoreBeginRequest{
		RestoreBegin: wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks}, Lookup: true}, wire.CodeUnavailable)
}

// TestBinaryBeginAndReports: restore.begin and restore reports in their
// binary forms (wire/beginreport.go) are planned and judged exactly as
// their JSON forms; bad binary input is refused as such.
func TestBinaryBeginAndReports(t *testing.T) {
	f := newRestoreFixture(t, 4)
	raw := func(t *testing.T, v interface{ MarshalBinary() ([]byte, error) }) bus.Raw {
		t.Helper()
		b, err := v.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		return bus.Raw(b)
	}
	req := &wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks, DeadlineMS: 5000}}
	plan := call[wire.RestorePlan](t, f.nc, f.c.subj.Coord(wire.CoordRestoreBegin), raw(t, req))
	if want := f.begin(t, f.chunks); plan.Prefix != 4 || len(plan.Ranks) != 2 || len(plan.Ranks["eng/0"]) != len(want.Ranks["eng/0"]) {
		t.Fatalf("binary begin planned %+v, JSON %+v", plan, want)
	}
	w := f.waitAsync(t, plan.RestoreID)
	for tp := range 2 {
		rk := wire.Rank{Instance: "eng", TPRank: tp}
		res := results(plan.Ranks[rk.String()])
		if tp == 1 {
			res[2].Sum ^= 1 // chunk 2 placed with another sum than recorded
		}
		call[wire.ReportAck](t, f.nc, f.c.subj.Coord(wire.CoordRestoreReport),
			raw(t, &wire.RestoreReport{RestoreID: plan.RestoreID, Rank: rk, Results: res}))
	}
	if v := recv(t, w); v.State != wire.VerdictFailed || !slices.Equal(v.Failed, []int{2}) {
		t.Fatalf("verdict %+v, want failed [2]", v)
	}
	bad := []byte(raw(t, req))
	bad[4] = 0x80 // an unknown flag
	callErr[wire.RestorePlan](t, f.nc, f.c.subj.Coord(wire.CoordRestoreBegin), bus.Raw(bad), wire.CodeBadRequest)
	rep := []byte(raw(t, &wire.RestoreReport{RestoreID: plan.RestoreID, Rank: wire.Rank{Instance: "eng"}}))
	callErr[wire.ReportAck](t, f.nc, f.c.subj.Coord(wire.CoordRestoreReport), bus.Raw(rep[:len(rep)-1]), wire.CodeBadRequest)
}

// BenchmarkBeginLookup2048: a binary restore.begin that is the lookup, of
// a 2,048-chunk chain stored by both ranks of a TP-2 instance (a 32k-token
// prompt in 16-token chunks), through the coordinator's embedded NATS, the
// binary plan back: the coordinator's per-chunk cost of a restore.
func BenchmarkBeginLookup2048(b *testing.B) {
	f := newRestoreFixture(b, 2048)
	f.c.rs.mu.Lock()
	f.c.cfg.MaxActiveRestores, f.c.cfg.MaxActiveRestoresPerInstance = 1<<30, 1<<30 // read under this lock
	f.c.rs.mu.Unlock()
	req := &wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks, DeadlineMS: 600000},
		PlanEncoding: wire.PlanEncodingBinary, Lookup: true}
	body, err := req.MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		m, err := f.nc.Request(f.c.subj.Coord(wire.CoordRestoreBegin), body, 10*time.Second)
		if err != nil || !wire.IsBinaryPlan(m.Data) {
			b.Fatalf("begin: %v %.80s", err, m.Data)
		}
	}
}

// TestSlowBeginHoldsNoOther: a restore.begin held while it prepares its
// plan (the hook stands for a large plan on a busy host) holds neither
// the begins after it, which the lookup pool's other workers answer, nor
// the restore table, whose history is answered meanwhile; the held begin
// is answered once it is let go.
func TestSlowBeginHoldsNoOther(t *testing.T) {
	entered, release := make(chan struct{}, 8), make(chan struct{})
	var held atomic.Bool
	var once sync.Once
	letGo := func() { once.Do(func() { close(release) }) }
	c := startCoord(t, func(cfg *Config) {
		cfg.beginPrepareHook = func() {
			if held.CompareAndSwap(false, true) {
				entered <- struct{}{}
				<-release
			}
		}
	})
	t.Cleanup(letGo) // runs before the coordinator's shutdown (registered earlier), which waits for the handler
	nc := connect(t, c)
	f := &restoreFixture{c: c, nc: nc, ns: register(t, nc, c.subj, testSpec(2))}
	f.chunks = chain(f.ns, 3, 7)
	for tp := range 2 {
		r := wire.Rank{Instance: "eng", TPRank: tp}
		if _, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 0, f.ns, f.chunks, wire.L1)); werr != nil {
			t.Fatal(werr)
		}
	}
	first := make(chan *wire.RestorePlan, 1)
	go func() {
		rep, err := bus.Call[wire.RestorePlan](tctx(t), connect(t, c), c.subj.Coord(wire.CoordRestoreBegin),
			wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks})
		if err != nil {
			t.Error(err)
		}
		first <- rep
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first begin never reached its preparation")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := bus.Call[wire.AdminRestoresReply](ctx, nc, c.subj.Admin(wire.AdminRestores), nil); err != nil {
		t.Fatalf("restore history while a begin prepares: %v (the restore table's lock held?)", err)
	}
	// Every one of 8 later begins is answered while the first is held: the
	// lookup pool's other workers take them. With NATS queue subscribers
	// (until stop 66) each went to the held one with odds of 1 in 4; with
	// one subscriber, or the table's lock held, none is answered.
	const more = 8
	plans := make(chan *wire.RestorePlan, more)
	for range more {
		go func() {
			rep, err := bus.Call[wire.RestorePlan](tctx(t), nc, c.subj.Coord(wire.CoordRestoreBegin),
				wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks})
			if err != nil {
				t.Error(err)
			}
			plans <- rep
		}()
	}
	ids := map[string]bool{}
	for k := range more {
		select {
		case p := <-plans:
			if p == nil || p.Prefix != 3 {
				t.Fatalf("a begin while the first prepares: plan %+v, want prefix 3", p)
			}
			ids[p.RestoreID] = true
		case <-ctx.Done():
			t.Fatalf("%d of %d begins answered while the first prepares", k, more)
		}
	}
	letGo()
	p := <-first
	if p == nil || p.Prefix != 3 {
		t.Fatalf("first plan %+v", p)
	}
	if ids[p.RestoreID] = true; len(ids) != more+1 {
		t.Fatalf("%d distinct restore ids, want %d", len(ids), more+1)
	}
	if n := len(history(t, c, nc).Restores); n != 0 {
		t.Fatalf("history holds %d decided restores, want 0 (both active)", n)
	}
}
