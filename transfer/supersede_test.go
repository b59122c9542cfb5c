package transfer

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
)

// heldGetTier holds every L2 Get until release is closed: a slow disk. A
// Get whose context ends first returns the context's error, unless
// deaf is set (a read stuck in the kernel).
type heldGetTier struct {
	L2Tier
	entered chan dcp.Key
	release chan struct{}
	deaf    bool
}

func (h *heldGetTier) Get(ctx context.Context, key dcp.Key, fp [32]byte, dst []byte) (L2Object, error) {
	h.entered <- key
	if h.deaf {
		<-h.release
	} else {
		select {
		case <-h.release:
		case <-ctx.Done():
			return L2Object{}, ctx.Err()
		}
	}
	return h.L2Tier.Get(ctx, key, fp, dst)
}

// supersedeRig stores chunk 0 into L2 through a first engine, then opens a
// second engine over the same L2 through a heldGetTier and registers the
// rig with it: a retrieve of the chunk there waits in its L2 read.
func supersedeRig(t *testing.T, deaf bool, retrieveTimeout time.Duration) (*Engine, *rig, chunk, *heldGetTier) {
	t.Helper()
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = root
	e1 := newEngine(t, cfg)
	r.register(e1)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e1, r, "s", c)
	closeEngine(t, e1)

	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	held := &heldGetTier{L2Tier: ft, entered: make(chan dcp.Key, 16), release: make(chan struct{}), deaf: deaf}
	cfg2 := engineConfig(t, dev, 0, 1)
	cfg2.L2 = held
	cfg2.RetrieveTimeout = retrieveTimeout
	e2 := newEngine(t, cfg2)
	t.Cleanup(func() { // before the engine's Close, which waits for the retrieve
		select {
		case <-held.release:
		default:
			close(held.release)
		}
	})
	r.register(e2)
	return e2, r, c, held
}

type retrieveOutcome struct {
	res RetrieveResult
	err error
}

// startHeldRetrieve starts a retrieve of c into tgt and returns once it
// waits in its L2 read.
func startHeldRetrieve(t *testing.T, e *Engine, r *rig, c chunk, tgt [][]int64, held *heldGetTier) <-chan retrieveOutcome {
	t.Helper()
	done := make(chan retrieveOutcome, 1)
	req := r.retrieveReq(0, []chunk{c}, [][][]int64{tgt})
	go func() {
		rr, err := e.Retrieve(context.Background(), req)
		done <- retrieveOutcome{rr, err}
	}()
	select {
	case <-held.entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the retrieve never reached its L2 read")
	}
	return done
}

// overwrite writes a fresh chunk's bytes into blocks of r's pools at once
// (what the engine does with its memory once its registration is
// answered) and records them in the image.
func overwrite(t *testing.T, r *rig, seed int, blocks [][]int64) {
	t.Helper()
	m := r.newChunk(seed, blocks)
	r.place(m, blocks, func(mem cuda.Mem, off uint64, p []byte) {
		if err := r.dev.Write(mem, off, p); err != nil {
			t.Fatal(err)
		}
	})
}

// TestReRegistrationDrainsSupersededRetrieves (issue 29.5): the engine
// registers the same pools again while a retrieve of its first session
// waits on a slow L2 read. The registration is answered only once that
// retrieve has stopped writing the pools (it is cancelled: its items fail,
// nothing is scattered), so bytes the engine writes into its memory after
// the answer stay as written. Seen red with the drain removed from
// Register: the superseded retrieve, released after the answer, scattered
// the chunk over the engine's new bytes ("byte ... = ..., want ...").
func TestReRegistrationDrainsSupersededRetrieves(t *testing.T) {
	e, r, c, held := supersedeRig(t, false, 30*time.Second)
	old := r.session
	tgt := r.consecutiveN(1)
	done := startHeldRetrieve(t, e, r, c, tgt, held)

	r.register(e) // the same engine, the same pools
	if r.session == old {
		t.Fatal("the re-registration kept the old session")
	}
	overwrite(t, r, 99, tgt)
	close(held.release)
	o := <-done
	r.check("the re-registered pools after the superseded retrieve ended")
	if o.err != nil || o.res.ChunkOK(0) {
		t.Fatalf("superseded retrieve: %+v %v; want its chunk failed", o.res, o.err)
	}
	if got := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_session_drains_total", "outcome", "drained"); got != 1 {
		t.Fatalf("session_drains_total{drained} = %v, want 1", got)
	}
	// The new session restores the chunk.
	tgt2 := r.consecutiveN(2)
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{tgt2}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve of the new session: %+v %v", rr, err)
	}
	r.expectRestored(c, tgt2)
	r.check("after the new session's retrieve")
}

// TestReRegistrationRefusedWhileRetrieveCannotDrain: a superseded retrieve
// stuck in a read that ignores its context cannot drain within the bound
// (the engine's RetrieveTimeout); the registration is refused with
// ErrTimeout naming the session, and the stuck retrieve writes nothing
// when it wakes. A later registration, once it has drained, is answered.
func TestReRegistrationRefusedWhileRetrieveCannotDrain(t *testing.T) {
	e, r, c, held := supersedeRig(t, true, 300*time.Millisecond)
	old := r.session
	tgt := r.consecutiveN(1)
	done := startHeldRetrieve(t, e, r, c, tgt, held)

	_, err := e.Register(testCtx(t), r.registration(), "")
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), old) {
		t.Fatalf("registration while a retrieve cannot drain = %v, want ErrTimeout naming session %s", err, old)
	}
	if got := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_session_drains_total", "outcome", "refused"); got != 1 {
		t.Fatalf("session_drains_total{refused} = %v, want 1", got)
	}
	close(held.release)
	o := <-done
	if o.err != nil || o.res.ChunkOK(0) {
		t.Fatalf("superseded retrieve after its read woke: %+v %v; want its chunk failed", o.res, o.err)
	}
	r.check("the pools after the stuck retrieve woke")
	r.register(e)
	if e.Sessions() != 1 {
		t.Fatalf("%d live sessions", e.Sessions())
	}
}
