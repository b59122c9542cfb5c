package transfer

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

func TestConfigValidate(t *testing.T) {
	dev := openDevice(t, "")
	base := engineConfig(t, dev, 0, 1)
	cases := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"instance", func(c *Config) { c.Rank.Instance = "a b" }, "rank instance"},
		{"tp rank", func(c *Config) { c.Rank.TPRank = 1 }, "TP rank 1 outside 0..0"},
		{"device", func(c *Config) { c.Device = nil }, "no device"},
		{"slab", func(c *Config) { c.L1SlabBytes = 1000 }, "multiple of 4096"},
		{"l1", func(c *Config) { c.L1Bytes = 4096; c.L1SlabBytes = 8192 }, "smaller than one"},
		{"watermarks", func(c *Config) { c.LowWatermark = 0.95 }, "want 0 < low < high <= 1"},
		{"policy", func(c *Config) { c.L2Policy = 9 }, "L2 policy 9"},
		{"timeout", func(c *Config) { c.StoreTimeout = -1 }, "must be > 0"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := base
			c.mod(&cfg)
			_, err := New(cfg)
			if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("New = %v, want ErrConfig naming %q", err, c.want)
			}
		})
	}
}

func TestRegistrationRules(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	ctx := testCtx(t)
	cases := []struct {
		name   string
		mod    func(*Registration)
		target error
		want   string
	}{
		{"declared over stride", func(g *Registration) { g.Spec.Groups[0].StrideBytes = 16*656 - 1 },
			dcp.ErrGeometry, "declared page 10496 B exceeds block stride 10495 B"},
		{"semantic over declared", func(g *Registration) { g.Spec.Groups[0].SemanticBytes = 16*656 + 1 },
			dcp.ErrGeometry, "semantic page 10497 B exceeds declared page 10496 B"},
		{"wrong device", func(g *Registration) { g.DeviceUUID = "GPU-other" }, ErrWrongDevice, "GPU-other"},
		{"pool of wrong device", func(g *Registration) { g.Pools[1].Handle.Device = "GPU-other" }, ErrWrongDevice, "layer 1"},
		{"pool too small", func(g *Registration) { g.Pools[0].Handle.Size = 100 }, ErrRegistration, "smaller than one 10496 B page"},
		{"missing pool", func(g *Registration) { g.Pools = g.Pools[:1] }, ErrRegistration, "1 pools, the spec has 2"},
		{"duplicate pool", func(g *Registration) { g.Pools[1].Layer = 0 }, ErrRegistration, "registered twice"},
		{"TP size", func(g *Registration) { g.Spec.Layout.TP, g.Spec.Layout.DCP = 2, 2 }, ErrRegistration, "TP size 2"},
		{"bad handle", func(g *Registration) { g.Pools[0].Handle.Raw = []byte("nope") }, ErrRegistration, "import pool"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			reg := r.registration()
			reg.Spec.Groups = append([]dcp.Group(nil), reg.Spec.Groups...)
			c.mod(&reg)
			_, err := e.Register(ctx, reg, "")
			if !errors.Is(err, c.target) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Register = %v, want %v naming %q", err, c.target, c.want)
			}
		})
	}
	// Requests against it.
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	r.write(c, c.blocks, 0)
	_, h := r.record()
	bad := []struct {
		name string
		req  StoreRequest
		want string
	}{
		{"unknown namespace", StoreRequest{Namespace: dcp.Namespace{7}, Event: h}, "not registered"},
		{"block count", StoreRequest{Namespace: r.res.Namespace, Session: r.session, Event: h, Chunks: []wire.ChunkBlocks{{Blocks: [][]int64{{0}}}}}, "1 block ids, a chunk of 32 tokens holds 2"},
		{"block outside pool", StoreRequest{Namespace: r.res.Namespace, Session: r.session, Event: h, Chunks: []wire.ChunkBlocks{{Blocks: [][]int64{{7, 8}}}}}, "block id 8"},
		{"groups", StoreRequest{Namespace: r.res.Namespace, Session: r.session, Event: h, Chunks: []wire.ChunkBlocks{{}}}, "block ids for 0 groups, the spec has 1"},
		{"event", StoreRequest{Namespace: r.res.Namespace, Session: r.session, Event: cuda.EventHandle{Backend: "host", Device: dev.Info().UUID, Raw: []byte("x")}}, "import producer event"},
	}
	for _, b := range bad {
		if _, err := e.Store(ctx, b.req); err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("%s: Store = %v, want an error naming %q", b.name, err, b.want)
		}
	}
	rq := r.retrieveReq(0, []chunk{c, c}, [][][]int64{r.consecutiveN(1), r.consecutiveN(1)})
	if _, err := e.Retrieve(ctx, rq); !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), "both write block 2") {
		t.Errorf("overlapping targets: %v", err)
	}
	rq = r.retrieveReq(0, []chunk{c}, [][][]int64{r.consecutiveN(1)})
	rq.Items[0].Key.Shard = 1
	if _, err := e.Retrieve(ctx, rq); !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), "reads shard 0") {
		t.Errorf("wrong shard: %v", err)
	}
	r.check("after rejected requests")
}

