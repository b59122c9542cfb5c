package rankd

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestReportRetriesOnTheCurrentConnection: a report whose first attempts
// are refused (unavailable) keeps retrying, and once the daemon has moved
// to another NATS URL (switchNATS: another coordinator's NATS) the next
// attempt goes out on the new connection and is delivered there. Seen
// failing when report took the connection once at its start: every retry
// went to the closed old connection until ReportTimeout, the new NATS
// got no report and the report was counted failed.
func TestReportRetriesOnTheCurrentConnection(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.ReportTimeout = 5 * time.Second })
	srvB := testutil.NATS(t)
	ncB, err := bus.Connect(srvB.ClientURL(), "test-b")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ncB.Close)
	got := make(chan wire.RestoreReport, 4)
	if _, err := ncB.Subscribe(h.subj.Report(h.rank), func(m *nats.Msg) {
		var r wire.RestoreReport
		if err := bus.Decode(m, &r); err != nil {
			_ = bus.RespondError(m, wire.CodeBadRequest, err.Error())
			return
		}
		got <- r
		_ = bus.Respond(m, &wire.ReportAck{State: wire.VerdictPending})
	}); err != nil {
		t.Fatal(err)
	}
	if err := ncB.Flush(); err != nil {
		t.Fatal(err)
	}

	h.mu.Lock()
	h.refuseReports = true
	h.mu.Unlock()
	results := []wire.ItemResult{{Chunk: 0, Group: 0, OK: true, Sum: 0x5eed}, {Chunk: 1, Group: 0, Reason: "test: lost"}}
	done := make(chan struct{})
	go func() { defer close(done); h.d.report("R-switch", results) }()

	// Wait for the old NATS to have refused at least one attempt, so the
	// report is mid-retry when the daemon switches.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		h.mu.Lock()
		n := h.refused
		h.mu.Unlock()
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the report never reached the first NATS")
		}
	}
	h.d.switchNATS(srvB.ClientURL())
	<-done

	select {
	case r := <-got:
		if r.RestoreID != "R-switch" || r.Rank != h.rank || len(r.Results) != 2 ||
			r.Results[0] != results[0] || r.Results[1] != results[1] {
			t.Fatalf("report on the new NATS %+v, want restore R-switch of %v with %+v", r, h.rank, results)
		}
	default:
		t.Fatal("the report never reached the new NATS: it retried on the old connection")
	}
	if len(got) != 0 {
		t.Fatalf("%d more reports on the new NATS, want exactly one", len(got))
	}
	const reports = "kvtier_rankd_restore_reports_total"
	if ok, all := testutil.Metric(t, h.d.met.reg, reports, "result", "ok"), testutil.MetricSum(t, h.d.met.reg, reports); ok != 1 || all != 1 {
		t.Fatalf("%s ok=%v, all results=%v, want 1 and 1 (none failed)", reports, ok, all)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.reports) != 0 {
		t.Fatalf("the old NATS took %d reports while refusing, want 0", len(h.reports))
	}
}
