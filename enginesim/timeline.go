package enginesim

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// Stage timelines of --bench: where the time of one store and one restore
// goes, from the engine's request to the reply (store) or the verdict
// (restore). The rankd measures its own stages and the engine's (decode,
// L1, each copy batch's enqueue, the device's copy timed by CUDA events,
// verification, the report to the coordinator, the reply: wire.Timeline)
// and keeps the recent ones for its status request; the simulator adds
// what it saw itself around them: the request and the reply in flight, the
// coordinator's restore.begin (lookup and plan) and restore.wait
// (verdict). The rankd's times are placed on the simulator's clock through
// the wall clock, so the two must run on one host (gpu-bench.sh does).

// BenchTimeline is one store's or one restore's timeline on one TP rank,
// from the last repetition.
type BenchTimeline struct {
	// Rank is the TP rank; Of says which request ("the last of 12 store
	// requests to reply", "restore <id>").
	Rank int    `json:"rank"`
	Of   string `json:"of"`
	// TotalNS is what the shares are of: the rank's time from the first
	// store request sent to its last reply, or from restore.begin to the
	// verdict (the benchmark's timed parts).
	TotalNS int64 `json:"total_ns"`
	// Rows are the stages, one per stage name and lane (a stage of
	// several copy batches: its first start and the sum of its times).
	Rows []TimelineRow `json:"rows"`
	// Skewed: a stage computed across the two clocks came out negative
	// (clamped to 0): the rankd's clock is not this process's.
	Skewed bool `json:"skewed,omitempty"`
	// Rankd is the rankd's timeline as it reported it (every batch).
	Rankd wire.Timeline `json:"rankd"`
}

// BenchTimelines are where the time of one store request and of one
// restore went; TimelineProblem says why one is missing (a rankd that keeps
// no timelines).
type BenchTimelines struct {
	StoreTimeline   *BenchTimeline `json:"store_timeline,omitempty"`
	RestoreTimeline *BenchTimeline `json:"restore_timeline,omitempty"`
	TimelineProblem string         `json:"timeline_problem,omitempty"`
}

// storeTimelineOf records in bt where the time of one request of the
// store run (request id reqID) went, on the first TP rank that stored.
func (s *sim) storeTimelineOf(ctx context.Context, bt *BenchTimelines, reqID string, run benchStoreRun) {
	t := slices.IndexFunc(run.requests, func(n int) bool { return n > 0 })
	if t < 0 || bt.TimelineProblem != "" {
		return
	}
	tls, err := s.fetchTimelines(ctx, s.workers[t], reqID)
	if err != nil {
		bt.TimelineProblem = err.Error()
		return
	}
	bt.StoreTimeline = storeTimeline(t, tls, run.requests[t], run.start, run.start.Add(run.ranks[t]))
}

// restoreTimelineOf records in bt where the time of the last restore
// (s.res, s.rc) went on TP rank 0.
func (s *sim) restoreTimelineOf(ctx context.Context, bt *BenchTimelines) {
	if bt.TimelineProblem != "" {
		return
	}
	tls, err := s.fetchTimelines(ctx, s.workers[0], s.res.RestoreID)
	if err != nil {
		bt.TimelineProblem = err.Error()
		return
	}
	bt.RestoreTimeline = restoreTimeline(0, tls[len(tls)-1], &s.rc)
}

// print writes bt's timelines, each named with its suffix, and why one is
// missing.
func (bt *BenchTimelines) print(out io.Writer, storeOf, restoreOf string) {
	if bt.StoreTimeline != nil {
		printTimeline(out, "store"+storeOf, bt.StoreTimeline)
	}
	if bt.RestoreTimeline != nil {
		printTimeline(out, "restore"+restoreOf, bt.RestoreTimeline)
	}
	if bt.TimelineProblem != "" {
		fmt.Fprintf(out, "\nno timeline%s: %s\n", storeOf, bt.TimelineProblem)
	}
}

// TimelineRow is one stage of a BenchTimeline.
type TimelineRow struct {
	Name string `json:"name"`
	// Where is "engine" (seen by this process), "rankd" (the rankd's
	// host work), "device" (the device's, overlapping the others) or
	// "beside" (the rankd's wait for its report's acknowledgment after
	// it replied, overlapping the engine's response and verdict).
	Where   string  `json:"where"`
	Batches int     `json:"batches"` // stages merged into the row (copy batches)
	StartNS int64   `json:"start_ns"`
	DurNS   int64   `json:"dur_ns"`
	Share   float64 `json:"share"` // DurNS / TotalNS
}

// fetchTimelines asks w's rankd for the recent timelines of id.
func (s *sim) fetchTimelines(ctx context.Context, w *worker, id string) ([]wire.Timeline, error) {
	type statusRequest struct {
		Timelines string `json:"timelines"`
	}
	type statusReply struct {
		Timelines []wire.Timeline `json:"timelines"`
	}
	cctx, cancel := s.callCtx(ctx)
	defer cancel()
	rep, err := bus.Call[statusReply](cctx, w.nc, w.subj.Engine(w.rank, "status"), statusRequest{Timelines: id})
	if err != nil {
		return nil, fmt.Errorf("rank %d: status with timelines: %w", w.t, err)
	}
	if len(rep.Timelines) == 0 {
		return nil, fmt.Errorf("rank %d: the rankd keeps no timeline of %s", w.t, id)
	}
	return rep.Timelines, nil
}

