package coordinator

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// Serving: the start-up phases and the gate that answers before them,
// the NATS subscriptions, and NATS's asynchronous errors.

// Start-up phases (Coordinator.phase): which handlers may run.
const (
	phaseOpening int32 = iota // NATS up, index opening: every request answered unavailable
	phaseIndex                // index open and verified: all but the membership admin requests served
	phaseServing              // cluster joined: everything served
)

// gate wraps a handler of operation op so that it runs only once the
// coordinator has reached phase need; before that the request is answered
// with code unavailable and the retry hint startupRetryMS (a message with
// no reply subject, a heartbeat, is dropped and counted as no_inbox).
func (c *Coordinator) gate(op string, need int32, fn nats.MsgHandler) nats.MsgHandler {
	return func(m *nats.Msg) {
		if c.phase.Load() < need {
			what := "index opening: the coordinator serves once it is open and verified; retry"
			if need == phaseServing && c.phase.Load() >= phaseIndex {
				what = "joining the cluster: membership is not known yet; retry"
			}
			c.met.startupRefused.Inc()
			c.sendErrorRetry(op, m, wire.CodeUnavailable, what, startupRetryMS, replyError)
			return
		}
		fn(m)
	}
}

// subscribe registers every NATS handler. In replicated mode it
// subscribes only what every coordinator serves (admin members and raft)
// and returns the rest, which the raft leader subscribes (replicated.go).
func (c *Coordinator) subscribe() ([]leaderHandler, error) {
	type handler struct {
		subject string
		op      string
		fn      nats.MsgHandler
	}
	hs := []handler{
		{c.subj.EventsAll(), opEvents, c.dispatchBatch},
		{c.subj.HeartbeatAll(), "heartbeat", c.handleHeartbeat},
		// Engine subjects scoped to the caller's instance and per-rank
		// reports (C9): the NATS permissions say who may publish there.
		{c.subj.EngineCoordAll(wire.CoordRegister), wire.CoordRegister, c.handleRegister},
		{c.subj.EngineCoordAll(wire.CoordLookup), wire.CoordLookup, c.handleLookup},
		{c.subj.EngineCoordAll(wire.CoordRestoreBegin), wire.CoordRestoreBegin, c.rs.handleBegin},
		{c.subj.ReportAll(), wire.CoordRestoreReport, c.rs.handleReport},
		{c.subj.EngineCoordAll(wire.CoordRestoreWait), wire.CoordRestoreWait, c.rs.handleWait},
		{c.subj.EngineCoordAll(wire.CoordRestoreCancel), wire.CoordRestoreCancel, c.rs.handleCancel},
		{c.subj.Admin(wire.AdminMembers), wire.AdminMembers, c.handleMembers},
		{c.subj.Admin(wire.AdminRanks), wire.AdminRanks, c.handleRanks},
		{c.subj.Admin(wire.AdminObject), wire.AdminObject, c.handleObject},
		{c.subj.Admin(wire.AdminNamespaces), wire.AdminNamespaces, c.handleNamespaces},
		{c.subj.Admin(wire.AdminRestores), wire.AdminRestores, c.rs.handleHistory},
		{c.subj.Admin(wire.AdminVerify), wire.AdminVerify, c.handleVerify},
		{c.subj.Admin(wire.AdminRankReset), wire.AdminRankReset, c.handleRankReset},
		{c.subj.Admin(wire.AdminRoute), wire.AdminRoute, c.handleAdminRoute},
	}
	if r, ok := c.repl.(*replicated); ok {
		hs = append(hs, []handler{
			{c.subj.Admin(wire.AdminRaft), wire.AdminRaft, r.handleRaftStatus},
			{c.subj.Admin(wire.AdminRaftVerify), wire.AdminRaftVerify, r.handleRaftVerify},
			{c.subj.Admin(wire.AdminRaftAddVoter), wire.AdminRaftAddVoter, r.handleRaftChange(wire.AdminRaftAddVoter)},
			{c.subj.Admin(wire.AdminRaftRemove), wire.AdminRaftRemove, r.handleRaftChange(wire.AdminRaftRemove)},
		}...)
	}
	everyNode := map[string]bool{c.subj.Admin(wire.AdminMembers): true, c.subj.Admin(wire.AdminRaft): true,
		c.subj.Admin(wire.AdminRaftVerify): true}
	var leaderOnly []leaderHandler
	if c.cfg.Insecure {
		// Clients from before C9 use the unscoped subjects.
		hs = append(hs, []handler{
			{c.subj.Coord(wire.CoordRegister), wire.CoordRegister, c.handleRegister},
			{c.subj.Coord(wire.CoordLookup), wire.CoordLookup, c.handleLookup},
			{c.subj.Coord(wire.CoordRestoreBegin), wire.CoordRestoreBegin, c.rs.handleBegin},
			{c.subj.Coord(wire.CoordRestoreReport), wire.CoordRestoreReport, c.rs.handleReport},
			{c.subj.Coord(wire.CoordRestoreWait), wire.CoordRestoreWait, c.rs.handleWait},
			{c.subj.Coord(wire.CoordRestoreCancel), wire.CoordRestoreCancel, c.rs.handleCancel},
		}...)
	}
	// Lookups and restore begins (the connector's lookup since issue 24)
	// are subscribed on the lookup connection, never behind the event
	// stream, and answered by the lookup pool's workers, several at once.
	lookups := map[string]bool{}
	for _, h := range hs {
		if h.op == wire.CoordLookup || h.op == wire.CoordRestoreBegin {
			lookups[h.subject] = true
		}
	}
	if c.lookups == nil {
		c.lookups = newLookupWorkPool(c, lookupWorkers)
	}
	// The membership admin requests read the member, which exists only
	// once the cluster is joined; the rest need the index.
	needs := map[string]int32{wire.AdminMembers: phaseServing, wire.AdminRanks: phaseServing}
	for _, h := range hs {
		need := phaseIndex
		if n, ok := needs[h.op]; ok {
			need = n
		}
		fn := c.gate(h.op, need, h.fn)
		if lookups[h.subject] {
			fn = c.lookups.handler(h.op, fn)
		}
		if c.cfg.Raft.Enabled() && !everyNode[h.subject] {
			lh := leaderHandler{subject: h.subject, fn: fn}
			if lookups[h.subject] {
				lh.queue = lookupQueue
			}
			leaderOnly = append(leaderOnly, lh)
			continue
		}
		var sub *nats.Subscription
		var err error
		if lookups[h.subject] {
			sub, err = c.lnc.QueueSubscribe(h.subject, lookupQueue, fn)
		} else {
			sub, err = c.nc.Subscribe(h.subject, fn)
		}
		if err != nil {
			return nil, fmt.Errorf("subscribe %s: %w", h.subject, err)
		}
		// Bursts of event batches wait in NATS's client buffer rather than
		// being dropped as a slow consumer: up to 1 GiB, unbounded count.
		if err := sub.SetPendingLimits(-1, 1<<30); err != nil {
			return nil, fmt.Errorf("pending limits of %s: %w", h.subject, err)
		}
		c.subs = append(c.subs, sub)
		if h.subject == c.subj.HeartbeatAll() {
			c.hbSub.Store(sub)
		}
	}
	if err := c.lnc.Flush(); err != nil {
		return nil, fmt.Errorf("flush the lookup connection: %w", err)
	}
	return leaderOnly, c.nc.Flush()
}

