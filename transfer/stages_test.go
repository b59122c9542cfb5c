package transfer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// checkTimeline checks the invariants of a finished timeline whose request
// took wall from the timeline's origin: host stages follow one another
// from the origin without gap or overlap, none negative, adding up to no
// more than wall; device stages lie within [0, wall]. It returns the
// spans by stage and batch.
func checkTimeline(t *testing.T, tl *Timeline, wall time.Duration) map[string]StageSpan {
	t.Helper()
	if tl.Truncated() {
		t.Fatal("timeline truncated")
	}
	byName := map[string]StageSpan{}
	var end, host time.Duration
	for i, s := range tl.Spans() {
		name := fmt.Sprintf("%s/%d", s.Stage, s.Batch)
		if _, dup := byName[name]; dup {
			t.Fatalf("span %d: stage %s recorded twice", i, name)
		}
		byName[name] = s
		if s.Start < 0 || s.Dur < 0 {
			t.Fatalf("span %d (%s): start %v, duration %v: negative", i, name, s.Start, s.Dur)
		}
		if s.Stage.Device() {
			if s.Start+s.Dur > wall {
				t.Fatalf("device stage %s ends at %v, after the request's %v", name, s.Start+s.Dur, wall)
			}
			continue
		}
		if s.Start != end {
			t.Fatalf("host stage %s starts at %v, the previous one ended at %v", name, s.Start, end)
		}
		end += s.Dur
		host += s.Dur
	}
	if host > wall {
		t.Fatalf("host stages add up to %v, more than the request's %v", host, wall)
	}
	if got := tl.End().Sub(tl.Origin()); got != end {
		t.Fatalf("End is %v after the origin, the host stages end at %v", got, end)
	}
	return byName
}

// within checks that device stage dev of a batch lies between the start of
// its enqueue and the end of the host's notice of it.
func within(t *testing.T, spans map[string]StageSpan, dev string, batch int) {
	t.Helper()
	d, ok := spans[fmt.Sprintf("%s/%d", dev, batch)]
	enq, ok2 := spans[fmt.Sprintf("enqueue/%d", batch)]
	notice, ok3 := spans[fmt.Sprintf("notice/%d", batch)]
	if !ok || !ok2 || !ok3 {
		t.Fatalf("batch %d: %s, enqueue or notice missing (%v %v %v)", batch, dev, ok, ok2, ok3)
	}
	if d.Start < enq.Start || d.Start+d.Dur > notice.Start+notice.Dur {
		t.Fatalf("batch %d: %s [%v, %v] outside its enqueue (from %v) and notice (to %v)", batch, dev,
			d.Start, d.Start+d.Dur, enq.Start, notice.Start+notice.Dur)
	}
}

// before checks that host stage a ends no later than host stage b starts.
func before(t *testing.T, spans map[string]StageSpan, a, b string) {
	t.Helper()
	sa, ok := spans[a]
	sb, ok2 := spans[b]
	if !ok || !ok2 {
		t.Fatalf("stage %s or %s missing (%v %v)", a, b, ok, ok2)
	}
	if sa.Start+sa.Dur > sb.Start {
		t.Fatalf("stage %s ends at %v, after %s starts at %v", a, sa.Start+sa.Dur, b, sb.Start)
	}
}

