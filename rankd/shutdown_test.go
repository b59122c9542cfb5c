package rankd

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// TestShutdownFlushesWriteBack (issue 18.2): under write-back, a graceful
// shutdown (what SIGTERM does) writes every object only L1 holds to L2
// before the rankd leaves; after a restart every chunk restores from L2,
// byte-exact, and nothing is counted unflushed.
func TestShutdownFlushesWriteBack(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.L2Policy = transfer.WriteBackOnEvict })
	e, reg := newStoringEngine(t, h)
	ctx := h.ctx()
	const n = 4
	s := e.stream(t)
	var chunks []dcp.ChunkHash
	for c := range n {
		for l, m := range e.pools {
			if err := e.dev.Write(m, uint64(c)*e.g.StrideBytes, pageOf(l, int64(c), e.g.PageBytes)); err != nil {
				t.Fatal(err)
			}
		}
		evh := recordedEvent(t, e, s)
		toks := make([]uint32, 16)
		toks[0] = uint32(c + 1)
		ch := dcp.ChunkHashes(e.res.Namespace, toks, 16)[0]
		chunks = append(chunks, ch)
		st, err := bus.Call[wire.StoreReply](ctx, h.nc, h.subj.Engine(h.rank, OpStore), wire.StoreRequest{
			RequestID: fmt.Sprint("p", c), Namespace: e.res.Namespace, Session: reg.Session, Event: evh,
			Chunks: []wire.ChunkBlocks{{Chunk: ch, Blocks: [][]int64{{int64(c)}}}}})
		if err != nil || st.Stored != 1 {
			t.Fatalf("store %d: %+v %v", c, st, err)
		}
	}
	if st := h.d.Engine().Stats(); st.L2Objects != 0 {
		t.Fatalf("%d objects in L2 before the shutdown; write-back writes on eviction only", st.L2Objects)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.d.Shutdown(sctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if st := h.d.Engine().Stats(); st.LostObjects != 0 || st.L2Objects != n {
		t.Fatalf("after shutdown: %d lost, %d in L2; want 0 and %d", st.LostObjects, st.L2Objects, n)
	}
	// Every event reached the coordinator before the rankd left, those of
	// the L2 writes the engine's Close made included: 1..LastSeq in order
	// (a batch sent again after a lost reply repeats a few), n L2 stores.
	h.mu.Lock()
	evs := slices.Clone(h.events)
	h.mu.Unlock()
	next, l2 := uint64(1), 0
	for _, ev := range evs {
		if ev.Seq < next {
			continue
		}
		if ev.Seq != next {
			t.Fatalf("event %d reached the coordinator after %d", ev.Seq, next-1)
		}
		next++
		if ev.Kind == wire.Stored && ev.Tier == wire.L2 {
			l2++
		}
	}
	if last := h.d.Engine().Stats().LastSeq; next-1 != last || l2 != n {
		t.Fatalf("the coordinator got events 1..%d with %d L2 stores; the engine emitted 1..%d, want %d L2 stores", next-1, l2, last, n)
	}

	// Restart on the same L2: every chunk restores from L2.
	d2, err := New(h.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Shutdown(context.Background()) })
	if err := d2.Start(ctx); err != nil {
		t.Fatal(err)
	}
	reg, err = bus.Call[wire.RegisterReply](ctx, h.nc, h.subj.Engine(h.rank, OpRegister), e.registerReq(t))
	if err != nil {
		t.Fatal(err)
	}
	var items []wire.RetrieveItem
	for c, ch := range chunks {
		items = append(items, wire.RetrieveItem{Chunk: c, Group: 0, Key: dcp.Key{NS: e.res.Namespace, Chunk: ch, Shard: 1},
			Blocks: []int64{int64(n + c)}})
	}
	rr, err := bus.Call[wire.RetrieveReply](ctx, h.nc, h.subj.Engine(h.rank, OpRetrieve), wire.RetrieveRequest{
		Namespace: e.res.Namespace, Session: reg.Session, Items: items})
	if err != nil {
		t.Fatal(err)
	}
	for c := range n {
		if !rr.Results[c].OK {
			t.Fatalf("chunk %d after the restart: %+v", c, rr.Results[c])
		}
		var want []byte
		for l, m := range e.pools {
			page := make([]byte, e.g.PageBytes)
			if err := e.dev.Read(m, uint64(n+c)*e.g.StrideBytes, page); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(page, pageOf(l, int64(c), e.g.PageBytes)) {
				t.Fatalf("chunk %d layer %d restored into block %d differs", c, l, n+c)
			}
			want = append(want, page...)
		}
		if rr.Results[c].Sum != checksum.Sum(want) {
			t.Fatalf("chunk %d: sum %016x, want %016x", c, rr.Results[c].Sum, checksum.Sum(want))
		}
	}
}

// TestShutdownCountsUnflushed: under write-back with the L2 directory
// gone, the shutdown cannot flush; it still ends, and every object only
// L1 held is counted lost (kvtier_transfer_lost_objects_total).
func TestShutdownCountsUnflushed(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.L2Policy = transfer.WriteBackOnEvict; c.FlushTimeout = 5 * time.Second })
	e, reg := newStoringEngine(t, h)
	ctx := h.ctx()
	s := e.stream(t)
	for c := range 2 {
		ev, _ := e.dev.NewEvent(true)
		defer ev.Release()
		if err := s.Record(ev); err != nil {
			t.Fatal(err)
		}
		evh, _ := e.dev.ExportEvent(ev)
		toks := make([]uint32, 16)
		toks[0] = uint32(c + 1)
		ch := dcp.ChunkHashes(e.res.Namespace, toks, 16)[0]
		if st, err := bus.Call[wire.StoreReply](ctx, h.nc, h.subj.Engine(h.rank, OpStore), wire.StoreRequest{
			RequestID: "u", Namespace: e.res.Namespace, Session: reg.Session, Event: evh,
			Chunks: []wire.ChunkBlocks{{Chunk: ch, Blocks: [][]int64{{int64(c)}}}}}); err != nil || st.Stored != 1 {
			t.Fatalf("store %d: %+v %v", c, st, err)
		}
	}
	if err := os.RemoveAll(h.cfg.L2Dir); err != nil {
		t.Fatal(err)
	}
	err := h.d.Shutdown(context.Background())
	if err == nil {
		t.Fatal("Shutdown that lost objects reported success")
	}
	if st := h.d.Engine().Stats(); st.LostObjects != 2 {
		t.Fatalf("%d objects counted lost, want 2", st.LostObjects)
	}
}
