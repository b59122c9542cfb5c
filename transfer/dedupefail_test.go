package transfer

import (
	"errors"
	"sync"
	"testing"

	"github.com/kvtier/kvtier/cuda"
)

// gateDevice hands out store streams whose WaitEvent on a marked (dying
// engine's) event blocks until the gate opens, then fails: the fill of a
// superseded session whose process died under it.
type gateDevice struct {
	cuda.Device
	mu      sync.Mutex
	bad     map[cuda.Event]bool
	waiting chan struct{} // closed when a WaitEvent on a marked event blocks
	gate    chan struct{} // closed to let it fail
}

type gateStream struct {
	cuda.Stream
	d *gateDevice
}

func (d *gateDevice) NewStream() (cuda.Stream, error) {
	s, err := d.Device.NewStream()
	if err != nil {
		return nil, err
	}
	return &gateStream{Stream: s, d: d}, nil
}

func (s *gateStream) WaitEvent(ev cuda.Event) error {
	s.d.mu.Lock()
	bad := s.d.bad[ev]
	s.d.mu.Unlock()
	if !bad {
		return s.Stream.WaitEvent(ev)
	}
	close(s.d.waiting)
	<-s.d.gate
	return errors.New("the event's process is gone")
}

// TestDedupeOntoFailedFillGathersOwnPages: a store of the new session
// dedupes onto an object the superseded session is still filling; that
// fill fails (its process died). The waiting store must not inherit the
// failure: it gathers from its own pages under its own event. On the
// unfixed code it was reported failed (reason device), naming the dead
// session's event wait (seen failing:
// "store b: {... Status:failed ... Reason:device Err:wait on the producer
// event: transfer: device error: the event's process is gone}").
func TestDedupeOntoFailedFillGathersOwnPages(t *testing.T) {
	gd := &gateDevice{Device: openDevice(t, ""), bad: map[cuda.Event]bool{},
		waiting: make(chan struct{}), gate: make(chan struct{})}
	ra := newRig(t, gd, c1Spec(), []int64{8})
	rb := newRig(t, gd, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, gd, 0, 1))
	e.hooks.imported = func(reqID string, ev cuda.Event) {
		if reqID == "a" {
			gd.mu.Lock()
			gd.bad[ev] = true
			gd.mu.Unlock()
		}
	}
	ra.register(e)

	ca := ra.newChunk(0, ra.consecutiveN(0))
	ra.write(ca, ca.blocks, 0)
	_, ha := ra.record()
	fa, err := e.Store(testCtx(t), ra.storeReq("a", ha, ca))
	if err != nil {
		t.Fatal(err)
	}
	<-gd.waiting // a's fill is in flight, stuck on its dying producer

	rb.register(e) // the restarted engine supersedes a's session
	cb := rb.newChunk(0, rb.consecutiveN(2))
	rb.write(cb, cb.blocks, 0)
	_, hb := rb.record()
	fb, err := e.Store(testCtx(t), rb.storeReq("b", hb, cb))
	if err != nil {
		t.Fatal(err)
	}
	// b has deduped onto a's filling object (Store planned it under the
	// lock): now a's fill fails.
	close(gd.gate)

	resA, _ := fa.Wait(testCtx(t))
	if len(resA.Objects) != 1 || resA.Objects[0].Status != Failed || resA.Objects[0].Reason != ReasonDevice {
		t.Fatalf("store a: %+v, want one object failed with reason %s", resA, ReasonDevice)
	}
	resB, err := fb.Wait(testCtx(t))
	if err != nil || len(resB.Objects) != 1 || resB.Objects[0].Status != Stored {
		t.Fatalf("store b: %+v %v, want its object stored from its own pages", resB, err)
	}
	if err := fb.WaitReleased(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitRequest(testCtx(t), "b"); err != nil {
		t.Fatal(err)
	}
	tgt := rb.consecutiveN(3)
	rr, err := e.Retrieve(testCtx(t), rb.retrieveReq(0, []chunk{cb}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve of b's chunk: %+v %v", rr, err)
	}
	rb.expectRestored(cb, tgt)
	rb.check("engine B's pools after restoring its chunk")
	ra.check("engine A's pools")
	if st := e.Stats(); st.ObjectsStored != 1 {
		t.Fatalf("%d objects stored, want 1 (b's, gathered after a's fill failed)", st.ObjectsStored)
	}
}

// TestTwoStoresDedupedOntoAFailedFill: two stores of the new session wait
// on the same failing fill; one gathers the object again from its pages,
// the other waits on that gather and dedupes onto it: one object stored,
// neither store failed. Seen failing with main's store.go: "store b1: ...
// Status:failed ... Reason:device".
func TestTwoStoresDedupedOntoAFailedFill(t *testing.T) {
	gd := &gateDevice{Device: openDevice(t, ""), bad: map[cuda.Event]bool{},
		waiting: make(chan struct{}), gate: make(chan struct{})}
	ra := newRig(t, gd, c1Spec(), []int64{8})
	rb := newRig(t, gd, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, gd, 0, 1))
	e.hooks.imported = func(reqID string, ev cuda.Event) {
		if reqID == "a" {
			gd.mu.Lock()
			gd.bad[ev] = true
			gd.mu.Unlock()
		}
	}
	ra.register(e)
	ca := ra.newChunk(0, ra.consecutiveN(0))
	ra.write(ca, ca.blocks, 0)
	_, ha := ra.record()
	fa, err := e.Store(testCtx(t), ra.storeReq("a", ha, ca))
	if err != nil {
		t.Fatal(err)
	}
	<-gd.waiting
	rb.register(e)
	cb := rb.newChunk(0, rb.consecutiveN(1))
	rb.write(cb, cb.blocks, 0)
	var fs []*StoreFuture
	for _, id := range []string{"b1", "b2"} {
		_, h := rb.record()
		f, err := e.Store(testCtx(t), rb.storeReq(id, h, cb))
		if err != nil {
			t.Fatal(err)
		}
		fs = append(fs, f)
	}
	close(gd.gate)
	if res, _ := fa.Wait(testCtx(t)); res.Objects[0].Status != Failed {
		t.Fatalf("store a: %+v, want failed", res)
	}
	got := map[StoreStatus]int{}
	for i, f := range fs {
		res, err := f.Wait(testCtx(t))
		if err != nil || len(res.Objects) != 1 {
			t.Fatalf("store b%d: %+v %v", i+1, res, err)
		}
		got[res.Objects[0].Status]++
	}
	if got[Stored] != 1 || got[Deduped] != 1 {
		t.Fatalf("outcomes of b1 and b2: %v, want one stored and one deduped", got)
	}
	if st := e.Stats(); st.ObjectsStored != 1 {
		t.Fatalf("%d objects stored, want 1", st.ObjectsStored)
	}
	tgt := rb.consecutiveN(3)
	rr, err := e.Retrieve(testCtx(t), rb.retrieveReq(0, []chunk{cb}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve: %+v %v", rr, err)
	}
	rb.expectRestored(cb, tgt)
	rb.check("engine B's pools")
}
