package transfer

import (
	"bytes"
	"testing"
	"time"
)

// TestGoroutinesRefusedAfterClose: Close closes the engine's group, so no
// goroutine starts after it; a store's own work asked for then (goFunc)
// runs on the caller instead of being dropped.
func TestGoroutinesRefusedAfterClose(t *testing.T) {
	dev := openDevice(t, "")
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	closeEngine(t, e)
	if e.goroutines.Go("late", func() { t.Error("a goroutine started after Close") }) {
		t.Fatal("the engine's group started a goroutine after Close")
	}
	if n := e.goroutines.Running(); n != 0 {
		t.Fatalf("%d goroutines still running after Close", n)
	}
	ran := false
	e.goFunc(func() { ran = true })
	if !ran {
		t.Fatal("goFunc after Close neither started f nor ran it on the caller")
	}
}

// TestRetrieveLoadsWhenReadersRefused: when the group refuses a retrieve's
// L2 readers (Close has begun), the retrieve loads its items itself: each
// is still placed and verified, none is left waiting for a reader.
func TestRetrieveLoadsWhenReadersRefused(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = t.TempDir()
	cfg.RetrieveTimeout = 10 * time.Second
	e := newEngine(t, cfg)
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e, r, "a", c)
	closeEngine(t, e) // written through to L2

	cfg.Incarnation, cfg.Registerer = 0, newRegistry()
	e2 := newEngine(t, cfg) // a fresh L1: the retrieve reads L2
	r.register(e2)
	e2.goroutines.Close() // as Close does at step 3, with the engine still serving
	tgt := r.consecutiveN(1)
	rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve with its L2 readers refused: %+v %v", rr, err)
	}
	if got := r.readChunk(tgt); !bytes.Equal(got[0], c.packed[0]) {
		t.Fatal("restored other bytes")
	}
}
