package coordinator

import (
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// TestPlanRestore: the restore.begin decision as a pure function of the
// table's state, the lookup and the readers' liveness: liveness first (a
// hit whose readers are dead says so even when the table is full), then
// the limits, then the plan (its items built by planItems before the
// decision, each reader's incarnation set by it).
func TestPlanRestore(t *testing.T) {
	ns := dcp.Namespace{1}
	chunks := []dcp.ChunkHash{{1}, {2}, {3}}
	exps := []dcp.Expectation{{Rank: 0, Shard: 0, Group: 0}, {Rank: 1, Shard: 1, Group: 0}}
	lookup := func(prefix int) *index.LookupResult {
		res := &index.LookupResult{Namespace: ns, Instance: "eng", Prefix: prefix, Expectations: exps}
		for i := range prefix * len(exps) {
			res.Sources = append(res.Sources, index.Source{HolderTP: int32(i % 2), Tier: wire.L2, Sum: uint64(100 + i)})
		}
		return res
	}
	alive := []readerStatus{{tp: 0, inc: 7}, {tp: 1, inc: 8}}
	dead := []readerStatus{{tp: 0, inc: 7}, {tp: 1, inc: 8, cause: "dead"}}
	ok := beginState{active: 1, instanceActive: 1, maxActive: 4, maxPerInstance: 2}
	req := &wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: ns, Chunks: chunks}}
	for _, tc := range []struct {
		name    string
		st      beginState
		prefix  int
		zeroCut string
		readers []readerStatus
		kind    beginKind
		plan    int // plan prefix
		reason  bool
	}{
		{"closed", beginState{closed: true, maxActive: 4, maxPerInstance: 2}, 3, "", alive, beginClosed, 0, false},
		{"too many", beginState{active: 4, maxActive: 4, maxPerInstance: 2}, 3, "", alive, beginTooMany, 0, false},
		{"instance full", beginState{active: 2, instanceActive: 2, maxActive: 4, maxPerInstance: 2}, 3, "", alive, beginInstanceFull, 0, false},
		{"instance full, nothing stored", beginState{active: 2, instanceActive: 2, maxActive: 4, maxPerInstance: 2}, 0, "", nil, beginEmpty, 0, false},
		{"reader dead", ok, 3, "", dead, beginNotPlanned, 0, true},
		{"reader dead, table full", beginState{active: 4, maxActive: 4, maxPerInstance: 2}, 3, "", dead, beginNotPlanned, 0, true},
		{"reader dead, instance full", beginState{active: 2, instanceActive: 2, maxActive: 4, maxPerInstance: 2}, 3, "", dead, beginNotPlanned, 0, true},
		{"nothing stored", ok, 0, "", nil, beginEmpty, 0, false},
		{"zero sum cut to nothing", ok, 0, "prefix cut at chunk 0", nil, beginEmpty, 0, true},
		{"planned", ok, 3, "", alive, beginActive, 3, false},
		{"planned after a zero-sum cut", ok, 2, "prefix cut at chunk 2", alive, beginActive, 2, true},
	} {
		var items *plannedItems
		if tc.prefix > 0 {
			items = planItems("id1", req, lookup(tc.prefix), tc.zeroCut)
		}
		p := planRestore(tc.st, "id1", req, lookup(tc.prefix), tc.zeroCut, tc.readers, items)
		if p.kind != tc.kind {
			t.Errorf("%s: kind %d, want %d", tc.name, p.kind, tc.kind)
			continue
		}
		if p.plan == nil {
			if tc.kind >= beginNotPlanned {
				t.Errorf("%s: no plan", tc.name)
			}
			continue
		}
		if p.plan.Prefix != tc.plan || (p.plan.Reason != "") != tc.reason || p.plan.RestoreID != "id1" {
			t.Errorf("%s: plan %+v", tc.name, p.plan)
		}
		if tc.kind == beginNotPlanned && (p.cause != "dead" || len(p.down) != 1) {
			t.Errorf("%s: cause %q, down %v", tc.name, p.cause, p.down)
		}
		if tc.kind != beginActive {
			continue
		}
		// Each reader gets its items in chunk order, with the recorded sum
		// and holder, and the restore expects it at its incarnation.
		for j, e := range exps {
			r := wire.Rank{Instance: "eng", TPRank: e.Rank}
			items := p.plan.Ranks[r.String()]
			if len(items) != tc.plan {
				t.Fatalf("%s: %s has %d items, want %d", tc.name, r, len(items), tc.plan)
			}
			for i, it := range items {
				src := lookup(tc.prefix).Source(i, j)
				if it.Chunk != i || it.Sum != src.Sum || it.Key.Chunk != chunks[i] || it.Key.Shard != uint16(e.Shard) || it.Source.Tier != wire.L2 {
					t.Errorf("%s: %s item %d: %+v", tc.name, r, i, it)
				}
			}
			if rd := p.readers[e.Rank]; rd == nil || rd.inc != alive[e.Rank].inc || len(rd.slots) != tc.plan {
				t.Errorf("%s: reader %d: %+v", tc.name, e.Rank, rd)
			}
		}
	}
}