// TestStageTimelines: on the host backend a store's and a retrieve's
// timelines hold every stage, the host's in order without gaps and adding
// up to no more than the measured time, each batch's device copy between
// its enqueue and the host's notice of its end; and the bytes moved. No
// duration is compared with a threshold.
func TestStageTimelines(t *testing.T) {
	dev := openDevice(t, "")
	spec := dcp.Spec{Model: "m", Layout: dcp1, ChunkTokens: 32, Groups: []dcp.Group{
		{Kind: dcp.Attention, BlockSize: 16, Layers: 2, SemanticBytes: 16 * 528, PageBytes: 16 * 561, StrideBytes: 16*561 + 37, KVFormat: "fp8"},
	}}
	r := newRig(t, dev, spec, []int64{32})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.RetrieveBatchBytes = cfg.L1SlabBytes // one chunk (one slab) per batch
	e := newEngine(t, cfg)
	res := r.register(e)
	const chunks = 3
	var cs []chunk
	for i := range chunks {
		cs = append(cs, r.newChunk(i, r.consecutive(int64(2*i))))
	}
	objBytes := res.ObjectSize(0)

	// A store of three chunks: one gather.
	for _, c := range cs {
		r.write(c, c.blocks, 0)
	}
	// The producer's work ends after a delay: the device waits for it.
	if err := r.stream.Delay(20 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	_, h := r.record()
	req := r.storeReq("timeline", h, cs...)
	origin := time.Now()
	tl := NewTimeline(origin)
	f, err := e.Store(WithTimeline(testCtx(t), tl), req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	wall := time.Since(origin)
	// The device's times are read once the request is over.
	if _, ok := tl.Total(StageGather); ok {
		t.Fatal("a gather time before Resolve")
	}
	tl.Resolve(testCtx(t))
	spans := checkTimeline(t, tl, wall)
	var order []string
	for _, s := range tl.Spans() {
		if !s.Stage.Device() {
			order = append(order, s.Stage.String())
		}
	}
	if got, want := fmt.Sprint(order), "[admit place stream enqueue launch wait notice commit]"; got != want {
		t.Fatalf("store host stages %s, want %s", got, want)
	}
	within(t, spans, "producer", 0)
	within(t, spans, "gather", 0)
	launchedFirst(t, spans, "gather", 0)
	if p, g := spans["producer/0"], spans["gather/0"]; p.Start+p.Dur != g.Start {
		t.Fatalf("the producer wait ends at %v, the gather starts at %v: they share a mark", p.Start+p.Dur, g.Start)
	}
	if tl.Bytes != chunks*objBytes {
		t.Fatalf("store timeline bytes %d, want %d", tl.Bytes, chunks*objBytes)
	}

	// A retrieve of the three chunks: three batches, overlapping by one.
	targets := make([][][]int64, chunks)
	for i := range targets {
		targets[i] = r.consecutive(int64(16 + 2*i))
	}
	rreq := r.retrieveReq(0, cs, targets)
	origin = time.Now()
	tl = NewTimeline(origin)
	rr, err := e.Retrieve(WithTimeline(testCtx(t), tl), rreq)
	if err != nil {
		t.Fatal(err)
	}
	wall = time.Since(origin)
	tl.Resolve(testCtx(t))
	for i := range chunks {
		if !rr.ChunkOK(i) {
			t.Fatalf("chunk %d not restored: %+v", i, rr.Items)
		}
		r.expectRestored(cs[i], targets[i])
	}
	r.check("after the retrieve")
	spans = checkTimeline(t, tl, wall)
	var host []StageSpan
	for _, s := range tl.Spans() {
		if !s.Stage.Device() {
			host = append(host, s)
		}
	}
	if host[0].Stage != StagePlan || host[len(host)-1].Stage != StageFinish {
		t.Fatalf("retrieve's host stages start with %s and end with %s, want plan and finish", host[0].Stage, host[len(host)-1].Stage)
	}
	for b := range chunks {
		seq := []string{"lookup", "stream", "enqueue", "launch", "wait", "notice", "verify"}
		for i := 1; i < len(seq); i++ {
			before(t, spans, fmt.Sprintf("%s/%d", seq[i-1], b), fmt.Sprintf("%s/%d", seq[i], b))
		}
		within(t, spans, "scatter", b)
		launchedFirst(t, spans, "scatter", b)
	}
	if n := len(tl.Spans()); n != 2+8*chunks {
		t.Fatalf("retrieve timeline has %d stages, want %d (plan, finish and 8 per batch)", n, 2+8*chunks)
	}
	if tl.Bytes != chunks*objBytes {
		t.Fatalf("retrieve timeline bytes %d, want %d", tl.Bytes, chunks*objBytes)
	}
	for _, st := range []Stage{StagePlan, StageLookup, StageScatter, StageVerify} {
		if _, ok := tl.Total(st); !ok {
			t.Fatalf("no total of %s", st)
		}
	}
	if _, ok := tl.Total(StageGather); ok {
		t.Fatal("a retrieve has a gather total")
	}
}

// fixedTimer is a Timer reached at a fixed time.
type fixedTimer struct{ at time.Time }

func (f fixedTimer) Time(context.Context) (time.Time, error) { return f.at, nil }
func (f fixedTimer) Release() error                          { return nil }

// TestCopyTimesNeverAfterTheHostSawTheEnd: marks after the moment the
// host saw the copy complete (reached late, as seen on the H200) are
// clamped to it and the clamp noted; marks before it are left alone.
func TestCopyTimesNeverAfterTheHostSawTheEnd(t *testing.T) {
	t0 := time.Now()
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	c := &copyTimers{n: 3, t: [3]cuda.Timer{fixedTimer{ms(1)}, fixedTimer{ms(2)}, fixedTimer{ms(5)}}}
	tl := NewTimeline(t0)
	at, ok := c.times(context.Background(), tl, ms(3))
	if !ok || !at[0].Equal(ms(1)) || !at[1].Equal(ms(2)) || !at[2].Equal(ms(3)) {
		t.Fatalf("times %v (ok %v), want 1, 2 and 3 ms", []time.Duration{at[0].Sub(t0), at[1].Sub(t0), at[2].Sub(t0)}, ok)
	}
	if tl.MarkClamp() != 2*time.Millisecond {
		t.Fatalf("mark clamp %v, want 2ms", tl.MarkClamp())
	}
	at, ok = c.times(context.Background(), tl, ms(6))
	if !ok || !at[2].Equal(ms(5)) || tl.MarkClamp() != 2*time.Millisecond {
		t.Fatalf("marks before the host saw the end moved: last %v, clamp %v", at[2].Sub(t0), tl.MarkClamp())
	}
}

// A copy's device stage starts when its work began to reach the stream
// (cuda.Op.Started), not at the mark placed before the Gather or Scatter
// call, which the stream reaches while the host still plans; the stage
// before it (a store's wait for the producer) keeps its marks, and a start
// after the end mark leaves the stage empty, never negative.
func TestCopyStageStartsWithItsWork(t *testing.T) {
	t0 := time.Now()
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	for _, c := range []struct {
		name             string
		started          time.Time
		producer, gather time.Duration
	}{
		{"planned 3 ms after the mark", ms(4), time.Millisecond, 2 * time.Millisecond},
		{"no start known", time.Time{}, time.Millisecond, 5 * time.Millisecond},
		{"started after the end mark", ms(7), time.Millisecond, 0},
	} {
		tl := NewTimeline(t0)
		tm := &copyTimers{n: 3, t: [3]cuda.Timer{fixedTimer{ms(0)}, fixedTimer{ms(1)}, fixedTimer{ms(6)}}, started: c.started}
		if rest := tl.copyDone(tm, 0, ms(7), StageProducer, StageGather); rest != nil {
			t.Fatalf("%s: copyDone kept the timers", c.name)
		}
		tl.Resolve(context.Background())
		producer, _ := tl.Total(StageProducer)
		gather, _ := tl.Total(StageGather)
		if producer != c.producer || gather != c.gather {
			t.Errorf("%s: producer %v, gather %v; want %v and %v", c.name, producer, gather, c.producer, c.gather)
		}
	}
}

// storedChunks stores n one-group chunks of two blocks each (561 B rows of
// 16-slot pages, blocks 0..2n-1) through a new engine and returns the rig,
// the engine, its registration, the chunks and a retrieve's targets for
// them (blocks 2n..4n-1).
func storedChunks(t *testing.T, n int) (*rig, *Engine, *dcp.Resolved, []chunk, [][][]int64) {
	t.Helper()
	dev := openDevice(t, "")
	spec := dcp.Spec{Model: "m", Layout: dcp1, ChunkTokens: 32, Groups: []dcp.Group{
		{Kind: dcp.Attention, BlockSize: 16, Layers: 2, SemanticBytes: 16 * 528, PageBytes: 16 * 561, StrideBytes: 16*561 + 37, KVFormat: "fp8"},
	}}
	r := newRig(t, dev, spec, []int64{int64(4 * n)})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	res := r.register(e)
	var cs []chunk
	for i := range n {
		cs = append(cs, r.newChunk(i, r.consecutive(int64(2*i))))
		r.write(cs[i], cs[i].blocks, 0)
	}
	_, h := r.record()
	f, err := e.Store(testCtx(t), r.storeReq("stored", h, cs...))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	targets := make([][][]int64, n)
	for i := range targets {
		targets[i] = r.consecutive(int64(2*n + 2*i))
	}
	return r, e, res, cs, targets
}

// TestRetrieveBatchesRamp: a retrieve's first batches grow to the batch
// bound (by default an eighth, a quarter, a half: Config.RetrieveRamp),
// its last ones shrink from it where Config.RetrieveTailRamp asks (off by
// default), the rest fill it, and every chunk is restored byte-exact;
// with no ramp every batch fills the bound, and a ramp outside 0..8 is
// refused.
func TestRetrieveBatchesRamp(t *testing.T) {
	if DefaultConfig().RetrieveRamp != 3 || DefaultConfig().RetrieveTailRamp != 0 {
		t.Fatalf("default ramps %d and %d, want 3 and 0", DefaultConfig().RetrieveRamp, DefaultConfig().RetrieveTailRamp)
	}
	for _, tc := range []struct {
		ramp, tail int
		paced      bool
		want       string
	}{
		{3, 0, false, "[1 2 4 8 5]"}, {1, 0, false, "[4 8 8]"}, {0, 0, false, "[8 8 4]"},
		{3, 3, false, "[1 2 4 6 4 2 1]"}, {0, 2, false, "[8 6 4 2]"}, {0, 8, false, "[8 2 3 4 2 1]"},
		{3, 3, true, "[1 2 4 8 5]"}, // a paced retrieve keeps its windows' batches
	} {
		const chunks = 20
		r, e, res, cs, targets := storedChunks(t, chunks)
		perChunk := uint64(e.cat.slabsFor(res.ObjectSize(0))) * e.cat.slabBytes
		e.cfg.RetrieveBatchBytes, e.cfg.RetrieveRamp, e.cfg.RetrieveTailRamp = 8*perChunk, tc.ramp, tc.tail
		if e.retrieveBatchBytes() != 8*perChunk {
			t.Fatalf("batch bound %d, want %d (L1 too small for the test)", e.retrieveBatchBytes(), 8*perChunk)
		}
		req := r.retrieveReq(0, cs, targets)
		if tc.paced {
			// A pace that moves the whole bound in a window: the same bound.
			req.Pace = max(MinPace, uint64(math.Ceil(float64(8*perChunk)/e.cfg.RetrievePaceWindow.Seconds())))
		}
		var sizes []int
		e.hooks.scatterEnqueued = func(_ string, idx []int) { sizes = append(sizes, len(idx)) }
		rr, err := e.Retrieve(testCtx(t), req)
		if err != nil {
			t.Fatal(err)
		}
		for i := range chunks {
			if !rr.ChunkOK(i) {
				t.Fatalf("ramp %d: chunk %d not restored: %+v", tc.ramp, i, rr.Items)
			}
			r.expectRestored(cs[i], targets[i])
		}
		r.check("after the retrieve")
		if got := fmt.Sprint(sizes); got != tc.want {
			t.Fatalf("ramp %d, tail %d, paced %v: batches of %s chunks, want %s", tc.ramp, tc.tail, tc.paced, got, tc.want)
		}
	}
	dev := openDevice(t, "")
	for _, ramp := range []int{-1, 9} {
		c := engineConfig(t, dev, 0, 1)
		c.RetrieveRamp = ramp
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "ramp") {
			t.Errorf("ramp %d: Validate = %v, want an error naming the ramp", ramp, err)
		}
		c = engineConfig(t, dev, 0, 1)
		c.RetrieveTailRamp = ramp
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "tail ramp") {
			t.Errorf("tail ramp %d: Validate = %v, want an error naming the tail ramp", ramp, err)
		}
	}
}

