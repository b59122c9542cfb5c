package rankd

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// ReleaseRequest asks a rankd to release the pools one engine session
// registered for a namespace (the engine is going away); objects stay in
// L1 and L2. Session is the RegisterReply.Session of that registration.
// wire has no type for it, so it lives here.
type ReleaseRequest struct {
	Namespace dcp.Namespace `json:"namespace"`
	Session   string        `json:"session"`
}

// ReleaseReply confirms a release.
type ReleaseReply struct {
	Namespace dcp.Namespace `json:"namespace"`
	Session   string        `json:"session"`
}

// CutRequest cuts the stores of one request that wait before their gather
// (for L1 room): vLLM preempted the request and freed its blocks without
// asking the engine, which must not reuse them while a store may still
// read them. Each cut store answers at once, the objects it had not begun
// to gather failed (not stored, their pages never read); a gather already
// begun ends first. Only the caller's own stores are cut.
//
// Through (Unix nanoseconds, optional) bounds the cut to the stores whose
// engine deadline (wire.HeaderDeadline) is at or before it, and makes it
// cut such a store also when the store registers after the cut (the two
// may arrive in either order); a store the engine sends after the cut
// carries a later deadline and is not cut. Zero: the stores in flight,
// whatever their deadline.
type CutRequest struct {
	RequestID string `json:"request_id"`
	Through   int64  `json:"through,omitempty"`
}

// CutReply says how many stores in flight were cut.
type CutReply struct {
	Stores int `json:"stores"`
}

// StatusRequest is the status request; "{}" or an empty body asks for
// the status alone.
type StatusRequest struct {
	// Timelines, when set, asks for the stage timelines of the recent
	// requests with this id (a store's request id, a retrieve's restore
	// id; StatusAllTimelines: every recent one) in StatusReply.Timelines.
	Timelines string `json:"timelines,omitempty"`
}

// StatusReply describes the daemon and its engine.
type StatusReply struct {
	Rank        wire.Rank      `json:"rank"`
	TPSize      int            `json:"tp_size"`
	Incarnation uint64         `json:"incarnation"`
	Device      DeviceStatus   `json:"device"`
	NATS        string         `json:"nats"`
	Gossip      string         `json:"gossip"`
	Events      EventStatus    `json:"events"`
	Engine      transfer.Stats `json:"engine"`
	// Sessions is the number of live engine sessions (one per registered
	// namespace).
	Sessions  int  `json:"sessions"`
	Accepting bool `json:"accepting"`
	// Timelines are the recent stage timelines StatusRequest.Timelines
	// asked for (the rankd keeps the last 64 stores and retrieves), oldest
	// first.
	Timelines []wire.Timeline `json:"timelines,omitempty"`
}

// DeviceStatus is the device part of a status reply.
type DeviceStatus struct {
	Backend string `json:"backend"`
	UUID    string `json:"uuid"`
	Name    string `json:"name"`
}

// EventStatus is the event publishing part of a status reply.
type EventStatus struct {
	QueuedBatches  int    `json:"queued_batches"`
	AppliedThrough uint64 `json:"applied_through"`
}

// DecodeReleaseRequest decodes and validates a release request.
func DecodeReleaseRequest(data []byte) (*ReleaseRequest, error) {
	var req ReleaseRequest
	if err := decodeStrict("release", data, &req); err != nil {
		return nil, err
	}
	if req.Namespace == (dcp.Namespace{}) {
		return nil, badf("release: namespace is missing")
	}
	return &req, nil
}

// decodeStatus accepts an empty body or a StatusRequest.
func decodeStatus(data []byte) (StatusRequest, error) {
	var req StatusRequest
	if len(data) == 0 {
		return req, nil
	}
	err := decodeStrict("status", data, &req)
	return req, err
}

