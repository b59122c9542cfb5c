package coordinator

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// hybridSpec is a TP2 namespace of a Mamba / attention hybrid (group 0 a
// recurrent state page per chunk, group 1 attention), chunks of 16
// tokens.
func hybridSpec() dcp.Spec {
	s := testSpec(2)
	state := dcp.Group{Name: "mamba", Kind: dcp.Recurrent, BlockSize: 16, Layers: 1, KVFormat: "mamba_f32",
		SemanticBytes: 512, PageBytes: 512, StrideBytes: 512}
	s.Groups = append([]dcp.Group{state}, s.Groups...)
	return s
}

// TestRestoreStateAtEnd: a restore.begin with StateAtEnd in a hybrid
// namespace plans, expects and judges a recurrent group's object for the
// last chunk only, JSON and binary (KVP2) alike; without it every group of
// every chunk, as before. A report of an inner state is no expectation.
func TestRestoreStateAtEnd(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, hybridSpec())
	const n = 4
	chunks := chain(ns, n, 11)
	// chunks: both groups' objects of every chunk; partial: attention of
	// 5 chunks, the state of chunks 1 and 3 only (an engine that kept no
	// state elsewhere).
	partial := chain(ns, 5, 12)
	for tp := range 2 {
		r := wire.Rank{Instance: "eng", TPRank: tp}
		b := &wire.Batch{Rank: r, Incarnation: 1}
		add := func(ch dcp.ChunkHash, g int, size uint64) {
			k := dcp.Key{NS: ns, Chunk: ch, Shard: uint16(tp), Group: uint16(g)}
			b.Events = append(b.Events, wire.Event{Seq: uint64(len(b.Events) + 1), Kind: wire.Stored, Tier: wire.L1,
				Key: k, Size: size, Sum: sumOf(k)})
		}
		for _, ch := range chunks {
			add(ch, 0, 512)
			add(ch, 1, 2048)
		}
		for i, ch := range partial {
			if i == 1 || i == 3 {
				add(ch, 0, 512)
			}
			add(ch, 1, 2048)
		}
		if _, werr := sendBatch(t, nc, c.subj, b); werr != nil {
			t.Fatal(werr)
		}
	}
	subject := c.subj.Coord(wire.CoordRestoreBegin)
	begin := func(atEnd bool, enc string, chunks []dcp.ChunkHash) *wire.RestorePlan {
		t.Helper()
		req, _ := json.Marshal(wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: ns, Chunks: chunks},
			Instance: "eng", PlanEncoding: enc, StateAtEnd: atEnd})
		m, err := nc.RequestWithContext(tctx(t), subject, req)
		if err != nil {
			t.Fatal(err)
		}
		if enc == wire.PlanEncodingBinary {
			p, err := wire.DecodePlanBinary(m.Data, chunks)
			if err != nil {
				t.Fatalf("binary plan: %v", err)
			}
			return p
		}
		var rep wire.Reply[wire.RestorePlan]
		if err := json.Unmarshal(m.Data, &rep); err != nil || rep.OK == nil {
			t.Fatalf("plan reply %s (%v)", m.Data, err)
		}
		return rep.OK
	}
	// (chunk, group) of a rank's items.
	shape := func(items []wire.RetrieveItem) [][2]int {
		var out [][2]int
		for _, it := range items {
			out = append(out, [2]int{it.Chunk, it.Group})
		}
		return out
	}
	all := [][2]int{{0, 0}, {0, 1}, {1, 0}, {1, 1}, {2, 0}, {2, 1}, {3, 0}, {3, 1}}
	atEnd := [][2]int{{0, 1}, {1, 1}, {2, 1}, {3, 0}, {3, 1}}
	plain := begin(false, "", chunks)
	for r, items := range plain.Ranks {
		if got := shape(items); !slices.Equal(got, all) {
			t.Fatalf("without StateAtEnd %s restores %v, want every group of every chunk %v", r, got, all)
		}
	}
	plan := begin(true, "", chunks)
	if plan.Prefix != n || len(plan.Ranks) != 2 {
		t.Fatalf("plan = %+v", plan)
	}
	for r, items := range plan.Ranks {
		if got := shape(items); !slices.Equal(got, atEnd) {
			t.Fatalf("with StateAtEnd %s restores %v, want %v", r, got, atEnd)
		}
	}
	bin := begin(true, wire.PlanEncodingBinary, chunks)
	binID := bin.RestoreID
	bin.RestoreID = plan.RestoreID
	if !reflect.DeepEqual(bin, plan) {
		t.Fatalf("binary plan %+v\nJSON plan %+v", bin, plan)
	}
	bin.RestoreID = binID
	// A shorter restore ends its states at its own last chunk.
	short := begin(true, "", chunks[:2])
	if got := shape(short.Ranks["eng/0"]); !slices.Equal(got, [][2]int{{0, 1}, {1, 0}, {1, 1}}) {
		t.Fatalf("2 chunks with StateAtEnd: %v", got)
	}

	// The verdict needs exactly the planned objects: a report that also
	// confirms chunk 1's state, which nothing expects, is refused whole;
	// the restore is complete once both ranks confirm their plans.
	w := func(id string) *wire.RestoreVerdict {
		return call[wire.RestoreVerdict](t, nc, c.subj.Coord(wire.CoordRestoreWait), wire.RestoreWait{RestoreID: id})
	}
	report := func(id string, tp int, res []wire.ItemResult) *wire.ReportAck {
		return call[wire.ReportAck](t, nc, c.subj.Coord(wire.CoordRestoreReport),
			wire.RestoreReport{RestoreID: id, Rank: wire.Rank{Instance: "eng", TPRank: tp}, Results: res})
	}
	extra := wire.ItemResult{Chunk: 1, Group: 0, OK: true, Sum: sumOf(dcp.Key{NS: ns, Chunk: chunks[1], Shard: 0, Group: 0})}
	callErr[wire.ReportAck](t, nc, c.subj.Coord(wire.CoordRestoreReport), wire.RestoreReport{RestoreID: plan.RestoreID,
		Rank: wire.Rank{Instance: "eng", TPRank: 0}, Results: append(results(plan.Ranks["eng/0"]), extra)}, wire.CodeBadRequest)
	if got := testutil.Metric(t, c.reg, "kvtier_coord_restore_reports_total", "outcome", "rejected"); got != 1 {
		t.Errorf("rejected reports = %v, want 1", got)
	}
	report(plan.RestoreID, 0, results(plan.Ranks["eng/0"]))
	if ack := report(plan.RestoreID, 1, results(plan.Ranks["eng/1"])); ack.State != wire.VerdictComplete {
		t.Fatalf("after both ranks: %+v", ack)
	}
	if v := w(plan.RestoreID); v.State != wire.VerdictComplete || v.Prefix != n {
		t.Fatalf("verdict = %+v", v)
	}

	// Chunks stored without their state: the strict lookup and restore
	// find nothing (chunk 0 has none), with StateAtEnd both end on chunk
	// 3, the last with its state, binary lookup request included.
	lookupOf := func(atEnd, binary bool) int {
		t.Helper()
		req := wire.LookupRequest{Namespace: ns, Chunks: partial, Instance: "eng", StateAtEnd: atEnd}
		if binary {
			p, err := req.MarshalBinary()
			if err != nil {
				t.Fatal(err)
			}
			m, err := nc.RequestWithContext(tctx(t), c.subj.Coord(wire.CoordLookup), p)
			if err != nil {
				t.Fatal(err)
			}
			var rep wire.Reply[wire.LookupReply]
			if err := json.Unmarshal(m.Data, &rep); err != nil || rep.OK == nil {
				t.Fatalf("binary lookup reply %s (%v)", m.Data, err)
			}
			return rep.OK.Prefix
		}
		return call[wire.LookupReply](t, nc, c.subj.Coord(wire.CoordLookup), req).Prefix
	}
	if a, b, s := lookupOf(true, false), lookupOf(true, true), lookupOf(false, false); a != 4 || b != 4 || s != 0 {
		t.Fatalf("lookup of chunks stored without states: %d (binary %d) with StateAtEnd, %d strict; want 4, 4, 0", a, b, s)
	}
	if p := begin(false, "", partial); p.Prefix != 0 {
		t.Fatalf("strict restore of chunks stored without states: prefix %d", p.Prefix)
	}
	pp := begin(true, wire.PlanEncodingBinary, partial)
	if got := shape(pp.Ranks["eng/1"]); pp.Prefix != 4 || !slices.Equal(got, atEnd) {
		t.Fatalf("StateAtEnd restore of chunks stored without states: prefix %d, items %v; want 4, %v", pp.Prefix, got, atEnd)
	}
	report(pp.RestoreID, 0, results(pp.Ranks["eng/0"]))
	if ack := report(pp.RestoreID, 1, results(pp.Ranks["eng/1"])); ack.State != wire.VerdictComplete {
		t.Fatalf("StateAtEnd restore of chunks stored without states: %+v", ack)
	}

	// A zero recorded sum cuts a StateAtEnd prefix back to a chunk that
	// ends on a stored state: chunk 3's attention zero -> 3 would end on
	// chunk 2, stored without its state -> 2. Chunk 2's attention zero ->
	// 2 (chunk 1 has its state). Strictly, chunk 0's missing state cuts
	// everything.
	lres, err := c.lookupOpts("eng", ns, partial, index.LookupOpts{StateAtEnd: true})
	if err != nil || lres.Prefix != 4 {
		t.Fatalf("lookup: prefix %d, %v", lres.Prefix, err)
	}
	attn := slices.IndexFunc(lres.Expectations, func(e dcp.Expectation) bool { return e.Group == 1 })
	for _, tc := range []struct{ zero, cut int }{{3, 2}, {2, 2}} {
		r := lres
		r.Sources = slices.Clone(lres.Sources)
		r.Sources[tc.zero*len(r.Expectations)+attn].Sum = 0
		if cut, why := zeroSumCut(&r, true); cut != tc.cut || !strings.Contains(why, fmt.Sprintf("chunk %d", tc.zero)) {
			t.Errorf("chunk %d's sum 0: cut %d (%q), want %d naming chunk %d", tc.zero, cut, why, tc.cut, tc.zero)
		}
	}
	if cut, _ := zeroSumCut(&lres, true); cut != -1 {
		t.Errorf("no zero sum: cut %d", cut)
	}
	if cut, _ := zeroSumCut(&lres, false); cut != 0 {
		t.Errorf("strict, chunk 0 without its state: cut %d, want 0", cut)
	}

	// The last chunk's state failing fails that chunk; a rank reporting
	// only its attention objects never completes the restore.
	res := results(bin.Ranks["eng/1"])
	res[3].OK, res[3].Reason = false, "corrupt" // chunk 3, group 0
	report(bin.RestoreID, 0, results(bin.Ranks["eng/0"]))
	report(bin.RestoreID, 1, res)
	if v := w(bin.RestoreID); v.State != wire.VerdictFailed || !slices.Equal(v.Failed, []int{3}) {
		t.Fatalf("verdict with the last state corrupt = %+v, want failed [3]", v)
	}
	p := begin(true, "", chunks)
	report(p.RestoreID, 0, results(p.Ranks["eng/0"]))
	if ack := report(p.RestoreID, 1, results(p.Ranks["eng/1"][:3])); ack.State != wire.VerdictPending {
		t.Fatalf("rank 1 without its last chunk: %+v, want pending", ack)
	}
}

