package transfer

import (
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
)

// slowScatterDevice delays every Scatter on the device side by delay (a
// large scatter on a busy link), so a short RetrieveTimeout expires while
// the copy is still to come.
type slowScatterDevice struct {
	cuda.Device
	delay time.Duration
}

type slowScatterStream struct {
	cuda.Stream
	delay time.Duration
}

func (d *slowScatterDevice) NewStream() (cuda.Stream, error) {
	s, err := d.Device.NewStream()
	if err != nil {
		return nil, err
	}
	return &slowScatterStream{Stream: s, delay: d.delay}, nil
}

func (s *slowScatterStream) Scatter(src cuda.HostBuf, objs []cuda.Object) (*cuda.Op, error) {
	if err := s.Stream.Delay(s.delay); err != nil {
		return nil, err
	}
	return s.Stream.Scatter(src, objs)
}

// TestC10RetrieveTimeoutStopsWritingBeforeReply: a retrieve that answers
// timeout has stopped writing the engine's pages (C10). The engine
// recomputes the pages the moment it has the failure reply; not one
// recomputed byte may be overwritten by the late scatter.
func TestC10RetrieveTimeoutStopsWritingBeforeReply(t *testing.T) {
	dev := openDevice(t, "")
	const n = 8
	r := newRig(t, dev, c1Spec(), []int64{int64(4 * n)})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.Device = &slowScatterDevice{Device: dev, delay: 300 * time.Millisecond}
	cfg.RetrieveTimeout = 30 * time.Millisecond
	e := newEngine(t, cfg)
	r.register(e)
	var cs []chunk
	var tgts [][][]int64
	for i := range n {
		cs = append(cs, r.newChunk(i, r.consecutiveN(i)))
		tgts = append(tgts, r.consecutiveN(n+i))
	}
	storeAll(t, e, r, "s", cs...)

	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, cs, tgts))
	if err != nil {
		t.Fatal(err)
	}
	for i, it := range rr.Items {
		if it.OK || it.Reason != ReasonTimeout {
			t.Fatalf("item %d of a retrieve out of time: %+v", i, it)
		}
	}
	// The engine recomputes every target page at once.
	for i := range n {
		re := r.newChunk(1000+i, tgts[i])
		r.place(re, tgts[i], func(m cuda.Mem, off uint64, p []byte) {
			if err := dev.Write(m, off, p); err != nil {
				t.Fatal(err)
			}
		})
	}
	// Whatever the engine still had running ends (pins back, no retrieve
	// in flight); then every recomputed byte must still be there.
	deadline := time.Now().Add(10 * time.Second)
	for {
		e.mu.Lock()
		busy := e.retrieves
		e.mu.Unlock()
		if busy == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("retrieve still in flight 10 s after its timeout reply")
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(400 * time.Millisecond) // room for a late scatter to show (not a timing assertion)
	r.check("recomputed pages after a timed-out retrieve")
}

// TestC10LargeScatterTimeout is the filed scenario without a delay seam: a
// 31 MiB scatter on the host backend with a retrieve timeout far shorter
// than the copy. Every chunk the answer calls failed is recomputed at
// once; none of its recomputed bytes may be overwritten afterwards, and
// every chunk it calls restored holds the stored bytes.
func TestC10LargeScatterTimeout(t *testing.T) {
	dev := openDevice(t, "")
	const n = 13
	r := newRig(t, dev, bigSpec(), []int64{4 * 2 * n})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.RetrieveTimeout = time.Millisecond
	e := newEngine(t, cfg)
	r.register(e)
	var cs []chunk
	var tgts [][][]int64
	for i := range n {
		cs = append(cs, r.newChunk(i, r.consecutiveN(i)))
		tgts = append(tgts, r.consecutiveN(n+i))
	}
	for _, c := range cs {
		storeAll(t, e, r, "s", c)
	}
	// The recomputed pages are ready before the answer, so they land the
	// moment it comes (a late scatter would land after them).
	var recomputed []chunk
	for i := range cs {
		recomputed = append(recomputed, r.newChunk(1000+i, tgts[i]))
	}
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, cs, tgts))
	if err != nil {
		t.Fatal(err)
	}
	failed := 0
	for i := range cs {
		if rr.ChunkOK(i) {
			r.expectRestored(cs[i], tgts[i])
			continue
		}
		failed++
		r.place(recomputed[i], tgts[i], func(m cuda.Mem, off uint64, p []byte) {
			if err := dev.Write(m, off, p); err != nil {
				t.Fatal(err)
			}
		})
	}
	t.Logf("%d of %d chunks failed the 1 ms retrieve", failed, n)
	closeEngine(t, e) // whatever the engine still ran has ended
	r.check("after recomputing the chunks a timed-out retrieve failed")
}