// timelineBuilder lays out rows on the simulator's clock from origin.
type timelineBuilder struct {
	origin time.Time
	bt     *BenchTimeline
}

// engineRow adds a stage this process saw, from a to b.
func (b *timelineBuilder) engineRow(name string, from, to time.Time) {
	b.row(name, "engine", 1, from.Sub(b.origin), to.Sub(from))
}

func (b *timelineBuilder) row(name, where string, n int, start, dur time.Duration) {
	if start < 0 || dur < 0 {
		b.bt.Skewed = true
		start, dur = max(start, 0), max(dur, 0)
	}
	b.bt.Rows = append(b.bt.Rows, TimelineRow{Name: name, Where: where, Batches: n, StartNS: int64(start), DurNS: int64(dur)})
}

// rankdRows adds the rankd's stages, merged per name and lane, and
// returns when its timeline started and ended on this process's clock.
func (b *timelineBuilder) rankdRows(tl wire.Timeline) (start, end time.Time) {
	start = time.Unix(0, tl.StartUnixNS)
	off := start.Sub(b.origin)
	type key struct {
		name   string
		device bool
	}
	idx := map[key]int{}
	first := len(b.bt.Rows)
	for _, st := range tl.Stages {
		k := key{st.Name, st.Device}
		i, ok := idx[k]
		if !ok {
			where := "rankd"
			if st.Device {
				where = "device"
			}
			i = len(b.bt.Rows)
			idx[k] = i
			b.row(st.Name, where, 0, off+time.Duration(st.StartNS), 0)
		}
		r := &b.bt.Rows[i]
		r.Batches++
		r.DurNS += st.DurNS
	}
	rows := b.bt.Rows[first:]
	slices.SortStableFunc(rows, func(x, y TimelineRow) int { return int(min(max(x.StartNS-y.StartNS, -1), 1)) })
	return start, start.Add(time.Duration(tl.DurNS))
}

func (b *timelineBuilder) finish(total time.Duration) *BenchTimeline {
	b.bt.TotalNS = int64(total)
	for i := range b.bt.Rows {
		if total > 0 {
			b.bt.Rows[i].Share = float64(b.bt.Rows[i].DurNS) / float64(total)
		}
	}
	return b.bt
}

// storeTimeline is the timeline of the store request among tls whose
// rankd finished last (the one the rank's store time waited for): the
// requests were sent at start, the rank's last reply came at replied.
// Every time is read on the wall clock, the rankd's only common clock
// with this process (a monotonic difference can differ from the wall
// clock's by the clock's slew, and the rows would not add up).
func storeTimeline(rank int, tls []wire.Timeline, requests int, start, replied time.Time) *BenchTimeline {
	start, replied = start.Round(0), replied.Round(0)
	last := tls[0]
	for _, tl := range tls[1:] {
		if tl.StartUnixNS+tl.DurNS > last.StartUnixNS+last.DurNS {
			last = tl
		}
	}
	b := &timelineBuilder{origin: start, bt: &BenchTimeline{Rank: rank, Rankd: last,
		Of: fmt.Sprintf("the last of its %d store requests to finish, %s", requests, human(last.Bytes))}}
	b.engineRow("request", start, time.Unix(0, last.StartUnixNS))
	_, end := b.rankdRows(last)
	b.engineRow("response", end, replied)
	return b.finish(replied.Sub(start))
}

// restoreClock is what the simulator saw of its last restore.
type restoreClock struct {
	begun, planned     time.Time   // restore.begin sent, plan received
	sent, replied      []time.Time // per TP rank: retrieve sent, reply received
	verdictFrom, ended time.Time   // every retrieve answered (the wait went out beside them), verdict received
}

