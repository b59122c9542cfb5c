package transfer

import (
	"os"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestStartServesBeforeRescan (issue 15.2): with many L2 objects, New
// returns while the rescan is still running (held here after its first
// object), the rank restores objects the rescan has not reached, the rescan
// reads only headers (a payload byte flipped while the rank was down is
// not noticed), and that corrupted object is still caught on read: failed
// as corrupt, quarantined, announced removed.
func TestStartServesBeforeRescan(t *testing.T) {
	dev := openDevice(t, "")
	const n = 40
	r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = root
	e1 := newEngine(t, cfg)
	r.register(e1)
	var cs []chunk
	for i := range n {
		c := r.newChunk(i, r.consecutiveN(i))
		cs = append(cs, c)
		storeAll(t, e1, r, "s", c)
	}
	if err := e1.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	ft := e1.L2().(*FileTier)
	closeEngine(t, e1)

	// A payload byte flipped while the rank is down.
	bad := cs[n-1]
	p := ft.Path(keyOf(r, bad, 0))
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-1] ^= 0x40
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}

	// Hold the rescan after its first object until released.
	release, held := make(chan struct{}), make(chan struct{})
	var once sync.Once
	rescanHook = func(ScanEntry) { once.Do(func() { close(held); <-release }) }
	t.Cleanup(func() { rescanHook = nil })
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock)

	cfg2 := cfg
	cfg2.Registerer, cfg2.KeepEvents = newRegistry(), true
	done := make(chan *Engine, 1)
	go func() {
		e, err := New(cfg2)
		if err != nil {
			t.Error(err)
		}
		done <- e
	}()
	var e2 *Engine
	select {
	case e2 = <-done:
	case <-time.After(30 * time.Second):
		unblock()
		if e := <-done; e != nil {
			closeEngine(t, e)
		}
		t.Fatal("New did not return while the rescan was held after its first object")
	}
	if e2 == nil {
		return
	}
	defer closeEngine(t, e2)
	pub := recordEvents(t, e2)
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("the rescan never reached its first object")
	}
	if st := e2.Stats(); st.L2Objects != 1 {
		t.Fatalf("%d L2 objects while the rescan is held after its first, want 1", st.L2Objects)
	}
	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_l2_rescanning"); v != 1 {
		t.Fatalf("l2_rescanning = %v during the rescan, want 1", v)
	}
	r.register(e2)
	// Serving already: every good object restores byte-exact from L2.
	good := cs[:n-1]
	var tgts [][][]int64
	for i := range good {
		tgts = append(tgts, r.consecutiveN(i))
	}
	rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, good, tgts))
	if err != nil {
		t.Fatal(err)
	}
	for i := range good {
		if !rr.ChunkOK(i) {
			t.Fatalf("chunk %d not restored during the rescan: %+v", i, rr.Items[i])
		}
		r.expectRestored(good[i], tgts[i])
	}

	unblock()
	if err := e2.WaitRescan(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if st := e2.Stats(); st.L2Objects != n || st.Quarantined != 0 {
		t.Fatalf("after the rescan: %d L2 objects, %d quarantined; want %d and 0 (headers only)", st.L2Objects, st.Quarantined, n)
	}
	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_l2_rescanning"); v != 0 {
		t.Fatalf("l2_rescanning = %v after the rescan, want 0", v)
	}

	// Verify-on-read catches the flipped byte (C5).
	tgt := [][][]int64{r.consecutiveN(n)}
	rr, err = e2.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{bad}, tgt))
	if err != nil {
		t.Fatal(err)
	}
	if rr.ChunkOK(0) || rr.Items[0].Reason != ReasonCorrupt {
		t.Fatalf("restore of a corrupted object: %+v, want corrupt", rr.Items[0])
	}
	r.check("after the corrupt restore")
	if len(quarantined(t, root)) == 0 {
		t.Fatal("the corrupted object was not quarantined")
	}
	if st := e2.Stats(); st.L2Objects != n-1 || st.ChecksumL2 != 1 {
		t.Fatalf("after the corrupt read: %d L2 objects, %d L2 checksum failures; want %d and 1", st.L2Objects, st.ChecksumL2, n-1)
	}
	closeEngine(t, e2)
	removed := 0
	for _, ev := range pub.events() {
		if ev.Tier == wire.L2 && ev.Kind == wire.Removed && ev.Key == keyOf(r, bad, 0) {
			removed++
		}
	}
	if removed != 1 {
		t.Fatalf("%d removal events of the corrupted object, want 1", removed)
	}
}
