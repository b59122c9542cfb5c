package transfer

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// pubRecorder pulls an engine's events (EventSource) as rankd's publisher
// does, acknowledging each batch as soon as it has it, and keeps every
// batch. A goroutine pulls whenever the engine says events wait; events()
// also pulls what is left, so a test may read them after Close.
type pubRecorder struct {
	e *Engine

	mu      sync.Mutex // guards the following; held across a pull, so batches stay in order
	batches []wire.Batch
}

// recordEvents starts pulling e's events (e was built with KeepEvents) until
// the test ends.
func recordEvents(t testing.TB, e *Engine) *pubRecorder {
	t.Helper()
	c := &pubRecorder{e: e}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			c.pull()
			select {
			case <-e.Ready():
			case <-stop:
				return
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
	return c
}

// pull takes and acknowledges every batch waiting.
func (c *pubRecorder) pull() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		b, ok := c.e.NextEvents()
		if !ok {
			return
		}
		c.batches = append(c.batches, b)
		c.e.AckEvents(b.Events[len(b.Events)-1].Seq)
	}
}

func (c *pubRecorder) events() []wire.Event {
	c.pull()
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
	evs := c.events()
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
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1Bytes = 6 * (64 << 10) // evictions
	cfg.L2Dir = t.TempDir()
	cfg.KeepEvents = true
	cfg.EventBatch = 7
	e := newEngine(t, cfg)
	pub := recordEvents(t, e)
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
	cfg.Incarnation, cfg.Registerer = 0, nil
	e2 := newEngine(t, cfg)
	pub2 := recordEvents(t, e2)
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

// TestEventBufferStalledConsumer: the engine's buffer is the only queue.
// A consumer that took a batch and stalls (its coordinator does not answer)
// keeps it counted against EventBuffer; the buffer fills, and every later
// event is dropped and counted, never retried: a batch is handed out once.
// Once the consumer acknowledges, the buffer is released and the events
// that were kept come out in order, the dropped ones leaving a sequence gap
// (the coordinator resyncs). Acknowledging never releases an event not
// taken.
func TestEventBufferStalledConsumer(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{24})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.KeepEvents = true
	cfg.EventBatch, cfg.EventBuffer = 2, 4
	e := newEngine(t, cfg)
	r.register(e)
	seqs := func(b wire.Batch) []uint64 {
		var out []uint64
		for _, ev := range b.Events {
			out = append(out, ev.Seq)
		}
		return out
	}
	next := func(want ...uint64) {
		t.Helper()
		b, ok := e.NextEvents()
		if got := seqs(b); ok != (len(want) > 0) || !slices.Equal(got, want) {
			t.Fatalf("NextEvents = %v (%v), want %v", got, ok, want)
		}
		if ok && (b.Rank != cfg.Rank || b.Incarnation != e.Incarnation()) {
			t.Fatalf("batch of %v incarnation %d", b.Rank, b.Incarnation)
		}
	}
	backlog := func(held, batches int) {
		t.Helper()
		if h, b := e.EventBacklog(); h != held || b != batches {
			t.Fatalf("backlog: %d held, %d batches waiting; want %d and %d", h, b, held, batches)
		}
	}
	store := func(from, to int) { // one L1 event per chunk (no L2)
		for i := from; i < to; i++ {
			storeAll(t, e, r, fmt.Sprint("s", i), r.newChunk(i, r.consecutiveN(i)))
		}
	}

	store(0, 3)
	backlog(3, 2)
	next(1, 2) // taken; the coordinator stalls: never acknowledged
	backlog(3, 1)
	store(3, 7) // seq 4 fills the buffer (1, 2 taken, 3, 4 waiting); 5..7 dropped
	backlog(4, 1)
	if st := e.Stats(); st.LastSeq != 7 || st.EventsDropped != 3 || st.EventsPublished != 0 {
		t.Fatalf("stalled: last seq %d, %d dropped, %d published; want 7, 3, 0", st.LastSeq, st.EventsDropped, st.EventsPublished)
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_events_dropped_total"); v != 3 {
		t.Fatalf("events_dropped_total = %v, want 3", v)
	}
	next(3, 4) // the next batch, not the stalled one again
	next()

	// The coordinator answers: everything acknowledged is released.
	e.AckEvents(2)
	backlog(2, 0)
	e.AckEvents(4)
	backlog(0, 0)
	if st := e.Stats(); st.EventsPublished != 4 || st.PublishedThrough != 4 {
		t.Fatalf("after the acks: %d published through %d; want 4 through 4", st.EventsPublished, st.PublishedThrough)
	}
	for len(e.Ready()) > 0 {
		<-e.Ready()
	}
	store(7, 8)
	select {
	case <-e.Ready():
	default:
		t.Fatal("no wake-up after an event arrived in an empty buffer")
	}
	e.AckEvents(8) // not taken yet: stays
	backlog(1, 1)
	next(8) // after the gap of the dropped 5..7, in order
	e.AckEvents(8)
	backlog(0, 0)
}

// TestCloseKeepsEventsForConsumer: the events emitted until Close returns,
// those of the L2 writes Close itself flushes included, stay held for the
// consumer, which takes them after Close, numbered 1..LastSeq.
func TestCloseKeepsEventsForConsumer(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{24})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.KeepEvents = true
	cfg.L2Dir, cfg.L2Policy = t.TempDir(), WriteBackOnEvict
	e := newEngine(t, cfg)
	r.register(e)
	const n = 3
	for i := range n {
		storeAll(t, e, r, fmt.Sprint("s", i), r.newChunk(i, r.consecutiveN(i)))
	}
	if st := e.Stats(); st.LastSeq != n {
		t.Fatalf("%d events before Close, want %d (write-back writes L2 at Close)", st.LastSeq, n)
	}
	closeEngine(t, e)
	evs := recordEvents(t, e).events()
	var l2 int
	for i, ev := range evs {
		if ev.Seq != uint64(i+1) {
			t.Fatalf("event %d has sequence %d after Close, want %d", i, ev.Seq, i+1)
		}
		if ev.Kind == wire.Stored && ev.Tier == wire.L2 {
			l2++
		}
	}
	if st := e.Stats(); len(evs) != 2*n || l2 != n || st.LastSeq != uint64(len(evs)) || st.PublishedThrough != st.LastSeq {
		t.Fatalf("after Close: %d events taken (%d L2 stores), last seq %d, acknowledged through %d; want %d, %d, %d, %d",
			len(evs), l2, st.LastSeq, st.PublishedThrough, 2*n, n, 2*n, 2*n)
	}
}
