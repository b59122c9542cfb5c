package rankd

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// TestBlocksFreedFollowsBlocksInUse (C10): a store whose producer is still
// writing past the store timeout is answered blocks_in_use; the rankd then
// publishes BlocksFreed for exactly that store once the device has let go
// of the blocks, and not before.
func TestBlocksFreedFollowsBlocksInUse(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.StoreTimeout = 100 * time.Millisecond })
	e, reg := newStoringEngine(t, h)
	ctx := h.ctx()
	freed, err := h.nc.SubscribeSync(h.subj.Freed(h.rank))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	// The producer's stream is busy for a minute: the store cannot finish.
	s, err := e.dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Delay(time.Minute); err != nil {
		t.Fatal(err)
	}
	evh := recordedEvent(t, e, s)
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	st, err := bus.Call[wire.StoreReply](ctx, h.nc, h.subj.Engine(h.rank, OpStore), wire.StoreRequest{
		RequestID: "slow", Namespace: e.res.Namespace, Session: reg.Session, Event: evh,
		Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{3}}}}})
	if err != nil {
		t.Fatal(err)
	}
	if !st.BlocksInUse || len(st.Failed) != 1 {
		t.Fatalf("store of a producer still writing: %+v, want blocks_in_use and one failed object", st)
	}
	// The device still waits on the producer: nothing may say "free".
	if m, err := freed.NextMsg(50 * time.Millisecond); err == nil {
		t.Fatalf("blocks announced free while the device still waits to read them: %s", m.Data)
	}
	// The producer finishes (closing its stream ends the delay).
	_ = s.Close()
	m, err := freed.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatalf("no BlocksFreed after the device let go of the blocks: %v", err)
	}
	var bf wire.BlocksFreed
	if err := json.Unmarshal(m.Data, &bf); err != nil {
		t.Fatal(err)
	}
	if bf.Rank != h.rank || bf.RequestID != "slow" || bf.Namespace != e.res.Namespace || len(bf.Chunks) != 1 || bf.Chunks[0] != chunk {
		t.Fatalf("BlocksFreed %+v does not name the store (rank %s, request slow, chunk %s)", bf, h.rank, chunk)
	}
}
