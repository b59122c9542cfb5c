package transfer

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

func TestMain(m *testing.M) {
	if dir := os.Getenv(segHolderEnv); dir != "" {
		os.Exit(runSegHolder(dir)) // a child of TestPeerL1HolderKilled
	}
	testutil.Main(m)
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 180*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// openDevice opens the real host backend with its shared files in dir
// ("" = a fresh temp dir).
func openDevice(t testing.TB, dir string) cuda.Device {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
		if err := os.Chmod(dir, 0o700); err != nil { // the host backend wants a private dir
			t.Fatal(err)
		}
	}
	dev, err := cuda.OpenHost(cuda.HostConfig{Dir: dir})
	if err != nil {
		t.Fatalf("OpenHost: %v", err)
	}
	t.Cleanup(func() { _ = dev.Close() })
	return dev
}

// rig is the inference engine's side of a test: KV pools on the device,
// filled with a sentinel (padding included), a stream that writes pages,
// and image, the expected content of every pool.
type rig struct {
	t      testing.TB
	dev    cuda.Device
	spec   dcp.Spec
	res    *dcp.Resolved
	pools  [][]cuda.Mem
	image  [][][]byte // nil when the pools are too large to mirror (sparse)
	stream cuda.Stream
	// session is the session of the latest register; storeReq and
	// retrieveReq name it, sent as caller (register's owner is "").
	session string
	caller  string
}

// newRig allocates pools of blocks[g] pages per group and fills them with
// a sentinel pattern.
func newRig(t testing.TB, dev cuda.Device, spec dcp.Spec, blocks []int64) *rig {
	t.Helper()
	res, err := spec.Resolve()
	if err != nil {
		t.Fatalf("Resolve: %v", err)
	}
	r := &rig{t: t, dev: dev, spec: spec, res: res}
	r.stream, err = dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.stream.Close() })
	for gi, g := range res.Geometry {
		size := g.PoolBytes(blocks[gi])
		var layers []cuda.Mem
		var imgs [][]byte
		for li := range g.Layers {
			m, err := dev.Alloc(size)
			if err != nil {
				t.Fatalf("Alloc(%d): %v", size, err)
			}
			t.Cleanup(func() { _ = m.Release() })
			if size <= 256<<20 {
				img := make([]byte, size)
				sentinel(img, byte(gi*16+li))
				if err := dev.Write(m, 0, img); err != nil {
					t.Fatal(err)
				}
				imgs = append(imgs, img)
			}
			layers = append(layers, m)
		}
		r.pools = append(r.pools, layers)
		if len(imgs) == len(layers) {
			r.image = append(r.image, imgs)
		} else {
			r.image = append(r.image, nil)
		}
	}
	return r
}

// sentinelPeriod is prime, so it is a multiple of no page, stride or row
// size: a byte that lands anywhere else than where it belongs shows.
const sentinelPeriod = 65521

var sentinelPatterns [256][]byte

func init() {
	for s := range sentinelPatterns {
		sentinelPatterns[s] = testutil.RandomBytes(sentinelPeriod, 0x5e47_0000|uint64(s))
	}
}

// sentinel fills b with the pattern of seed, as at offset 0 of a pool.
func sentinel(b []byte, seed byte) { sentinelAt(b, 0, seed) }

// sentinelAt fills b with the pattern of seed as at offset off of a pool.
func sentinelAt(b []byte, off uint64, seed byte) {
	p := sentinelPatterns[seed]
	start := int(off % sentinelPeriod)
	n := copy(b, p[start:])
	for n < len(b) {
		n += copy(b[n:], p)
	}
}

func (r *rig) registration() Registration {
	r.t.Helper()
	reg := Registration{Spec: r.spec, DeviceUUID: r.dev.Info().UUID}
	for gi, layers := range r.pools {
		for li, m := range layers {
			h, err := r.dev.ExportMem(m, 0, m.Size())
			if err != nil {
				r.t.Fatal(err)
			}
			reg.Pools = append(reg.Pools, wire.PoolRegistration{Group: gi, Layer: li, Handle: h})
		}
	}
	return reg
}

func (r *rig) register(e *Engine) *dcp.Resolved {
	r.t.Helper()
	s, err := e.Register(testCtx(r.t), r.registration(), "")
	if err != nil {
		r.t.Fatalf("Register: %v", err)
	}
	r.session = s.ID
	res := s.Resolved
	if res.Namespace != r.res.Namespace {
		r.t.Fatalf("namespace %s, want %s", res.Namespace, r.res.Namespace)
	}
	return res
}

// chunk is one chunk of the engine: its hash, its blocks per group and the
// packed bytes of each group's object (layer-major, block order).
type chunk struct {
	hash   dcp.ChunkHash
	blocks [][]int64
	packed [][]byte
}

func chunkHash(i int) dcp.ChunkHash {
	var h dcp.ChunkHash
	copy(h[:], fmt.Sprintf("chunk-%010d", i))
	return h
}