// TestRouteOfHybrid: admin.route answers for a hybrid what its engines
// restore: the run of chunks ending on a stored state (attention of 4
// chunks, states of chunks 1 and 3: prefix 4), counting the objects such a
// restore reads (2 ranks x (4 attention + 1 state)). Strict, it was 0.
func TestRouteOfHybrid(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, hybridSpec())
	chunks := chain(ns, 5, 13)
	for tp := range 2 {
		b := &wire.Batch{Rank: wire.Rank{Instance: "eng", TPRank: tp}, Incarnation: 1}
		add := func(ch dcp.ChunkHash, g int, size uint64) {
			k := dcp.Key{NS: ns, Chunk: ch, Shard: uint16(tp), Group: uint16(g)}
			b.Events = append(b.Events, wire.Event{Seq: uint64(len(b.Events) + 1), Kind: wire.Stored, Tier: wire.L1,
				Key: k, Size: size, Sum: sumOf(k)})
		}
		for i, ch := range chunks[:4] {
			if i == 1 || i == 3 {
				add(ch, 0, 512)
			}
			add(ch, 1, 2048)
		}
		if _, werr := sendBatch(t, nc, c.subj, b); werr != nil {
			t.Fatal(werr)
		}
	}
	rep := call[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), wire.RouteRequest{Namespace: ns, Chunks: chunks, Instance: "eng"})
	if len(rep.Instances) != 1 {
		t.Fatalf("route = %+v", rep)
	}
	if ri := rep.Instances[0]; ri.Prefix != 4 || ri.L1Prefix != 4 || ri.Objects["L1"] != 2*5 || len(ri.Objects) != 1 {
		t.Fatalf("route of the hybrid: %+v, want prefix 4 and 10 L1 objects", ri)
	}
}