// TestBatchRunsCutEveryChunkOnce: for random chunk sizes, bounds and
// ramps, a retrieve's batches hold every chunk once, in order, each within
// its ramp's bound (from the start for the head, from the end for the
// tail) or a single chunk, and where the tail can cut (the last chunk is at
// most half the bytes) the last batch is at most the tail's first bound.
func TestBatchRunsCutEveryChunkOnce(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 51))
	for trial := range 5000 {
		need := make([]uint64, 1+rng.IntN(60))
		for i := range need {
			need[i] = 1 + uint64(rng.IntN(9))
		}
		total := sumOf(need)
		bound := 1 + uint64(rng.IntN(40))
		ramp, tailRamp := rng.IntN(5), rng.IntN(5)
		runs := batchRuns(need, 1, bound, ramp, tailRamp)
		next := 0
		for k, run := range runs {
			if run[0] != next || run[1] <= run[0] {
				t.Fatalf("trial %d: batch %d is %v after chunk %d: %v", trial, k, run, next, runs)
			}
			next = run[1]
			if b := sumOf(need[run[0]:run[1]]); b > bound && run[1]-run[0] > 1 {
				t.Fatalf("trial %d: batch %d of %d bytes, bound %d: %v", trial, k, b, bound, runs)
			}
		}
		if next != len(need) {
			t.Fatalf("trial %d: batches end at chunk %d of %d: %v", trial, next, len(need), runs)
		}
		if first := max(1, bound>>uint(ramp)); sumOf(need[runs[0][0]:runs[0][1]]) > first && runs[0][1]-runs[0][0] > 1 && (tailRamp == 0 || len(runs) > tailRamp) {
			t.Fatalf("trial %d: first batch over %d: %v", trial, first, runs)
		}
		last := runs[len(runs)-1]
		if tailRamp > 0 && 2*need[len(need)-1] <= total {
			if lim := max(1, bound>>uint(tailRamp)); sumOf(need[last[0]:last[1]]) > lim && last[1]-last[0] > 1 {
				t.Fatalf("trial %d: last batch over the tail's %d: %v (need %v)", trial, lim, runs, need)
			}
		}
	}
}