// newChunk makes chunk i's content for the given blocks (of every group).
func (r *rig) newChunk(i int, blocks [][]int64) chunk {
	c := chunk{hash: chunkHash(i), blocks: blocks}
	for gi, g := range r.res.Geometry {
		c.packed = append(c.packed, testutil.RandomBytes(uint64(len(blocks[gi])*g.Layers)*g.PageBytes, uint64(i)<<8|uint64(gi)))
	}
	return c
}

// consecutive returns n block ids per group starting at first.
func (r *rig) consecutive(first int64) [][]int64 {
	var out [][]int64
	for gi := range r.res.Geometry {
		var ids []int64
		for k := range r.res.BlocksPerChunk(gi) {
			ids = append(ids, first+int64(k))
		}
		out = append(out, ids)
	}
	return out
}

// gate holds back all later work on the engine stream until open is
// called: the stream waits on an event recorded behind an hour's Delay on
// a stream of its own, and open closes that stream, which cuts the Delay
// short and completes the event. The stream waits however slowly the
// test goes on, where a Delay of fixed length can run out under load.
// open is idempotent; the cleanup opens a gate left shut.
func (r *rig) gate() (open func()) {
	r.t.Helper()
	g, err := r.dev.NewStream()
	if err != nil {
		r.t.Fatal(err)
	}
	ev, err := r.dev.NewEvent(false)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { _ = ev.Release() })
	r.t.Cleanup(func() { _ = g.Close() }) // runs first
	if err := g.Delay(time.Hour); err != nil {
		r.t.Fatal(err)
	}
	if err := g.Record(ev); err != nil {
		r.t.Fatal(err)
	}
	if err := r.stream.WaitEvent(ev); err != nil {
		r.t.Fatal(err)
	}
	return func() { _ = g.Close() }
}

// write enqueues the chunk's page writes on the engine stream (after
// delay), places them into blocks and updates the image.
func (r *rig) write(c chunk, blocks [][]int64, delay time.Duration) {
	r.t.Helper()
	if delay > 0 {
		if err := r.stream.Delay(delay); err != nil {
			r.t.Fatal(err)
		}
	}
	r.place(c, blocks, func(m cuda.Mem, off uint64, p []byte) {
		if _, err := r.stream.Upload(m, off, p); err != nil {
			r.t.Fatalf("Upload: %v", err)
		}
	})
}

// place walks the pages of c in blocks, calling put for each, and updates
// the expected image.
func (r *rig) place(c chunk, blocks [][]int64, put func(m cuda.Mem, off uint64, p []byte)) {
	for gi, g := range r.res.Geometry {
		if len(blocks[gi]) == 0 {
			continue
		}
		pos := uint64(0)
		for li := range g.Layers {
			for _, b := range blocks[gi] {
				off := uint64(b) * g.StrideBytes
				p := c.packed[gi][pos : pos+g.PageBytes]
				pos += g.PageBytes
				if put != nil {
					put(r.pools[gi][li], off, p)
				}
				if img := r.image[gi]; img != nil {
					copy(img[li][off:], p)
				}
			}
		}
	}
}

// expectRestored records that c's bytes must now be in blocks.
func (r *rig) expectRestored(c chunk, blocks [][]int64) { r.place(c, blocks, nil) }

// record records a fresh interprocess event after everything enqueued so
// far and returns it with its handle.
func (r *rig) record() (cuda.Event, cuda.EventHandle) {
	r.t.Helper()
	ev, err := r.dev.NewEvent(true)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { _ = ev.Release() })
	if err := r.stream.Record(ev); err != nil {
		r.t.Fatal(err)
	}
	h, err := r.dev.ExportEvent(ev)
	if err != nil {
		r.t.Fatal(err)
	}
	return ev, h
}

// storeReq builds a store of chunks (at their blocks).
func (r *rig) storeReq(reqID string, h cuda.EventHandle, cs ...chunk) StoreRequest {
	req := StoreRequest{RequestID: reqID, Namespace: r.res.Namespace, Session: r.session, Event: h, Caller: r.caller}
	for _, c := range cs {
		req.Chunks = append(req.Chunks, wire.ChunkBlocks{Chunk: c.hash, Blocks: c.blocks})
	}
	return req
}

// retrieveReq builds a retrieve of chunks into targets (one per chunk),
// for TP rank tp.
func (r *rig) retrieveReq(tp int, cs []chunk, targets [][][]int64) RetrieveRequest {
	req := RetrieveRequest{RestoreID: "restore", Namespace: r.res.Namespace, Session: r.session, Caller: r.caller}
	for ci, c := range cs {
		for gi := range r.res.Groups {
			key := dcp.Key{NS: r.res.Namespace, Chunk: c.hash, Shard: uint16(r.res.ReadShard(gi, tp)), Group: uint16(gi)}
			req.Items = append(req.Items, wire.RetrieveItem{Chunk: ci, Group: gi, Key: key, Blocks: targets[ci][gi]})
		}
	}
	return req
}

