package rankd

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// checkWireTimeline checks a timeline from a status reply: op and id, host
// stages from the receipt in order without gaps adding up to DurNS, which
// is no more than wall (the caller's request to reply); device stages
// within it; every stage of want present. It returns the stage names.
func checkWireTimeline(t *testing.T, tl wire.Timeline, op, id string, wall time.Duration, want []string) map[string]wire.TimelineStage {
	t.Helper()
	if tl.Op != op || tl.ID != id {
		t.Fatalf("timeline of %s %q, want %s %q", tl.Op, tl.ID, op, id)
	}
	if tl.DurNS <= 0 || time.Duration(tl.DurNS) > wall {
		t.Fatalf("%s timeline lasts %v, the caller measured %v", op, time.Duration(tl.DurNS), wall)
	}
	got := map[string]wire.TimelineStage{}
	var end int64
	for _, s := range tl.Stages {
		got[s.Name] = s
		if s.StartNS < 0 || s.DurNS < 0 {
			t.Fatalf("%s stage %s: start %d ns, duration %d ns", op, s.Name, s.StartNS, s.DurNS)
		}
		if s.Device {
			if s.StartNS+s.DurNS > tl.DurNS {
				t.Fatalf("%s device stage %s ends at %d ns, after the request's %d ns", op, s.Name, s.StartNS+s.DurNS, tl.DurNS)
			}
			continue
		}
		if s.StartNS != end {
			t.Fatalf("%s host stage %s starts at %d ns, the previous one ended at %d ns", op, s.Name, s.StartNS, end)
		}
		end += s.DurNS
	}
	if end != tl.DurNS {
		t.Fatalf("%s host stages add up to %d ns, the timeline lasts %d ns", op, end, tl.DurNS)
	}
	for _, w := range want {
		if _, ok := got[w]; !ok {
			t.Fatalf("%s timeline has no stage %s: %+v", op, w, tl.Stages)
		}
	}
	return got
}