func sumOf(xs []uint64) (s uint64) {
	for _, x := range xs {
		s += x
	}
	return s
}

// TestRetrievePaced: a paced retrieve starts each batch after the first
// no sooner than the bytes before it take at its pace (measured from the
// call, which precedes the pacer's start), its batches hold at most what
// the pace moves in Config.RetrievePaceWindow (4 ms here, so that the
// slowest pace makes several), every chunk is restored byte-exact, and a
// pace under MinPace is refused before anything is placed.
func TestRetrievePaced(t *testing.T) {
	const chunks = 24
	r, e, res, cs, targets := storedChunks(t, chunks)
	e.cfg.RetrievePaceWindow = 4 * time.Millisecond
	window := e.cfg.RetrievePaceWindow

	slow := r.retrieveReq(0, cs, targets)
	slow.Pace = MinPace - 1
	if _, err := e.Retrieve(testCtx(t), slow); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("a pace under MinPace: %v, want ErrBadRequest", err)
	}
	r.check("after a refused pace") // nothing placed

	req := r.retrieveReq(0, cs, targets)
	req.Pace = MinPace
	obj := res.ObjectSize(0)
	quantum := max(e.cat.slabBytes, uint64(float64(req.Pace)*window.Seconds()))
	type started struct {
		at    time.Time
		chunk int
	}
	var starts []started
	var inFlight, waits int
	e.hooks.scatterEnqueued = func(_ string, idx []int) {
		if uint64(len(idx))*obj > quantum && len(idx) > 1 {
			t.Errorf("a paced batch of %d objects of %d B, more than the pace moves in %v (%d B)", len(idx), obj, window, quantum)
		}
		starts = append(starts, started{time.Now(), len(idx)})
		inFlight++
	}
	e.hooks.scatterCompleted = func(string, []int) { inFlight-- }
	e.hooks.paceWaiting = func(string) {
		waits++
		if inFlight != 0 {
			t.Errorf("a paced retrieve waits with %d batches on the device: it holds their streams and pins", inFlight)
		}
	}
	// A machine slower than the pace (the race detector at a load of 10:
	// 2 of 20 runs) never has to wait: every attempt is checked, and one of
	// up to five must have waited, or the test fails.
	const attempts = 5
	for attempt := 1; ; attempt++ {
		starts, waits = starts[:0], 0
		begun := time.Now()
		rr, err := e.Retrieve(testCtx(t), req)
		if err != nil {
			t.Fatal(err)
		}
		sent := 0
		for k, s := range starts {
			due := time.Duration(float64(uint64(sent)*obj) / float64(req.Pace) * float64(time.Second))
			if got := s.at.Sub(begun); got < due {
				t.Fatalf("batch %d started %v after the call, before the %v its %d earlier objects take at %d B/s", k, got, due, sent, req.Pace)
			}
			sent += s.chunk
		}
		for i := range chunks {
			if !rr.ChunkOK(i) {
				t.Fatalf("chunk %d not restored: %+v", i, rr.Items)
			}
			r.expectRestored(cs[i], targets[i])
		}
		r.check("after the paced retrieve")
		t.Logf("attempt %d: %d batches, %d waits, objects of %d B, quantum %d B, last started %v after the call",
			attempt, len(starts), waits, obj, quantum, starts[len(starts)-1].at.Sub(begun))
		if len(starts) >= 3 && waits > 0 {
			return
		}
		if attempt == attempts {
			t.Fatalf("%d attempts, none with several batches and a wait (the last: %d batches, %d waits): the test never saw the pace", attempts, len(starts), waits)
		}
	}
}