// check compares every byte of every pool with the expected image: the
// declared bytes of every page written or restored, and the sentinel
// everywhere else (padding included).
func (r *rig) check(what string) {
	r.t.Helper()
	if err := r.stream.Synchronize(testCtx(r.t)); err != nil {
		r.t.Fatalf("%s: engine stream: %v", what, err)
	}
	for gi, layers := range r.pools {
		if r.image[gi] == nil {
			continue
		}
		g := r.res.Geometry[gi]
		for li, m := range layers {
			got := make([]byte, m.Size())
			if err := r.dev.Read(m, 0, got); err != nil {
				r.t.Fatal(err)
			}
			want := r.image[gi][li]
			if bytes.Equal(got, want) {
				continue
			}
			for i := range got {
				if got[i] != want[i] {
					where := "page"
					if uint64(i)%g.StrideBytes >= g.PageBytes {
						where = "padding"
					}
					r.t.Fatalf("%s: group %d layer %d: byte %d (block %d, %s offset %d) = %#02x, want %#02x",
						what, gi, li, i, uint64(i)/g.StrideBytes, where, uint64(i)%g.StrideBytes, got[i], want[i])
				}
			}
		}
	}
}

// engineConfig returns a config for TP rank tp of tpSize on dev.
func engineConfig(t testing.TB, dev cuda.Device, tp, tpSize int) Config {
	cfg := DefaultConfig()
	cfg.Rank = wire.Rank{Instance: "test", TPRank: tp}
	cfg.TPSize = tpSize
	cfg.Device = dev
	cfg.L1Bytes = 64 << 20
	cfg.L1SlabBytes = 64 << 10
	// Bounds for a loaded 2-core machine under -race: a CI run at a load
	// of ~15 saw a 72 MiB restore from L2 (every byte read, hashed and
	// copied on the CPU) pass 60 s (TestStoresThrottleOnFullL1).
	cfg.StoreTimeout = 150 * time.Second
	cfg.RetrieveTimeout = 150 * time.Second
	if tt, ok := t.(*testing.T); ok && os.Getenv("KVTIER_TEST_LOG") != "" {
		cfg.Logger = zaptest.NewLogger(tt, zaptest.Level(zap.DebugLevel))
	} else if ok {
		cfg.Logger = zaptest.NewLogger(tt, zaptest.Level(zap.WarnLevel))
	}
	cfg.Registerer = prometheus.NewRegistry()
	return cfg
}

func newRegistry() *prometheus.Registry { return prometheus.NewRegistry() }

func newEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	e, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if err := e.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	// Most tests look at the inventory right after a restart: wait for the
	// background rescan (TestStartServesBeforeRescan does not).
	if err := e.WaitRescan(testCtx(t)); err != nil {
		t.Fatalf("L2 rescan: %v", err)
	}
	return e
}

func closeEngine(t testing.TB, e *Engine) {
	t.Helper()
	if err := e.Close(testCtx(t)); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

// storeAll stores chunks in one request and waits for the result.
func storeAll(t testing.TB, e *Engine, r *rig, reqID string, cs ...chunk) StoreResult {
	t.Helper()
	for _, c := range cs {
		r.write(c, c.blocks, 0)
	}
	_, h := r.record()
	f, err := e.Store(testCtx(t), r.storeReq(reqID, h, cs...))
	if err != nil {
		t.Fatalf("Store: %v", err)
	}
	res, err := f.Wait(testCtx(t))
	if err != nil {
		t.Fatalf("store result: %v", err)
	}
	return res
}

// shareMember is an engine of TP rank 0 of instance inst on dev, its
// config edited by edit, with a registered rig of c1Spec and 16 blocks:
// one member of a share group in the share tests.
func shareMember(t testing.TB, dev cuda.Device, inst string, edit func(*Config)) (*Engine, *rig) {
	t.Helper()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.Rank.Instance = inst
	edit(&cfg)
	e := newEngine(t, cfg)
	r := newRig(t, dev, c1Spec(), []int64{16})
	r.register(e)
	return e, r
}

// restoreAll retrieves cs into targets and checks every byte.
func restoreAll(t testing.TB, e *Engine, r *rig, what string, cs []chunk, tgts [][][]int64) RetrieveResult {
	t.Helper()
	return restoreWith(t, e, r, what, r.retrieveReq(0, cs, tgts), cs, tgts)
}

// restoreWith is restoreAll with req, a request of cs into tgts.
func restoreWith(t testing.TB, e *Engine, r *rig, what string, req RetrieveRequest, cs []chunk, tgts [][][]int64) RetrieveResult {
	t.Helper()
	rr, err := e.Retrieve(testCtx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	for i := range cs {
		if !rr.ChunkOK(i) {
			t.Fatalf("%s: chunk %d of %d: %+v", what, i, len(cs), rr.Items[i])
		}
		r.expectRestored(cs[i], tgts[i])
	}
	r.check(what)
	return rr
}

// gatherer is e's test registry, for testutil.Metric.
func gatherer(t testing.TB, e *Engine) prometheus.Gatherer {
	t.Helper()
	reg, ok := e.cfg.Registerer.(prometheus.Gatherer)
	if !ok {
		t.Fatal("engine has no test registry")
	}
	return reg
}
