package transfer

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer/hostl1"
	"github.com/kvtier/kvtier/wire"
)

// hostL1Dir returns a private directory for host L1 segments.
func hostL1Dir(t *testing.T) string {
	t.Helper()
	d := t.TempDir()
	if err := os.Chmod(d, 0o700); err != nil {
		t.Fatal(err)
	}
	return d
}

// tp4MLA is c1Spec's MLA group at TP4/DCP1: rank 0 stores, all 4 read.
func tp4MLA() dcp.Spec {
	spec := c1Spec()
	spec.Layout = dcp.Layout{TP: 4, DCP: 1, Interleave: 1, PP: 1}
	return spec
}

// peerRig is four engines of one instance on one host sharing host L1.
type peerRig struct {
	rigs []*rig
	engs []*Engine
}

func newPeerRig(t *testing.T, policy L2Policy, hostL1 bool) *peerRig {
	dev := openDevice(t, "")
	dir, root := hostL1Dir(t), t.TempDir()
	p := &peerRig{}
	for tp := range 4 {
		r := newRig(t, dev, tp4MLA(), []int64{16})
		cfg := engineConfig(t, dev, tp, 4)
		cfg.L2Dir = root
		cfg.L2Policy = policy
		if hostL1 {
			cfg.HostL1Dir = dir
		}
		e := newEngine(t, cfg)
		r.register(e)
		p.rigs, p.engs = append(p.rigs, r), append(p.engs, e)
	}
	return p
}

// TestPeerL1WriteBackTPReaders (issue 15.1): MLA at TP4/DCP1 under
// write-back. Rank 0 stores 3 chunks (nothing reaches L2); ranks 1-3
// restore all of them straight from rank 0's L1, byte-exact, reading no
// L2 file and holding nothing in their own L1: the host holds each object
// once. Seen failing without HostL1Dir (the readers find nothing: not in
// L1, not in L2).
func TestPeerL1WriteBackTPReaders(t *testing.T) {
	p := newPeerRig(t, WriteBackOnEvict, true)
	r0, e0 := p.rigs[0], p.engs[0]
	var cs []chunk
	for i := range 3 {
		cs = append(cs, r0.newChunk(i, r0.consecutiveN(i)))
	}
	if res := storeAll(t, e0, r0, "a", cs...); len(res.Objects) != 3 {
		t.Fatalf("rank 0 store: %+v", res)
	}
	if st := e0.Stats(); st.L2Objects != 0 || st.L1Objects != 3 {
		t.Fatalf("rank 0 after the store: %d L1, %d L2 objects; want 3 and 0 (write-back)", st.L1Objects, st.L2Objects)
	}
	for tp := 1; tp < 4; tp++ {
		r, e := p.rigs[tp], p.engs[tp]
		tgt := [][][]int64{r.consecutiveN(4), r.consecutiveN(5), r.consecutiveN(6)}
		rr, err := e.Retrieve(testCtx(t), r.retrieveReq(tp, cs, tgt))
		if err != nil {
			t.Fatal(err)
		}
		for ci := range cs {
			if !rr.ChunkOK(ci) || rr.Items[ci].From != wire.L1 {
				t.Fatalf("rank %d chunk %d: %+v", tp, ci, rr.Items[ci])
			}
			r.expectRestored(cs[ci], tgt[ci])
		}
		r.check("rank reading rank 0's L1")
		st := e.Stats()
		if st.PeerL1Reads != 3 || st.PeerL1Bytes != 3*r.res.ObjectSize(0) || st.L2Reads != 0 || st.BytesReadL2 != 0 ||
			st.L1Objects != 0 || st.PeerL1Failures != 0 {
			t.Fatalf("rank %d stats: peer reads %d (%d B), L2 reads %d, own L1 objects %d, peer failures %d",
				tp, st.PeerL1Reads, st.PeerL1Bytes, st.L2Reads, st.L1Objects, st.PeerL1Failures)
		}
		if got := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_peer_l1_reads_total"); got != 3 {
			t.Fatalf("rank %d: kvtier_transfer_peer_l1_reads_total %v", tp, got)
		}
		if got := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l2_reads_total"); got != 0 {
			t.Fatalf("rank %d: kvtier_transfer_l2_reads_total %v", tp, got)
		}
	}
	if st := e0.Stats(); st.L1Objects != 3 {
		t.Fatalf("rank 0 holds %d objects after the reads", st.L1Objects)
	}
}

