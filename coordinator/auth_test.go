package coordinator

import (
	"encoding/hex"
	"encoding/json"
	"testing"
	"time"

	"github.com/kvtier/kvtier/wire"
)

// The NATS permissions decide who may publish on a scoped subject; these
// tests check the coordinator's half of C9: a body naming another rank or
// instance than its subject is refused, counted by subject kind, and a
// forged report cannot move the verdict. (Insecure mode, so the test can
// publish anywhere; auth/ and e2e/ test the permissions.)
func TestScopedSubjectsRefuseOtherIdentities(t *testing.T) {
	f := newRestoreFixture(t, 3)
	c, nc := f.c, f.nc
	plan := call[wire.RestorePlan](t, nc, c.subj.EngineCoord("eng", wire.CoordRestoreBegin),
		wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks})
	if plan.Prefix != 3 || len(plan.Ranks) != 2 {
		t.Fatalf("plan = %+v", plan)
	}
	if id, err := hex.DecodeString(plan.RestoreID); err != nil || len(id) != 16 {
		t.Fatalf("restore id %q is not 128 random bits in hex", plan.RestoreID)
	}
	r0, r1 := wire.Rank{Instance: "eng", TPRank: 0}, wire.Rank{Instance: "eng", TPRank: 1}
	// Rank 0 (on its own subject) forges rank 1's report with the planned
	// sums, and its own: without the check that gives COMPLETE.
	forged := wire.RestoreReport{RestoreID: plan.RestoreID, Rank: r1, Results: results(plan.Ranks[r1.String()])}
	callErr[wire.ReportAck](t, nc, c.subj.Report(r0), forged, wire.CodeUnauthorized)
	ack := call[wire.ReportAck](t, nc, c.subj.Report(r0),
		wire.RestoreReport{RestoreID: plan.RestoreID, Rank: r0, Results: results(plan.Ranks[r0.String()])})
	if ack.State != wire.VerdictPending {
		t.Fatalf("after rank 0's own report and a forged rank 1 report: state %s, want pending", ack.State)
	}
	// Engine instance "other" asks about, and waits on, instance eng.
	callErr[wire.LookupReply](t, nc, c.subj.EngineCoord("other", wire.CoordLookup),
		wire.LookupRequest{Namespace: f.ns, Chunks: f.chunks, Instance: "eng"}, wire.CodeUnauthorized)
	callErr[wire.RestorePlan](t, nc, c.subj.EngineCoord("other", wire.CoordRestoreBegin),
		wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks}, Instance: "eng"}, wire.CodeUnauthorized)
	callErr[wire.RestoreVerdict](t, nc, c.subj.EngineCoord("other", wire.CoordRestoreWait),
		wire.RestoreWait{RestoreID: plan.RestoreID}, wire.CodeUnauthorized)
	// A scoped lookup without an instance is the caller's own: instance
	// "other" has no ranks, so nothing is restorable for it.
	lr := call[wire.LookupReply](t, nc, c.subj.EngineCoord("other", wire.CoordLookup),
		wire.LookupRequest{Namespace: f.ns, Chunks: f.chunks, Detail: true})
	if lr.Prefix != 0 {
		t.Fatalf("lookup scoped to instance other = %+v, want prefix 0", lr)
	}
	// Lookup detail gives no checksums (admin.object does).
	lr = call[wire.LookupReply](t, nc, c.subj.EngineCoord("eng", wire.CoordLookup),
		wire.LookupRequest{Namespace: f.ns, Chunks: f.chunks, Detail: true})
	if lr.Prefix != 3 || len(lr.Sources) == 0 {
		t.Fatalf("lookup = %+v", lr)
	}
	for _, s := range lr.Sources {
		for _, p := range s.Placements {
			if p.Sum != 0 {
				t.Fatalf("lookup detail hands out sum %x of %s", p.Sum, s.Key)
			}
		}
	}
	// A heartbeat naming rank 1 on rank 0's subject is refused.
	hb, _ := json.Marshal(wire.Heartbeat{Rank: r1, Incarnation: 1, Seq: 99})
	if err := nc.Publish(c.subj.Heartbeat(r0), hb); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the forged heartbeat to be refused", func() bool {
		return metric(t, c, "kvtier_coord_unauthorized_total", "subject", "heartbeat") == 1
	})
	for kind, want := range map[string]float64{"report": 1, "lookup": 1, "restore_begin": 1, "restore_wait": 1} {
		if got := metric(t, c, "kvtier_coord_unauthorized_total", "subject", kind); got != want {
			t.Errorf("unauthorized %s = %v, want %v", kind, got, want)
		}
	}
	// The real rank 1 completes it.
	ack = call[wire.ReportAck](t, nc, c.subj.Report(r1),
		wire.RestoreReport{RestoreID: plan.RestoreID, Rank: r1, Results: results(plan.Ranks[r1.String()])})
	if ack.State != wire.VerdictComplete {
		t.Fatalf("after both real reports: %s", ack.State)
	}
}