// engineHandler returns the NATS handler of one engine API operation. The
// callback only takes a slot and hands the request to a goroutine of the
// requests group, so a store waiting on its producer event never holds up
// other requests. Once Shutdown has closed the group every request is
// answered unavailable here, on the callback (refuseClosing).
func (d *Daemon) engineHandler(op string) nats.MsgHandler {
	name, rejectName := "engine-"+op, "engine-"+op+"-busy"
	return func(msg *nats.Msg) {
		recv := time.Now() // a store's or retrieve's timeline starts here
		d.mu.Lock()
		closing := d.closing
		d.mu.Unlock()
		if closing {
			d.refuseClosing(op, msg)
			return
		}
		select {
		case d.slots <- struct{}{}:
		default:
			err := fmt.Errorf("rankd %s serves %d requests already: %w", d.cfg.Rank, d.cfg.MaxInFlight, ErrUnavailable)
			if op != OpRetrieve {
				d.replyErr(op, msg, err)
				return
			}
			// The report may take a while: not on the NATS callback.
			if !d.requests.Go(rejectName, func() {
				d.reportRejected(msg.Data, err)
				d.replyErr(op, msg, err)
			}) {
				d.refuseClosing(op, msg)
			}
			return
		}
		d.met.inFlight.Inc()
		if !d.requests.Go(name, func() {
			var fin *finishedTimeline
			defer func() {
				<-d.slots
				d.met.inFlight.Dec()
				// After the slot: reading the device's times may wait
				// (up to a second) for the marks of a copy that failed.
				fin.record(d.met.stages)
			}()
			start := time.Now()
			fin = d.serve(op, msg, recv)
			d.met.requestSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
		}) {
			// Shutdown closed the group since closing was read.
			<-d.slots
			d.met.inFlight.Dec()
			d.refuseClosing(op, msg)
		}
	}
}

// refuseClosing answers a request that arrived once Shutdown began with
// code unavailable; a retrieve's restore is also reported rejected, so the
// coordinator does not wait for it (bounded by ReportTimeout).
func (d *Daemon) refuseClosing(op string, msg *nats.Msg) {
	err := fmt.Errorf("rankd %s is shutting down: %w", d.cfg.Rank, ErrUnavailable)
	if op == OpRetrieve {
		d.reportRejected(msg.Data, err)
	}
	d.replyErr(op, msg, err)
}

// finishedTimeline is the timeline of a store or retrieve that was
// answered, for stageRecorder.done once the request's slot is free.
type finishedTimeline struct {
	op, id string
	tl     *transfer.Timeline
}

func (f *finishedTimeline) record(r *stageRecorder) {
	if f != nil {
		r.done(f.op, f.id, f.tl)
	}
}

// serve answers one engine request, received at recv; every path replies
// exactly once. It returns the timeline of a store or retrieve that was
// answered (nil for others and for refusals), not written any more.
func (d *Daemon) serve(op string, msg *nats.Msg, recv time.Time) (fin *finishedTimeline) {
	defer func() {
		if r := recover(); r != nil {
			fin = nil // possibly half written
			d.log.Error("engine request handler panicked; replied internal", zap.String("op", op), zap.Any("panic", r), zap.Stack("stack"))
			d.replyErr(op, msg, fmt.Errorf("internal error serving %s", op))
		}
	}()
	// Requests are bounded by the engine's own timeouts; the daemon's life
	// context cuts them short at the very end of a shutdown.
	ctx := d.life
	var err error
	switch op {
	case OpRegister:
		err = d.serveRegister(ctx, msg)
	case OpStore:
		fin, err = d.serveStore(ctx, msg, transfer.NewTimeline(recv))
	case OpRetrieve:
		fin, err = d.serveRetrieve(ctx, msg, transfer.NewTimeline(recv))
	case OpRelease:
		err = d.serveRelease(msg)
	case OpStatus:
		err = d.serveStatus(msg)
	default:
		err = badf("unknown operation %q", op)
	}
	if err != nil {
		d.replyErr(op, msg, err)
	}
	return fin
}

// replyErr sends an error reply with the error's stable code and counts it.
func (d *Daemon) replyErr(op string, msg *nats.Msg, err error) {
	code := Code(err)
	d.met.requests.WithLabelValues(op, code).Inc()
	if code == wire.CodeInternal {
		d.log.Error("engine request failed", zap.String("op", op), zap.String("code", code), zap.Error(err))
	} else {
		d.log.Debug("engine request refused", zap.String("op", op), zap.String("code", code), zap.Error(err))
	}
	if msg.Reply == "" {
		return
	}
	if rerr := bus.RespondError(msg, code, err.Error()); rerr != nil {
		d.log.Warn("cannot send an error reply", zap.String("op", op), zap.Error(rerr))
	}
}

func respond[T any](d *Daemon, op string, msg *nats.Msg, v *T) error {
	d.met.requests.WithLabelValues(op, "ok").Inc()
	if msg.Reply == "" {
		return nil
	}
	if err := bus.Respond(msg, v); err != nil {
		d.log.Warn("cannot send a reply", zap.String("op", op), zap.Error(err))
	}
	return nil
}

