package coordinator

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// TestResyncStreamsPages: a resync hands the inventory to the index one
// page at a time, never more (issue 28.3: an inventory of 16 Mi objects
// cost ~2.4 GB while applied whole), and the result is exactly the
// inventory: the rank's placements it does not name are gone, every one
// it names is there. The rank holds 40 L1 placements; its inventory (7
// pages of at most 16) lists 10 of them again and 101 L2 objects. Seen red
// with bus.StreamInventory handing over the pages assembled (one step of
// 111 objects).
func TestResyncStreamsPages(t *testing.T) {
	c := startCoord(t, nil)
	var mu sync.Mutex
	var steps []int
	c.testInvStep = func(n int) {
		mu.Lock()
		steps = append(steps, n)
		mu.Unlock()
	}
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	old := chain(ns, 40, 1)
	if ack, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 0, ns, old, wire.L1)); werr != nil || ack.AppliedThrough != 40 {
		t.Fatalf("fill: %+v %v", ack, werr)
	}
	events := storeBatch(r, 1, 0, ns, old[:10], wire.L1).Events
	events = append(events, storeBatch(r, 1, 0, ns, chain(ns, 101, 2), wire.L2).Events...)
	inv := inventoryOf(r, 1, 60, events)
	want := slices.Clone(inv.Objects)
	index.SortPlacements(want)
	const pageSize = 16
	srv := newInventoryServer(pageSize)
	sub, err := connect(t, c).Subscribe(c.subj.Inventory(r), func(m *nats.Msg) {
		srv.serve(m, func() wire.Inventory { return inv })
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	// A gap asks for the inventory.
	if ack, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 50, ns, chain(ns, 1, 3), wire.L1)); werr != nil || !ack.Resync {
		t.Fatalf("gap batch: %+v %v", ack, werr)
	}
	testutil.Eventually(t, 10*time.Second, "the inventory to be applied", func() bool {
		ri, ok := c.idx.Rank(r)
		return ok && ri.LastSeq == 60 && !ri.Partial
	})
	mu.Lock()
	got := slices.Clone(steps)
	mu.Unlock()
	total := 0
	for _, n := range got {
		if n > pageSize {
			t.Fatalf("a step of %d objects (steps %v): the coordinator held more than a page", n, got)
		}
		total += n
	}
	if pages := (len(want) + pageSize - 1) / pageSize; len(got) != pages || total != len(want) {
		t.Fatalf("steps %v: %d steps of %d objects, want %d pages of %d", got, len(got), total, pages, len(want))
	}
	info, err := c.idx.ListRank(r)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(info.Placements, want) {
		t.Fatalf("the rank holds %d placements, want exactly the inventory's %d", len(info.Placements), len(want))
	}
	mustVerify(t, c)
}

// TestResyncAbandonedMidStream: the rank stops answering half way through
// its inventory (it died or restarted: page 2 of its first snapshot
// fails). The attempt is abandoned with two pages applied: until the next
// attempt applies a whole inventory the rank is partial, Get and ListRank
// show none of its placements, old or new, and its batches are refused
// with a resync; the retry then leaves exactly its inventory.
func TestResyncAbandonedMidStream(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	old := chain(ns, 20, 1)
	if ack, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 0, ns, old, wire.L1)); werr != nil || ack.AppliedThrough != 20 {
		t.Fatalf("fill: %+v %v", ack, werr)
	}
	fresh := chain(ns, 30, 2)
	inv := inventoryOf(r, 1, 30, storeBatch(r, 1, 0, ns, fresh, wire.L2).Events)
	want := slices.Clone(inv.Objects)
	index.SortPlacements(want)
	srv := newInventoryServer(4)
	var mu sync.Mutex
	snapshots := 0
	second := make(chan struct{})
	release := make(chan struct{})
	sub, err := connect(t, c).Subscribe(c.subj.Inventory(r), func(m *nats.Msg) {
		req, err := decodeInventoryRequest(m)
		if err != nil {
			t.Error(err)
			return
		}
		mu.Lock()
		if srv.fresh(m) {
			snapshots++
		}
		n := snapshots
		mu.Unlock()
		switch {
		case n == 1 && req.Page == 2:
			_ = bus.RespondError(m, wire.CodeUnavailable, "rank restarting")
			return
		case n == 2 && srv.fresh(m):
			close(second)
			<-release
		}
		srv.serve(m, func() wire.Inventory { return inv })
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	released := false
	t.Cleanup(func() {
		if !released {
			close(release)
		}
	})
	if ack, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 25, ns, chain(ns, 1, 3), wire.L1)); werr != nil || !ack.Resync {
		t.Fatalf("gap batch: %+v %v", ack, werr)
	}
	select {
	case <-second:
	case <-time.After(10 * time.Second):
		t.Fatal("no second attempt")
	}
	ri, _ := c.idx.Rank(r)
	info, err := c.idx.ListRank(r)
	if err != nil || !ri.Partial || len(info.Placements) != 0 || ri.L2Placements != 8 {
		t.Fatalf("between the attempts: %+v, %d placements listed, %v; want partial, none listed, 8 L2 counted (2 pages)",
			ri, len(info.Placements), err)
	}
	for _, ch := range append(slices.Clone(old), fresh...) {
		if hs := c.idx.Get(dcp.Key{NS: ns, Chunk: ch}); len(hs) != 0 {
			t.Fatalf("between the attempts: Get shows %+v", hs)
		}
	}
	if ack, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 30, ns, chain(ns, 1, 4), wire.L1)); werr != nil || !ack.Resync || ack.AppliedThrough != 30 {
		t.Fatalf("batch between the attempts: %+v %v, want refused with a resync", ack, werr)
	}
	close(release)
	released = true
	testutil.Eventually(t, 10*time.Second, "the retry to apply", func() bool {
		ri, _ := c.idx.Rank(r)
		return !ri.Partial && ri.LastSeq == 30
	})
	info, err = c.idx.ListRank(r)
	if err != nil || !slices.Equal(info.Placements, want) {
		t.Fatalf("after the retry: %d placements, want the inventory's %d (%v)", len(info.Placements), len(want), err)
	}
	mustVerify(t, c)
}
