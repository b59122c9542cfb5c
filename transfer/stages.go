package transfer

import (
	"context"
	"time"

	"github.com/kvtier/kvtier/cuda"
)

// Stage timelines: where the time of one store or retrieve goes, for the
// rankd's kvtier_rankd_stage_seconds histograms and enginesim --bench.
//
// A Timeline has two lanes. The host lane is a sequence of laps: each
// host stage runs from the end of the previous one to the moment it is
// recorded, so host stages never overlap, leave no gap and add up to the
// request's time so far. The device lane holds what the device did, timed
// with cuda.Timer marks placed around each copy on its stream (CUDA
// events on a GPU); device stages overlap the host's (the host waits, or
// prepares the next batch, meanwhile).

// Stage is one step of a store or a retrieve.
type Stage uint8

// The stages, host lane first. Per batch: Lookup, Stream, Enqueue, Launch, Wait,
// Notice, Verify, Scatter (a store is one batch).
const (
	StageDecode   Stage = iota // rankd: receipt to request decoded (including the hand-off to a handler)
	StageAdmit                 // store: session, checks, object keys, dedupe, producer event import
	StagePlan                  // retrieve: session, checks and target spans of every item
	StagePlace                 // store: L1 room for the objects (and the start of the store's goroutine)
	StageLookup                // retrieve: L1 lookup and pins, L2/L3/peer reads, checks before the scatter
	StagePace                  // retrieve, paced (RetrieveRequest.Pace): the wait before a batch's lookup
	StageStream                // waiting for a free stream
	StageEnqueue               // the copy's checks, plan and tables, and the timer mark before it (a store: and its wait on the producer event)
	StageLaunch                // the copy's driver calls, from cuda.Op.Started until the enqueue returned (and the mark after it)
	StageWait                  // the host waits until the device has finished the copy
	StageNotice                // from the device's finish until the host saw it (polling)
	StageCommit                // store: the objects committed in L1
	StageVerify                // retrieve: sums compared, peers' objects placed, pins given back
	StageFinish                // retrieve: failures accounted, last pins given back
	StageRelease               // store, rankd: result final, blocks released, durability checked
	StageReport                // retrieve, rankd: the report to the coordinator and its ack
	StageReply                 // rankd: the reply encoded and sent
	StageProducer              // device, store: the stream waits for the producer event
	StageGather                // device, store: the gather (copy and checksum)
	StageScatter               // device, retrieve: the scatter (copy, then the read-back checksum)
	NumStages
)

var stageNames = [NumStages]string{
	StageDecode: "decode", StageAdmit: "admit", StagePlan: "plan", StagePlace: "place", StageLookup: "lookup",
	StagePace: "pace", StageStream: "stream", StageEnqueue: "enqueue", StageLaunch: "launch", StageWait: "wait", StageNotice: "notice",
	StageCommit: "commit", StageVerify: "verify", StageFinish: "finish", StageRelease: "release",
	StageReport: "report", StageReply: "reply", StageProducer: "producer", StageGather: "gather",
	StageScatter: "scatter",
}

func (s Stage) String() string {
	if s < NumStages {
		return stageNames[s]
	}
	return "stage?"
}

// Device reports whether s is a device-lane stage.
func (s Stage) Device() bool { return s >= StageProducer && s < NumStages }

// StageSpan is one recorded stage.
type StageSpan struct {
	Stage Stage
	// Batch is the copy batch the stage belongs to (a retrieve's batches
	// from 0; a store's one gather is 0); -1 for a stage of the request.
	Batch int
	// Start and Dur are offsets from the timeline's origin.
	Start, Dur time.Duration
}

// maxSpans bounds the spans a Timeline keeps; later ones are still added
// to Totals. A retrieve of 100 GB in 256 MiB batches records ~2,400.
const maxSpans = 512

// Timeline records the stages of one store or retrieve. A caller asks
// for it by passing the Timeline in the context of Store or Retrieve
// (WithTimeline); a nil *Timeline records nothing. It is used by one
// goroutine at a time: a store hands it to its future's goroutine until
// the future is Done, and the caller must not touch it before.
type Timeline struct {
	origin    time.Time
	last      time.Time // end of the last host stage
	spans     []StageSpan
	totals    [NumStages]time.Duration
	seen      [NumStages]bool
	truncated bool
	clamp     time.Duration // the largest MarkClamp
	pending   []pendingCopy // copies whose device times Resolve reads
	// Bytes are the bytes the request moved (gathered or scattered).
	Bytes uint64
}

