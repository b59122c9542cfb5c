package transfer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// faultyTier is an L2 tier whose Puts fail on demand (a full or broken
// disk).
type faultyTier struct {
	L2Tier
	mu       sync.Mutex
	failPuts int // fail this many Puts; < 0: fail all
	failed   int
}

func (f *faultyTier) Put(ctx context.Context, obj L2Object, p []byte) error {
	f.mu.Lock()
	fail := f.failPuts != 0
	if f.failPuts > 0 {
		f.failPuts--
	}
	if fail {
		f.failed++
	}
	f.mu.Unlock()
	if fail {
		return fmt.Errorf("put %s: no space left on device: %w", obj.Key, ErrIO)
	}
	return f.L2Tier.Put(ctx, obj, p)
}

// TestL2WriteFailuresAreRetriedAndCounted: failed L2 writes keep the object
// in L1 (dirty), are counted and logged, never announced, and are retried
// by Flush; with writes failing for good, Close counts the objects lost.
func TestL2WriteFailuresAreRetriedAndCounted(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	ft, err := OpenFileTier(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	tier := &faultyTier{L2Tier: ft, failPuts: 3}
	core, logs := observer.New(zap.WarnLevel)
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2, cfg.Logger, cfg.KeepEvents = tier, zap.New(core), true
	e := newEngine(t, cfg)
	pub := recordEvents(t, e)
	r.register(e)
	var cs []chunk
	for i := range 4 {
		cs = append(cs, r.newChunk(i, r.consecutiveN(i)))
	}
	storeAll(t, e, r, "w", cs...)
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	st := e.Stats()
	if st.L2Objects != 4 || st.L2WriteErrors != 3 {
		t.Fatalf("%d L2 objects, %d write errors; want 4 and 3", st.L2Objects, st.L2WriteErrors)
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l2_write_errors_total"); v != 3 {
		t.Fatalf("l2_write_errors_total = %v", v)
	}
	if n := logs.FilterMessage("L2 write failed; the object stays in L1 and is retried").Len(); n != 3 {
		t.Fatalf("%d warnings of failed L2 writes, want 3", n)
	}
	waitPublished(t, e)
	l2Stored := 0
	for _, ev := range pub.events() {
		if ev.Kind == wire.Stored && ev.Tier == wire.L2 {
			l2Stored++
		}
	}
	if l2Stored != 4 {
		t.Fatalf("%d L2 stored events, want exactly 4 (failed writes are never announced)", l2Stored)
	}

	// Write-back onto a dead disk: Close cannot save the objects, and says
	// so.
	dev2 := openDevice(t, "")
	r2 := newRig(t, dev2, c1Spec(), []int64{16})
	dead := &faultyTier{L2Tier: ft, failPuts: -1}
	cfg2 := engineConfig(t, dev2, 0, 1)
	cfg2.L2, cfg2.L2Policy, cfg2.Logger = dead, WriteBackOnEvict, zap.New(core)
	e2 := newEngine(t, cfg2)
	r2.register(e2)
	storeAll(t, e2, r2, "w", r2.newChunk(10, r2.consecutiveN(0)), r2.newChunk(11, r2.consecutiveN(1)))
	if err := e2.Flush(testCtx(t)); err == nil {
		t.Fatal("Flush onto a dead disk succeeded")
	}
	logs.TakeAll()
	closeEngine(t, e2)
	if st := e2.Stats(); st.LostObjects != 2 {
		t.Fatalf("%d objects counted lost at Close, want 2", st.LostObjects)
	}
	if n := logs.FilterLevelExact(zap.ErrorLevel).FilterMessage("objects only in L1 were not written to L2 before shutdown").Len(); n != 1 {
		t.Fatalf("%d error logs of lost objects, want 1", n)
	}
}

// TestRetrieveTimeout: a retrieve that runs out of time reports its items
// failed with reason timeout, never restored, and gives its pins back.
func TestRetrieveTimeout(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.RetrieveTimeout = time.Nanosecond
	e := newEngine(t, cfg)
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e, r, "t", c)
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{r.consecutiveN(1)}))
	if err != nil {
		t.Fatal(err)
	}
	if rr.Items[0].OK || rr.Items[0].Reason != ReasonTimeout {
		t.Fatalf("retrieve with no time: %+v", rr.Items[0])
	}
	// Pins come back (possibly after a reaper): the object is evictable.
	deadline := time.Now().Add(10 * time.Second)
	for {
		e.mu.Lock()
		pins := -1
		if o := e.cat.objs[keyOf(r, c, 0)]; o != nil {
			pins = o.pins
		}
		e.mu.Unlock()
		if pins == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("object still pinned (%d) after a timed-out retrieve", pins)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestCloseWithStuckProducer: a store waits on a producer that never
// finishes; Close with a deadline cuts it short, fails the store, stops
// every goroutine (goleak) and reports the deadline.
func TestCloseWithStuckProducer(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	e, err := New(engineConfig(t, dev, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	r.write(c, c.blocks, time.Hour)
	_, h := r.record()
	f, err := e.Store(testCtx(t), r.storeReq("stuck", h, c))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	cerr := e.Close(ctx)
	if !errors.Is(cerr, context.DeadlineExceeded) {
		t.Fatalf("Close with a stuck producer = %v, want its deadline", cerr)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("Close took %v", d)
	}
	res, err := f.Wait(testCtx(t))
	if err == nil || res.Objects[0].Status != Failed {
		t.Fatalf("stuck store after Close: %+v %v", res, err)
	}
	select {
	case <-f.Released():
	default:
		t.Fatal("blocks not released after Close")
	}
	if !e.RequestDone("stuck") {
		t.Fatal("request not finished after Close")
	}
	if err := e.Close(context.Background()); err == nil || err.Error() != cerr.Error() {
		t.Fatalf("second Close = %v, want the first one's result %v", err, cerr)
	}
}

// scatterFailDevice hands out streams whose first Scatter fails (as an
// enqueue failure does on the CUDA backend, which leaves the stream
// failed for good) and records which streams were closed.
type scatterFailDevice struct {
	cuda.Device
	mu     sync.Mutex
	fail   int // fail this many Scatters
	failed map[*scatterFailStream]bool
	closed map[*scatterFailStream]bool
}

type scatterFailStream struct {
	cuda.Stream
	d *scatterFailDevice
}

func (d *scatterFailDevice) NewStream() (cuda.Stream, error) {
	s, err := d.Device.NewStream()
	if err != nil {
		return nil, err
	}
	return &scatterFailStream{Stream: s, d: d}, nil
}

func (s *scatterFailStream) Scatter(src cuda.HostBuf, objs []cuda.Object) (*cuda.Op, error) {
	s.d.mu.Lock()
	if s.d.failed[s] {
		s.d.mu.Unlock()
		return nil, errors.New("stream is in a failed state")
	}
	if s.d.fail > 0 {
		s.d.fail--
		s.d.failed[s] = true
		s.d.mu.Unlock()
		return nil, errors.New("launch failed")
	}
	s.d.mu.Unlock()
	return s.Stream.Scatter(src, objs)
}

func (s *scatterFailStream) Close() error {
	s.d.mu.Lock()
	s.d.closed[s] = true
	s.d.mu.Unlock()
	return s.Stream.Close()
}

// TestScatterErrorRetiresTheStream: a retrieve stream whose Scatter failed
// is closed, never handed to a later retrieve, which succeeds.
func TestScatterErrorRetiresTheStream(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	fd := &scatterFailDevice{Device: dev, fail: 1,
		failed: make(map[*scatterFailStream]bool), closed: make(map[*scatterFailStream]bool)}
	cfg := engineConfig(t, dev, 0, 1)
	cfg.Device = fd
	e := newEngine(t, cfg)
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e, r, "s", c)

	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{r.consecutiveN(1)}))
	if err != nil {
		t.Fatal(err)
	}
	if rr.ChunkOK(0) {
		t.Fatal("retrieve with a failing Scatter succeeded")
	}
	fd.mu.Lock()
	for s := range fd.failed {
		if !fd.closed[s] {
			t.Error("the stream whose Scatter failed went back to the pool")
		}
	}
	fd.mu.Unlock()
	for i := range 4 {
		tgt := [][][]int64{r.consecutiveN(1 + i%2)}
		rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, tgt))
		if err != nil {
			t.Fatal(err)
		}
		if !rr.ChunkOK(0) {
			t.Fatalf("retrieve %d after a failed Scatter: %+v", i, rr.Items)
		}
		r.expectRestored(c, tgt[0])
	}
	r.check("after retrieves following a failed Scatter")
	closeEngine(t, e)
}
