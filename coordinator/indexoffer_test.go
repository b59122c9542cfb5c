package coordinator

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestIndexOfferResyncsUnknownRank (issue 29.2): a rank this new index was
// never told about (the coordinator's startup ask missed it: it sends no
// events) offers its inventory in a heartbeat naming the index id it saw
// in the signed gossip; the coordinator resyncs it and the rank's
// placements reach the index. An offer for another index id is ignored
// and counted. Red without the coordinator's offer handling: the heartbeat
// of an unknown rank started nothing (unknown_rank_heartbeat).
func TestIndexOfferResyncsUnknownRank(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	r := wire.Rank{Instance: "eng", TPRank: 1}
	all := storeBatch(r, 3, 0, ns, chain(ns, 6, 5), wire.L1)
	requests := serveInventory(t, c, r, inventoryOf(r, 3, 6, all.Events))
	beat := func(offer string) {
		t.Helper()
		p, _ := json.Marshal(wire.Heartbeat{Rank: r, Incarnation: 3, Seq: 6, OfferIndex: offer})
		if err := nc.Publish(c.subj.Heartbeat(r), p); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	// An offer to another index (another coordinator's, or a replayed old
	// id) asks nothing.
	beat("0123456789abcdef0123456789abcdef")
	testutil.Eventually(t, 5*time.Second, "the other index's offer counted", func() bool {
		return testutil.Metric(t, c.reg, "kvtier_coord_index_offers_total", "outcome", "other_index") == 1
	})
	if requests.Load() != 0 {
		t.Fatalf("an offer to another index asked for the inventory (%d requests)", requests.Load())
	}
	if _, known := c.idx.Rank(r); known {
		t.Fatal("the rank is in the index before its offer")
	}
	beat(c.idx.ID())
	testutil.Eventually(t, 5*time.Second, "the offered inventory in the index", func() bool {
		info, err := c.idx.ListRank(r)
		return err == nil && info.LastSeq == 6 && len(info.Placements) == 6
	})
	if requests.Load() < 1 || testutil.Metric(t, c.reg, "kvtier_coord_index_offers_total", "outcome", "resync") < 1 {
		t.Fatalf("requests %d, offers %v", requests.Load(), testutil.Metric(t, c.reg, "kvtier_coord_index_offers_total", "outcome", "resync"))
	}
	mustVerify(t, c)
}
