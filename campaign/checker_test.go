package campaign

import (
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/wire"
)

// restoredImage builds rank t's allocation of group gi as a correct
// restore into the restore table leaves it.
func restoredImage(p *enginesim.Plan, t, gi int) []byte {
	img := make([]byte, p.AllocBytes(gi))
	p.Blank(gi, img)
	g := p.R.Geometry[gi]
	page := make([]byte, g.PageBytes)
	for l := range g.Layers {
		for v, b := range p.Tables[enginesim.PhaseRestoreTable][gi] {
			p.Page(t, gi, l, v, page)
			copy(img[p.PageOffset(gi, l, b):], page)
		}
	}
	return img
}

// resultFor turns per-rank comparisons into the engine's result the way
// enginesim does.
func resultFor(p *enginesim.Plan, verdict string, failed []int, ms map[int]enginesim.Mismatch) *enginesim.Result {
	res := &enginesim.Result{Scenario: p.Scenario.Name, Namespace: p.R.Namespace.String(), Chunks: len(p.Hashes),
		Prefix: len(p.Hashes), Verdict: verdict, Failed: failed, RestoreID: "r-test"}
	for t := range p.R.Layout.TP {
		row := enginesim.RankResult{Rank: t, Compare: "ok"}
		if m, ok := ms[t]; ok {
			for _, n := range m.Chunks {
				row.Mismatch += n
			}
			row.Outside = m.Outside
			if row.Mismatch > 0 || row.Outside > 0 {
				row.Compare = "MISMATCH " + m.First
			}
		}
		res.Ranks = append(res.Ranks, row)
	}
	return res
}

// TestCheckerCatchesWrongComplete proves the checker can fail: one byte of
// a restored buffer is flipped (as a coordinator that said COMPLETE
// without proof would leave it), the engine's own comparison finds it, and
// Classify reports WRONG_COMPLETE naming the rank and the byte. The same
// flip in a chunk a FAILED verdict names is fine; in one it does not name
// it is WRONG_UNNAMED. A byte outside the block table is caught too.
func TestCheckerCatchesWrongComplete(t *testing.T) {
	sc, err := enginesim.LookupScenario("tp4dcp4")
	if err != nil {
		t.Fatal(err)
	}
	sc.Chunks = 2
	p, err := enginesim.NewPlan(sc, 7)
	if err != nil {
		t.Fatal(err)
	}
	const rank, gi = 2, 0
	img := restoredImage(p, rank, gi)
	if m := p.Verify(rank, gi, enginesim.PhaseRestoreTable, img, nil); len(m.Chunks) != 0 || m.Outside != 0 {
		t.Fatalf("the correct image does not compare clean: %+v", m)
	}
	if o, prob := Classify(resultFor(p, wire.VerdictComplete, nil, nil)); o != Complete || prob != "" {
		t.Fatalf("clean COMPLETE classified %s %q", o, prob)
	}
	// Flip one byte of chunk 1's first page, layer 0.
	b := p.Tables[enginesim.PhaseRestoreTable][gi][p.BPC[gi]] // first block of chunk 1
	off := p.PageOffset(gi, 0, b) + 17
	img[off] ^= 0x40
	m := p.Verify(rank, gi, enginesim.PhaseRestoreTable, img, nil)
	if m.Chunks[1] != 1 || m.Outside != 0 {
		t.Fatalf("flip not seen as 1 byte of chunk 1: %+v", m)
	}
	o, prob := Classify(resultFor(p, wire.VerdictComplete, nil, map[int]enginesim.Mismatch{rank: m}))
	if o != WrongComplete || !strings.Contains(prob, "rank 2: MISMATCH chunk 1 layer 0") ||
		!strings.Contains(prob, "verdict COMPLETE for restore r-test") {
		t.Fatalf("flipped byte under COMPLETE: %s %q", o, prob)
	}
	// Named by a failed verdict: the engine skips it, nothing is wrong.
	named := p.Verify(rank, gi, enginesim.PhaseRestoreTable, img, map[int]bool{1: true})
	if o, prob := Classify(resultFor(p, wire.VerdictFailed, []int{1}, map[int]enginesim.Mismatch{rank: named})); o != Failed {
		t.Fatalf("flip in a named chunk: %s %q", o, prob)
	}
	// Not named: chunk 0 failed, chunk 1 is wrong.
	unnamed := p.Verify(rank, gi, enginesim.PhaseRestoreTable, img, map[int]bool{0: true})
	if o, prob := Classify(resultFor(p, wire.VerdictFailed, []int{0}, map[int]enginesim.Mismatch{rank: unnamed})); o != WrongUnnamed ||
		!strings.Contains(prob, "verdict FAILED [0]") {
		t.Fatalf("flip in an unnamed chunk: %s %q", o, prob)
	}
	// A byte of padding changes under COMPLETE.
	img[off] ^= 0x40
	pad := p.PageOffset(gi, 0, b) + p.R.Geometry[gi].PageBytes // first padding byte after the page
	img[pad] ^= 1
	m = p.Verify(rank, gi, enginesim.PhaseRestoreTable, img, nil)
	if o, _ := Classify(resultFor(p, wire.VerdictComplete, nil, map[int]enginesim.Mismatch{rank: m})); o != WrongComplete || m.Outside != 1 {
		t.Fatalf("padding byte under COMPLETE: %s, outside %d", o, m.Outside)
	}
	// A rank said a chunk failed, the verdict says COMPLETE.
	res := resultFor(p, wire.VerdictComplete, nil, nil)
	res.Ranks[3].FailedItem = []int{0}
	if o, prob := Classify(res); o != WrongComplete || !strings.Contains(prob, "ranks reported chunks [0] not placed") {
		t.Fatalf("rank failure under COMPLETE: %s %q", o, prob)
	}
	// A retrieve reply the engine did not get in time, bytes exact: the
	// rank placed and reported them; COMPLETE is right (the campaign's
	// first 10,000-fault run flagged this as wrong before the fix).
	res = resultFor(p, wire.VerdictComplete, nil, nil)
	res.Ranks[0].Error, res.Ranks[0].ChunkList = "request ...retrieve: context deadline exceeded", []int{0, 1}
	if o, prob := Classify(res); o != Complete {
		t.Fatalf("late retrieve reply, exact bytes, COMPLETE: %s %q", o, prob)
	}
	if o, _ := Classify(nil); o != NoVerdict {
		t.Fatalf("nil result: %s", o)
	}
}

