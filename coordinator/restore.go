package coordinator

import (
	"container/heap"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// The restore protocol (C5). The verdict itself is index.Restore's pure
// state machine; this file owns what is around it: ids, the plan, locking,
// the waiters, the deadline timer and the verdict history.
//
//	restore.begin  RestoreBeginRequest -> RestorePlan   lookup, plan, start tracking
//	restore.report RestoreReport       -> ReportAck     feed the state machine
//	restore.wait   RestoreWait         -> RestoreVerdict as soon as it is final
//
// Waiters are parked (their request message kept, no goroutine) and
// answered directly by the report handler that makes the verdict final, so
// the verdict leaves within microseconds of the last report; the deadline
// loop answers them when silence becomes failure.
//
// A restore whose prefix is 0 (nothing restorable) is decided at once as
// complete with prefix 0: nothing was promised, so nothing can be missing;
// the engine recomputes every chunk, as it would after any verdict for the
// chunks past the prefix. Its id is valid for restore.wait like any other.
// A restore refused although chunks are stored (a reader rank is not
// alive: see below) is decided at once as refused, with the reason in the
// plan and in the verdict; it is recorded and counted as refused, never as
// complete.
//
// # Reader liveness
//
// Lookup counts stored copies, and an L2 copy outlives its holder: while a
// reader rank is dead or partitioned, lookup still finds a full prefix, but
// a restore can only fail, at its deadline. So restore.begin plans nothing
// (prefix 0, RestorePlan.Reason says why, counted in
// kvtier_coord_restores_not_planned_total) unless every reader rank of the
// namespace's layout, for the chosen instance, is alive. Lookup still
// reports the prefix (what is stored) and lists the readers that are not
// alive in LookupReply.NotAlive. A reader rank is judged (judgeReader) from
// the rankd incarnations this coordinator has seen in memberlist since it
// started (liveTable, which, unlike memberlist's table, never forgets the
// newest incarnation of a rank) and the index's record of the rank:
//
//   - an incarnation of it is alive in memberlist: alive. This holds even
//     when the index has it fenced: a member that came back after a false
//     death (its resync pending), or a restarted rankd whose first batch
//     has not landed, reads the plan's L2 copies fine (fenced L1 copies are
//     never planned);
//   - it was seen, and its newest incarnation seen (not older than the
//     index's) is dead or left: not alive;
//   - never seen in memberlist (or the index knows a newer incarnation than
//     any seen): alive if the index does not know the rank either (a reader
//     that never stored anything has no record: no evidence against it);
//     not alive if the index has it fenced; not alive if membership
//     inference is on (StartupFenceGrace > 0, the same switch that lets the
//     startup fence treat absence as death) and the grace has passed since
//     Start, by which time every live rankd has (re)joined; otherwise alive.
//     So a cluster of one driven over NATS alone (tests, StartupFenceGrace
//     0) is never refused for want of members, and a coordinator restarted
//     under a running cluster does not refuse restores while its ranks
//     rejoin.
//
// The check runs under the restore table's lock, so a begin and a fence
// are ordered: a restore planned just before a death notification is in
// the table when the death fails it.
//
// # Failing early
//
// When the coordinator fences a rank (memberlist death or leave, a new
// incarnation's first batch or inventory, the startup fence), every active
// restore expecting that incarnation of the rank (readers record the
// incarnation they expect at begin: see readerStatus.inc) gets the rank's
// unreported chunks failed at once with the reason ("rank eng/1 dead",
// "left", "superseded"), fed through the state machine's Report exactly as
// the rank would report failures; results it had already reported stay as
// they were. When that makes the verdict final the waiters are answered at
// once. Counted in kvtier_coord_restore_rank_failures_total by cause.

// restores is the coordinator's restore table.
type restores struct {
	c    *Coordinator
	boot string        // random per start: ids are unique across restarts
	kick chan struct{} // capacity 1: the earliest deadline changed

	mu      sync.Mutex // guards the following
	seq     uint64
	active  map[string]*activeRestore
	byDL    deadlineHeap
	history []*wire.AdminRestore // ring, VerdictHistory entries (admin.restores)
	next    int                  // next ring slot
	// decided holds each instance's last VerdictHistory verdicts by id,
	// for restore.wait and late reports; decidedOf rings their ids by
	// instance, so one instance's restores (a flood of empty begins)
	// never push another's verdict out before its engine waited for it.
	decided   map[string]*wire.AdminRestore
	decidedOf map[string]*verdictRing
	closed    bool
	// perInstance counts active restores by instance; waiters counts the
	// parked waiters of every active restore, waitersOf those by instance.
	perInstance map[string]int
	waiters     int
	waitersOf   map[string]int
}

type activeRestore struct {
	r          *index.Restore
	instance   string
	prefix     int
	ranks      int
	began      time.Time
	lastReport time.Time
	waiters    []*nats.Msg
	heapIdx    int
	readers    map[int]*restoreReader // by TP rank
}

// restoreReader is what a restore expects of one reader rank: the
// incarnation it expected at begin and the (chunk, group) it reads, so a
// fence can report them failed.
type restoreReader struct {
	inc   uint64
	slots []readSlot
}

type readSlot struct {
	chunk int32
	group int32
}

func newRestores(c *Coordinator) *restores {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &restores{
		c:         c,
		boot:      hex.EncodeToString(b[:]),
		kick:      make(chan struct{}, 1),
		active:    make(map[string]*activeRestore),
		history:   make([]*wire.AdminRestore, c.cfg.VerdictHistory),
		decided:   make(map[string]*wire.AdminRestore),
		decidedOf: make(map[string]*verdictRing),

		perInstance: make(map[string]int),
		waitersOf:   make(map[string]int),
	}
}

// encodePlan encodes a successful restore.begin reply in the requested
// encoding: a wire.Reply with the plan as JSON (encodeReply), or the
// binary plan (wire/plan.go), checked against the max payload the same
// way (the error wraps errReplyTooLarge and names both numbers).
func (c *Coordinator) encodePlan(enc string, ns dcp.Namespace, plan *wire.RestorePlan) ([]byte, error) {
	if enc != wire.PlanEncodingBinary {
		return c.encodeReply(plan)
	}
	data, err := wire.AppendPlanBinary(nil, plan, ns)
	if err != nil {
		return nil, fmt.Errorf("encode reply: %w", err)
	}
	if lim := c.nc.MaxPayload(); int64(len(data)) > lim {
		return nil, fmt.Errorf("binary reply of %d B exceeds the NATS max payload of %d B: %w", len(data), lim, errReplyTooLarge)
	}
	return data, nil
}

// handleReport feeds one rank's report to the state machine; when that
// makes the verdict final, the waiters are answered before the reporter.
func (rs *restores) handleReport(m *nats.Msg) {
	at := time.Now()
	c := rs.c
	var rep wire.RestoreReport
	if err := decodeRequest(m, &rep, wire.IsBinaryReport); err != nil {
		c.met.reports.WithLabelValues("rejected").Inc()
		c.badRequest(m, "restore.report", err)
		return
	}
	if !c.cfg.Insecure || m.Subject != c.subj.Coord(wire.CoordRestoreReport) {
		if want := c.subj.Report(rep.Rank); m.Subject != want {
			c.met.reports.WithLabelValues("rejected").Inc()
			c.refuse(m, "report", fmt.Errorf("report of rank %s arrived on %s, want %s: %w", rep.Rank, m.Subject, want, wire.ErrMalformed))
			return
		}
	}
	rs.mu.Lock()
	a := rs.active[rep.RestoreID]
	if a == nil {
		d := rs.decided[rep.RestoreID]
		rs.mu.Unlock()
		if d != nil {
			// Decided already (deadline, or a rank failed): late, harmless.
			c.met.reports.WithLabelValues("late").Inc()
			c.log.Info("report after the verdict ignored", zap.String("restore", rep.RestoreID),
				zap.Stringer("rank", rep.Rank), zap.String("state", d.State))
			c.reply(wire.CoordRestoreReport, m, &wire.ReportAck{State: d.State})
			return
		}
		c.met.reports.WithLabelValues("rejected").Inc()
		c.log.Warn("report for an unknown restore", zap.String("restore", rep.RestoreID), zap.Stringer("rank", rep.Rank))
		c.replyError(wire.CoordRestoreReport, m, wire.CodeNotFound, fmt.Sprintf("restore %q is not known (never begun, or its verdict left the history)", rep.RestoreID))
		return
	}
	if rep.Rank.Instance != a.instance {
		rs.mu.Unlock()
		c.met.reports.WithLabelValues("rejected").Inc()
		c.badRequest(m, "restore.report", fmt.Errorf("restore %s is read by instance %q, not by rank %s: %w",
			rep.RestoreID, a.instance, rep.Rank, index.ErrUnexpectedReport))
		return
	}
	out, err := a.r.Report(rep.Rank.TPRank, rep.Results)
	if out.Accepted > 0 {
		a.lastReport = at
	}
	var fin *finished
	if v := a.r.Verdict(); v.Final() {
		fin = rs.finishLocked(rep.RestoreID, a, v, "reports", at)
	}
	rs.mu.Unlock()
	if fin != nil {
		fin.deliver(c)
	}
	switch {
	case err != nil && out.Accepted == 0:
		c.met.reports.WithLabelValues("rejected").Inc()
		c.badRequest(m, "restore.report", err)
		return
	case err != nil:
		// Part of the report counted; say which part did not.
		c.met.reports.WithLabelValues("rejected").Inc()
		c.badRequest(m, "restore.report", err)
		return
	case out.Duplicates > 0 && out.Accepted == 0:
		c.met.reports.WithLabelValues("duplicate").Inc()
		c.log.Debug("duplicate report ignored", zap.String("restore", rep.RestoreID), zap.Stringer("rank", rep.Rank))
	case out.Late > 0:
		c.met.reports.WithLabelValues("late").Inc()
	default:
		c.met.reports.WithLabelValues("ok").Inc()
	}
	c.reply(wire.CoordRestoreReport, m, &wire.ReportAck{Duplicate: out.Duplicates > 0 && out.Accepted == 0, State: out.State})
}

// refuseForeign refuses m, a kind request (restore_wait, restore_cancel)
// by instance caller about restore id of instance owner, counted as
// unauthorized and, when the caller is outside owner's share group, as a
// share refusal too.
func (c *Coordinator) refuseForeign(m *nats.Msg, kind, id, owner, caller string) {
	if _, outside := c.share.outside(caller, owner); outside {
		c.share.met.refused.WithLabelValues(kind).Inc()
	}
	c.refuse(m, kind, fmt.Errorf("restore %s belongs to instance %q, not to the caller %q: %w", id, owner, caller, wire.ErrMalformed))
}

// handleWait parks the waiter until the verdict is final, or answers at
// once if it is.
func (rs *restores) handleWait(m *nats.Msg) {
	c := rs.c
	var req wire.RestoreWait
	if err := bus.Decode(m, &req); err != nil {
		c.badRequest(m, "restore.wait", err)
		return
	}
	var inst string
	if !c.scope(m, wire.CoordRestoreWait, "restore_wait", &inst) {
		return
	}
	rs.mu.Lock()
	if a := rs.active[req.RestoreID]; a != nil {
		if inst != "" && a.instance != inst {
			rs.mu.Unlock()
			c.refuseForeign(m, "restore_wait", req.RestoreID, a.instance, inst)
			return
		}
		if rs.closed {
			rs.mu.Unlock()
			c.replyError(wire.CoordRestoreWait, m, wire.CodeUnavailable, "coordinator shutting down")
			return
		}
		if len(a.waiters) >= c.cfg.MaxWaitersPerRestore || rs.waiters >= c.cfg.MaxWaiters {
			n, total := len(a.waiters), rs.waiters
			rs.mu.Unlock()
			c.met.refused.WithLabelValues("waiters").Inc()
			c.replyError(wire.CoordRestoreWait, m, wire.CodeUnavailable,
				fmt.Sprintf("restore %s has %d waiters (limit %d, MaxWaitersPerRestore), %d in all (limit %d, MaxWaiters)",
					req.RestoreID, n, c.cfg.MaxWaitersPerRestore, total, c.cfg.MaxWaiters))
			return
		}
		if n := rs.waitersOf[a.instance]; n >= c.cfg.MaxWaitersPerInstance {
			rs.mu.Unlock()
			c.met.refused.WithLabelValues("instance_waiters").Inc()
			c.replyError(wire.CoordRestoreWait, m, wire.CodeUnavailable,
				fmt.Sprintf("instance %s has %d waiters parked (limit %d, MaxWaitersPerInstance)", a.instance, n,
					c.cfg.MaxWaitersPerInstance))
			return
		}
		a.waiters = append(a.waiters, m)
		rs.waiters++
		rs.waitersOf[a.instance]++
		rs.mu.Unlock()
		return
	}
	d := rs.decided[req.RestoreID]
	rs.mu.Unlock()
	if d == nil {
		c.replyError(wire.CoordRestoreWait, m, wire.CodeNotFound, fmt.Sprintf("restore %q is not known (never begun, or its verdict left the history)", req.RestoreID))
		return
	}
	if inst != "" && d.Instance != inst {
		c.refuseForeign(m, "restore_wait", req.RestoreID, d.Instance, inst)
		return
	}
	v := d.RestoreVerdict
	if v.State == wire.VerdictComplete {
		if err := c.repl.confirmComplete(); err != nil {
			c.replyError(wire.CoordRestoreWait, m, wire.CodeUnavailable, "COMPLETE withheld: "+err.Error())
			return
		}
	}
	c.replyVerdict(m, &v)
}

// causeCancelled is the finish cause of a restore the engine withdrew.
const causeCancelled = "cancelled"

// handleCancel withdraws an active restore no rank has reported for
// (wire.RestoreCancel): every expectation fails with the engine's reason,
// the verdict is final at once (cause "cancelled") and its waiters, if
// any, get it. A restore with a report accepted is left to be decided as
// any: a read ran. Only the restore's instance may cancel it (scope, and
// the instance check below, as for restore.wait).
func (rs *restores) handleCancel(m *nats.Msg) {
	c := rs.c
	var req wire.RestoreCancel
	if err := bus.Decode(m, &req); err != nil {
		c.badRequest(m, "restore.cancel", err)
		return
	}
	var inst string
	if !c.scope(m, wire.CoordRestoreCancel, "restore_cancel", &inst) {
		return
	}
	out := rs.cancel(req.RestoreID, inst)
	switch {
	case out.unknown:
		c.replyError(wire.CoordRestoreCancel, m, wire.CodeNotFound, fmt.Sprintf("restore %q is not known", req.RestoreID))
	case out.owner != "":
		c.refuseForeign(m, "restore_cancel", req.RestoreID, out.owner, inst)
	case out.err != nil:
		c.met.internal.Inc() // the slots are the plan's: cannot happen
		c.log.Error("cancelling a restore's expectations was refused", zap.String("restore", req.RestoreID), zap.Error(out.err))
		c.replyError(wire.CoordRestoreCancel, m, wire.CodeInternal, out.err.Error())
	case out.fin != nil:
		out.fin.deliver(c)
		c.reply(wire.CoordRestoreCancel, m, &wire.CancelReply{Cancelled: true, State: out.fin.verdict.State})
	default:
		c.reply(wire.CoordRestoreCancel, m, &wire.CancelReply{State: out.state})
	}
}

// cancelOutcome is cancel's decision, acted on after the lock is released.
type cancelOutcome struct {
	unknown bool      // no such restore, active or in the history
	owner   string    // set: the restore is this other instance's
	fin     *finished // cancelled: the verdict to deliver
	state   string    // not cancelled: the restore's state (decided, or pending: a rank reported)
	err     error
}

// cancel withdraws restore id for instance inst ("" unscoped) under the
// table's lock, taken once: see handleCancel.
func (rs *restores) cancel(id, inst string) cancelOutcome {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	a := rs.active[id]
	if a == nil {
		d := rs.decided[id]
		switch {
		case d == nil:
			return cancelOutcome{unknown: true}
		case inst != "" && d.Instance != inst:
			return cancelOutcome{owner: d.Instance}
		}
		return cancelOutcome{state: d.State}
	}
	switch {
	case inst != "" && a.instance != inst:
		return cancelOutcome{owner: a.instance}
	case !a.lastReport.IsZero():
		return cancelOutcome{state: wire.VerdictPending}
	}
	for tp, rd := range a.readers {
		results := make([]wire.ItemResult, len(rd.slots))
		for i, sl := range rd.slots {
			results[i] = wire.ItemResult{Chunk: int(sl.chunk), Group: int(sl.group), Reason: "cancelled by the engine before its load"}
		}
		if _, err := a.r.Report(tp, results); err != nil {
			return cancelOutcome{err: fmt.Errorf("cancelling restore %s: %w", id, err)}
		}
	}
	v := a.r.Verdict()
	if !v.Final() {
		return cancelOutcome{err: fmt.Errorf("restore %s not final after every expectation failed", id)}
	}
	return cancelOutcome{fin: rs.finishLocked(id, a, v, causeCancelled, time.Time{})}
}

// replyVerdict answers a restore.wait with v. A failed verdict that fits
// the max payload only without its GroupReasons is sent without them:
// Failed and Reasons (each chunk's first failure) are what the engine acts
// on, and a too_large answer instead would make it recompute the chunks
// before the first failure too (issue 27 added the per-group reasons).
func (c *Coordinator) replyVerdict(m *nats.Msg, v *wire.RestoreVerdict) {
	if len(v.GroupReasons) > 0 {
		data, err := c.encodeReply(v)
		if err == nil {
			c.sendEncoded(wire.CoordRestoreWait, m, data)
			return
		}
		if errors.Is(err, errReplyTooLarge) {
			c.log.Warn("verdict sent without its per-group reasons, which exceed the max payload",
				zap.String("restore", v.RestoreID), zap.Int("failed_chunks", len(v.Failed)), zap.Error(err))
			short := *v
			short.GroupReasons = nil
			v = &short
		}
	}
	c.reply(wire.CoordRestoreWait, m, v)
}

// finished is a verdict to deliver outside the lock.
type finished struct {
	verdict wire.RestoreVerdict
	waiters []*nats.Msg
	entry   *wire.AdminRestore
	last    time.Time // the report that decided it; zero for the deadline
	cause   string
	// bytesWrong counts the failed chunks with wrong bytes
	// (index.Verdict.BytesWrong).
	bytesWrong int
}

// finishLocked moves a decided restore from active to the history.
func (rs *restores) finishLocked(id string, a *activeRestore, v index.Verdict, cause string, last time.Time) *finished {
	delete(rs.active, id)
	rs.waiters -= len(a.waiters)
	if rs.waitersOf[a.instance] -= len(a.waiters); rs.waitersOf[a.instance] <= 0 {
		delete(rs.waitersOf, a.instance)
	}
	if rs.perInstance[a.instance]--; rs.perInstance[a.instance] <= 0 {
		delete(rs.perInstance, a.instance)
	}
	if a.heapIdx >= 0 {
		heap.Remove(&rs.byDL, a.heapIdx)
	}
	rs.c.met.active.Set(float64(len(rs.active)))
	wv := v.Wire(id, a.prefix)
	e := &wire.AdminRestore{RestoreVerdict: wv, Namespace: a.r.Namespace().String(), Instance: a.instance, Ranks: a.ranks,
		Began: a.began, VerdictLatencyUS: -1}
	rs.recordLocked(e)
	return &finished{verdict: wv, waiters: a.waiters, entry: e, last: last, cause: cause, bytesWrong: v.BytesWrong}
}

// verdictRing is one instance's decided restore ids, the oldest
// overwritten first.
type verdictRing struct {
	ids  []string
	next int
}

// recordLocked adds a decided restore to the bounded history and to its
// instance's decided verdicts, dropping the instance's oldest.
func (rs *restores) recordLocked(e *wire.AdminRestore) {
	rs.history[rs.next] = e
	rs.next = (rs.next + 1) % len(rs.history)
	r := rs.decidedOf[e.Instance]
	if r == nil {
		r = &verdictRing{}
		rs.decidedOf[e.Instance] = r
	}
	if len(r.ids) < len(rs.history) { // grown as used: most instances restore little
		r.ids = append(r.ids, e.RestoreID)
	} else {
		delete(rs.decided, r.ids[r.next])
		r.ids[r.next] = e.RestoreID
		r.next = (r.next + 1) % len(r.ids)
	}
	rs.decided[e.RestoreID] = e
}

// deliver counts the verdict, answers the waiters, then measures and logs.
// It counts first so a waiter that reads the metrics after its verdict sees
// the verdict counted.
func (f *finished) deliver(c *Coordinator) {
	if f.cause == causeCancelled {
		// Not a failed read: an alert on failed restores must not fire.
		c.met.restores.WithLabelValues("cancelled", "engine").Inc()
	} else {
		c.met.restores.WithLabelValues(f.verdict.State, f.cause).Inc()
	}
	// Every chunk of the plan is verified or failed once the verdict is
	// final; a cancelled restore's chunks were never read.
	if f.cause != causeCancelled {
		failed := len(f.verdict.Failed)
		c.met.restoreChunks.WithLabelValues("verified").Add(float64(f.verdict.Prefix - failed))
		c.met.restoreChunks.WithLabelValues("bytes_wrong").Add(float64(f.bytesWrong))
		c.met.restoreChunks.WithLabelValues("failed").Add(float64(failed - f.bytesWrong))
	}
	if len(f.waiters) > 0 && f.verdict.State == wire.VerdictComplete {
		if err := c.repl.confirmComplete(); err != nil {
			// Replicated and deposed: a leader that cannot confirm its
			// leadership sends no COMPLETE; the engine recomputes.
			for _, w := range f.waiters {
				c.replyError(wire.CoordRestoreWait, w, wire.CodeUnavailable, "COMPLETE withheld: "+err.Error())
			}
			c.log.Warn("COMPLETE verdict withheld", zap.String("restore", f.verdict.RestoreID), zap.Error(err))
			return
		}
	}
	for _, w := range f.waiters {
		c.replyVerdict(w, &f.verdict)
	}
	now := time.Now()
	var lat time.Duration
	if !f.last.IsZero() {
		lat = now.Sub(f.last)
		c.met.verdictSeconds.Observe(lat.Seconds())
	}
	c.rs.mu.Lock()
	f.entry.Decided = now
	if !f.last.IsZero() {
		f.entry.VerdictLatencyUS = lat.Microseconds()
	}
	c.rs.mu.Unlock()
	fields := []zap.Field{zap.String("restore", f.verdict.RestoreID), zap.String("state", f.verdict.State),
		zap.Int("prefix", f.verdict.Prefix), zap.String("cause", f.cause), zap.Int("waiters", len(f.waiters))}
	if !f.last.IsZero() {
		fields = append(fields, zap.Duration("verdict_latency", lat))
	}
	if f.cause == causeCancelled {
		c.log.Debug("restore cancelled by the engine", fields...)
		return
	}
	if f.verdict.State == wire.VerdictFailed {
		fields = append(fields, zap.Ints("failed_chunks", f.verdict.Failed), zap.Strings("reasons", firstN(f.verdict.Reasons, 8)))
		if g := f.verdict.GroupReasons; len(g) > 0 {
			// Every failed group of the first chunks, not only the one
			// Reasons names (issue 27).
			fields = append(fields, zap.Any("group_reasons", g[:min(len(g), 8)]))
		}
		c.log.Warn("restore failed", fields...)
		return
	}
	c.log.Debug("restore complete", fields...)
}

func firstN(s []string, n int) []string {
	if len(s) > n {
		return append(s[:n:n], fmt.Sprintf("... and %d more", len(s)-n))
	}
	return s
}

// deadlineLoop turns silence into failure at each restore's deadline. It
// sleeps until the earliest deadline, or until handleBegin kicks it with an
// earlier one.
func (rs *restores) deadlineLoop() {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		rs.mu.Lock()
		wait := time.Hour
		if len(rs.byDL) > 0 {
			wait = time.Until(rs.byDL[0].r.Deadline())
		}
		rs.mu.Unlock()
		t.Reset(max(wait, 0))
		select {
		case <-rs.c.ctx.Done():
			return
		case <-rs.kick:
			if !t.Stop() {
				select {
				case <-t.C:
				default:
				}
			}
		case now := <-t.C:
			rs.expire(now)
		}
	}
}