type timelineKey struct{}

// WithTimeline returns ctx carrying tl, for Store or Retrieve to record
// their stages in.
func WithTimeline(ctx context.Context, tl *Timeline) context.Context {
	return context.WithValue(ctx, timelineKey{}, tl)
}

// TimelineFrom returns the Timeline ctx carries, or nil.
func TimelineFrom(ctx context.Context) *Timeline {
	tl, _ := ctx.Value(timelineKey{}).(*Timeline)
	return tl
}

// NewTimeline starts a timeline at origin (the request's receipt).
func NewTimeline(origin time.Time) *Timeline {
	return &Timeline{origin: origin, last: origin, spans: make([]StageSpan, 0, 16)}
}

// Origin is the time the timeline starts at.
func (t *Timeline) Origin() time.Time { return t.origin }

// Spans returns the recorded stages, in the order recorded.
func (t *Timeline) Spans() []StageSpan { return t.spans }

// Truncated reports whether spans beyond maxSpans were left out of Spans
// (they are in Totals).
func (t *Timeline) Truncated() bool { return t.truncated }

// Total returns the summed duration of stage s and whether it occurred.
func (t *Timeline) Total(s Stage) (time.Duration, bool) { return t.totals[s], t.seen[s] }

// MarkClamp is the most a mark after a copy was moved back to the moment
// the host saw the copy complete (0: none was). The work before the mark
// ended by then, so a later time says when the mark was reached, not when
// the copy ended: on the H200 the end marks of scatters came out up to
// 4.5 ms (one rankd) and 14 ms (four rankds time-slicing the GPU) after
// op.Wait returned, while the marks before the copies matched the host's
// enqueue. A clamped copy's device time is the bound the host saw.
func (t *Timeline) MarkClamp() time.Duration { return t.clamp }

// End is the end of the last host stage.
func (t *Timeline) End() time.Time { return t.last }

func (t *Timeline) add(s Stage, batch int, from, to time.Time) {
	d := max(to.Sub(from), 0)
	t.totals[s] += d
	t.seen[s] = true
	if len(t.spans) >= maxSpans {
		t.truncated = true
		return
	}
	t.spans = append(t.spans, StageSpan{Stage: s, Batch: batch, Start: from.Sub(t.origin), Dur: d})
}

// Lap records host stage s (of batch, or -1) from the end of the previous
// host stage until now.
func (t *Timeline) Lap(s Stage, batch int) {
	if t == nil {
		return
	}
	t.LapTo(s, batch, time.Now())
}

// LapTo records host stage s from the end of the previous host stage until
// at (at most now: clamped so the lane stays ordered).
func (t *Timeline) LapTo(s Stage, batch int, at time.Time) {
	if t == nil {
		return
	}
	if at.Before(t.last) {
		at = t.last
	}
	t.add(s, batch, t.last, at)
	t.last = at
}

// Device records device stage s of batch over [from, to), clamped to
// start no earlier than the origin.
func (t *Timeline) Device(s Stage, batch int, from, to time.Time) {
	if t == nil {
		return
	}
	if from.Before(t.origin) {
		from = t.origin
	}
	if to.Before(from) {
		to = from
	}
	t.add(s, batch, from, to)
}

// copyTimers are the marks around one copy on its stream: before it,
// (a store) after the producer event, and after the copy. The mark before
// the copy goes on the stream before the Gather or Scatter call, so the
// stream reaches it while the host still checks and plans the copy;
// started (cuda.Op.Started) is when the copy's work began to reach the
// stream, and the copy's device stage starts no earlier: on an H100 a
// restore batch of 512 small objects spent ~1 ms in that call, which the
// copy's stage counted as device time until stop 62.
type copyTimers struct {
	t       [3]cuda.Timer
	n       int
	started time.Time
}

// began notes when op's work began to reach the stream.
func (c *copyTimers) began(op *cuda.Op) *copyTimers {
	if c != nil && op != nil {
		c.started = op.Started()
	}
	return c
}

// newCopyTimers creates n timers for a timeline, or none (nil) when tl is
// nil or the device cannot: the copy is then simply not timed.
func newCopyTimers(dev cuda.Device, tl *Timeline, n int) *copyTimers {
	if tl == nil {
		return nil
	}
	c := &copyTimers{n: n}
	for i := range n {
		t, err := dev.NewTimer()
		if err != nil {
			c.release()
			return nil
		}
		c.t[i] = t
	}
	return c
}

