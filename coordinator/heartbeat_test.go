package coordinator

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// An idle rank whose last events were lost is resynced from its heartbeat;
// a rank whose index is current is left alone.
func TestHeartbeatExposesLostEvents(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	r := wire.Rank{Instance: "eng", TPRank: 1}
	chunks := chain(ns, 6, 5)
	all := storeBatch(r, 3, 0, ns, chunks, wire.L1)
	first := *all
	first.Events = all.Events[:4]
	if ack, werr := sendBatch(t, nc, c.subj, &first); werr != nil || ack.AppliedThrough != 4 {
		t.Fatalf("batch: %+v %v", ack, werr)
	}
	requests := serveInventory(t, c, r, inventoryOf(r, 3, 6, all.Events))
	beat := func(seq uint64) {
		t.Helper()
		p, _ := json.Marshal(wire.Heartbeat{Rank: r, Incarnation: 3, Seq: seq})
		if err := nc.Publish(c.subj.Heartbeat(r), p); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	// Current index: two heartbeats at seq 4 change nothing.
	beat(4)
	beat(4)
	time.Sleep(100 * time.Millisecond) // nothing to wait for: prove nothing happens
	if requests.Load() != 0 || testutil.Metric(t, c.reg, "kvtier_coord_heartbeat_gaps_total") != 0 {
		t.Fatalf("a current rank was resynced (%d requests)", requests.Load())
	}
	// Events 5 and 6 are lost: the first heartbeat at 6 may race them, the
	// second proves them lost.
	beat(6)
	beat(6)
	testutil.Eventually(t, 5*time.Second, "the resync after the heartbeat", func() bool {
		info, err := c.idx.ListRank(r)
		return err == nil && info.LastSeq == 6 && len(info.Placements) == 6
	})
	if requests.Load() < 1 || testutil.Metric(t, c.reg, "kvtier_coord_heartbeat_gaps_total") < 1 {
		t.Fatalf("requests %d, heartbeat gaps %v", requests.Load(), testutil.Metric(t, c.reg, "kvtier_coord_heartbeat_gaps_total"))
	}
	mustVerify(t, c)
}