// failRank reports, in every active restore of rank r's instance that
// expects r at incarnation upTo or older, every result r has not reported
// yet as failed with reason, through the state machine's Report as r would
// (results r already reported count as duplicates and change nothing).
// Restores whose verdict that makes final are answered at once, with cause
// "rank_<cause>". It returns the number of restores that had results of r
// pending. Called when the coordinator fences r: death, leave, new
// incarnation, startup fence (see "Failing early").
func (rs *restores) failRank(r wire.Rank, upTo uint64, cause, reason string) int {
	return rs.failRankRange(r, 0, upTo, cause, reason)
}

// failRankRange is failRank for the restores that expect r at an
// incarnation in from..upTo. A death notice fails only the restores that
// expect the incarnation it names.
func (rs *restores) failRankRange(r wire.Rank, from, upTo uint64, cause, reason string) int {
	c := rs.c
	now := time.Now()
	var fins []*finished
	var ids []string
	rs.mu.Lock()
	for id, a := range rs.active {
		if a.instance != r.Instance {
			continue
		}
		rd := a.readers[r.TPRank]
		if rd == nil || rd.inc > upTo || rd.inc < from {
			continue
		}
		results := make([]wire.ItemResult, len(rd.slots))
		for i, sl := range rd.slots {
			results[i] = wire.ItemResult{Chunk: int(sl.chunk), Group: int(sl.group), Reason: reason}
		}
		out, err := a.r.Report(r.TPRank, results)
		if err != nil {
			// Cannot happen: the slots are the plan's.
			c.met.internal.Inc()
			c.log.Error("failing a fenced rank's results was refused", zap.String("restore", id),
				zap.Stringer("rank", r), zap.Error(err))
		}
		if out.Accepted == 0 {
			continue // r had reported everything
		}
		ids = append(ids, id)
		if v := a.r.Verdict(); v.Final() {
			// Removing the current entry while ranging is allowed.
			fins = append(fins, rs.finishLocked(id, a, v, "rank_"+cause, now))
		}
	}
	rs.mu.Unlock()
	if len(ids) > 0 {
		c.met.rankFailures.WithLabelValues(cause).Add(float64(len(ids)))
	}
	for _, f := range fins {
		f.deliver(c)
	}
	if len(ids) > 0 {
		c.log.Warn("active restores failed early: a reader rank was fenced", zap.Stringer("rank", r),
			zap.Uint64("up_to_incarnation", upTo), zap.String("cause", cause), zap.Int("restores", len(ids)),
			zap.Int("decided", len(fins)), zap.Strings("restore_ids", firstN(ids, 8)),
			zap.Duration("took", time.Since(now)))
	}
	return len(ids)
}

