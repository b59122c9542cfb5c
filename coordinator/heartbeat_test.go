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

// Events handed to the index but still committing are not lost: on a
// loaded host a commit can outlast a heartbeat interval (issue 31: every
// rank of a busy machine was resynced, TestNATSClusterSurvivesServerKill
// failed at a load of 16). Here the index has events through 4 while
// events through 6 were received and are committing: two heartbeats at 6
// resync nothing; a heartbeat of another incarnation does not count them.
func TestHeartbeatCountsEventsStillCommitting(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	r := wire.Rank{Instance: "eng", TPRank: 1}
	all := storeBatch(r, 3, 0, ns, chain(ns, 6, 5), wire.L1)
	first := *all
	first.Events = all.Events[:4]
	if ack, werr := sendBatch(t, nc, c.subj, &first); werr != nil || ack.AppliedThrough != 4 {
		t.Fatalf("batch: %+v %v", ack, werr)
	}
	requests := serveInventory(t, c, r, inventoryOf(r, 3, 6, all.Events))
	c.hb.noteReceived(r, 3, 6) // events 5 and 6 handed to the index, not committed yet
	beat := func(inc, seq uint64) {
		t.Helper()
		p, _ := json.Marshal(wire.Heartbeat{Rank: r, Incarnation: inc, Seq: seq})
		if err := nc.Publish(c.subj.Heartbeat(r), p); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	beat(3, 6)
	beat(3, 6)
	time.Sleep(100 * time.Millisecond) // nothing to wait for: prove nothing happens
	if requests.Load() != 0 || testutil.Metric(t, c.reg, "kvtier_coord_heartbeat_gaps_total") != 0 {
		t.Fatalf("events still committing were taken for lost (%d inventory requests)", requests.Load())
	}
	// What is remembered of incarnation 3 says nothing of incarnation 2.
	c.hb.noteReceived(r, 2, 9)
	c.hb.mu.Lock()
	got := c.hb.received[r]
	c.hb.mu.Unlock()
	if got != (receivedSeq{2, 9}) {
		t.Fatalf("received after another incarnation: %+v, want {2 9}", got)
	}
}