func (d *Daemon) serveRegister(ctx context.Context, msg *nats.Msg) error {
	// One request delivered twice (same bytes, same reply subject: every
	// request has its own) gets the first delivery's answer; registering
	// it again would supersede the engine's own session.
	first, dup := d.regs.claim(msg.Reply, msg.Data)
	if dup {
		rep, err := first.wait(ctx)
		if err != nil {
			return err
		}
		d.log.Warn("register request delivered twice; answered with the session of its first delivery",
			zap.String("session", rep.Session), zap.String("reply", msg.Reply))
		return respond(d, OpRegister, msg, rep)
	}
	rep, err := d.register(ctx, msg)
	first.finish(rep, err)
	if err != nil {
		return err
	}
	return respond(d, OpRegister, msg, rep)
}

func (d *Daemon) register(ctx context.Context, msg *nats.Msg) (*wire.RegisterReply, error) {
	req, _, err := DecodeRegisterRequest(msg.Data)
	if err != nil {
		return nil, err
	}
	if req.Spec.Layout.TP != d.cfg.TPSize {
		return nil, fmt.Errorf("register: layout TP size %d, this rank belongs to TP size %d: %w", req.Spec.Layout.TP, d.cfg.TPSize, ErrBadRequest)
	}
	caller := d.callerOf(msg)
	s, err := d.eng.Register(ctx, transfer.Registration(*req), caller)
	if err != nil {
		return nil, err
	}
	res := s.Resolved
	if s.Superseded != "" {
		d.met.supersessions.Inc()
		d.log.Warn("engine registration superseded a live session: its later requests are refused as stale_session",
			zap.Stringer("namespace", res.Namespace), zap.String("session", s.ID), zap.String("superseded", s.Superseded),
			zap.String("engine", caller))
	}
	d.log.Info("engine registered pools", zap.Stringer("namespace", res.Namespace), zap.String("model", res.Model),
		zap.String("session", s.ID), zap.String("engine", caller), zap.Int("pools", len(req.Pools)))
	return &wire.RegisterReply{Namespace: res.Namespace, Session: s.ID, Superseded: s.Superseded}, nil
}

// regDedup remembers the last register requests by reply subject and body
// digest, so that a second delivery of one request is answered, not
// registered again.
type regDedup struct {
	mu      sync.Mutex  // guards the following
	entries []*regEntry // oldest first, at most regDedupSize
}

// regDedupSize is how many recent register requests are remembered.
const regDedupSize = 64

type regEntry struct {
	reply string
	sum   [sha256.Size]byte
	done  chan struct{}
	rep   *wire.RegisterReply // valid after done
	err   error
}

