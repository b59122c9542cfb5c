package rankd

import (
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// An inventory larger than one page is served in pages of one snapshot
// that reassemble to exactly the engine's inventory; unknown snapshots get
// not_found and bad pages bad_request.
func TestInventoryPaged(t *testing.T) {
	h := newHarness(t)
	e, reg := newStoringEngine(t, h)
	ctx := h.ctx()
	s := e.stream(t)
	evh := recordedEvent(t, e, s)
	const chunks = 12
	req := wire.StoreRequest{RequestID: "r", Namespace: e.res.Namespace, Session: reg.Session, Event: evh}
	for i, ch := range dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16*chunks), 16) {
		req.Chunks = append(req.Chunks, wire.ChunkBlocks{Chunk: ch, Blocks: [][]int64{{int64(i % blocks)}}})
	}
	st, err := bus.Call[wire.StoreReply](ctx, h.nc, h.subj.Engine(h.rank, OpStore), req)
	if err != nil || st.Stored != chunks {
		t.Fatalf("store of %d chunks: %+v %v", chunks, st, err)
	}

	// Fetch page by page until the snapshot matches the engine's state
	// (L2 write-through may still be adding placements).
	const pageSize = 5
	var got *wire.Inventory
	var want wire.Inventory
	deadline := time.Now().Add(10 * time.Second)
	for {
		if got, err = bus.FetchInventory(ctx, h.nc, h.subj.Inventory(h.rank), pageSize, time.Second); err != nil {
			t.Fatal(err)
		}
		want = h.d.eng.Inventory()
		if got.Seq == want.Seq && len(want.Objects) >= 2*chunks {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("inventory never settled: snapshot seq %d, engine seq %d with %d objects", got.Seq, want.Seq, len(want.Objects))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got.Rank != want.Rank || got.Incarnation != want.Incarnation || !slices.Equal(got.Objects, want.Objects) {
		t.Fatalf("paged inventory %+v\ndiffers from the engine's %+v", got, want)
	}

	// The pages themselves: page 0 starts a snapshot of several pages.
	first, err := bus.Call[wire.InventoryPage](ctx, h.nc, h.subj.Inventory(h.rank), wire.InventoryRequest{PageSize: pageSize})
	if err != nil {
		t.Fatal(err)
	}
	if wantPages := (len(want.Objects) + pageSize - 1) / pageSize; first.Pages != wantPages || len(first.Objects) != pageSize || first.Snapshot == "" {
		t.Fatalf("page 0: %d pages of %d objects, snapshot %q; want %d pages of %d", first.Pages, len(first.Objects), first.Snapshot, wantPages, pageSize)
	}
	last, err := bus.Call[wire.InventoryPage](ctx, h.nc, h.subj.Inventory(h.rank), wire.InventoryRequest{Snapshot: first.Snapshot, Page: first.Pages - 1})
	if err != nil || last.Snapshot != first.Snapshot || last.Seq != first.Seq || len(last.Objects) == 0 || len(last.Objects) > pageSize {
		t.Fatalf("last page: %+v %v", last, err)
	}

	// The last page in binary is the JSON page's binary encoding, byte for
	// byte.
	data, _ := json.Marshal(wire.InventoryRequest{Snapshot: first.Snapshot, Page: first.Pages - 1, Encoding: wire.InventoryEncodingBinary})
	msg, err := h.nc.RequestWithContext(ctx, h.subj.Inventory(h.rank), data)
	if err != nil {
		t.Fatal(err)
	}
	if wantBin, _ := last.MarshalBinary(); string(msg.Data) != string(wantBin) {
		t.Fatalf("binary last page %x\nwant %x", msg.Data, wantBin)
	}

	var we *wire.Error
	for _, c := range []struct {
		req  wire.InventoryRequest
		code string
	}{
		{wire.InventoryRequest{Snapshot: "nope", Page: 1}, wire.CodeNotFound},
		{wire.InventoryRequest{Snapshot: first.Snapshot, Page: first.Pages}, wire.CodeBadRequest},
		{wire.InventoryRequest{Snapshot: first.Snapshot, Page: 1, PageSize: pageSize + 1}, wire.CodeBadRequest},
		{wire.InventoryRequest{Page: -1}, wire.CodeBadRequest},
		{wire.InventoryRequest{PageSize: wire.MaxInventoryPageSize + 1}, wire.CodeBadRequest},
		{wire.InventoryRequest{Snapshot: first.Snapshot, Page: 1, Encoding: "zstd"}, wire.CodeBadRequest},
	} {
		_, err := bus.Call[wire.InventoryPage](ctx, h.nc, h.subj.Inventory(h.rank), c.req)
		if !errors.As(err, &we) || we.Code != c.code {
			t.Errorf("request %+v: %v, want code %s", c.req, err, c.code)
		}
	}
}

// Snapshots expire after the TTL and the oldest is evicted beyond the
// limit.
func TestInventorySnapshotsExpireAndEvict(t *testing.T) {
	now := time.Unix(1000, 0)
	s := newSnapshots(30*time.Second, 2)
	s.now = func() time.Time { return now }
	inv := wire.Inventory{Objects: make([]wire.Placement, 3)}
	var ids []string
	for range 3 {
		pages, err := s.put(&inv, 2)
		if err != nil || len(pages) != 2 {
			t.Fatalf("put: %d pages, %v", len(pages), err)
		}
		ids = append(ids, pages[0].Snapshot)
	}
	if _, _, err := s.get(ids[0]); !errors.Is(err, ErrNotFound) || Code(err) != wire.CodeNotFound {
		t.Fatalf("evicted snapshot: %v", err)
	}
	if _, size, err := s.get(ids[2]); err != nil || size != 2 {
		t.Fatalf("newest snapshot: size %d, %v", size, err)
	}
	now = now.Add(31 * time.Second)
	if _, _, err := s.get(ids[2]); !errors.Is(err, ErrNotFound) {
		t.Fatalf("expired snapshot: %v", err)
	}
}