// mark places timer i on s; a failure forgets the timers (the copy is not
// timed), it never fails the copy: the enqueue that follows reports a
// broken stream itself.
func (c *copyTimers) mark(s cuda.Stream, i int) *copyTimers {
	if c == nil {
		return nil
	}
	if err := s.Mark(c.t[i]); err != nil {
		c.release()
		return nil
	}
	return c
}

// times waits for the marks (the copy's Op has completed, so they are
// reached or about to be) and returns their times; ok is false when one
// cannot be read. The host saw the copy complete at waited: a mark later
// than that is clamped to it, noted in tl (Timeline.MarkClamp).
func (c *copyTimers) times(ctx context.Context, tl *Timeline, waited time.Time) (at [3]time.Time, ok bool) {
	if c == nil {
		return at, false
	}
	for i := range c.n {
		var err error
		if at[i], err = c.t[i].Time(ctx); err != nil {
			return at, false
		}
	}
	for i := range c.n {
		if at[i].After(waited) {
			if tl != nil {
				tl.clamp = max(tl.clamp, at[i].Sub(waited))
			}
			at[i] = waited
		}
	}
	return at, true
}

func (c *copyTimers) release() {
	if c == nil {
		return
	}
	for i, t := range c.t {
		if t != nil {
			_ = t.Release()
			c.t[i] = nil
		}
	}
}

// pendingCopy is a copy the host saw complete whose marks Resolve reads.
type pendingCopy struct {
	c         *copyTimers
	stages    [2]Stage // device stage i runs from mark i to mark i+1
	batch     int
	waitStart time.Time // the host began to wait
	waited    time.Time // the host saw the copy complete
	wait      int       // index of its StageWait span; -1: not kept
	notice    int       // index of its StageNotice span; -1: not kept
}

// copyDone records that the host saw the copy of batch complete at
// waited: StageWait up to then and an empty StageNotice, which Resolve
// splits at the device's end of the copy. It takes c (the marks around
// the copy, one more than stages) for Resolve and returns nil; without a
// timeline it returns c, for the caller to release. Reading the marks here
// would hold the host up: on the H200 a mark after a copy was seen
// reached up to 14 ms after the copy's own completion with four rankds
// time-slicing the GPU.
func (t *Timeline) copyDone(c *copyTimers, batch int, waited time.Time, stages ...Stage) *copyTimers {
	if t == nil {
		return c
	}
	p := pendingCopy{c: c, batch: batch, waitStart: t.last, waited: waited, wait: -1, notice: -1}
	if n := len(t.spans); !t.truncated && n+2 <= maxSpans {
		p.wait, p.notice = n, n+1
	}
	t.LapTo(StageWait, batch, waited)
	t.LapTo(StageNotice, batch, waited)
	if c == nil {
		return nil
	}
	copy(p.stages[:], stages)
	t.pending = append(t.pending, p)
	return nil
}

// Resolve reads the device times of the copies (their marks are reached
// by then, or soon: ctx bounds the wait), records the device stages,
// splits each copy's wait at the device's end into StageWait and
// StageNotice, and releases the timers. The caller calls it once the
// request is over, before reading Spans or Total.
func (t *Timeline) Resolve(ctx context.Context) {
	if t == nil {
		return
	}
	for _, p := range t.pending {
		at, ok := p.c.times(ctx, t, p.waited)
		p.c.release()
		if !ok {
			continue
		}
		n := p.c.n - 1
		for i := range n {
			from := at[i]
			if s := p.c.started; i == n-1 && from.Before(s) {
				// the copy's stage: from its first work on the stream
				from = s
				if from.After(at[i+1]) {
					from = at[i+1]
				}
			}
			t.Device(p.stages[i], p.batch, from, at[i+1])
		}
		end := at[n]
		if end.Before(p.waitStart) {
			end = p.waitStart
		}
		d := p.waited.Sub(end) // after the device's end: the host's notice
		if d <= 0 {
			continue
		}
		t.totals[StageWait] -= d
		t.totals[StageNotice] += d
		if p.wait >= 0 {
			t.spans[p.wait].Dur -= d
			t.spans[p.notice].Start -= d
			t.spans[p.notice].Dur += d
		}
	}
	t.pending = nil
}