// claim returns the entry of the request (reply, data): the earlier one
// and dup true when it was seen, else a new one the caller must finish.
// A request without a reply subject is never a duplicate.
func (r *regDedup) claim(reply string, data []byte) (*regEntry, bool) {
	e := &regEntry{reply: reply, sum: sha256.Sum256(data), done: make(chan struct{})}
	if reply == "" {
		return e, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, old := range r.entries {
		if old.reply == reply && old.sum == e.sum {
			return old, true
		}
	}
	if len(r.entries) == regDedupSize {
		r.entries = append(r.entries[:0], r.entries[1:]...)
	}
	r.entries = append(r.entries, e)
	return e, false
}

func (e *regEntry) finish(rep *wire.RegisterReply, err error) {
	e.rep, e.err = rep, err
	close(e.done)
}

func (e *regEntry) wait(ctx context.Context) (*wire.RegisterReply, error) {
	select {
	case <-e.done:
		return e.rep, e.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// callerOf returns the engine identity of msg's sender (Config.EngineIdentity).
func (d *Daemon) callerOf(msg *nats.Msg) string {
	if d.cfg.EngineIdentity != nil {
		return d.cfg.EngineIdentity(msg)
	}
	return "engine/" + d.cfg.Rank.Instance
}

// serveStore serves a store, recording its stages in tl; once it has
// answered it returns tl, final.
func (d *Daemon) serveStore(ctx context.Context, msg *nats.Msg, tl *transfer.Timeline) (*finishedTimeline, error) {
	req, err := DecodeStoreRequest(msg.Data)
	if err != nil {
		return nil, err
	}
	tl.Lap(transfer.StageDecode, -1)
	// The engine's deadline (wire.HeaderDeadline): the engine holds the
	// blocks until the answer, so the store may keep it waiting on the
	// cache (for L1 room) only until then (C11); a gather already begun
	// still ends before the answer (C1). Past it on arrival: refused,
	// nothing read. (A rankd that predates the header ignores it and
	// bounds the store by its store timeout only.)
	sctx := ctx
	var dl time.Time
	if v := msg.Header.Get(wire.HeaderDeadline); v != "" {
		if dl, err = wire.ParseDeadline(v); err != nil {
			return nil, err
		}
		if late := time.Since(dl); late >= 0 {
			d.met.storeDeadline.WithLabelValues("expired_on_arrival").Inc()
			return nil, fmt.Errorf("store %s arrived %v after the engine's deadline; nothing stored: %w", req.RequestID, late.Round(time.Millisecond), ErrUnavailable)
		}
		// Store takes the deadline of its context as the engine's; the
		// future outlives it (waited for under ctx below).
		var cancel context.CancelFunc
		sctx, cancel = context.WithDeadline(ctx, dl)
		defer cancel()
	}
	// When the engine stops waiting for the answer (wire.HeaderGatherLimit):
	// a gather that ends later commits nothing, its pages may have been
	// reused meanwhile.
	if v := msg.Header.Get(wire.HeaderGatherLimit); v != "" {
		limit, err := wire.ParseGatherLimit(v)
		if err != nil {
			return nil, err
		}
		sctx = transfer.WithGatherLimit(sctx, limit)
	}
	// The engine serves it only for the session's owner (checked where it
	// finds the session).
	// tl is the store's until Done.
	caller := d.callerOf(msg)
	f, err := d.eng.Store(transfer.WithTimeline(sctx, tl), transfer.StoreRequestOf(req, caller))
	if err != nil {
		return nil, err
	}
	untrack, cut := d.cuts.track(cutKey{caller, req.RequestID}, f, dl, time.Now())
	defer untrack()
	if cut {
		d.met.storeCuts.WithLabelValues("on_arrival").Inc()
		d.log.Debug("store cut on arrival by its engine's earlier cut", zap.String("request", req.RequestID))
	}
	// The reply goes out once the objects are committed (or failed): the
	// engine may then reuse its blocks and release its event.
	res, _ := f.Wait(ctx)
	select {
	case <-f.Done():
	default:
		return nil, fmt.Errorf("store %s: %w", req.RequestID, ctx.Err())
	}
	rep := res.Wire()
	if cut := res.PastDeadline(); cut > 0 {
		d.met.storeDeadline.WithLabelValues("cut").Inc()
		// Counted; "store had failed objects" below names them.
		d.log.Debug("store's engine deadline passed while it waited for L1 room: objects not stored",
			zap.String("request", req.RequestID), zap.Int("objects", cut), zap.Time("deadline", dl))
	}
	if res.GatherLate() > 0 {
		// Counted; the engine logged the store, "store had failed
		// objects" below names them.
		d.met.storeDeadline.WithLabelValues("gather_late").Inc()
	}
	// A store that timed out is done before the device has finished
	// reading the blocks (a reaper waits for it): the engine must not
	// reuse them or destroy its event until Released. Wait for it, and
	// if it still has not come, say so in the reply.
	wctx, wcancel := context.WithTimeout(ctx, d.releaseWait)
	if err := f.WaitReleased(wctx); err != nil {
		rep.BlocksInUse = true
		d.log.Warn("store replied with its blocks still in use by the device", zap.String("request", req.RequestID), zap.Duration("waited", d.releaseWait))
		d.announceFreed(req, f) // C10: a later message says when they are free
	}
	wcancel()
	if len(rep.Failed) > 0 {
		d.log.Warn("store had failed objects", zap.String("request", req.RequestID), zap.Strings("failed", rep.Failed))
	}
	tl.Lap(transfer.StageRelease, -1)
	err = respond(d, OpStore, msg, &rep)
	tl.Lap(transfer.StageReply, -1)
	return &finishedTimeline{OpStore, req.RequestID, tl}, err
}

// serveCut serves OpCut on the NATS callback: it takes no request slot
// (the stores it cuts may hold every one) and does not wait for the
// stores, which answer their own requests once cut.
func (d *Daemon) serveCut(msg *nats.Msg) {
	var req CutRequest
	if err := decodeStrict("cut", msg.Data, &req); err != nil {
		d.replyErr(OpCut, msg, err)
		return
	}
	if err := checkID("request id", req.RequestID, true); err != nil {
		d.replyErr(OpCut, msg, err)
		return
	}
	if req.Through < 0 {
		d.replyErr(OpCut, msg, badf("cut: through %d: want Unix nanoseconds >= 0", req.Through))
		return
	}
	var through time.Time
	if req.Through > 0 {
		through = time.Unix(0, req.Through)
	}
	// A store the engine sent before this cut registers within moments of
	// its arrival; one that has not within the store timeout never will.
	now := time.Now()
	expires := through
	if limit := now.Add(d.cfg.StoreTimeout); expires.After(limit) {
		expires = limit
	}
	n := d.cuts.cut(cutKey{d.callerOf(msg), req.RequestID}, through, expires, now)
	if n > 0 {
		d.met.storeCuts.WithLabelValues("in_flight").Add(float64(n))
		d.log.Debug("stores cut by the engine", zap.String("request", req.RequestID), zap.Int("stores", n))
	}
	_ = respond(d, OpCut, msg, &CutReply{Stores: n})
}

// serveRetrieve serves a retrieve, recording its stages in tl.
func (d *Daemon) serveRetrieve(ctx context.Context, msg *nats.Msg, tl *transfer.Timeline) (*finishedTimeline, error) {
	req, err := DecodeRetrieveRequest(msg.Data)
	if err != nil {
		d.reportRejected(msg.Data, err)
		return nil, err
	}
	tl.Lap(transfer.StageDecode, -1)
	// The engine's deadline (wire.HeaderDeadline): past it the engine has
	// taken the blocks back, so nothing may be placed after it. It cuts
	// the retrieve's context: items not yet scattered fail as timed out.
	if v := msg.Header.Get(wire.HeaderDeadline); v != "" {
		dl, err := wire.ParseDeadline(v)
		if err != nil {
			d.reportRejected(msg.Data, err)
			return nil, err
		}
		if late := time.Since(dl); late >= 0 {
			d.met.retrieveDeadline.WithLabelValues("expired_on_arrival").Inc()
			err := fmt.Errorf("retrieve %s arrived %v after the engine's deadline; nothing placed: %w", req.RestoreID, late.Round(time.Millisecond), ErrUnavailable)
			d.reportRejected(msg.Data, err)
			return nil, err
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, dl)
		defer cancel()
	}
	// The pace of the copies: the engine's (wire.HeaderPace), else the
	// rank's own (Config.RestorePace).
	rreq := transfer.RetrieveRequestOf(req, d.callerOf(msg))
	rreq.Pace = d.cfg.RestorePace
	if v := msg.Header.Get(wire.HeaderPace); v != "" {
		if rreq.Pace, err = wire.ParsePace(v); err != nil {
			d.reportRejected(msg.Data, err)
			return nil, err
		}
	}
	// The caller must own the session before anything is placed: the
	// engine checks it where it finds the session.
	res, err := d.eng.Retrieve(transfer.WithTimeline(ctx, tl), rreq)
	if ctx.Err() != nil && d.life.Err() == nil && (err != nil || len(res.FailedChunks()) > 0) {
		// The deadline passed before every item was placed (one that
		// passed just after a complete retrieve cut nothing).
		d.met.retrieveDeadline.WithLabelValues("cut").Inc()
	}
	if err != nil {
		if req.RestoreID != "" {
			// The coordinator must learn that this rank placed nothing, so
			// the restore fails now rather than at its deadline.
			failed := make([]wire.ItemResult, len(req.Items))
			for i, it := range req.Items {
				failed[i] = wire.ItemResult{Chunk: it.Chunk, Group: it.Group, Reason: "rejected: " + Code(err)}
			}
			d.report(req.RestoreID, failed)
		}
		return nil, err
	}
	rep := res.Wire()
	if res.BlocksInUse {
		// C10: a scatter that timed out could not be drained (the daemon
		// is closing): the device may still write the engine's blocks.
		// A failure reply would let the engine recompute into them at
		// once, so there is none: the engine keeps the blocks until its
		// own bound, past the deadline it sent and past this process's
		// end, which stops the device's work. The report of the failed
		// items is tried as on any retrieve (at shutdown it rarely gets
		// out; the coordinator then fails them when the rank leaves or at
		// the restore's deadline).
		if req.RestoreID != "" {
			d.report(req.RestoreID, rep.Results)
		}
		d.met.requests.WithLabelValues(OpRetrieve, "unanswered_blocks_in_use").Inc()
		d.log.Error("retrieve left unanswered: its timed-out scatter may still write the engine's blocks",
			zap.String("restore", req.RestoreID))
		return nil, nil
	}
	// The report goes out beside the reply rather than before it: the
	// coordinator parks the engine's restore.wait until every report is
	// in, so the reply need not wait for the report's acknowledgment (a
	// NATS round trip and the coordinator's bookkeeping, 2.6 ms of a
	// 1.3 GB restore on the H200, issue 25.4). The handler still ends
	// only once the report is done, as before: its slot bounds the
	// reports in flight and Shutdown waits for them.
	var reported chan struct{}
	if req.RestoreID != "" {
		reported = make(chan struct{})
		go func() {
			defer close(reported)
			d.report(req.RestoreID, rep.Results)
		}()
	}
	if fc := res.FailedChunks(); len(fc) > 0 {
		d.log.Warn("retrieve had failed chunks", zap.String("restore", req.RestoreID), zap.Ints("chunks", fc))
	}
	reply := rep
	if msg.Header.Get(wire.HeaderResults) == wire.ResultsFailed {
		reply = rep.OnlyFailed() // the report above still carries every item
	}
	err = respond(d, OpRetrieve, msg, &reply)
	tl.Lap(transfer.StageReply, -1)
	if reported != nil {
		<-reported
		tl.Lap(transfer.StageReport, -1) // what of the report outlasted the reply
	}
	return &finishedTimeline{OpRetrieve, req.RestoreID, tl}, err
}

// reportRejected tells the coordinator that a retrieve of a restore was
// rejected before anything was placed: every item failed, the reason
// naming the rejection. It decodes data leniently (only the restore id and
// the items' chunk and group: JSON, or a binary request up to its items),
// so a retrieve refused for validation or before it was decoded still
// fails its restore now rather than at the deadline; when those cannot be
// decoded it reports nothing.
func (d *Daemon) reportRejected(data []byte, rejection error) {
	type item struct{ Chunk, Group int }
	var restoreID string
	var items []item
	if wire.IsBinaryRetrieve(data) {
		req, err := wire.PeekRetrieveBinary(data, binaryLimits)
		if err != nil {
			return
		}
		restoreID = req.RestoreID
		items = make([]item, len(req.Items))
		for i, it := range req.Items {
			items[i] = item{it.Chunk, it.Group}
		}
	} else {
		var req struct {
			RestoreID string `json:"restore_id"`
			Items     []struct {
				Chunk int `json:"chunk"`
				Group int `json:"group"`
			} `json:"items"`
		}
		if json.Unmarshal(data, &req) != nil {
			return
		}
		restoreID = req.RestoreID
		items = make([]item, len(req.Items))
		for i, it := range req.Items {
			items[i] = item{it.Chunk, it.Group}
		}
	}
	if restoreID == "" || len(items) == 0 || checkID("restore id", restoreID, false) != nil {
		return
	}
	failed := make([]wire.ItemResult, len(items))
	for i, it := range items {
		failed[i] = wire.ItemResult{Chunk: it.Chunk, Group: it.Group, Reason: "rejected: " + Code(rejection)}
	}
	d.report(restoreID, failed)
}

// report sends the results of a restore's retrieve to the coordinator,
// retrying within ReportTimeout; a report that cannot be delivered makes
// the restore fail at its deadline (counted and logged). Each attempt
// takes the daemon's current connection: after switchNATS the old one is
// closed, and a retry on it could never arrive.
//
// A report goes in its binary form (wire's KVT1: 17 bytes a result where
// JSON spends about 60, decoded without reflection) unless the coordinator
// refused one and then took it as JSON: it predates the form, and reports
// go as JSON from then on (Daemon.reportJSON).
func (d *Daemon) report(restoreID string, results []wire.ItemResult) {
	rep := wire.RestoreReport{RestoreID: restoreID, Rank: d.cfg.Rank, Results: results}
	var body any = &rep
	binary := false
	if !d.reportJSON.Load() {
		if b, err := rep.MarshalBinary(); err == nil { // else a result the form cannot carry: JSON
			body, binary = bus.Raw(b), true
		}
	}
	fellBack := false
	ctx, cancel := context.WithTimeout(d.life, d.cfg.ReportTimeout)
	defer cancel()
	var err error
	for attempt := 0; ; attempt++ {
		actx, acancel := context.WithTimeout(ctx, max(d.cfg.ReportTimeout/4, 100*time.Millisecond))
		var ack *wire.ReportAck
		d.mu.Lock()
		nc := d.nc
		d.mu.Unlock()
		ack, err = bus.Call[wire.ReportAck](actx, nc, d.subj.Report(d.cfg.Rank), body)
		acancel()
		if err == nil {
			if fellBack && d.reportJSON.CompareAndSwap(false, true) {
				d.log.Warn("the coordinator reads restore reports as JSON only (it predates binary reports): reports go as JSON")
			}
			d.met.reports.WithLabelValues("ok").Inc()
			d.log.Debug("restore reported", zap.String("restore", restoreID), zap.String("state", ack.State), zap.Bool("duplicate", ack.Duplicate))
			return
		}
		if binary && wire.IsNotJSONRefusal(err) {
			// A coordinator from before binary reports: the same report
			// as JSON, at once.
			body, binary, fellBack = &rep, false, true
			continue
		}
		var we *wire.Error
		if errors.As(err, &we) && we.Code != wire.CodeUnavailable && we.Code != wire.CodeInternal {
			break // the coordinator will never take it (unknown restore, bad report)
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond << min(attempt, 4)):
			continue
		}
		break
	}
	d.met.reports.WithLabelValues("failed").Inc()
	d.log.Error("could not report restore results to the coordinator", zap.String("restore", restoreID), zap.Error(err))
}

func (d *Daemon) serveRelease(msg *nats.Msg) error {
	req, err := DecodeReleaseRequest(msg.Data)
	if err != nil {
		return err
	}
	if err := d.eng.Release(req.Namespace, req.Session, d.callerOf(msg)); err != nil {
		return err
	}
	d.log.Info("engine released its pools", zap.Stringer("namespace", req.Namespace), zap.String("session", req.Session))
	return respond(d, OpRelease, msg, &ReleaseReply{Namespace: req.Namespace, Session: req.Session})
}

func (d *Daemon) serveStatus(msg *nats.Msg) error {
	req, err := decodeStatus(msg.Data)
	if err != nil {
		return err
	}
	st := d.Status()
	if req.Timelines != "" {
		st.Timelines = d.met.stages.find(req.Timelines)
	}
	return respond(d, OpStatus, msg, st)
}

// Status returns the daemon's status.
func (d *Daemon) Status() *StatusReply {
	info := d.dev.Info()
	d.mu.Lock()
	st := &StatusReply{Rank: d.cfg.Rank, TPSize: d.cfg.TPSize, Incarnation: d.inc, NATS: d.natsURL,
		Device: DeviceStatus{Backend: info.Backend, UUID: info.UUID, Name: info.Name}, Accepting: !d.closing && d.readyOnce}
	eng := d.eng
	d.mu.Unlock()
	st.Gossip = d.clu.LocalMember().Addr
	st.Events = d.pub.status()
	if eng != nil { // nil until Start passed the duplicate check
		st.Engine = eng.Stats()
		st.Sessions = eng.Sessions()
	}
	return st
}

// onInventory answers one of the coordinator's paged inventory requests
// (resync; wire.InventoryRequest).
func (d *Daemon) onInventory(msg *nats.Msg) {
	ok := d.goroutines.Go("inventory", func() {
		page, _, err := d.invs.serve(msg)
		if page != nil {
			d.met.inventories.Inc()
			d.log.Debug("inventory page served", zap.String("snapshot", page.Snapshot), zap.Int("page", page.Page),
				zap.Int("pages", page.Pages), zap.Int("objects", len(page.Objects)))
		}
		if err != nil {
			d.log.Warn("cannot send the inventory reply", zap.Error(err))
		}
	})
	if !ok {
		// Shutdown's last phase (the group closes with stopped): say so
		// rather than let the request time out. The coordinator retries a
		// resync later; a liveness probe answered so proves nothing.
		if err := bus.RespondError(msg, wire.CodeUnavailable, fmt.Sprintf("rankd %s is shutting down", d.cfg.Rank)); err != nil {
			d.log.Warn("cannot send the inventory refusal", zap.Error(err))
		}
	}
}
