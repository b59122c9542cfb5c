package enginesim

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/wire"
)

const ms = int64(time.Millisecond)

// rankdRetrieve is a rankd timeline of a retrieve of two batches that
// started at start: 10 ms of host stages, the scatters overlapping them.
func rankdRetrieve(start time.Time) wire.Timeline {
	st := func(name string, batch int, dev bool, from, dur int64) wire.TimelineStage {
		return wire.TimelineStage{Name: name, Batch: batch, Device: dev, StartNS: from * ms / 10, DurNS: dur * ms / 10}
	}
	return wire.Timeline{Op: "retrieve", ID: "R", StartUnixNS: start.UnixNano(), DurNS: 10 * ms, Bytes: 2 << 20,
		Stages: []wire.TimelineStage{
			st("decode", -1, false, 0, 2), st("plan", -1, false, 2, 3),
			st("lookup", 0, false, 5, 5), st("enqueue", 0, false, 10, 5),
			st("scatter", 0, true, 15, 30),
			st("lookup", 1, false, 15, 5), st("enqueue", 1, false, 20, 5),
			st("wait", 0, false, 25, 20), st("verify", 0, false, 45, 5),
			st("scatter", 1, true, 45, 40),
			st("wait", 1, false, 50, 35), st("verify", 1, false, 85, 5),
			st("report", -1, false, 90, 8), st("reply", -1, false, 98, 2),
		}}
}

// checkRows: the rows are in order of their first start; those of the
// engine and the rankd (which tile the request's time, merged per stage)
// add up to the total (the shares to 1); device rows lie within it.
func checkRows(t *testing.T, bt *BenchTimeline, want []string) {
	t.Helper()
	var prev, sum int64
	var share float64
	var names []string
	for _, r := range bt.Rows {
		names = append(names, r.Where+":"+r.Name)
		if r.StartNS < prev || r.DurNS < 0 || r.StartNS+r.DurNS > bt.TotalNS {
			t.Fatalf("row %s [%d, +%d]: out of order (previous start %d) or outside [0, %d]", r.Name, r.StartNS, r.DurNS, prev, bt.TotalNS)
		}
		prev = r.StartNS
		if r.Where != "device" && r.Where != "beside" {
			sum += r.DurNS
			share += r.Share
		}
	}
	if got := strings.Join(names, " "); got != strings.Join(want, " ") {
		t.Fatalf("rows\n%s\nwant\n%s", got, strings.Join(want, " "))
	}
	if sum != bt.TotalNS || share < 0.999 || share > 1.001 {
		t.Fatalf("engine and rankd rows add up to %d ns (shares %.4f), the total is %d ns", sum, share, bt.TotalNS)
	}
}

// TestRestoreTimelineRows: the restore's rows are the simulator's begin,
// request, response, wait for the other ranks and verdict around the
// rankd's stages merged per name (batches counted, times summed), in
// order of their first start; a rankd clock that disagrees is clamped
// and said.
func TestRestoreTimelineRows(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(msx10 int64) time.Time { return t0.Add(time.Duration(msx10 * ms / 10)) }
	rc := &restoreClock{begun: t0, planned: at(20), sent: []time.Time{at(21)}, replied: []time.Time{at(135)},
		verdictFrom: at(150), ended: at(160)}
	bt := restoreTimeline(0, rankdRetrieve(at(30)), rc)
	checkRows(t, bt, []string{"engine:begin", "engine:request", "rankd:decode", "rankd:plan", "rankd:lookup", "rankd:enqueue",
		"device:scatter", "rankd:wait", "rankd:verify", "rankd:report", "rankd:reply", "engine:response", "engine:other ranks", "engine:verdict"})
	if bt.TotalNS != 16*ms || bt.Skewed {
		t.Fatalf("total %d ns, skewed %v", bt.TotalNS, bt.Skewed)
	}
	for _, r := range bt.Rows {
		switch r.Name {
		case "lookup":
			if r.Batches != 2 || r.DurNS != ms || r.StartNS != 3*ms+ms/2 {
				t.Fatalf("lookup row %+v: want 2 batches, 1 ms from 3.5 ms", r)
			}
		case "scatter":
			if r.Batches != 2 || r.DurNS != 7*ms || r.StartNS != 4*ms+ms/2 {
				t.Fatalf("scatter row %+v: want 2 batches, 7 ms from 4.5 ms", r)
			}
		case "request":
			if r.StartNS != 2*ms || r.DurNS != ms {
				t.Fatalf("request row %+v: want 1 ms from 2 ms", r)
			}
		}
	}
	var out bytes.Buffer
	printTimeline(&out, "restore", bt)
	for _, want := range []string{"timeline of one restore, TP rank 0 (restore R, 2.0 MiB on this rank): 16.000 ms", "scatter", "other ranks"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("printed timeline has no %q:\n%s", want, out.String())
		}
	}

	// The rankd's clock runs 5 ms ahead of ours: its receipt is after its
	// reply reached us. Clamped, and said.
	bt = restoreTimeline(0, rankdRetrieve(at(130)), rc)
	if !bt.Skewed {
		t.Fatal("a rankd timeline ending after its reply arrived is not flagged")
	}
	out.Reset()
	printTimeline(&out, "restore", bt)
	if !strings.Contains(out.String(), "clamped") {
		t.Fatalf("no warning printed:\n%s", out.String())
	}
}

