package coordinator

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// TestZeroSumRejectedAtIngest (issue 11.8): a Stored event with sum 0 is
// refused with bad_request naming the event, and nothing of its batch is
// applied. On f044f94 it was acknowledged.
func TestZeroSumRejectedAtIngest(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	chunks := chain(ns, 3, 1)
	b := storeBatch(r, 1, 0, ns, chunks, wire.L1)
	b.Events[1].Sum = 0
	ack, werr := sendBatch(t, nc, c.subj, b)
	if werr == nil || werr.Code != wire.CodeBadRequest {
		t.Fatalf("batch with a zero sum: ack %+v err %v, want bad_request", ack, werr)
	}
	want := "batch from eng/0 incarnation 1: event 1 (seq 2) stores " + b.Events[1].Key.String() + " in L1 with sum 0: every stored object has a nonzero kvsum64: wire: malformed message"
	if werr.Message != want {
		t.Fatalf("message %q\nwant    %q", werr.Message, want)
	}
	if _, known := c.idx.Rank(r); known {
		t.Fatal("the rank of a refused batch is in the index")
	}
	if p, _ := c.lookup("eng", ns, chunks); p.Prefix != 0 {
		t.Fatalf("prefix %d after a refused batch", p.Prefix)
	}
	// The same batch with the sum set is applied.
	b.Events[1].Sum = sumOf(b.Events[1].Key)
	if ack, werr := sendBatch(t, nc, c.subj, b); werr != nil || ack.AppliedThrough != 3 {
		t.Fatalf("fixed batch: %+v %v", ack, werr)
	}
}

// TestZeroSumInventoryRefused (issue 11.8): an inventory listing an object
// with sum 0 is refused whole (the index's rule, index.ErrZeroSum), with
// the message the coordinator gave when it checked the rule itself; the
// rank keeps the placements it had.
func TestZeroSumInventoryRefused(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	b := storeBatch(r, 1, 0, ns, chain(ns, 3, 1), wire.L1)
	if ack, werr := sendBatch(t, nc, c.subj, b); werr != nil || ack.AppliedThrough != 3 {
		t.Fatalf("batch: %+v %v", ack, werr)
	}
	before, err := c.idx.ListRank(r)
	if err != nil {
		t.Fatal(err)
	}
	inv := inventoryOf(r, 1, 5, b.Events)
	inv.Objects[1].Sum = 0
	rankNC := connect(t, c)
	srv := newInventoryServer(2)
	sub, err := rankNC.Subscribe(c.subj.Inventory(r), func(m *nats.Msg) { srv.serve(m, func() wire.Inventory { return inv }) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := rankNC.Flush(); err != nil { // the subscription is in place before the request
		t.Fatal(err)
	}
	done, err := c.resyncOnce(tctx(t), r)
	want := "inventory of eng/0 incarnation 1: object 1 (" + b.Events[1].Key.String() +
		", L1) has sum 0: every stored object has a nonzero kvsum64: wire: malformed message"
	if done || err == nil || err.Error() != want || !errors.Is(err, wire.ErrMalformed) || !errors.Is(err, index.ErrZeroSum) {
		t.Fatalf("inventory with a zero sum: done %v err %v\nwant not done, %q", done, err, want)
	}
	after, err := c.idx.ListRank(r)
	if err != nil {
		t.Fatal(err)
	}
	if after.LastSeq != before.LastSeq || len(after.Placements) != len(before.Placements) {
		t.Fatalf("refused inventory changed the rank: %+v -> %+v", before, after)
	}
}

// TestZeroSumNeverPlanned: a placement recorded with sum 0 (written by an
// older coordinator) ends the plan's prefix before its chunk: no rank is
// ever handed a sum it cannot check.
func TestZeroSumNeverPlanned(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	chunks := chain(ns, 4, 1)
	b := storeBatch(r, 1, 0, ns, chunks, wire.L1)
	b.Events[2].Sum = 0
	// Straight into the index, as an older coordinator would have: the
	// index refuses sum 0 now (index.ErrZeroSum), its test seam writes
	// what it once accepted.
	if _, err := index.ApplyLegacyBatchForTest(tctx(t), c.idx, *b); err != nil {
		t.Fatal(err)
	}
	plan := call[wire.RestorePlan](t, nc, c.subj.Coord(wire.CoordRestoreBegin), wire.RestoreBegin{Namespace: ns, Chunks: chunks})
	if plan.Prefix != 2 || len(plan.Ranks["eng/0"]) != 2 {
		t.Fatalf("plan over a zero sum: prefix %d, %d items; want 2 and 2", plan.Prefix, len(plan.Ranks["eng/0"]))
	}
	for _, it := range plan.Ranks["eng/0"] {
		if it.Sum == 0 {
			t.Fatalf("plan hands out sum 0: %+v", it)
		}
	}
	if !strings.Contains(plan.Reason, "chunk 2") {
		t.Fatalf("plan reason %q does not name chunk 2", plan.Reason)
	}
}
