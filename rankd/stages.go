package rankd

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// Stage timelines of stores and retrieves (transfer.Timeline): the rankd
// starts one at the receipt of each request, adds its own stages (decode,
// report, reply) around the engine's, observes every stage's time in
// kvtier_rankd_stage_seconds and keeps the last recentTimelines for the
// status request's Timelines.

// recentTimelines is how many finished timelines the rankd keeps.
const recentTimelines = 64

// StatusAllTimelines as StatusRequest.Timelines asks for every recent
// timeline.
const StatusAllTimelines = "*"

// opStages are the stages each operation records: the series of
// kvtier_rankd_stage_seconds.
var opStages = map[string][]transfer.Stage{
	OpStore: {transfer.StageDecode, transfer.StageAdmit, transfer.StagePlace, transfer.StageStream,
		transfer.StageEnqueue, transfer.StageLaunch, transfer.StageWait, transfer.StageNotice, transfer.StageCommit,
		transfer.StageRelease, transfer.StageReply, transfer.StageProducer, transfer.StageGather},
	OpRetrieve: {transfer.StageDecode, transfer.StagePlan, transfer.StagePace, transfer.StageLookup, transfer.StageStream,
		transfer.StageEnqueue, transfer.StageLaunch, transfer.StageWait, transfer.StageNotice, transfer.StageVerify,
		transfer.StageFinish, transfer.StageReport, transfer.StageReply, transfer.StageScatter},
}

// stageRecorder observes finished timelines and keeps the recent ones.
type stageRecorder struct {
	obs map[string]*[transfer.NumStages]prometheus.Observer // by op; nil: a stage the op does not record

	// resolveHook, when set (tests), runs before a timeline's device
	// times are read.
	resolveHook func()

	mu   sync.Mutex // guards the following
	ring [recentTimelines]recentTimeline
	next int // ring slot of the next timeline
}

type recentTimeline struct {
	op, id string
	tl     *transfer.Timeline // final: nothing writes it any more
}

// newStageRecorder resolves every series of h once, so that observing a
// request costs no label lookup (and every series shows from the start).
func newStageRecorder(h *prometheus.HistogramVec) *stageRecorder {
	r := &stageRecorder{obs: map[string]*[transfer.NumStages]prometheus.Observer{}}
	for op, stages := range opStages {
		var o [transfer.NumStages]prometheus.Observer
		for _, s := range stages {
			o[s] = h.WithLabelValues(op, s.String())
		}
		r.obs[op] = &o
	}
	return r
}

// done records the finished timeline of one request, after its reply:
// the device's times read (Timeline.Resolve), each stage's total in the
// histogram, the timeline among the recent ones. tl must not be written
// any more.
func (r *stageRecorder) done(op, id string, tl *transfer.Timeline) {
	if tl == nil {
		return
	}
	if r.resolveHook != nil {
		r.resolveHook()
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	tl.Resolve(ctx) // the device's times, now that the reply is out
	cancel()
	if o := r.obs[op]; o != nil {
		for s := range transfer.NumStages {
			if d, ok := tl.Total(s); ok && o[s] != nil {
				o[s].Observe(d.Seconds())
			}
		}
	}
	r.mu.Lock()
	r.ring[r.next] = recentTimeline{op: op, id: id, tl: tl}
	r.next = (r.next + 1) % recentTimelines
	r.mu.Unlock()
}

// find returns the recent timelines of requests named id (every recent
// one for StatusAllTimelines), oldest first.
func (r *stageRecorder) find(id string) []wire.Timeline {
	r.mu.Lock()
	var found []recentTimeline
	for i := range recentTimelines {
		rt := r.ring[(r.next+i)%recentTimelines]
		if rt.tl != nil && (id == StatusAllTimelines || rt.id == id) {
			found = append(found, rt)
		}
	}
	r.mu.Unlock()
	out := make([]wire.Timeline, 0, len(found))
	for _, rt := range found {
		out = append(out, wireTimeline(rt.op, rt.id, rt.tl))
	}
	return out
}

// wireTimeline converts a finished timeline.
func wireTimeline(op, id string, tl *transfer.Timeline) wire.Timeline {
	spans := tl.Spans()
	w := wire.Timeline{Op: op, ID: id, StartUnixNS: tl.Origin().UnixNano(), DurNS: int64(tl.End().Sub(tl.Origin())),
		Bytes: tl.Bytes, Truncated: tl.Truncated(), MarkClampNS: int64(tl.MarkClamp()), Stages: make([]wire.TimelineStage, len(spans))}
	for i, s := range spans {
		w.Stages[i] = wire.TimelineStage{Name: s.Stage.String(), Batch: s.Batch, Device: s.Stage.Device(),
			StartNS: int64(s.Start), DurNS: int64(s.Dur)}
	}
	return w
}