// TestRestoreTimelineReportBeside: a rankd that replied before its
// report's acknowledgment came (the report sent beside the reply) shows
// that wait as a "beside" row, and the response runs from its reply.
func TestRestoreTimelineReportBeside(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(msx10 int64) time.Time { return t0.Add(time.Duration(msx10 * ms / 10)) }
	tl := rankdRetrieve(at(30))
	n := len(tl.Stages)
	tl.Stages[n-2], tl.Stages[n-1] = wire.TimelineStage{Name: "reply", Batch: -1, StartNS: 9 * ms, DurNS: ms / 5},
		wire.TimelineStage{Name: "report", Batch: -1, StartNS: 9*ms + ms/5, DurNS: ms * 4 / 5}
	rc := &restoreClock{begun: t0, planned: at(20), sent: []time.Time{at(21)}, replied: []time.Time{at(125)},
		verdictFrom: at(150), ended: at(160)}
	bt := restoreTimeline(0, tl, rc)
	checkRows(t, bt, []string{"engine:begin", "engine:request", "rankd:decode", "rankd:plan", "rankd:lookup", "rankd:enqueue",
		"device:scatter", "rankd:wait", "rankd:verify", "rankd:reply", "beside:report", "engine:response", "engine:other ranks", "engine:verdict"})
	for _, r := range bt.Rows {
		if r.Name == "response" && (r.StartNS != 12*ms+ms/5 || r.DurNS != 3*ms/10) {
			t.Fatalf("response row %+v: want from the reply's end (12.2 ms) to 12.5 ms", r)
		}
	}
	if bt.Skewed {
		t.Fatal("flagged skewed")
	}
}

// TestStoreTimelineRows: of several store timelines the one that finished
// last is shown, between the request sent and the last reply.
func TestStoreTimelineRows(t *testing.T) {
	t0 := time.Unix(2000, 0)
	mk := func(startMS, durMS int64) wire.Timeline {
		return wire.Timeline{Op: "store", ID: "S", StartUnixNS: t0.UnixNano() + startMS*ms, DurNS: durMS * ms, Bytes: 1 << 20,
			Stages: []wire.TimelineStage{
				{Name: "decode", Batch: -1, DurNS: ms},
				{Name: "producer", Batch: 0, Device: true, StartNS: ms, DurNS: ms},
				{Name: "gather", Batch: 0, Device: true, StartNS: 2 * ms, DurNS: (durMS - 3) * ms},
				{Name: "wait", Batch: 0, StartNS: ms, DurNS: (durMS - 2) * ms},
				{Name: "reply", Batch: -1, StartNS: (durMS - 1) * ms, DurNS: ms},
			}}
	}
	tls := []wire.Timeline{mk(1, 10), mk(2, 20), mk(1, 5)}
	bt := storeTimeline(0, tls, 3, t0, t0.Add(25*time.Millisecond))
	if bt.Rankd.DurNS != 20*ms {
		t.Fatalf("shown the timeline of %d ns, want the one that finished last (20 ms)", bt.Rankd.DurNS)
	}
	checkRows(t, bt, []string{"engine:request", "rankd:decode", "device:producer", "rankd:wait", "device:gather", "rankd:reply", "engine:response"})
	if want := fmt.Sprintf("the last of its %d store requests to finish", 3); !strings.HasPrefix(bt.Of, want) {
		t.Fatalf("Of %q, want %q...", bt.Of, want)
	}
}

// TestCopyCoverage: the device's copy batches of a transfer, overlapping
// ones counted once, and the time between the first and the last in which
// none copied (the H100's restore: two batches at once, then a gap).
func TestCopyCoverage(t *testing.T) {
	dev := func(name string, from, to int64) wire.TimelineStage {
		return wire.TimelineStage{Name: name, Device: true, StartNS: from * ms, DurNS: (to - from) * ms}
	}
	host := wire.TimelineStage{Name: "wait", StartNS: 0, DurNS: 40 * ms}
	tl := wire.Timeline{Stages: []wire.TimelineStage{host,
		dev("scatter", 10, 20), dev("scatter", 1, 3), dev("scatter", 2, 10), dev("scatter", 22, 30), dev("scatter", 25, 27)}}
	c := copyCoverage(tl)
	if c.stage != "scatter" || c.batches != 5 || c.first != 1*ms || c.last != 30*ms || c.busy != 27*ms {
		t.Fatalf("coverage %+v, want scatter, 5 batches, 1-30 ms, busy 27 ms (idle 20-22)", c)
	}
	if c := copyCoverage(wire.Timeline{Stages: []wire.TimelineStage{host}}); c.batches != 0 {
		t.Fatalf("coverage of a timeline without device copies: %+v", c)
	}
	var out bytes.Buffer
	printTimeline(&out, "restore", &BenchTimeline{Rankd: tl})
	if !strings.Contains(out.String(), "device scatter, 5 batches: 1.000-30.000 ms of the rankd's, busy 27.000 ms, idle 2.000 ms between batches") {
		t.Fatalf("printed:\n%s", out.String())
	}
}
