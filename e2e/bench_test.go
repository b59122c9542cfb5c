package e2e

import (
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/enginesim"
)

// The daemon-path benchmark (enginesim --bench) through real daemons on the
// host backend: every repetition moves every byte (fresh content, nothing
// deduplicated), restores COMPLETE and byte-exact, and reports a timed
// figure and a ceiling per repetition. Speed is not asserted.
func TestBenchDaemonPath(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	const reps, chunks = 2, 2
	res := c.mustSim("--scenario", "tp4dcp4", "--bench", "--bench-reps", "2", "--chunks", "2", "--seed", "7")
	b := res.Bench
	if b == nil || b.Reps != reps || b.Ranks != 4 || b.ChunksPerStore != 8 {
		t.Fatalf("bench result %+v", b)
	}
	sc, err := enginesim.LookupScenario("tp4dcp4")
	if err != nil {
		t.Fatal(err)
	}
	sc.Chunks = chunks
	p, err := enginesim.NewPlan(sc, 7)
	if err != nil {
		t.Fatal(err)
	}
	// TP4/DCP4: each rank stores and restores its own shard of every group.
	var perRank uint64
	for gi := range p.R.Geometry {
		perRank += p.ChunkBytes(gi) * chunks
	}
	for tr := range 4 {
		if b.StoreBytes[tr] != perRank || b.RestoreBytes[tr] != perRank {
			t.Fatalf("rank %d: store %d B, restore %d B, want %d B each", tr, b.StoreBytes[tr], b.RestoreBytes[tr], perRank)
		}
	}
	// Both chunks of a rank in one store request (8 per request).
	if res.Stores != reps*4 {
		t.Fatalf("%d store requests, want %d (one per rank and repetition)", res.Stores, reps*4)
	}
	if want := reps * 4 * len(p.R.Geometry) * chunks; res.Stored != want {
		t.Fatalf("%d objects committed, want %d (%d repetitions x 4 ranks x %d groups x %d chunks)", res.Stored, want, reps, len(p.R.Geometry), chunks)
	}
	for name, st := range map[string]enginesim.BenchStat{"store": b.Store, "restore": b.Restore, "ceiling d2h": b.CeilingD2H, "ceiling h2d": b.CeilingH2D} {
		if len(st.Seconds) != reps || len(st.RankSeconds) != reps || st.Median <= 0 || st.GBps <= 0 || len(st.RankGBps) != 4 {
			t.Fatalf("%s: %+v", name, st)
		}
	}
	if b.StoreRatio <= 0 || b.RestoreRatio <= 0 {
		t.Fatalf("ratios %v / %v", b.StoreRatio, b.RestoreRatio)
	}
	for _, r := range res.Ranks {
		if r.Placed != r.Items || r.Mismatch != 0 || r.Outside != 0 {
			t.Fatalf("rank %d: %+v", r.Rank, r)
		}
	}

	// The last repetition's timelines: every stage, the engine's and the
	// rankd's adding up to no more than the timed total, on one clock.
	for name, want := range map[string][]string{
		"store": {"request", "decode", "admit", "place", "stream", "enqueue", "launch", "wait", "notice", "commit", "release", "reply",
			"response", "producer", "gather"},
		"restore": {"begin", "request", "decode", "plan", "lookup", "stream", "enqueue", "launch", "wait", "notice", "verify", "finish",
			"report", "reply", "response", "other ranks", "verdict", "scatter"},
	} {
		tl := b.StoreTimeline
		if name == "restore" {
			tl = b.RestoreTimeline
		}
		if tl == nil {
			t.Fatalf("no %s timeline: %s", name, b.TimelineProblem)
		}
		seen := map[string]bool{}
		var host int64
		for _, r := range tl.Rows {
			seen[r.Name] = true
			// A device row of several batches sums their times, which
			// may overlap: only its start is bounded. So is a "beside"
			// row (the rankd's wait for its report's acknowledgment after
			// its reply), which the coordinator sends after the verdict.
			overlaps := r.Where == "device" || r.Where == "beside"
			if r.StartNS < 0 || r.DurNS < 0 || r.StartNS > tl.TotalNS || (!overlaps && r.StartNS+r.DurNS > tl.TotalNS) {
				t.Fatalf("%s timeline row %+v outside [0, %d ns]", name, r, tl.TotalNS)
			}
			if !overlaps {
				host += r.DurNS
			}
		}
		if tl.Skewed || host > tl.TotalNS {
			t.Fatalf("%s timeline: engine and rankd stages add up to %d ns of %d ns (skewed %v)", name, host, tl.TotalNS, tl.Skewed)
		}
		for _, w := range want {
			if !seen[w] {
				t.Fatalf("%s timeline has no stage %s: %+v", name, w, tl.Rows)
			}
		}
	}

	// The restore loop (--bench-traffic): the prompt restored again and
	// again for the given time, each verdict COMPLETE.
	res3, out, err := c.sim("--scenario", "tp4dcp4", "--bench", "--bench-reps", "1", "--chunks", "2", "--seed", "9",
		"--bench-traffic", "500ms")
	if err != nil || res3 == nil || !res3.OK || res3.Bench == nil || res3.Bench.Traffic == nil {
		t.Fatalf("bench traffic: err %v, result %+v\n%s", err, res3, tail(out, 20))
	}
	if tr := res3.Bench.Traffic; tr.Restores < 1 || tr.Seconds < 0.5 || tr.GBps <= 0 {
		t.Fatalf("bench traffic %+v: want >= 1 restore over >= 0.5 s", tr)
	}
	if !strings.Contains(out, "bench traffic:") || res3.Verdict != "complete" {
		t.Fatalf("bench traffic: verdict %q\n%s", res3.Verdict, tail(out, 20))
	}

	// Stopped by a signal (how an interference run ends the loop): the
	// restore cut short is no failure, and the last line is the rate.
	sp, result := c.startSim("--scenario", "tp4dcp4", "--bench", "--bench-reps", "1", "--chunks", "2", "--seed", "11",
		"--bench-traffic", "10m")
	deadline := time.Now().Add(2 * time.Minute)
	for !strings.Contains(sp.output(), "bench traffic: restoring") && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	if err := syscall.Kill(sp.pid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = sp.wait(time.Minute)
	res4 := readResult(t, result)
	if err != nil || res4 == nil || !res4.OK || res4.Bench == nil || res4.Bench.Traffic == nil || res4.Bench.Traffic.Restores < 1 {
		t.Fatalf("bench traffic stopped by SIGTERM: err %v, result %+v\n%s", err, res4, tail(sp.output(), 20))
	}
	if !regexp.MustCompile(`bench traffic: \d+ restores in [\d.]+ s, [\d.]+ GB/s\n`).MatchString(sp.output()) {
		t.Fatalf("bench traffic stopped by SIGTERM printed no rate:\n%s", tail(sp.output(), 20))
	}

	// Both directions at once (--bench-duplex): on the 8B pages, whose
	// store and restore tables are disjoint, each duplex repetition
	// stores a fresh prompt while the one before is restored; every byte
	// of both is compared (the last prompt stored is restored alone at
	// the end).
	resD, out, err := c.sim("--spec", filepath.Join(specDir, "llama8b-tp4.json"), "--bench", "--bench-reps", "1",
		"--chunks", "2", "--seed", "13", "--bench-duplex", "2")
	if err != nil || resD == nil || !resD.OK || resD.Bench == nil || resD.Bench.Duplex == nil {
		t.Fatalf("bench duplex: err %v, result %+v\n%s", err, resD, tail(out, 20))
	}
	d := resD.Bench.Duplex
	if d.Reps != 2 || len(d.Both.Seconds) != 2 || len(d.Ceiling.Seconds) != 2 || d.Both.GBps <= 0 || d.Ceiling.GBps <= 0 ||
		d.Single <= 0 || d.Ratio <= 0 || d.CeilingRatio <= 0 || len(d.Bytes) != 4 || d.Bytes[0] != resD.Bench.StoreBytes[0]+resD.Bench.RestoreBytes[0] {
		t.Fatalf("bench duplex %+v", d)
	}
	// 1 + 2 prompts stored, every object of each (4 ranks x 2 chunks: the
	// spec's one group, its 64 pools in one object), none deduplicated;
	// 1 + 2 + 1 restores, the last compared alone, all COMPLETE.
	if want := 3 * 4 * 2; resD.Stored != want || resD.Verdict != "complete" {
		t.Fatalf("bench duplex: %d objects committed (want %d), verdict %q", resD.Stored, want, resD.Verdict)
	}
	// The last repetition's stages of both, each beside the other.
	if d.TimelineProblem != "" || d.StoreTimeline == nil || d.RestoreTimeline == nil ||
		!strings.Contains(out, "timeline of one store beside a restore (duplex)") ||
		!strings.Contains(out, "timeline of one restore beside a store (duplex)") {
		t.Fatalf("bench duplex timelines: problem %q, store %v, restore %v\n%s", d.TimelineProblem,
			d.StoreTimeline != nil, d.RestoreTimeline != nil, tail(out, 60))
	}
	if !strings.Contains(out, "both directions at once (2 repetitions") || strings.Count(out, "verdict complete") != 4 {
		t.Fatalf("bench duplex: output\n%s", tail(out, 40))
	}
	for _, r := range resD.Ranks {
		if r.Placed != r.Items || r.Mismatch != 0 || r.Outside != 0 || r.Compare == "" {
			t.Fatalf("bench duplex: rank %d: %+v", r.Rank, r)
		}
	}
	// A scenario whose tables share blocks cannot run both directions at
	// once (the store would read pages the restore writes): refused.
	resR, out, err := c.sim("--scenario", "tp4dcp4", "--bench", "--bench-reps", "1", "--chunks", "2", "--seed", "15",
		"--bench-duplex", "1")
	if err == nil || resR == nil || resR.OK || !strings.Contains(resR.Problem, "disjoint block tables") {
		t.Fatalf("bench duplex over shared blocks: err %v, result %+v\n%s", err, resR, tail(out, 20))
	}

	// The same seed again: the first store finds its objects held, which
	// moves no bytes, and the benchmark must refuse to report it.
	res2, out, err := c.sim("--scenario", "tp4dcp4", "--bench", "--bench-reps", "1", "--chunks", "2", "--seed", "7")
	if err == nil || res2 == nil || res2.OK || !strings.Contains(res2.Problem, "deduplicated") {
		t.Fatalf("bench over already stored content: err %v, result %+v\n%s", err, res2, tail(out, 20))
	}
}
