package transfer

import (
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// pubRecorder is a Publisher that keeps every batch; fail makes the next
// calls fail.
type pubRecorder struct {
	mu      sync.Mutex
	batches []wire.Batch
	fail    int // fail this many calls first
	calls   int
}

func (c *pubRecorder) Publish(b wire.Batch) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls++
	if c.fail > 0 {
		c.fail--
		return errors.New("coordinator unreachable")
	}
	// The engine must not reuse the batch's memory after Publish returns.
	b.Events = slices.Clone(b.Events)
	c.batches = append(c.batches, b)
	return nil
}

func (c *pubRecorder) events() []wire.Event {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []wire.Event
	for _, b := range c.batches {
		out = append(out, b.Events...)
	}
	return out
}

// waitPublished waits until every event assigned so far was published.
func waitPublished(t *testing.T, e *Engine) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := e.Stats()
		if st.PublishedThrough == st.LastSeq {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("published through %d of %d", st.PublishedThrough, st.LastSeq)
		}
		time.Sleep(time.Millisecond)
	}
}

type placementKey struct {
	key  dcp.Key
	tier wire.Tier
}

// checkEvents asserts the batches of one incarnation are in order, with
// sequences 1..n, and that folding them gives inv.
func checkEvents(t *testing.T, c *pubRecorder, rank wire.Rank, inc uint64, inv wire.Inventory) {
	t.Helper()
	c.mu.Lock()
	for _, b := range c.batches {
		if b.Rank != rank || b.Incarnation != inc || inc == 0 {
			t.Fatalf("batch from %v incarnation %d, want %v %d", b.Rank, b.Incarnation, rank, inc)
		}
		if len(b.Events) == 0 || len(b.Events) > wire.MaxBatchEvents {
			t.Fatalf("batch of %d events", len(b.Events))
		}
	}
	c.mu.Unlock()
	evs := c.events()
	state := map[placementKey]wire.Placement{}
	for i, ev := range evs {
		if ev.Seq != uint64(i+1) {
			t.Fatalf("event %d has sequence %d, want %d (strictly increasing from 1, no gaps)", i, ev.Seq, i+1)
		}
		k := placementKey{ev.Key, ev.Tier}
		switch ev.Kind {
		case wire.Stored:
			state[k] = wire.Placement{Key: ev.Key, Tier: ev.Tier, Size: ev.Size, Sum: ev.Sum}
		case wire.Removed:
			delete(state, k)
		default:
			t.Fatalf("event %d kind %d", i, ev.Kind)
		}
	}
	if inv.Seq != uint64(len(evs)) {
		t.Fatalf("inventory at sequence %d, %d events published", inv.Seq, len(evs))
	}
	if len(inv.Objects) != len(state) {
		t.Fatalf("inventory lists %d placements, the events fold to %d", len(inv.Objects), len(state))
	}
	for _, p := range inv.Objects {
		if got, ok := state[placementKey{p.Key, p.Tier}]; !ok || got != p {
			t.Fatalf("inventory has %+v, events fold to %+v (present %v)", p, got, ok)
		}
	}
}

// TestEventsSequencedAndInventoryConsistent: every commit, eviction and L2
// write becomes an event, numbered from 1 without gaps, delivered in order
// in batches; the inventory equals the fold of the events up to its
// sequence; a restarted rank starts again at 1 under a new incarnation
// with its L2 objects.
func TestEventsSequencedAndInventoryConsistent(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{2 * 24})
	pub := &pubRecorder{fail: 2} // the first publishes fail and are retried
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes = 6 * (64 << 10) // evictions
	cfg.L2Dir = t.TempDir()
	cfg.Publisher = pub
	cfg.EventBatch = 7
	e := newEngine(t, cfg)
	r.register(e)
	var cs []chunk
	for i := range 20 {
		cs = append(cs, r.newChunk(i, r.consecutiveN(i)))
	}
	for i := 0; i < 20; i += 4 {
		storeAll(t, e, r, "ev", cs[i:i+4]...)
	}
	storeAll(t, e, r, "ev-dup", cs[0]) // a dedupe changes nothing
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, cs[:2], [][][]int64{r.consecutiveN(22), r.consecutiveN(23)}))
	if err != nil || len(rr.FailedChunks()) != 0 {
		t.Fatalf("retrieve: %+v %v", rr, err)
	}
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	waitPublished(t, e)
	inv := e.Inventory()
	checkEvents(t, pub, cfg.Rank, e.Incarnation(), inv)
	st := e.Stats()
	if st.Evictions == 0 || st.EventsDropped != 0 || st.EventsPublished != st.LastSeq {
		t.Fatalf("stats %+v", st)
	}
	var kinds [3][3]int
	for _, ev := range pub.events() {
		kinds[ev.Kind][ev.Tier]++
	}
	if kinds[wire.Stored][wire.L2] != 20 || kinds[wire.Stored][wire.L1] < 20 || kinds[wire.Removed][wire.L1] == 0 {
		t.Fatalf("event kinds %v: want 20 L2 stores, >= 20 L1 stores, L1 removals", kinds)
	}
	closeEngine(t, e)

	// Restart: a new incarnation, numbered from 1, announcing its L2.
	pub2 := &pubRecorder{}
	cfg.Publisher, cfg.Incarnation, cfg.Registerer = pub2, 0, nil
	e2 := newEngine(t, cfg)
	if e2.Incarnation() == e.Incarnation() || e2.Incarnation() == 0 {
		t.Fatal("same incarnation after restart")
	}
	waitPublished(t, e2)
	inv2 := e2.Inventory()
	checkEvents(t, pub2, cfg.Rank, e2.Incarnation(), inv2)
	if len(inv2.Objects) != 20 {
		t.Fatalf("restarted inventory lists %d objects, want the 20 in L2", len(inv2.Objects))
	}
}

// TestPublishFailuresDropAndCount: a publisher that never succeeds makes
// the engine drop batches after its retries, counted; the engine keeps
// working and sequences keep increasing.
func TestPublishFailuresDropAndCount(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	pub := &pubRecorder{fail: 1 << 30}
	cfg := engineConfig(t, dev, 0, 1)
	cfg.Publisher = pub
	cfg.PublishRetries = 1
	e := newEngine(t, cfg)
	r.register(e)
	storeAll(t, e, r, "x", r.newChunk(0, r.consecutiveN(0)))
	deadline := time.Now().Add(10 * time.Second)
	for e.Stats().EventsDropped == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no event dropped")
		}
		time.Sleep(time.Millisecond)
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_events_dropped_total"); v != 1 {
		t.Fatalf("events_dropped_total = %v, want 1", v)
	}
	storeAll(t, e, r, "y", r.newChunk(1, r.consecutiveN(1)))
	if e.Stats().LastSeq != 2 {
		t.Fatalf("last sequence %d, want 2", e.Stats().LastSeq)
	}
}
