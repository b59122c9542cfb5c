package transfer

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// partialDevice is the host backend, or CUDA device 0 with
// KVTIER_TEST_CUDA=1 (on a GPU machine: .gpu/transfer.test from make
// gpu-build), so the partial scatter and its read-back run through the
// driver backend too.
func partialDevice(t *testing.T) cuda.Device {
	t.Helper()
	if os.Getenv("KVTIER_TEST_CUDA") != "1" {
		return openDevice(t, "")
	}
	dev, err := cuda.OpenCUDA(0)
	if err != nil {
		t.Fatalf("KVTIER_TEST_CUDA=1: %v", err)
	}
	t.Cleanup(func() { _ = dev.Close() })
	return dev
}

// partialSpec: chunks of 4 blocks of 16 tokens, two groups of 2 and 1
// layers (pages of 1 KiB and 640 B, the second with padding).
func partialSpec() dcp.Spec {
	return dcp.Spec{Model: "partial", Layout: dcp1, ChunkTokens: 64, Groups: []dcp.Group{
		{Kind: dcp.Attention, BlockSize: 16, Layers: 2, KVFormat: "bf16", SemanticBytes: 16 * 64, PageBytes: 16 * 64, StrideBytes: 16 * 64},
		{Kind: dcp.Attention, BlockSize: 16, Layers: 1, KVFormat: "bf16", SemanticBytes: 16 * 32, PageBytes: 16 * 40, StrideBytes: 16 * 80}}}
}

// skipItems makes the items of chunk index ci of req skip their first
// skip blocks: their Blocks lose the skipped ids.
func skipItems(req RetrieveRequest, ci, skip int) RetrieveRequest {
	for i := range req.Items {
		if it := &req.Items[i]; it.Chunk == ci {
			it.Blocks, it.Skip = it.Blocks[skip:], skip
		}
	}
	return req
}

// expectPartial records that c's pages of blocks skip.. are now in
// blocks[g][skip:] (the skipped blocks keep what they held).
func (r *rig) expectPartial(c chunk, blocks [][]int64, skip int) {
	for gi, g := range r.res.Geometry {
		n := len(blocks[gi])
		for li := range g.Layers {
			for k := skip; k < n; k++ {
				off := uint64(blocks[gi][k]) * g.StrideBytes
				src := uint64(li*n+k) * g.PageBytes
				copy(r.image[gi][li][off:], c.packed[gi][src:src+g.PageBytes])
			}
		}
	}
}

// l1Bytes returns the bytes of key's object in e's L1 (nil: not there).
func l1Bytes(e *Engine, key dcp.Key) []byte {
	e.mu.Lock()
	defer e.mu.Unlock()
	o := e.cat.objs[key]
	if o == nil {
		return nil
	}
	return e.l1mem[e.cat.off(o) : e.cat.off(o)+o.size]
}

// A chunk whose first block the engine holds is placed from its second
// block on: the held block's pages (every layer, every group) keep their
// bytes, the others get the object's pages, and the item reports the
// whole object's recorded sum. A whole chunk in the same request is
// placed as usual.
func TestRetrievePartialPlacesOnlyLaterBlocks(t *testing.T) {
	dev := partialDevice(t)
	r := newRig(t, dev, partialSpec(), []int64{24, 24})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	cs := []chunk{r.newChunk(0, r.consecutiveN(0)), r.newChunk(1, r.consecutiveN(1))}
	storeAll(t, e, r, "partial", cs...)
	r.check("stored")

	tgt := [][][]int64{nil, r.consecutiveN(2)}
	for skip := 1; skip <= 3; skip++ {
		// A different target each round, never written before: the
		// chunk's held blocks must keep the sentinel.
		tgt[0] = r.consecutiveN(2 + skip)
		rr, err := e.Retrieve(testCtx(t), skipItems(r.retrieveReq(0, cs, tgt), 0, skip))
		if err != nil {
			t.Fatalf("skip %d: %v", skip, err)
		}
		if !rr.ChunkOK(0) || !rr.ChunkOK(1) {
			t.Fatalf("skip %d: %+v", skip, rr.Items)
		}
		for i, it := range rr.Items {
			if want := checksum.Sum(cs[it.Chunk].packed[it.Group]); it.Sum != want {
				t.Errorf("skip %d: item %d reports sum %016x, the object's is %016x", skip, i, it.Sum, want)
			}
		}
		r.expectPartial(cs[0], tgt[0], skip)
		r.expectRestored(cs[1], tgt[1])
		r.check("partial restore")
	}
	if got := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_objects_restored_total"); got != 3*4 {
		t.Errorf("objects restored %v, want 12", got)
	}
}