// expire decides every restore whose deadline has passed.
func (rs *restores) expire(now time.Time) {
	var fins []*finished
	rs.mu.Lock()
	for len(rs.byDL) > 0 && !now.Before(rs.byDL[0].r.Deadline()) {
		a := rs.byDL[0]
		v := a.r.Expire(now)
		if !v.Final() { // cannot happen: Expire at the deadline decides
			heap.Pop(&rs.byDL)
			continue
		}
		fins = append(fins, rs.finishLocked(a.r.ID(), a, v, "deadline", time.Time{}))
	}
	rs.mu.Unlock()
	for _, f := range fins {
		f.deliver(rs.c)
	}
}

// close answers every parked waiter with code unavailable; later begins
// and waits of active restores are refused.
func (rs *restores) close() {
	rs.mu.Lock()
	rs.closed = true
	var ws []*nats.Msg
	for _, a := range rs.active {
		ws = append(ws, a.waiters...)
		a.waiters = nil
	}
	rs.waiters = 0
	clear(rs.waitersOf)
	rs.mu.Unlock()
	for _, w := range ws {
		rs.c.replyError(wire.CoordRestoreWait, w, wire.CodeUnavailable, "coordinator shutting down before the verdict")
	}
}

// handleHistory answers admin.restores with the verdict history, newest
// first.
func (rs *restores) handleHistory(m *nats.Msg) {
	rs.mu.Lock()
	out := &wire.AdminRestoresReply{Restores: make([]wire.AdminRestore, 0, len(rs.history))}
	n := len(rs.history)
	for i := 1; i <= n; i++ {
		e := rs.history[(rs.next-i+n)%n]
		if e == nil {
			break
		}
		out.Restores = append(out.Restores, *e)
	}
	rs.mu.Unlock()
	rs.c.reply(wire.AdminRestores, m, out)
}