// TestPacedBatchBound: a paced retrieve's batches hold what its pace moves
// in Config.RetrievePaceWindow, at least a slab and at most the unpaced
// bound; an unpaced one's are the unpaced bound.
func TestPacedBatchBound(t *testing.T) {
	dev := openDevice(t, "")
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	full, slab := e.retrieveBatchBytes(), e.cat.slabBytes
	if e.cfg.RetrievePaceWindow != DefaultConfig().RetrievePaceWindow {
		t.Fatalf("engine window %v, want the default %v", e.cfg.RetrievePaceWindow, DefaultConfig().RetrievePaceWindow)
	}
	for _, tc := range []struct {
		window time.Duration
		pace   uint64
		want   uint64
	}{
		{64 * time.Millisecond, 0, full},
		{64 * time.Millisecond, MinPace, max(slab, min(full, MinPace*64/1000))},
		{4 * time.Millisecond, MinPace, max(slab, min(full, MinPace*4/1000))},
		{time.Second, 1 << 40, full},
		{time.Millisecond, 1000, slab}, // 1 B in a window: a slab at least
	} {
		e.cfg.RetrievePaceWindow = tc.window
		r := &retrieval{e: e, pace: tc.pace}
		if got := r.batchBound(); got != tc.want {
			t.Errorf("window %v, pace %d B/s: batches of %d B, want %d (slab %d, unpaced %d)", tc.window, tc.pace, got, tc.want, slab, full)
		}
	}
	if tc := DefaultConfig(); tc.RetrievePaceWindow != 64*time.Millisecond {
		t.Errorf("default window %v", tc.RetrievePaceWindow)
	}
	for _, w := range []time.Duration{0, time.Millisecond - 1, time.Second + 1} {
		c := engineConfig(t, dev, 0, 1)
		c.RetrievePaceWindow = w
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "pace window") {
			t.Errorf("window %v: Validate = %v, want an error naming the pace window", w, err)
		}
	}
}