// A wrong source byte fails the partial item before anything is written,
// in a skipped page (its bytes are verified though not placed) as in a
// placed one; the object is dropped from L1 and counted.
func TestRetrievePartialBadSourceWritesNothing(t *testing.T) {
	for _, c := range []struct {
		name string
		page int // page of layer 0 of group 0 whose first byte flips
	}{{"skipped page", 0}, {"placed page", 2}} {
		t.Run(c.name, func(t *testing.T) {
			dev := partialDevice(t)
			r := newRig(t, dev, partialSpec(), []int64{24, 24})
			e := newEngine(t, engineConfig(t, dev, 0, 1))
			r.register(e)
			cs := []chunk{r.newChunk(0, r.consecutiveN(0))}
			storeAll(t, e, r, "bad", cs...)
			src := l1Bytes(e, keyOf(r, cs[0], 0))
			src[uint64(c.page)*r.res.Geometry[0].PageBytes] ^= 0x10
			rr, err := e.Retrieve(testCtx(t), skipItems(r.retrieveReq(0, cs, [][][]int64{r.consecutiveN(3)}), 0, 1))
			if err != nil {
				t.Fatal(err)
			}
			it := rr.Items[0]
			if it.OK || it.Reason != ReasonCorrupt || !strings.Contains(it.Err.Error(), "nothing of its chunk written") ||
				rr.Items[1].Reason != ReasonSibling {
				t.Fatalf("items %+v", rr.Items)
			}
			r.check("after a failed partial restore")
			if l1Bytes(e, keyOf(r, cs[0], 0)) != nil {
				t.Error("the corrupt object is still in L1")
			}
			if got := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_checksum_failures_total", "tier", "L1"); got != 1 {
				t.Errorf("L1 checksum failures %v, want 1", got)
			}
		})
	}
}

// A placed byte that differs from the verified source (changed between
// the check and the scatter: what a fault of the copy looks like) fails
// the item by the scatter's read-back; the skipped pages stay untouched.
func TestRetrievePartialReadBackMismatchFails(t *testing.T) {
	dev := partialDevice(t)
	r := newRig(t, dev, partialSpec(), []int64{24, 24})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	cs := []chunk{r.newChunk(0, r.consecutiveN(0))}
	storeAll(t, e, r, "readback", cs...)
	page := r.res.Geometry[0].PageBytes
	e.hooks.partialChecked = func(key dcp.Key, src []byte) {
		if key.Group == 0 {
			src[4*page+3*page+7] ^= 0x01 // layer 1, block 3 (placed)
		}
	}
	tgt := r.consecutiveN(3)
	rr, err := e.Retrieve(testCtx(t), skipItems(r.retrieveReq(0, cs, [][][]int64{tgt}), 0, 2))
	if err != nil {
		t.Fatal(err)
	}
	it := rr.Items[0]
	if it.OK || it.Reason != ReasonCorrupt || !strings.Contains(it.Err.Error(), "read back") {
		t.Fatalf("item %+v", it)
	}
	// Group 1 was placed; group 0's placed pages hold what the copy
	// carried (the engine recomputes them); its skipped pages nothing new.
	for li := range 2 {
		for _, b := range tgt[0][:2] {
			got := make([]byte, page)
			if err := dev.Read(r.pools[0][li], uint64(b)*page, got); err != nil {
				t.Fatal(err)
			}
			if want := r.image[0][li][uint64(b)*page : uint64(b+1)*page]; string(got) != string(want) {
				t.Fatalf("layer %d block %d (skipped) was written", li, b)
			}
		}
	}
}

// Items whose skip does not fit the chunk, or whose pages would split
// kvsum64's words, are refused with the request.
func TestRetrievePartialRefusals(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, partialSpec(), []int64{24, 24})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	cs := []chunk{r.newChunk(0, r.consecutiveN(0))}
	storeAll(t, e, r, "refuse", cs...)
	for _, c := range []struct {
		name, msg string
		edit      func(req *RetrieveRequest)
	}{
		{"all skipped", "skips 4 of the 4 blocks", func(req *RetrieveRequest) { req.Items[0].Skip, req.Items[0].Blocks = 4, nil }},
		{"negative", "skips -1", func(req *RetrieveRequest) { req.Items[0].Skip = -1 }},
		{"ids left in", "skips 1 and names 4 block ids", func(req *RetrieveRequest) { req.Items[0].Skip = 1 }},
	} {
		req := r.retrieveReq(0, cs, [][][]int64{r.consecutiveN(3)})
		c.edit(&req)
		if _, err := e.Retrieve(testCtx(t), req); !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: %v", c.name, err)
		}
	}
	r.check("nothing written")
}