// lookupError answers a failed lookup: unknown namespace, or internal.
func (c *Coordinator) lookupError(m *nats.Msg, op string, ns dcp.Namespace, err error) {
	if errors.Is(err, errTooLarge) {
		c.met.badRequests.WithLabelValues(op).Inc()
		c.replyError(op, m, wire.CodeTooLarge, err.Error())
		return
	}
	if errors.Is(err, index.ErrUnknownNamespace) {
		c.met.badRequests.WithLabelValues(op).Inc()
		c.log.Info("request for an unknown namespace", zap.String("op", op), zap.Stringer("namespace", ns))
		c.replyError(op, m, wire.CodeUnknownNamespace, fmt.Sprintf("namespace %s is not registered", ns))
		return
	}
	c.internalError(m, op, op, err)
}

// deadlineHeap orders active restores by deadline.
type deadlineHeap []*activeRestore

func (h deadlineHeap) Len() int           { return len(h) }
func (h deadlineHeap) Less(i, j int) bool { return h[i].r.Deadline().Before(h[j].r.Deadline()) }
func (h deadlineHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx, h[j].heapIdx = i, j
}
func (h *deadlineHeap) Push(x any) {
	a := x.(*activeRestore)
	a.heapIdx = len(*h)
	*h = append(*h, a)
}
func (h *deadlineHeap) Pop() any {
	old := *h
	a := old[len(old)-1]
	old[len(old)-1] = nil
	a.heapIdx = -1
	*h = old[:len(old)-1]
	return a
}

// abandonAll drops every active restore, answering its waiters with code
// unavailable, and returns how many there were.
func (rs *restores) abandonAll(reason string) int {
	rs.mu.Lock()
	var waiters []*nats.Msg
	n := len(rs.active)
	for id, a := range rs.active {
		waiters = append(waiters, a.waiters...)
		delete(rs.active, id)
	}
	rs.byDL = rs.byDL[:0]
	rs.perInstance = make(map[string]int)
	rs.waiters = 0
	clear(rs.waitersOf)
	rs.c.met.active.Set(0)
	rs.mu.Unlock()
	for _, w := range waiters {
		rs.c.replyError(wire.CoordRestoreWait, w, wire.CodeUnavailable, reason)
	}
	return n
}
