package rankd

import (
	"sync/atomic"
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
		r, err := decodeReport(m)
		if err != nil {
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

// decodeReport decodes a report in either form, as the coordinator does.
func decodeReport(m *nats.Msg) (wire.RestoreReport, error) {
	var r wire.RestoreReport
	if wire.IsBinaryReport(m.Data) {
		return r, r.UnmarshalBinary(m.Data)
	}
	return r, bus.Decode(m, &r)
}

// TestReportFallsBackToJSON: reports go binary; a coordinator that
// refuses the binary form as bad input (one from before it) gets the
// same report as JSON at once, and every later report goes as JSON
// without a binary attempt. A report the coordinator refuses in both
// forms is not retried further.
func TestReportFallsBackToJSON(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.ReportTimeout = 5 * time.Second })
	// The harness's coordinator reads both forms: the first report goes
	// binary and is taken.
	h.d.report("R-bin", []wire.ItemResult{{Chunk: 0, OK: true, Sum: 0x5eed}})
	h.mu.Lock()
	nBin, nRep := h.binaryReports, len(h.reports)
	h.mu.Unlock()
	if nBin != 1 || nRep != 1 {
		t.Fatalf("%d binary of %d reports, want 1 of 1", nBin, nRep)
	}

	// A coordinator that reads the binary form and refuses the report for
	// what it says: not sent again as JSON, and reports stay binary.
	srvN := testutil.NATS(t)
	ncN, err := bus.Connect(srvN.ClientURL(), "test-n")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ncN.Close)
	var refusedBin, refusedOther atomic.Int32
	if _, err := ncN.Subscribe(h.subj.Report(h.rank), func(m *nats.Msg) {
		if wire.IsBinaryReport(m.Data) {
			refusedBin.Add(1)
		} else {
			refusedOther.Add(1)
		}
		_ = bus.RespondError(m, wire.CodeBadRequest, "test: restore R-x is read by another instance")
	}); err != nil {
		t.Fatal(err)
	}
	if err := ncN.Flush(); err != nil {
		t.Fatal(err)
	}
	h.d.switchNATS(srvN.ClientURL())
	h.d.report("R-x", []wire.ItemResult{{Chunk: 0, OK: true, Sum: 0x5eed}})
	if b, o := refusedBin.Load(), refusedOther.Load(); b != 1 || o != 0 || h.d.reportJSON.Load() {
		t.Fatalf("a report refused for its content: %d binary and %d JSON sends, JSON kept %v; want 1, 0, false",
			b, o, h.d.reportJSON.Load())
	}

	// An old coordinator: JSON only, on another NATS.
	srvB := testutil.NATS(t)
	ncB, err := bus.Connect(srvB.ClientURL(), "test-b")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ncB.Close)
	var binary, taken, refusedJSON atomic.Int32
	if _, err := ncB.Subscribe(h.subj.Report(h.rank), func(m *nats.Msg) {
		var r wire.RestoreReport
		if err := bus.Decode(m, &r); err != nil {
			binary.Add(1)
			_ = bus.RespondError(m, wire.CodeBadRequest, err.Error())
			return
		}
		if r.RestoreID == "R-bad" {
			refusedJSON.Add(1)
			_ = bus.RespondError(m, wire.CodeBadRequest, "test: a bad report")
			return
		}
		taken.Add(1)
		_ = bus.Respond(m, &wire.ReportAck{State: wire.VerdictPending})
	}); err != nil {
		t.Fatal(err)
	}
	if err := ncB.Flush(); err != nil {
		t.Fatal(err)
	}
	h.d.switchNATS(srvB.ClientURL())
	for _, id := range []string{"R-1", "R-2", "R-3"} {
		h.d.report(id, []wire.ItemResult{{Chunk: 0, OK: true, Sum: 0x5eed}})
	}
	if b, n := binary.Load(), taken.Load(); b != 1 || n != 3 {
		t.Fatalf("old coordinator: %d binary attempts, %d reports taken; want 1 and 3", b, n)
	}
	if !h.d.reportJSON.Load() {
		t.Fatal("the daemon did not keep to JSON")
	}
	h.d.report("R-bad", []wire.ItemResult{{Chunk: 0, OK: true, Sum: 0x5eed}})
	if n := refusedJSON.Load(); n != 1 {
		t.Fatalf("a report refused as JSON was sent %d times, want 1", n)
	}
}