// TestDeviceTransfersCountedByPath: every gather and scatter the device
// enqueued is counted under the copy path it took (the host backend's
// kernels: "sm"; its DMA path: "dma"), none under another.
func TestDeviceTransfersCountedByPath(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	r.write(c, c.blocks, 0)
	storeAll(t, e, r, "a", c)
	for range 2 {
		tgt := r.consecutiveN(1)
		if rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{tgt})); err != nil || !rr.ChunkOK(0) {
			t.Fatalf("retrieve: %+v %v", rr, err)
		}
	}
	g := gatherer(t, e)
	for op, want := range map[string]float64{"gather": 1, "scatter": 2} {
		if all := testutil.MetricSum(t, g, "kvtier_transfer_device_transfers_total", "op", op); all != want {
			t.Errorf("%s: %v counted, want %v", op, all, want)
		}
		for _, path := range []string{"sm-direct", "sm-staged"} {
			if v := testutil.Metric(t, g, "kvtier_transfer_device_transfers_total", "op", op, "path", path); v != 0 {
				t.Errorf("%s: %v counted under %s on the host backend", op, v, path)
			}
		}
	}
}

// TestStoreTimeoutHoldsBlocksUntilDeviceDone: a store whose producer is
// late fails with a timeout, but keeps its event, its blocks and its L1
// room until the device has really finished; only then is its request
// finished.
func TestStoreTimeoutHoldsBlocksUntilDeviceDone(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.StoreTimeout = 100 * time.Millisecond
	e := newEngine(t, cfg)
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	r.write(c, c.blocks, time.Minute)
	_, h := r.record()
	f, err := e.Store(testCtx(t), r.storeReq("late", h, c))
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.Wait(testCtx(t))
	if !errors.Is(err, ErrTimeout) || res.Objects[0].Reason != ReasonTimeout {
		t.Fatalf("store of a late producer: %+v %v", res.Objects, err)
	}
	select {
	case <-f.Released():
		t.Fatal("blocks released while the device still waits to read them")
	case <-time.After(50 * time.Millisecond):
	}
	if e.RequestDone("late") || e.Stats().L1OccupiedBytes == 0 {
		t.Fatal("a timed-out store let go of its request or L1 room while the device may still write")
	}
	// The producer finishes (its stream is closed, which ends the delay).
	_ = r.stream.Close()
	if err := f.WaitReleased(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitRequest(testCtx(t), "late"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for e.Stats().L1OccupiedBytes != 0 {
		if time.Now().After(deadline) {
			t.Fatal("L1 room of a timed-out store never freed")
		}
		time.Sleep(time.Millisecond)
	}
	if len(e.Inventory().Objects) != 0 {
		t.Fatal("a timed-out store committed an object")
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_store_failures_total", "reason", "timeout"); v != 1 {
		t.Fatalf("store_failures_total{reason=timeout} = %v", v)
	}
}

// TestReRegistrationDrainsOldPools: an engine restart re-registers its
// namespace while a store on the old pools is in flight; the store
// finishes on the old imports, which are released only afterwards.
func TestReRegistrationDrainsOldPools(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	e.mu.Lock()
	old := e.sess.byNS[r.res.Namespace]
	e.mu.Unlock()
	c := r.newChunk(0, r.consecutiveN(0))
	r.write(c, c.blocks, 200*time.Millisecond)
	_, h := r.record()
	f, err := e.Store(testCtx(t), r.storeReq("a", h, c))
	if err != nil {
		t.Fatal(err)
	}
	r.register(e) // the restarted engine's registration
	e.mu.Lock()
	cur := e.sess.byNS[r.res.Namespace]
	oldPools := old.pools != nil
	e.mu.Unlock()
	if cur == old || cur.gen != old.gen+1 || !oldPools {
		t.Fatalf("re-registration: new space %v (gen %d), old pools kept %v", cur != old, cur.gen, oldPools)
	}
	if _, err := f.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitRequest(testCtx(t), "a"); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	released := old.pools == nil && old.refs == 0
	e.mu.Unlock()
	if !released {
		t.Fatal("old imports not released after their last store")
	}
	tgt := r.consecutiveN(1)
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve on the new registration: %+v %v", rr, err)
	}
	r.expectRestored(c, tgt)
	r.check("after re-registration")
}

// TestDedupe: storing objects that exist is a counted no-op success, also
// while the first store is still in flight.
func TestDedupe(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	r.write(c, c.blocks, 100*time.Millisecond)
	_, h1 := r.record()
	f1, err := e.Store(testCtx(t), r.storeReq("a", h1, c))
	if err != nil {
		t.Fatal(err)
	}
	_, h2 := r.record()
	f2, err := e.Store(testCtx(t), r.storeReq("b", h2, c)) // while f1 is in flight
	if err != nil {
		t.Fatal(err)
	}
	res1, err1 := f1.Wait(testCtx(t))
	res2, err2 := f2.Wait(testCtx(t))
	if err1 != nil || err2 != nil || res1.Objects[0].Status != Stored || res2.Objects[0].Status != Deduped ||
		res2.Objects[0].Sum != res1.Objects[0].Sum || res1.Objects[0].Sum != checksum.Sum(c.packed[0]) {
		t.Fatalf("stores: %+v %v / %+v %v", res1, err1, res2, err2)
	}
	res3 := storeAll(t, e, r, "c", c)
	if res3.Objects[0].Status != Deduped {
		t.Fatalf("third store %+v", res3)
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_dedupe_hits_total"); v != 2 {
		t.Fatalf("dedupe_hits_total = %v, want 2", v)
	}
	if w := res3.Wire(); w.Deduped != 1 || w.Stored != 0 {
		t.Fatalf("wire reply %+v", w)
	}
}

// TestMLAReadersRestoreTheWritersShard: MLA without DCP on TP 2: rank 0
// stores shard 0, rank 1 stores nothing and restores rank 0's object from
// the shared L2 root.
func TestMLAReadersRestoreTheWritersShard(t *testing.T) {
	dev := openDevice(t, "")
	spec := c1Spec()
	spec.Layout = dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}
	r0 := newRig(t, dev, spec, []int64{8})
	r1 := newRig(t, dev, spec, []int64{8}) // rank 1's own pools
	root := t.TempDir()
	cfg0 := engineConfig(t, dev, 0, 2)
	cfg0.L2Dir = root
	cfg1 := engineConfig(t, dev, 1, 2)
	cfg1.L2Dir = root
	e0, e1 := newEngine(t, cfg0), newEngine(t, cfg1)
	r0.register(e0)
	r1.register(e1)
	c := r0.newChunk(0, r0.consecutiveN(0))
	if res := storeAll(t, e0, r0, "a", c); len(res.Objects) != 1 || res.Objects[0].Key.Shard != 0 {
		t.Fatalf("rank 0 store %+v", res)
	}
	c1 := c
	if res := storeAll(t, e1, r1, "a", c1); len(res.Objects) != 0 {
		t.Fatalf("rank 1 stored %+v; MLA without DCP is stored by rank 0 only", res)
	}
	if err := e0.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	tgt := r1.consecutiveN(2)
	rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, []chunk{c}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L2 {
		t.Fatalf("rank 1 retrieve: %+v %v", rr, err)
	}
	r1.expectRestored(c, tgt)
	r1.check("rank 1 after restoring rank 0's shard")
	// Rank 1's inventory lists what it holds (L1), never rank 0's L2 file.
	for _, p := range e1.Inventory().Objects {
		if p.Tier == wire.L2 {
			t.Fatalf("rank 1 lists an L2 object it did not write: %+v", p)
		}
	}
}