// TestPlanRestoreWithoutItems: a begin decided active whose items were
// not prepared (its readers looked not alive before the lock) gets no
// plan from the decision, so its caller prepares one; a refusal needs
// none.
func TestPlanRestoreWithoutItems(t *testing.T) {
	ns := dcp.Namespace{1}
	exps := []dcp.Expectation{{Rank: 0, Shard: 0, Group: 0}}
	res := &index.LookupResult{Namespace: ns, Instance: "eng", Prefix: 1, Expectations: exps,
		Sources: []index.Source{{Tier: wire.L2, Sum: 5}}}
	req := &wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: ns, Chunks: []dcp.ChunkHash{{1}}}}
	st := beginState{maxActive: 4, maxPerInstance: 2}
	alive := []readerStatus{{tp: 0, inc: 3}}
	if p := planRestore(st, "id1", req, res, "", alive, nil); p.kind != beginActive || p.plan != nil || p.readers != nil {
		t.Fatalf("without items: %+v", p)
	}
	p := planRestore(st, "id1", req, res, "", alive, planItems("id1", req, res, ""))
	if p.kind != beginActive || p.plan == nil || p.readers[0] == nil || p.readers[0].inc != 3 || len(p.readers[0].slots) != 1 {
		t.Fatalf("with items: %+v", p)
	}
}

// TestRestoreDeadline: 0 asks the default; the ask is capped at the max,
// before the multiplication (2^62 ms would overflow).
func TestRestoreDeadline(t *testing.T) {
	def, max := 5*time.Second, time.Minute
	for _, tc := range []struct {
		ms   int
		want time.Duration
	}{{0, def}, {-1, def}, {1, time.Millisecond}, {59999, 59999 * time.Millisecond}, {60000, max}, {1 << 62, max}} {
		if got := restoreDeadline(tc.ms, def, max); got != tc.want {
			t.Errorf("restoreDeadline(%d) = %v, want %v", tc.ms, got, tc.want)
		}
	}
}

// TestZeroSumCut: the prefix ends before the first chunk with a source
// recorded with sum 0.
func TestZeroSumCut(t *testing.T) {
	exps := []dcp.Expectation{{Rank: 0, Shard: 0, Group: 0}, {Rank: 1, Shard: 1, Group: 2}}
	res := &index.LookupResult{Prefix: 3, Expectations: exps,
		Sources: []index.Source{{Sum: 1}, {Sum: 2}, {Sum: 3}, {Sum: 0}, {Sum: 5}, {Sum: 6}}}
	if cut, why := zeroSumCut(res, false); cut != 1 || why == "" {
		t.Fatalf("cut %d %q, want 1", cut, why)
	}
	res.Sources[3].Sum = 4
	if cut, _ := zeroSumCut(res, false); cut != -1 {
		t.Fatalf("cut %d, want -1", cut)
	}
}