// TestStageTimelinesThroughTheDaemon: a store and a retrieve through NATS
// leave their timelines, with the rankd's own stages (decode, report,
// reply) around the engine's, in the status reply that asks for them, and
// an observation of every stage in kvtier_rankd_stage_seconds.
func TestStageTimelinesThroughTheDaemon(t *testing.T) {
	h := newHarness(t)
	e, reg := newStoringEngine(t, h)
	ctx := h.ctx()
	s := e.stream(t)
	want := e.uploadPage(t, s, 2)
	evh := recordedEvent(t, e, s)
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	start := time.Now()
	st, err := bus.Call[wire.StoreReply](ctx, h.nc, h.subj.Engine(h.rank, OpStore), &wire.StoreRequest{
		RequestID: "tl-store", Namespace: e.res.Namespace, Session: reg.Session, Event: evh,
		Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{2}}}}})
	storeWall := time.Since(start)
	if err != nil || st.Stored != 1 {
		t.Fatalf("store: %+v, %v", st, err)
	}
	key := dcp.Key{NS: e.res.Namespace, Chunk: chunk, Shard: 1, Group: 0}
	start = time.Now()
	rr, err := bus.Call[wire.RetrieveReply](ctx, h.nc, h.subj.Engine(h.rank, OpRetrieve), &wire.RetrieveRequest{
		RestoreID: "tl-restore", Namespace: e.res.Namespace, Session: reg.Session,
		Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key, Sum: checksum.Sum(want), Blocks: []int64{5}}}})
	retrieveWall := time.Since(start)
	if err != nil || len(rr.Results) != 1 || !rr.Results[0].OK {
		t.Fatalf("retrieve: %+v, %v", rr, err)
	}

	status := func(id string) []wire.Timeline {
		t.Helper()
		rep, err := bus.Call[StatusReply](ctx, h.nc, h.subj.Engine(h.rank, OpStatus), &StatusRequest{Timelines: id})
		if err != nil {
			t.Fatal(err)
		}
		return rep.Timelines
	}
	tls := status("tl-store")
	if len(tls) != 1 {
		t.Fatalf("%d timelines of the store, want 1", len(tls))
	}
	stages := checkWireTimeline(t, tls[0], OpStore, "tl-store", storeWall, []string{"decode", "admit", "place", "stream", "enqueue", "launch",
		"wait", "notice", "commit", "release", "reply", "producer", "gather"})
	if !stages["gather"].Device || stages["commit"].Device {
		t.Fatalf("device flags: gather %v, commit %v", stages["gather"].Device, stages["commit"].Device)
	}
	if tls[0].Bytes != e.res.ObjectSize(0) {
		t.Fatalf("store timeline bytes %d, want %d", tls[0].Bytes, e.res.ObjectSize(0))
	}
	// The retrieve's report goes out beside its reply and its timeline
	// ends once the report is acknowledged, so it may be kept just after
	// the reply came: the bound is the wall time until it was.
	testutil.Eventually(t, 10*time.Second, "the retrieve's timeline", func() bool {
		tls = status("tl-restore")
		return len(tls) > 0
	})
	retrieveWall = time.Since(start)
	if len(tls) != 1 {
		t.Fatalf("%d timelines of the restore, want 1", len(tls))
	}
	rs := checkWireTimeline(t, tls[0], OpRetrieve, "tl-restore", retrieveWall, []string{"decode", "plan", "lookup", "stream", "enqueue", "launch",
		"wait", "notice", "verify", "finish", "report", "reply", "scatter"})
	if rs["report"].StartNS < rs["reply"].StartNS+rs["reply"].DurNS {
		t.Fatalf("report stage %+v before the reply %+v: the reply waited for the report's acknowledgment", rs["report"], rs["reply"])
	}
	if n := len(status(StatusAllTimelines)); n != 2 {
		t.Fatalf("%d recent timelines, want 2", n)
	}
	if n := len(status("no-such-request")); n != 0 {
		t.Fatalf("%d timelines of an unknown request", n)
	}
	if rep, err := bus.Call[StatusReply](ctx, h.nc, h.subj.Engine(h.rank, OpStatus), struct{}{}); err != nil || rep.Timelines != nil {
		t.Fatalf("plain status: %d timelines, %v", len(rep.Timelines), err)
	}

	// Every stage of both was observed once, but pace: the retrieve was
	// not paced.
	for op, stages := range opStages {
		for _, s := range stages {
			want := 1.0
			if s == transfer.StagePace {
				want = 0
			}
			if n := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_stage_seconds", "op", op, "stage", s.String()); n != want {
				t.Errorf("kvtier_rankd_stage_seconds{op=%q,stage=%q} has %v observations, want %v", op, s, n, want)
			}
		}
	}
	// Beyond the ring, the oldest timelines are forgotten.
	for i := range recentTimelines {
		tl := transfer.NewTimeline(time.Now())
		tl.Lap(transfer.StageDecode, -1)
		h.d.met.stages.done(OpRetrieve, fmt.Sprintf("filler-%d", i), tl)
	}
	if n := len(status("tl-store")); n != 0 {
		t.Fatalf("the store's timeline is still kept after %d newer ones", recentTimelines)
	}
}

// TestTimelineResolvedOutsideTheSlot: a store's timeline is finished (the
// device's times read, which may wait up to a second for the marks of a
// copy that failed) after its request slot is free. Until eab9791 the
// slot was held meanwhile, so with MaxInFlight 1 the next store was
// refused while the first one's answered timeline was read.
func TestTimelineResolvedOutsideTheSlot(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MaxInFlight = 1 })
	e, reg := newStoringEngine(t, h)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h.d.met.stages.resolveHook = func() {
		once.Do(func() {
			close(entered)
			<-release
		})
	}
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	if rep, err := e.storeFirstChunk(t, h, reg.Session); err != nil || rep.Stored != 1 {
		t.Fatalf("first store: %+v, %v", rep, err)
	}
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first store's timeline was never finished")
	}
	// The first store's timeline is being read: its slot must be free.
	if rep, err := e.storeFirstChunk(t, h, reg.Session); err != nil {
		t.Fatalf("a store while the last one's timeline is read: %+v, %v", rep, err)
	}
	close(release)
	testutil.Eventually(t, 10*time.Second, "both stores' timelines", func() bool {
		rep, err := bus.Call[StatusReply](h.ctx(), h.nc, h.subj.Engine(h.rank, OpStatus), &StatusRequest{Timelines: StatusAllTimelines})
		return err == nil && len(rep.Timelines) == 2
	})
}