// TestCloseFlushesWriteBackAndRefusesWork: Close writes objects only L1
// holds to L2 (write-back), is idempotent, and later calls fail ErrClosed.
func TestCloseFlushesWriteBackAndRefusesWork(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = t.TempDir()
	cfg.L2Policy = WriteBackOnEvict
	e := newEngine(t, cfg)
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e, r, "a", c)
	if e.Stats().L2Objects != 0 {
		t.Fatal("write-back wrote before eviction")
	}
	closeEngine(t, e)
	closeEngine(t, e)
	if st := e.Stats(); st.L2Objects != 1 || st.LostObjects != 0 {
		t.Fatalf("after Close: %d L2 objects, %d lost", st.L2Objects, st.LostObjects)
	}
	if _, err := e.Store(context.Background(), r.storeReq("b", cuda.EventHandle{}, c)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Store after Close: %v", err)
	}
	if _, err := e.Retrieve(context.Background(), RetrieveRequest{Namespace: r.res.Namespace}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Retrieve after Close: %v", err)
	}
	// The object is there for the next incarnation.
	cfg.Incarnation, cfg.Registerer = 0, nil
	e2 := newEngine(t, cfg)
	r.register(e2)
	tgt := r.consecutiveN(1)
	rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve after restart: %+v %v", rr, err)
	}
	if got := r.readChunk(tgt); !bytes.Equal(got[0], c.packed[0]) {
		t.Fatal("restored other bytes")
	}
}