// partialSums' whole sum is kvsum64 of the object and each run's is
// kvsum64 of that run alone, hashed here or by several goroutines.
func TestPartialSums(t *testing.T) {
	for _, c := range []struct {
		page           uint64
		layers, n, skp int
	}{{64, 1, 1, 0}, {64, 2, 4, 1}, {1024, 3, 4, 3}, {8, 5, 7, 7}, {128 << 10, 8, 8, 1}} {
		src := testutil.RandomBytes(c.page*uint64(c.layers*c.n), c.page+uint64(c.skp))
		spawned := 0
		whole, runs := partialSums(src, c.page, c.layers, c.n, c.skp, func(f func()) bool { spawned++; go f(); return true })
		if want := checksum.Sum(src); whole != want {
			t.Errorf("%+v: whole %016x, want %016x", c, whole, want)
		}
		for li, s := range runs {
			run := src[uint64(li*c.n+c.skp)*c.page : uint64(li+1)*uint64(c.n)*c.page]
			if want := checksum.Sum(run); s != want {
				t.Errorf("%+v: run %d %016x, want %016x", c, li, s, want)
			}
		}
		if big := len(src) >= partialSumsParallelBytes; big != (spawned > 0) {
			t.Errorf("%+v: %d goroutines for %d B", c, spawned, len(src))
		}
	}
}

// A partial chunk restores from L2 (verified on read into L1, then hashed
// as a partial item) after a restart, and from a peer's L1 (host-shared
// L1, MLA at TP4: rank 1 reads rank 0's object), whose bytes are hashed
// where they lie: a wrong byte in a skipped page there fails the chunk,
// nothing written, counted as a peer failure.
func TestRetrievePartialFromL2AndPeerL1(t *testing.T) {
	t.Run("L2", func(t *testing.T) {
		dev := openDevice(t, "")
		r := newRig(t, dev, partialSpec(), []int64{24, 24})
		cfg := engineConfig(t, dev, 0, 1)
		cfg.L2Dir = t.TempDir()
		e1 := newEngine(t, cfg)
		r.register(e1)
		cs := []chunk{r.newChunk(0, r.consecutiveN(0))}
		storeAll(t, e1, r, "l2", cs...)
		closeEngine(t, e1)
		cfg.Incarnation, cfg.Registerer = 0, newRegistry()
		e2 := newEngine(t, cfg)
		r.register(e2)
		tgt := [][][]int64{r.consecutiveN(3)}
		rr, err := e2.Retrieve(testCtx(t), skipItems(r.retrieveReq(0, cs, tgt), 0, 3))
		if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L2 {
			t.Fatalf("%+v, %v", rr.Items, err)
		}
		r.expectPartial(cs[0], tgt[0], 3)
		r.check("partial restore from L2")
	})
	t.Run("peer L1", func(t *testing.T) {
		p := newPeerRig(t, WriteBackOnEvict, true)
		r0, e0 := p.rigs[0], p.engs[0]
		cs := []chunk{r0.newChunk(0, r0.consecutiveN(0)), r0.newChunk(1, r0.consecutiveN(1))}
		storeAll(t, e0, r0, "peer", cs...)
		r, e := p.rigs[1], p.engs[1]
		tgt := [][][]int64{r.consecutiveN(4)}
		rr, err := e.Retrieve(testCtx(t), skipItems(r.retrieveReq(1, cs[:1], tgt), 0, 1))
		if err != nil || !rr.ChunkOK(0) || rr.Items[0].Sum != checksum.Sum(cs[0].packed[0]) {
			t.Fatalf("%+v, %v", rr.Items, err)
		}
		r.expectPartial(cs[0], tgt[0], 1)
		r.check("partial restore from a peer's L1")
		if st := e.Stats(); st.PeerL1Reads != 1 || st.PeerL1Bytes != r.res.ObjectSize(0)/2 || st.L1Objects != 0 {
			t.Fatalf("peer reads %d (%d B), own L1 objects %d", st.PeerL1Reads, st.PeerL1Bytes, st.L1Objects)
		}
		l1Bytes(e0, keyOf(r0, cs[1], 0))[9] ^= 0x04 // block 0 of layer 0: a page the next load skips
		rr, err = e.Retrieve(testCtx(t), skipItems(r.retrieveReq(1, cs[1:], [][][]int64{r.consecutiveN(5)}), 0, 1))
		if err != nil || rr.ChunkOK(0) || rr.Items[0].Reason != ReasonCorrupt {
			t.Fatalf("%+v, %v", rr.Items, err)
		}
		r.check("nothing written after a bad peer source")
		if st := e.Stats(); st.PeerL1Failures != 1 {
			t.Fatalf("peer failures %d", st.PeerL1Failures)
		}
	})
}

// BenchmarkPartialSums: the CPU pass of a partial item over an object of
// Llama-3.1-8B's geometry at one rank (32 layers, chunks of 16 blocks of
// 16 tokens, 64 KiB pages: 32 MiB), one block skipped; b.SetBytes is the
// object, hashed by as many goroutines as GOMAXPROCS allows (at most 8).
func BenchmarkPartialSums(b *testing.B) {
	const page, layers, n = 64 << 10, 32, 16
	src := testutil.RandomBytes(page*layers*n, 1)
	spawn := func(f func()) bool { go f(); return true }
	b.SetBytes(int64(len(src)))
	for b.Loop() {
		partialSums(src, page, layers, n, 1, spawn)
	}
}
