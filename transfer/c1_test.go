package transfer

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
)

// c1Spec: 656-byte rows, two layers, chunks of two 16-token blocks.
func c1Spec() dcp.Spec {
	return dcp.Spec{Model: "c1", Layout: dcp1, ChunkTokens: 32, Groups: []dcp.Group{
		{Kind: dcp.Attention, MLA: true, BlockSize: 16, Layers: 2, KVFormat: "fp8_ds_mla",
			SemanticBytes: 16 * 656, PageBytes: 16 * 656, StrideBytes: 16 * 656}}}
}

// c1Outcome is what one run of the incremental-store scenario produced.
type c1Outcome struct {
	failed    int // stores that failed
	wrongData int // stores committed with bytes other than the engine wrote
	released  error
}

// runIncrementalStores is the seed regression of C1: n incremental stores
// of one request id, each with its own producer event recorded after the
// engine's (delayed) page writes. With requestKeyed, the engine behaves as
// the buggy one did: a table keyed by request id replaces an earlier
// store's event with the new one and releases the earlier one.
func runIncrementalStores(t *testing.T, n int, requestKeyed bool) c1Outcome {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{int64(4 * n)})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.Streams = 4 // fewer streams than stores: later stores queue holding their events
	e := newEngine(t, cfg)

	var (
		mu         sync.Mutex
		byRequest  = map[string]cuda.Event{} // the buggy engine's table
		violations []string
		releases   atomic.Int64
	)
	if requestKeyed {
		e.hooks.imported = func(reqID string, ev cuda.Event) {
			mu.Lock()
			defer mu.Unlock()
			if old := byRequest[reqID]; old != nil {
				_ = old.Release() // overwritten while its store still waits on it
			}
			byRequest[reqID] = ev
		}
	}
	e.hooks.releasing = func(f *StoreFuture) {
		releases.Add(1)
		select {
		case <-f.released:
		default:
			mu.Lock()
			violations = append(violations, fmt.Sprintf("future %d released its event before the device finished reading its pages", f.id))
			mu.Unlock()
		}
	}
	r.register(e)

	const req = "prompt-1"
	chunks := make([]chunk, n)
	futures := make([]*StoreFuture, n)
	// The engine's page writes wait behind a gate until every store has
	// started, so every later store arrives while earlier ones still wait
	// on their events (a 150 ms head start of the first store ran out
	// under load: the request read as done mid-loop).
	open := r.gate()
	for i := range n {
		chunks[i] = r.newChunk(i, r.consecutiveN(i))
		r.write(chunks[i], chunks[i].blocks, 2*time.Millisecond)
		_, h := r.record()
		f, err := e.Store(testCtx(t), r.storeReq(req, h, chunks[i]))
		if err != nil {
			t.Fatalf("store %d: %v", i, err)
		}
		futures[i] = f
		if e.RequestDone(req) {
			t.Fatalf("request done with store %d just started", i)
		}
	}
	// Behind the shut gate no store can finish, unless the buggy table
	// released its event.
	if got := e.PendingStores(req); got == 0 || (!requestKeyed && got != n) {
		t.Fatalf("%d pending stores behind the shut gate, want %d", got, n)
	}
	open()
	// The request finishes only after its last store: whenever it reads
	// as done, every future has finished.
	allDone := func() bool {
		for _, f := range futures {
			select {
			case <-f.Done():
			default:
				return false
			}
		}
		return true
	}
	for i, f := range futures {
		select {
		case <-f.Done():
		case <-time.After(60 * time.Second):
			t.Fatalf("store %d never finished", i)
		}
		if e.RequestDone(req) && !allDone() {
			t.Fatalf("request reads as done after store %d while later stores are in flight", i)
		}
	}
	if err := e.WaitRequest(testCtx(t), req); err != nil {
		t.Fatal(err)
	}
	for i, f := range futures {
		select {
		case <-f.Done():
		default:
			t.Fatalf("request finished before store %d", i)
		}
		select {
		case <-f.Released():
		default:
			t.Fatalf("request finished before store %d released its blocks", i)
		}
	}
	if got := releases.Load(); got != int64(n) {
		t.Fatalf("%d events released, want %d (one per store)", got, n)
	}

	var out c1Outcome
	for i, f := range futures {
		res, err := f.Wait(testCtx(t))
		if err != nil {
			out.failed++
			if !errors.Is(err, ErrDevice) {
				t.Errorf("store %d failed with %v, want a device error", i, err)
			}
			if out.released == nil && errors.Is(err, cuda.ErrReleased) {
				out.released = err
			}
			continue
		}
		if res.Objects[0].Status != Stored || res.Objects[0].Sum != checksum.Sum(chunks[i].packed[0]) {
			out.wrongData++
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, v := range violations {
		t.Error(v)
	}
	if requestKeyed {
		return out
	}
	// Every chunk comes back byte-exact.
	tgts := make([][][]int64, n)
	for i := range n {
		tgts[i] = r.consecutiveN(n + i)
	}
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, chunks, tgts))
	if err != nil {
		t.Fatal(err)
	}
	if fc := rr.FailedChunks(); len(fc) > 0 {
		t.Fatalf("chunks %v failed to restore: %+v", fc, rr.Items[fc[0]])
	}
	for i := range n {
		r.expectRestored(chunks[i], tgts[i])
	}
	r.check("after restoring every incremental store")
	return out
}

func TestC1IncrementalStoresOwnTheirEvents(t *testing.T) {
	for _, n := range []int{2, 84} {
		t.Run(fmt.Sprintf("%d_stores", n), func(t *testing.T) {
			out := runIncrementalStores(t, n, false)
			if out.failed != 0 || out.wrongData != 0 {
				t.Fatalf("%d stores failed, %d committed wrong bytes", out.failed, out.wrongData)
			}
		})
	}
}

// TestC1RequestKeyedEventsFail runs the same scenario with the old
// behaviour simulated; it must go wrong, and visibly: with the host
// backend a wait on a released event is an error.
func TestC1RequestKeyedEventsFail(t *testing.T) {
	for _, n := range []int{2, 84} {
		t.Run(fmt.Sprintf("%d_stores", n), func(t *testing.T) {
			out := runIncrementalStores(t, n, true)
			if out.failed+out.wrongData == 0 {
				t.Fatal("the request-keyed event table went unnoticed: every store succeeded with the right bytes")
			}
			if out.released == nil {
				t.Fatalf("%d stores failed, %d wrong, but none with cuda.ErrReleased", out.failed, out.wrongData)
			}
			t.Logf("request-keyed events: %d of %d stores failed (e.g. %v), %d committed wrong bytes", out.failed, n, out.released, out.wrongData)
		})
	}
}