// restoreTimeline is the timeline of rank's retrieve within the restore
// that rc saw.
func restoreTimeline(rank int, tl wire.Timeline, rc0 *restoreClock) *BenchTimeline {
	rc := &restoreClock{begun: rc0.begun.Round(0), planned: rc0.planned.Round(0), replied: []time.Time{},
		verdictFrom: rc0.verdictFrom.Round(0), ended: rc0.ended.Round(0)} // wall clock only (storeTimeline)
	for _, t := range rc0.replied {
		rc.replied = append(rc.replied, t.Round(0))
	}
	b := &timelineBuilder{origin: rc.begun, bt: &BenchTimeline{Rank: rank, Rankd: tl,
		Of: fmt.Sprintf("restore %s, %s on this rank", tl.ID, human(tl.Bytes))}}
	b.engineRow("begin", rc.begun, rc.planned)
	start, _ := b.rankdRows(tl)
	// The request row goes before the rankd's: it ends where they start.
	req := TimelineRow{Name: "request", Where: "engine", Batches: 1, StartNS: int64(rc.planned.Sub(rc.begun)), DurNS: int64(start.Sub(rc.planned))}
	if req.DurNS < 0 {
		b.bt.Skewed, req.DurNS = true, 0
	}
	b.bt.Rows = slices.Insert(b.bt.Rows, 1, req)
	end := time.Unix(0, tl.StartUnixNS+tl.DurNS)
	if reply, ok := stageEnd(tl, "reply"); ok && reportAfter(b.bt.Rows, reply.Sub(b.origin)) {
		// The rankd sent its report beside the reply (rankd.serveRetrieve)
		// and then waited for the acknowledgment: that wait overlaps the
		// engine's response and verdict, so its row is "beside" them and
		// the response runs from the reply.
		end = reply
	}
	b.engineRow("response", end, rc.replied[rank])
	b.engineRow("other ranks", rc.replied[rank], rc.verdictFrom)
	b.engineRow("verdict", rc.verdictFrom, rc.ended)
	return b.finish(rc.ended.Sub(rc.begun))
}

// stageEnd is when tl's last stage named name ended, on the wall clock.
func stageEnd(tl wire.Timeline, name string) (time.Time, bool) {
	for i := len(tl.Stages) - 1; i >= 0; i-- {
		if st := tl.Stages[i]; st.Name == name && !st.Device {
			return time.Unix(0, tl.StartUnixNS+st.StartNS+st.DurNS), true
		}
	}
	return time.Time{}, false
}

// reportAfter marks the rankd's report row "beside" when it starts at or
// after from (the end of the reply), and says whether it did.
func reportAfter(rows []TimelineRow, from time.Duration) bool {
	for i := range rows {
		if r := &rows[i]; r.Name == "report" && r.Where == "rankd" && r.StartNS >= int64(from) {
			r.Where = "beside"
			return true
		}
	}
	return false
}

// printTimeline writes bt as a table.
func printTimeline(out io.Writer, what string, bt *BenchTimeline) {
	fmt.Fprintf(out, "\ntimeline of one %s, TP rank %d (%s): %.3f ms\n", what, bt.Rank, bt.Of, float64(bt.TotalNS)/1e6)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STAGE\tWHERE\tBATCHES\tSTART ms\tTIME ms\tSHARE")
	for _, r := range bt.Rows {
		n := ""
		if r.Batches > 1 || r.Where == "device" {
			n = fmt.Sprint(r.Batches)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.3f\t%.3f\t%.1f%%\n", r.Name, r.Where, n, float64(r.StartNS)/1e6, float64(r.DurNS)/1e6, 100*r.Share)
	}
	tw.Flush()
	fmt.Fprintln(out, "engine and rankd stages take turns (their shares add up to 100%); device and beside stages overlap them; a stage")
	fmt.Fprintln(out, "of several copy batches shows its first start and its summed time (docs/enginesim.md)")
	if bt.Skewed {
		fmt.Fprintln(out, "warning: the rankd's clock is not this process's: stages across the two were clamped to 0")
	}
	if c := copyCoverage(bt.Rankd); c.batches > 0 {
		fmt.Fprintf(out, "device %s, %d batches: %.3f-%.3f ms of the rankd's, busy %.3f ms, idle %.3f ms between batches\n",
			c.stage, c.batches, float64(c.first)/1e6, float64(c.last)/1e6, float64(c.busy)/1e6, float64(c.last-c.first-c.busy)/1e6)
	}
	if s := bt.Rankd.MarkClampNS; s > 0 {
		fmt.Fprintf(out, "a copy's end mark was reached up to %.3f ms after the rankd saw the copy end: clamped there (docs/enginesim.md)\n", float64(s)/1e6)
	}
}

// coverage is where the device copied during one transfer (copyCoverage).
type coverage struct {
	stage             string
	batches           int
	first, last, busy int64 // ns from the rankd timeline's start; busy: the union of the batches' spans
}

// copyCoverage returns the extent and the busy time of tl's device copy
// stages (a retrieve's scatter, a store's gather): batches that overlap
// count once, so last-first-busy is the time between first and last in
// which the device copied nothing of this transfer.
func copyCoverage(tl wire.Timeline) coverage {
	var c coverage
	type span struct{ from, to int64 }
	var spans []span
	for _, st := range tl.Stages {
		if st.Device && (st.Name == "scatter" || st.Name == "gather") {
			c.stage = st.Name
			spans = append(spans, span{st.StartNS, st.StartNS + st.DurNS})
		}
	}
	if len(spans) == 0 {
		return c
	}
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.from, b.from) })
	c.batches, c.first, c.last = len(spans), spans[0].from, spans[0].to
	from, to := spans[0].from, spans[0].to
	for _, sp := range spans[1:] {
		if sp.from > to {
			c.busy += to - from
			from = sp.from
		}
		to = max(to, sp.to)
		c.last = max(c.last, sp.to)
	}
	c.busy += to - from
	return c
}