// TestEffectivePace: a pace holds where its copies take at most half the
// time left to the deadline; else the retrieve goes as fast as that half
// needs, and at full speed once no time is left.
func TestEffectivePace(t *testing.T) {
	now := time.Unix(1000, 0)
	const gb = 1_000_000_000
	for _, tc := range []struct {
		name        string
		pace, total uint64
		deadline    time.Time
		want        uint64
	}{
		{"no deadline", 20 * gb, 4 * gb, time.Time{}, 20 * gb},
		{"ample time", 20 * gb, 4 * gb, now.Add(10 * time.Second), 20 * gb},
		{"exactly half", 20 * gb, 4 * gb, now.Add(400 * time.Millisecond), 20 * gb},
		{"too slow for half", 20 * gb, 4 * gb, now.Add(200 * time.Millisecond), 40 * gb},
		{"passed", 20 * gb, 4 * gb, now.Add(-time.Millisecond), math.MaxUint64},
	} {
		if got := effectivePace(tc.pace, tc.total, now, tc.deadline); got != tc.want {
			t.Errorf("%s: %d B/s, want %d", tc.name, got, tc.want)
		}
	}
}

// A retrieve's batches group each chunk's items, chunks in order of first
// appearance and items in request order within a chunk, whatever order
// the request lists them in (group-major here: every chunk's group 0,
// then every chunk's group 1), and every item is in exactly one batch.
func TestBatchesGroupEachChunksItems(t *testing.T) {
	dev := openDevice(t, "")
	spec := dcp.Spec{Model: "m", Layout: dcp1, ChunkTokens: 16, Groups: []dcp.Group{
		{Kind: dcp.Attention, BlockSize: 16, Layers: 1, KVFormat: "bf16", SemanticBytes: 4096, PageBytes: 4096, StrideBytes: 4096},
		{Kind: dcp.Attention, BlockSize: 16, Layers: 1, KVFormat: "bf16", SemanticBytes: 4096, PageBytes: 4096, StrideBytes: 4096},
	}}
	res, err := spec.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1SlabBytes = 4096
	cfg.RetrieveBatchBytes = 2 * 4096 // one chunk (two objects) a batch
	cfg.RetrieveRamp, cfg.RetrieveTailRamp = 0, 0
	e := newEngine(t, cfg)
	var items []wire.RetrieveItem
	for g := range 2 {
		for _, c := range []int{2, 0, 1} {
			items = append(items, wire.RetrieveItem{Chunk: c, Group: g})
		}
	}
	// Chunk numbers far apart (chunkRanks' map, not its slice) group alike.
	sparse := slices.Clone(items)
	for i := range sparse {
		sparse[i].Chunk = sparse[i].Chunk*1_000_003 + 7
	}
	for _, its := range [][]wire.RetrieveItem{items, sparse} {
		r := &retrieval{e: e, sp: &space{res: res}, req: RetrieveRequest{Items: its}}
		got := fmt.Sprint(r.batches())
		if want := "[[0 3] [1 4] [2 5]]"; got != want {
			t.Fatalf("batches %s, want %s (chunk 2's items, then chunk 0's, then chunk 1's; chunks %d..)", got, want, its[0].Chunk)
		}
	}
	cfg.RetrieveBatchBytes = 1 << 20 // all in one batch
	cfg.Registerer = newRegistry()
	e2 := newEngine(t, cfg)
	r := &retrieval{e: e2, sp: &space{res: res}, req: RetrieveRequest{Items: items}}
	if got, want := fmt.Sprint(r.batches()), "[[0 3 1 4 2 5]]"; got != want {
		t.Fatalf("one batch: %s, want %s", got, want)
	}
}

// launchedFirst checks that device copy dev of a batch starts no earlier
// than its launch stage: the enqueue stage ends when the copy's work began
// to reach its stream (cuda.Op.Started), where the copy's device time
// starts at the earliest.
func launchedFirst(t *testing.T, spans map[string]StageSpan, dev string, batch int) {
	t.Helper()
	d, ok := spans[fmt.Sprintf("%s/%d", dev, batch)]
	l, ok2 := spans[fmt.Sprintf("launch/%d", batch)]
	if !ok || !ok2 {
		t.Fatalf("batch %d: %s or launch missing (%v %v)", batch, dev, ok, ok2)
	}
	if d.Start < l.Start {
		t.Fatalf("batch %d: %s starts at %v, before its launch at %v", batch, dev, d.Start, l.Start)
	}
}