// TestPeerL1EvictionDuringReadFailsChunk (issue 15.1, C5): while rank 1
// holds its lease on chunk 0 in rank 0's L1, the object is not chosen for
// eviction; rank 0 then evicts it anyway (the race a lease cannot
// exclude: chosen before the lease was taken) and a new store reuses its
// slabs before rank 1's scatter. That chunk fails (corrupt), the others
// restore byte-exact, and the next restore of chunk 0 succeeds from L2.
// Seen failing first with the checksum comparison of peer reads off (the
// chunk came back OK holding the other chunk's bytes).
func TestPeerL1EvictionDuringReadFailsChunk(t *testing.T) {
	p := newPeerRig(t, WriteThrough, true)
	r0, e0, r1, e1 := p.rigs[0], p.engs[0], p.rigs[1], p.engs[1]
	cs := []chunk{r0.newChunk(0, r0.consecutiveN(0)), r0.newChunk(1, r0.consecutiveN(1))}
	storeAll(t, e0, r0, "a", cs...)
	if err := e0.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	victim := dcp.Key{NS: r0.res.Namespace, Chunk: cs[0].hash}
	fired := false
	e1.hooks.peerLeased = func(k dcp.Key) {
		if fired || k != victim {
			return
		}
		fired = true
		e0.mu.Lock()
		o := e0.cat.objs[k]
		off := e0.cat.off(o)
		if cl := e0.cat.classify(o, e0.cfg.Now()); cl != slabBlocked {
			e0.mu.Unlock()
			t.Errorf("object leased by a peer classified %d, want blocked (%d)", cl, slabBlocked)
			return
		}
		slab := o.slab
		e0.evictLocked(o)
		e0.cat.cursor = slab // the next placement takes the evicted slabs (next fit wraps to them in time)
		e0.mu.Unlock()
		other := r0.newChunk(9, r0.consecutiveN(3))
		storeAll(t, e0, r0, "b", other)
		e0.mu.Lock()
		n := e0.cat.objs[dcp.Key{NS: r0.res.Namespace, Chunk: other.hash}]
		if e0.cat.off(n) != off {
			t.Errorf("the new object went to offset %d, not the evicted one's %d", e0.cat.off(n), off)
		}
		e0.mu.Unlock()
	}
	tgt := [][][]int64{r1.consecutiveN(4), r1.consecutiveN(5)}
	rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, cs, tgt))
	if err != nil {
		t.Fatal(err)
	}
	if !fired {
		t.Fatal("the hook never ran: chunk 0 was not read from rank 0's L1")
	}
	if rr.ChunkOK(0) || rr.Items[0].Reason != ReasonCorrupt || !rr.ChunkOK(1) || rr.Items[1].From != wire.L1 {
		t.Fatalf("retrieve racing the eviction: %+v", rr.Items)
	}
	if got := r1.readChunk(tgt[1]); !bytes.Equal(got[0], cs[1].packed[0]) {
		t.Fatal("chunk 1 restored other bytes")
	}
	if st := e1.Stats(); st.PeerL1Failures != 1 || st.PeerL1Reads != 1 {
		t.Fatalf("peer failures %d reads %d, want 1 and 1", st.PeerL1Failures, st.PeerL1Reads)
	}
	// The engine recomputes chunk 0; the next restore takes it from L2.
	rr, err = e1.Retrieve(testCtx(t), r1.retrieveReq(1, cs[:1], tgt[:1]))
	if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L2 {
		t.Fatalf("next restore: %+v %v", rr, err)
	}
	if got := r1.readChunk(tgt[0]); !bytes.Equal(got[0], cs[0].packed[0]) {
		t.Fatal("the next restore of chunk 0 placed other bytes")
	}
}

// TestPeerL1PeerRestartReplacesSegment: a holder that closes and starts
// again publishes a new segment; a reader that mapped the old one finds
// it closed, maps the new one and reads what the new run stores.
func TestPeerL1PeerRestartReplacesSegment(t *testing.T) {
	p := newPeerRig(t, WriteThrough, true)
	r0, e0, r1, e1 := p.rigs[0], p.engs[0], p.rigs[1], p.engs[1]
	c := r0.newChunk(0, r0.consecutiveN(0))
	storeAll(t, e0, r0, "a", c)
	tgt := [][][]int64{r1.consecutiveN(3)}
	if rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, []chunk{c}, tgt)); err != nil || !rr.ChunkOK(0) || e1.Stats().PeerL1Reads != 1 {
		t.Fatalf("first read: %+v %v", rr, err)
	}
	cfg := e0.cfg
	closeEngine(t, e0)
	cfg.Incarnation, cfg.Registerer, cfg.L2Dir = 0, nil, t.TempDir() // a fresh L2: only the new L1 has it
	e0b := newEngine(t, cfg)
	r0.register(e0b)
	c2 := r0.newChunk(1, r0.consecutiveN(1))
	storeAll(t, e0b, r0, "b", c2)
	tgt2 := [][][]int64{r1.consecutiveN(5)}
	rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, []chunk{c2}, tgt2))
	if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L1 || e1.Stats().PeerL1Reads != 2 {
		t.Fatalf("read after the holder's restart: %+v %v (peer reads %d)", rr, err, e1.Stats().PeerL1Reads)
	}
	if got := r1.readChunk(tgt2[0]); !bytes.Equal(got[0], c2.packed[0]) {
		t.Fatal("read other bytes after the restart")
	}
}