// natsError counts and logs NATS asynchronous errors: a slow consumer
// drops messages, and each one is a request that gets no reply (C8). A
// reply refused by the requester's allow_responses window (C9) loses
// nothing: the request was delivered twice and its first answer went out,
// or the requester had given up. It is counted by its kind and logged at
// Warn.
func (c *Coordinator) natsError(_ *nats.Conn, sub *nats.Subscription, err error) {
	kind := natsErrorKind(err)
	c.met.natsErrors.WithLabelValues(kind).Inc()
	subject := ""
	if sub != nil {
		subject = sub.Subject
	}
	if kind == natsErrReplyPermission {
		c.log.Warn("NATS refused a reply: the request was already answered (a duplicate) or its response window expired",
			zap.String("kind", kind), zap.Error(err))
		return
	}
	c.met.dropped.Inc()
	c.log.Error("NATS error; requests may have been dropped", zap.String("subject", subject), zap.String("kind", kind), zap.Error(err))
}

// Kinds of NATS asynchronous errors (natsErrorKind), the kind label of
// kvtier_coord_nats_errors_total.
const (
	natsErrReplyPermission = "reply_permission"
	natsErrPermission      = "permission"
	natsErrSlowConsumer    = "slow_consumer"
	natsErrOther           = "other"
)

// natsErrorKind classifies a NATS asynchronous error. A permission
// violation whose refused publish went to a reply inbox ("_INBOX." and
// more: the server's text is "Permissions Violation for Publish to
// \"<subject>\"") is reply_permission; any other violation is permission.
func natsErrorKind(err error) string {
	switch {
	case err == nil:
		return natsErrOther
	case errors.Is(err, nats.ErrSlowConsumer):
		return natsErrSlowConsumer
	case !errors.Is(err, nats.ErrPermissionViolation):
		return natsErrOther
	}
	const marker = "publish to "
	msg := err.Error()
	i := strings.LastIndex(strings.ToLower(msg), marker)
	if i < 0 {
		return natsErrPermission
	}
	quoted := msg[i+len(marker):]
	q, qerr := strconv.QuotedPrefix(quoted)
	if qerr != nil || q != quoted { // unquoted, or more follows ("using reply subject ...")
		return natsErrPermission
	}
	subject, qerr := strconv.Unquote(q)
	if qerr != nil || !strings.HasPrefix(subject, "_INBOX.") || len(subject) == len("_INBOX.") {
		return natsErrPermission
	}
	return natsErrReplyPermission
}
