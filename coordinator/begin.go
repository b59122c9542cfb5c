package coordinator

import (
	"container/heap"
	"fmt"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// restore.begin (see restore.go for the protocol): the plan's items, the
// restore's state machine and the encoded reply are built without a lock
// (prepare), then a pure decision, planRestore, is taken under the restore
// table's lock in admit, which locks once and releases by defer;
// handleBegin replies after it.

// handleBegin answers restore.begin with a plan: it checks the request,
// looks the chunks up and prepares the plan (no lock), then admit decides
// and records under the restore table's lock, once; the reply leaves after
// the lock is released.
func (rs *restores) handleBegin(m *nats.Msg) {
	c := rs.c
	t0 := time.Now()
	planned := func() { c.met.beginSeconds.Observe(time.Since(t0).Seconds()) }
	var req wire.RestoreBeginRequest
	if err := decodeRequest(m, &req, wire.IsBinaryBegin); err != nil {
		c.badRequest(m, "restore.begin", err)
		return
	}
	if req.DeadlineMS < 0 {
		c.badRequest(m, "restore.begin", fmt.Errorf("deadline %d ms must be >= 0: %w", req.DeadlineMS, wire.ErrMalformed))
		return
	}
	if req.Instance != "" {
		if err := wire.ValidInstance(req.Instance); err != nil {
			c.badRequest(m, "restore.begin", err)
			return
		}
	}
	if !c.scope(m, wire.CoordRestoreBegin, "restore_begin", &req.Instance) {
		return
	}
	switch req.PlanEncoding {
	case "", wire.PlanEncodingJSON, wire.PlanEncodingBinary:
	default:
		c.badRequest(m, "restore.begin", fmt.Errorf("plan encoding %q: want %q or %q: %w",
			req.PlanEncoding, wire.PlanEncodingJSON, wire.PlanEncodingBinary, wire.ErrMalformed))
		return
	}
	deadline := restoreDeadline(req.DeadlineMS, c.cfg.RestoreDeadline, c.cfg.MaxRestoreDeadline)
	now := time.Now()
	res, err := c.lookupOpts(req.Instance, req.Namespace, req.Chunks, index.LookupOpts{StateAtEnd: req.StateAtEnd})
	if err != nil {
		c.lookupError(m, "restore.begin", req.Namespace, err)
		return
	}
	c.met.restoreBegins.Inc()
	if req.Lookup {
		c.countLookupTokens(req.Instance, len(req.Chunks), &res, req.StateAtEnd)
	}
	// No rank is handed a sum it cannot check (issue 11.8): the prefix
	// ends before a chunk with a recorded sum of 0 (only an index written
	// before ingest refused such events holds one).
	zeroCut := ""
	if cut, reason := zeroSumCut(&res, req.StateAtEnd); cut >= 0 {
		c.log.Warn("placement with sum 0 in the index; restore prefix cut", zap.Stringer("namespace", req.Namespace),
			zap.Int("chunk", cut), zap.Int("stored_prefix", res.Prefix))
		res.Prefix, zeroCut = cut, reason
	}

	out := rs.admit(&req, &res, zeroCut, now, deadline)
	switch out.kind {
	case beginClosed:
		c.replyError(wire.CoordRestoreBegin, m, wire.CodeUnavailable, "coordinator shutting down")
	case beginTooMany:
		c.met.internal.Inc()
		c.log.Warn("restore refused: too many active restores", zap.Int("active", out.active))
		c.replyError(wire.CoordRestoreBegin, m, wire.CodeUnavailable, fmt.Sprintf("%d restores active, limit %d", out.active, c.cfg.MaxActiveRestores))
	case beginInstanceFull:
		c.met.refused.WithLabelValues("instance_restores").Inc()
		c.log.Warn("restore refused: the instance has too many active restores", zap.String("instance", res.Instance),
			zap.Int("active", out.active))
		c.replyError(wire.CoordRestoreBegin, m, wire.CodeUnavailable,
			fmt.Sprintf("instance %s has %d restores active, limit %d (MaxActiveRestoresPerInstance)", res.Instance, out.active,
				c.cfg.MaxActiveRestoresPerInstance))
	case beginUnsendable:
		c.replyUnsendable(wire.CoordRestoreBegin, m, out.err)
	case beginFailed:
		c.internalError(m, wire.CoordRestoreBegin, "start restore", out.err, zap.String("restore", out.id))
	case beginNotPlanned:
		c.met.notPlanned.WithLabelValues(out.cause).Inc()
		log := c.log.Info
		if req.Lookup {
			log = c.log.Debug // a lookup's miss, as coord.lookup's not_alive: no restore was refused
		} else {
			c.met.restores.WithLabelValues(wire.VerdictRefused, "readers_not_alive").Inc()
		}
		log("restore not planned: reader ranks not alive", zap.String("restore", out.id),
			zap.Stringer("namespace", req.Namespace), zap.String("instance", res.Instance),
			zap.Int("stored_prefix", res.Prefix), zap.Strings("not_alive", out.down), zap.String("reason", out.plan.Reason))
		c.sendEncoded(wire.CoordRestoreBegin, m, out.data)
		planned()
	case beginEmpty:
		if !req.Lookup {
			c.met.restores.WithLabelValues(wire.VerdictComplete, "empty").Inc()
		}
		c.log.Debug("restore with nothing to restore decided complete", zap.String("restore", out.id),
			zap.Stringer("namespace", req.Namespace), zap.Int("chunks", len(req.Chunks)))
		c.sendEncoded(wire.CoordRestoreBegin, m, out.data)
		planned()
	case beginActive:
		if out.earliest {
			select {
			case rs.kick <- struct{}{}:
			default:
			}
		}
		shared := res.SharedSources(out.plan.Prefix, req.StateAtEnd)
		if shared > 0 {
			c.share.met.restores.Inc()
			c.share.met.objects.Add(float64(shared))
		}
		c.log.Debug("restore begun", zap.String("restore", out.id), zap.Stringer("namespace", req.Namespace),
			zap.String("instance", res.Instance), zap.Int("prefix", res.Prefix), zap.Int("chunks", len(req.Chunks)),
			zap.Int("ranks", len(out.plan.Ranks)), zap.Int("shared_objects", shared), zap.Duration("deadline", deadline))
		c.sendEncoded(wire.CoordRestoreBegin, m, out.data)
		planned()
	}
}

// restoreDeadline is how long a restore waits for its reports: the
// configured default when the request asks none (0 ms), else what it asks,
// capped at max (clamped before the multiplication: 2^62 ms would
// overflow).
func restoreDeadline(askedMS int, def, max time.Duration) time.Duration {
	if askedMS <= 0 {
		return def
	}
	if int64(askedMS) < max.Milliseconds() {
		return time.Duration(askedMS) * time.Millisecond
	}
	return max
}

// zeroSumCut returns the first chunk of res's prefix with a source whose
// recorded sum is 0, and why; -1 when there is none. Only the sources a
// restore needs count (with stateAtEnd an inner chunk's state may be
// unstored, a zero Source), and with stateAtEnd a cut prefix must still
// end on a chunk with its state, so the cut goes back until it does.
func zeroSumCut(res *index.LookupResult, stateAtEnd bool) (int, string) {
	cut, reason := -1, ""
	for n := res.Prefix; ; {
		i, j := firstZeroSum(res, n, stateAtEnd)
		if i < 0 {
			return cut, reason
		}
		if cut < 0 {
			reason = fmt.Sprintf("prefix cut at chunk %d: its object of shard %d group %d is recorded with sum 0, which cannot be checked",
				i, res.Expectations[j].Shard, res.Expectations[j].Group)
		}
		cut, n = i, i
	}
}

// firstZeroSum is the first (chunk, expectation) of a restore of res's
// first n chunks that it needs and whose recorded sum is 0; (-1, -1) when
// there is none.
func firstZeroSum(res *index.LookupResult, n int, stateAtEnd bool) (int, int) {
	for i := range n {
		for j := range res.Expectations {
			if res.Needed(i, j, n, stateAtEnd) && res.Source(i, j).Sum == 0 {
				return i, j
			}
		}
	}
	return -1, -1
}

// beginKind is what a restore.begin gets.
type beginKind uint8

const (
	beginClosed       beginKind = iota + 1 // the coordinator is shutting down
	beginTooMany                           // MaxActiveRestores reached
	beginInstanceFull                      // the instance's MaxActiveRestoresPerInstance reached
	beginNotPlanned                        // a reader rank is not alive: decided refused at once
	beginEmpty                             // nothing restorable: decided complete at once
	beginActive                            // planned and tracked until its verdict
	beginUnsendable                        // the plan cannot fit a reply: nothing recorded
	beginFailed                            // the restore could not be started: nothing recorded
)

// beginState is what planRestore needs of the restore table: read under
// its lock.
type beginState struct {
	closed bool
	// active counts the active restores, instanceActive those of the
	// restore's instance.
	active, instanceActive int
	// maxActive and maxPerInstance are the limits (Config).
	maxActive, maxPerInstance int
}

// restorePlan is planRestore's decision.
type restorePlan struct {
	kind beginKind
	// active is the count that refused the restore (beginTooMany,
	// beginInstanceFull).
	active int
	// plan is the reply (every kind from beginNotPlanned on).
	plan *wire.RestorePlan
	// down and cause name the reader ranks not alive and the first one's
	// cause (beginNotPlanned).
	down  []string
	cause string
	// readers is what the restore expects of each reader rank, by TP rank
	// (beginActive).
	readers map[int]*restoreReader
}

// planRestore decides a restore.begin from the table's state, the
// lookup (its prefix already cut by zeroSumCut, whose reason is zeroCut)
// and the reader ranks' liveness judged under the table's lock: a pure
// function of its inputs. Liveness comes before the limits: a hit whose
// readers are not all alive is not planned, and says why, whether or not
// the table has room (it would take no slot); then the limits, which a
// lookup's miss skips; a prefix of 0 is decided complete; otherwise the
// restore is planned with items, the reply planItems built for res (nil:
// the caller builds it), and each reader expected at the incarnation
// readers judged.
func planRestore(st beginState, id string, req *wire.RestoreBeginRequest, res *index.LookupResult, zeroCut string,
	readers []readerStatus, items *plannedItems) restorePlan {
	if st.closed {
		return restorePlan{kind: beginClosed}
	}
	if res.Prefix > 0 {
		if down, reason := notAlive(res.Instance, readers); reason != "" {
			plan := &wire.RestorePlan{RestoreID: id, Ranks: map[string][]wire.RetrieveItem{}, Reason: reason}
			p := restorePlan{kind: beginNotPlanned, plan: plan, down: down}
			for _, s := range readers {
				if s.cause != "" {
					p.cause = s.cause
					break
				}
			}
			return p
		}
	}
	switch {
	case req.Lookup && res.Prefix == 0:
		// A lookup that missed: no restore, so no limit applies.
	case st.active >= st.maxActive:
		return restorePlan{kind: beginTooMany, active: st.active}
	case res.Prefix > 0 && st.instanceActive >= st.maxPerInstance:
		return restorePlan{kind: beginInstanceFull, active: st.instanceActive}
	}
	if res.Prefix == 0 {
		plan := &wire.RestorePlan{RestoreID: id, Ranks: map[string][]wire.RetrieveItem{}, Reason: zeroCut}
		return restorePlan{kind: beginEmpty, plan: plan}
	}
	if items == nil {
		return restorePlan{kind: beginActive}
	}
	byTP := make(map[int]*restoreReader, len(readers))
	for _, s := range readers {
		byTP[s.tp] = &restoreReader{inc: s.inc, slots: items.slots[s.tp]}
	}
	return restorePlan{kind: beginActive, plan: items.plan, readers: byTP}
}

// plannedItems is the reply of a restore with items and the (chunk,
// group) slots each reader rank reads, by TP rank: planItems' result. The
// incarnation each reader is expected at is judged when the restore is
// admitted (planRestore).
type plannedItems struct {
	plan  *wire.RestorePlan
	slots map[int][]readSlot
}

// planItems lists each reader's items of res's prefix in chunk order
// (with req.StateAtEnd, a recurrent group's for the last chunk only): a
// pure function, and most of a begin's work, so it runs before the
// restore table's lock.
func planItems(id string, req *wire.RestoreBeginRequest, res *index.LookupResult, zeroCut string) *plannedItems {
	plan := &wire.RestorePlan{RestoreID: id, Prefix: res.Prefix, Ranks: make(map[string][]wire.RetrieveItem), Reason: zeroCut}
	// Each expectation's reader once (its items and slots), not per item:
	// a restore of 2,048 chunks is thousands of items.
	type readerOf struct {
		items *[]wire.RetrieveItem
		slots *[]readSlot
	}
	lists := make(map[int]*[]wire.RetrieveItem)
	slots := make(map[int]*[]readSlot)
	of := make([]readerOf, len(res.Expectations))
	for j, e := range res.Expectations {
		l := lists[e.Rank]
		if l == nil {
			l = new([]wire.RetrieveItem)
			*l = make([]wire.RetrieveItem, 0, res.Prefix)
			lists[e.Rank] = l
			sl := make([]readSlot, 0, res.Prefix)
			slots[e.Rank] = &sl
		}
		of[j] = readerOf{items: l, slots: slots[e.Rank]}
	}
	for i := range res.Prefix {
		for j, e := range res.Expectations {
			if !res.Needed(i, j, res.Prefix, req.StateAtEnd) {
				continue // a state inside the prefix, never read (StateAtEnd)
			}
			src := res.Source(i, j)
			o := of[j]
			*o.items = append(*o.items, wire.RetrieveItem{
				Chunk: i, Group: e.Group,
				Key:    dcp.Key{NS: req.Namespace, Chunk: req.Chunks[i], Shard: uint16(e.Shard), Group: uint16(e.Group)},
				Sum:    src.Sum,
				Source: wire.Source{Holder: res.Holder(i, j), Tier: src.Tier},
			})
			*o.slots = append(*o.slots, readSlot{chunk: int32(i), group: int32(e.Group)})
		}
	}
	for tp, l := range lists {
		if len(*l) > 0 {
			plan.Ranks[wire.Rank{Instance: res.Instance, TPRank: tp}.String()] = *l
		}
	}
	out := &plannedItems{plan: plan, slots: make(map[int][]readSlot, len(slots))}
	for tp, sl := range slots {
		out.slots[tp] = *sl
	}
	return out
}

// prepared is a restore with items made ready before the restore table's
// lock: its plan, its state machine and its encoded reply, or why it
// cannot be begun (kind beginFailed or beginUnsendable, err).
type prepared struct {
	items *plannedItems
	r     *index.Restore
	data  []byte
	kind  beginKind
	err   error
}

// prepare builds the restore of res's prefix as if it were admitted.
func (rs *restores) prepare(id string, req *wire.RestoreBeginRequest, res *index.LookupResult, zeroCut string,
	expires time.Time) *prepared {
	if h := rs.c.cfg.beginPrepareHook; h != nil {
		h()
	}
	p := &prepared{items: planItems(id, req, res, zeroCut)}
	r, err := index.NewRestore(id, req.Namespace, req.Chunks[:res.Prefix], index.ExpectFromLookup(res, res.Prefix, req.StateAtEnd), expires)
	if err != nil {
		p.kind, p.err = beginFailed, err
		return p
	}
	data, err := rs.c.encodePlan(req.PlanEncoding, req.Namespace, p.items.plan)
	if err != nil {
		p.kind, p.err = beginUnsendable, fmt.Errorf("restore plan of %d chunks for %d ranks: %w", res.Prefix, len(p.items.plan.Ranks), err)
		return p
	}
	p.r, p.data = r, data
	return p
}

// beginOutcome is admit's result, acted on after the lock is released.
type beginOutcome struct {
	restorePlan
	id string
	// data is the encoded reply (beginNotPlanned, beginEmpty,
	// beginActive).
	data []byte
	// earliest: the new restore has the earliest deadline (beginActive).
	earliest bool
	err      error // beginUnsendable, beginFailed
}

// stateLocked is the table's state a begin of instance is decided on.
func (rs *restores) stateLocked(instance string) beginState {
	return beginState{closed: rs.closed, active: len(rs.active), instanceActive: rs.perInstance[instance],
		maxActive: rs.c.cfg.MaxActiveRestores, maxPerInstance: rs.c.cfg.MaxActiveRestoresPerInstance}
}

// full reports whether a begin of instance would be refused by the table
// now (closed, or a limit reached), so that admit does not build a plan
// the decision refuses: a flood past the limits costs a lock's moment per
// begin, not a plan. The decision under the lock stays the one that
// counts.
func (rs *restores) full(instance string) bool {
	rs.mu.Lock()
	st := rs.stateLocked(instance)
	rs.mu.Unlock()
	return st.closed || st.active >= st.maxActive || st.instanceActive >= st.maxPerInstance
}

// admit prepares the plan of a begin whose readers look alive and that the
// table has room for (no lock: most of a begin's CPU, 133 of 157 us for a
// 128-chunk TP8 begin at stop 64), then takes the restore table's lock once: it judges the readers'
// liveness under it (see "Reader liveness"), decides (planRestore) and
// records the restore or its immediate verdict. A plan that cannot be sent
// is refused before anything is recorded: it would leave a restore nobody
// executes (C8). A prepared plan the decision refuses is dropped; a begin
// decided active without one (its readers came alive meanwhile) prepares
// under the lock.
func (rs *restores) admit(req *wire.RestoreBeginRequest, res *index.LookupResult, zeroCut string, now time.Time,
	deadline time.Duration) beginOutcome {
	c := rs.c
	id := newRestoreID() // random 128 bits: not guessable by other callers (C9)
	var pre *prepared
	if res.Prefix > 0 && !rs.full(res.Instance) {
		if _, reason := notAlive(res.Instance, c.readerStatuses(res.Instance, res.Expectations)); reason == "" {
			pre = rs.prepare(id, req, res, zeroCut, now.Add(deadline))
		}
	}
	rs.mu.Lock()
	defer rs.mu.Unlock()
	st := rs.stateLocked(res.Instance)
	var readers []readerStatus
	if res.Prefix > 0 && !st.closed {
		readers = c.readerStatuses(res.Instance, res.Expectations)
	}
	var items *plannedItems
	if pre != nil {
		items = pre.items
	}
	out := beginOutcome{restorePlan: planRestore(st, id, req, res, zeroCut, readers, items), id: id}
	switch out.kind {
	case beginClosed, beginTooMany, beginInstanceFull:
		return out
	case beginActive:
		if pre == nil {
			pre = rs.prepare(id, req, res, zeroCut, now.Add(deadline))
			out.restorePlan = planRestore(st, id, req, res, zeroCut, readers, pre.items)
		}
		if pre.err != nil {
			out.kind, out.err = pre.kind, pre.err
			return out
		}
		out.data = pre.data
	default:
		data, err := c.encodePlan(req.PlanEncoding, req.Namespace, out.plan)
		if err != nil {
			out.kind, out.err = beginUnsendable, err
			return out
		}
		out.data = data
	}
	rs.seq++
	switch out.kind {
	case beginNotPlanned:
		if req.Lookup {
			break // a miss, not a restore (RestoreBeginRequest.Lookup)
		}
		// Refused, never complete (issue 11.4): nothing was restored or
		// checked, and the reason travels with the verdict.
		v := wire.RestoreVerdict{RestoreID: id, State: wire.VerdictRefused, Reason: out.plan.Reason}
		rs.recordLocked(&wire.AdminRestore{RestoreVerdict: v, Namespace: req.Namespace.String(), Instance: req.Instance, Began: now, Decided: now,
			VerdictLatencyUS: 0})
	case beginEmpty:
		if req.Lookup {
			break // a miss, not a restore: nothing to record (RestoreBeginRequest.Lookup)
		}
		v := wire.RestoreVerdict{RestoreID: id, State: wire.VerdictComplete}
		rs.recordLocked(&wire.AdminRestore{RestoreVerdict: v, Namespace: req.Namespace.String(), Instance: req.Instance, Began: now, Decided: now,
			VerdictLatencyUS: 0})
	case beginActive:
		a := &activeRestore{r: pre.r, instance: res.Instance, prefix: res.Prefix, ranks: len(out.plan.Ranks), began: now, readers: out.readers}
		rs.active[id] = a
		rs.perInstance[a.instance]++
		heap.Push(&rs.byDL, a)
		out.earliest = rs.byDL[0] == a
		c.met.active.Set(float64(len(rs.active)))
	}
	return out
}