// TestPeerL1ReadsRacingEvictionsNeverWrong (C5): rank 0's L1 holds 16
// objects while it stores 120 chunks, evicting all the time; meanwhile
// rank 1 keeps restoring the latest chunks from it. Every item rank 1
// reports OK holds exactly the chunk's bytes; the rest failed (missing:
// evicted before the lookup; corrupt: changed under the read).
func TestPeerL1ReadsRacingEvictionsNeverWrong(t *testing.T) {
	dev := openDevice(t, "")
	dir := hostL1Dir(t)
	spec := c1Spec()
	spec.Layout = dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}
	r0 := newRig(t, dev, spec, []int64{16})
	r1 := newRig(t, dev, spec, []int64{16})
	cfg0 := engineConfig(t, dev, 0, 2)
	cfg0.HostL1Dir, cfg0.L1Bytes = dir, 16*cfg0.L1SlabBytes
	cfg1 := engineConfig(t, dev, 1, 2)
	cfg1.HostL1Dir = dir
	e0, e1 := newEngine(t, cfg0), newEngine(t, cfg1)
	r0.register(e0)
	r1.register(e1)

	const total = 120
	var mu sync.Mutex // guards stored
	var stored []chunk
	done := make(chan struct{})
	var ok, failed, wrong int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			mu.Lock()
			// Chunks around the eviction edge: some still in L1, some gone.
			cs := append([]chunk(nil), stored[max(0, len(stored)-19):max(0, len(stored)-13)]...)
			mu.Unlock()
			if len(cs) == 0 {
				continue
			}
			tgt := make([][][]int64, len(cs))
			for i := range cs {
				tgt[i] = r1.consecutiveN(i)
			}
			rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, cs, tgt))
			if err != nil {
				t.Errorf("retrieve: %v", err)
				return
			}
			for i := range cs {
				if !rr.ChunkOK(i) {
					failed++
					continue
				}
				ok++
				if got := r1.readChunk(tgt[i]); !bytes.Equal(got[0], cs[i].packed[0]) {
					wrong++
				}
			}
		}
	}()
	for i := range total {
		c := r0.newChunk(i, r0.consecutiveN(i%8))
		storeAll(t, e0, r0, "s", c)
		mu.Lock()
		stored = append(stored, c)
		mu.Unlock()
	}
	close(done)
	wg.Wait()
	st := e1.Stats()
	t.Logf("rank 1: %d chunks OK, %d failed; peer reads %d, failures %d, stale %d; rank 0 evictions %d",
		ok, failed, st.PeerL1Reads, st.PeerL1Failures, st.PeerL1Stale, e0.Stats().Evictions)
	if wrong != 0 || ok == 0 || e0.Stats().Evictions == 0 {
		t.Fatalf("%d chunks reported OK with wrong bytes, %d OK, %d evictions", wrong, ok, e0.Stats().Evictions)
	}
}

// TestPeerL1DirRules: New refuses a host L1 directory that is not private
// and real (C9), naming the rule; a good one gets this rank's segment,
// which Close removes.
func TestPeerL1DirRules(t *testing.T) {
	dev := openDevice(t, "")
	open := hostL1Dir(t)
	if err := os.Chmod(open, 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "l1")
	good := hostL1Dir(t)
	if err := os.Symlink(good, link); err != nil {
		t.Fatal(err)
	}
	// A missing directory is created (hostl1.TestSegDirSquat); one whose
	// parent is missing is refused.
	for _, d := range []string{open, link, filepath.Join(good, "missing", "l1")} {
		cfg := engineConfig(t, dev, 0, 1)
		cfg.HostL1Dir = d
		if e, err := New(cfg); !errors.Is(err, ErrConfig) {
			if e != nil {
				_ = e.Close(testCtx(t))
			}
			t.Fatalf("host L1 dir %s: %v, want ErrConfig", d, err)
		}
	}
	cfg := engineConfig(t, dev, 0, 1)
	cfg.HostL1Dir = good
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	seg := filepath.Join(good, "test.0.l1")
	fi, err := os.Lstat(seg)
	if err != nil || fi.Mode().Perm() != 0o600 || uint64(fi.Size()) != hostl1.NewGeometry(cfg.L1Bytes/cfg.L1SlabBytes, cfg.L1SlabBytes).Size() {
		t.Fatalf("segment %s: %v %v", seg, fi, err)
	}
	closeEngine(t, e)
	if _, err := os.Lstat(seg); !os.IsNotExist(err) {
		t.Fatalf("Close left the segment: %v", err)
	}
}