// TestLedgerJudgesPlacements: a seen placement is present, lost while the
// rank still holds it, explained by a removal event, an L2 fault, a
// restart or a fence, or lost with no explanation.
func TestLedgerJudgesPlacements(t *testing.T) {
	l := newLedger()
	t0 := time.Now()
	ids := map[string]placementID{
		"present":   {"k1", "engine0/0", wire.L1},
		"stillheld": {"k2", "engine0/0", wire.L2},
		"removed":   {"k3", "engine0/1", wire.L1},
		"l2fault":   {"k4", "engine0/1", wire.L2},
		"restart":   {"k5", "engine0/2", wire.L1},
		"fenced":    {"k6", "engine0/3", wire.L1},
		"lostL2":    {"k7", "engine0/2", wire.L2},
		"lostL1":    {"k8", "engine0/1", wire.L1},
	}
	for _, p := range ids {
		l.see(p, 5, 100, 1, t0)
	}
	l.remove(ids["removed"], t0.Add(time.Second))
	l.hitL2("k4", t0.Add(time.Second))
	l.hitRank("engine0/3", t0.Add(time.Second))
	index := map[placementID]bool{ids["present"]: true}
	inv := map[placementID]bool{ids["present"]: true, ids["stillheld"]: true}
	incs := map[string]uint64{"engine0/0": 5, "engine0/1": 5, "engine0/2": 6, "engine0/3": 5}
	lost, ex := l.judgePlacements(index, inv, incs)
	if len(lost) != 3 || lost[0].Key != "k2" || lost[1].Key != "k7" || lost[2].Key != "k8" ||
		!strings.Contains(lost[0].Why, "the rank still holds it") {
		t.Fatalf("lost %+v", lost)
	}
	want := map[string]int{"present": 1, "removed_event": 1, "l2_fault": 1, "fenced_restart": 1, "fenced_or_resynced": 1}
	for k, n := range want {
		if ex[k] != n {
			t.Errorf("explained %s = %d, want %d (all %v)", k, ex[k], n, ex)
		}
	}
}

// TestLedgerL3SurvivesRestarts: an L3 copy outlives its writer's restart
// and fences, so a lost one is explained only by an L3 fault on its key
// (the L1 rules once excused it as fenced at the restart).
func TestLedgerL3SurvivesRestarts(t *testing.T) {
	l := newLedger()
	t0 := time.Now()
	hit := placementID{"k1", "engine0/0", wire.L3}
	gone := placementID{"k2", "engine0/0", wire.L3}
	l.see(hit, 5, 100, 1, t0)
	l.see(gone, 5, 100, 1, t0)
	l.hitL3("k1", t0.Add(time.Second))
	l.hitL2("k2", t0.Add(time.Second)) // an L2 fault does not explain an L3 copy
	l.hitRank("engine0/0", t0.Add(time.Second))
	lost, ex := l.judgePlacements(map[placementID]bool{}, map[placementID]bool{}, map[string]uint64{"engine0/0": 6})
	if len(lost) != 1 || lost[0].Key != "k2" || lost[0].Tier != "L3" {
		t.Fatalf("lost %+v, want only k2 on L3", lost)
	}
	if ex["l3_fault"] != 1 || len(ex) != 1 {
		t.Fatalf("explained %v, want l3_fault 1 only", ex)
	}
}
