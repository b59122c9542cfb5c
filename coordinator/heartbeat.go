package coordinator

import (
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/wire"
)

// heartbeats remembers, per rank, the sequence its previous heartbeat
// announced. An event lost in transit (a batch the rank gave up on, or an
// event its buffer dropped) is otherwise noticed only when a later batch
// arrives, which an idle rank never sends. A rank's events may be in
// flight when it announces a sequence, so the rule allows one heartbeat
// interval: when the index is still behind the sequence announced by the
// PREVIOUS heartbeat of the same incarnation, events were lost, and the
// rank is resynced. "Behind" counts the events received and handed to the
// index but not yet committed (received): on a loaded host a commit can
// take longer than a heartbeat interval, and those events are not lost
// (issue 31: the coordinator resynced every rank of a busy machine).
//
// The heartbeats are also the authenticated proof of life that a gossip
// death needs before it is acted on (deaths.go): beats keeps, per rank the
// index knows, when its last heartbeat arrived, the interval it announced
// and whether it said it is leaving.
type heartbeats struct {
	mu       sync.Mutex // guards prev, received and beats
	prev     map[wire.Rank]wire.Heartbeat
	received map[wire.Rank]receivedSeq
	beats    map[wire.Rank]beatSeen
}

// beatSeen is a rank's last heartbeat as received.
type beatSeen struct {
	inc      uint64
	at       time.Time     // received (local clock)
	interval time.Duration // announced; 0: none
	leaving  bool          // this incarnation said it is leaving
	gap      time.Duration // since the previous heartbeat of this incarnation; 0: none
}

func newHeartbeats() heartbeats {
	return heartbeats{prev: make(map[wire.Rank]wire.Heartbeat), received: make(map[wire.Rank]receivedSeq),
		beats: make(map[wire.Rank]beatSeen)}
}

// noteBeat records hb's arrival at now and returns what was recorded.
func (h *heartbeats) noteBeat(hb *wire.Heartbeat, now time.Time) beatSeen {
	h.mu.Lock()
	defer h.mu.Unlock()
	b := beatSeen{inc: hb.Incarnation, at: now, interval: time.Duration(hb.IntervalMS) * time.Millisecond, leaving: hb.Leaving}
	if b.interval < 0 {
		b.interval = 0
	}
	if old, ok := h.beats[hb.Rank]; ok {
		switch {
		case old.inc > b.inc:
			return old // a superseded incarnation still beating
		case old.inc == b.inc:
			b.leaving = b.leaving || old.leaving // said once, stays said
			b.gap = max(now.Sub(old.at), 0)
		}
	}
	h.beats[hb.Rank] = b
	return b
}

// lastBeat returns rank r's last recorded heartbeat.
func (h *heartbeats) lastBeat(r wire.Rank) (beatSeen, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	b, ok := h.beats[r]
	return b, ok
}

// receivedSeq is the last event sequence of a rank's incarnation handed to
// the index.
type receivedSeq struct{ incarnation, seq uint64 }

// noteReceived records that events through seq of the rank's incarnation
// were handed to the index.
func (h *heartbeats) noteReceived(r wire.Rank, incarnation, seq uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if cur, ok := h.received[r]; ok && cur.incarnation == incarnation && cur.seq >= seq {
		return
	}
	h.received[r] = receivedSeq{incarnation, seq}
}

// forget drops what is remembered of a removed rank.
func (h *heartbeats) forget(r wire.Rank) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.prev, r)
	delete(h.received, r)
	delete(h.beats, r)
}

// heartbeatBacklog is how many heartbeats this coordinator's subscription
// holds unhandled (0 when it has none, or no subscription) and how many it
// has handed to the handler so far (the handler runs them one at a time:
// the one handed last may be in the handler still).
func (c *Coordinator) heartbeatBacklog() (queued int, handed int64, sub *nats.Subscription) {
	sub = c.hbSub.Load()
	if sub == nil {
		return 0, 0, nil
	}
	n, _, err := sub.Pending()
	if err != nil {
		return 0, 0, nil // unsubscribed (a follower now): it judges nothing
	}
	handed, err = sub.Delivered()
	if err != nil {
		return 0, 0, nil
	}
	return n, handed, sub
}

// handleHeartbeat applies the rule above. Heartbeats are plain publishes:
// a lost one only delays detection by an interval.
func (c *Coordinator) handleHeartbeat(m *nats.Msg) {
	if c.cfg.heartbeatHook != nil {
		c.cfg.heartbeatHook()
	}
	var hb wire.Heartbeat
	if err := json.Unmarshal(m.Data, &hb); err != nil || wire.ValidInstance(hb.Rank.Instance) != nil {
		c.met.badRequests.WithLabelValues("heartbeat").Inc()
		c.log.Warn("malformed heartbeat dropped", zap.String("subject", m.Subject), zap.Error(err))
		return
	}
	if want := c.subj.Heartbeat(hb.Rank); m.Subject != want {
		c.refuse(m, "heartbeat", fmt.Errorf("heartbeat of rank %s arrived on %s, want %s: %w", hb.Rank, m.Subject, want, wire.ErrMalformed))
		return
	}
	// Only ranks the index knows are tracked (issue 10.5): the table stays
	// bounded by MaxRanks, and a heartbeat of an invented rank starts
	// nothing. A rank whose first batch was lost is caught by its next
	// batch's gap instead.
	now := time.Now()
	ri, known := c.idx.Rank(hb.Rank)
	if !known {
		// Still proof of life for a suspect the index does not know (a
		// reader that never stored): the suspect table is bounded.
		c.provedAlive(hb.Rank, hb.Incarnation, now, time.Duration(hb.IntervalMS)*time.Millisecond, hb.Leaving, "heartbeat")
		if hb.OfferIndex != "" && c.checkIncarnation("heartbeat", hb.Rank, hb.Incarnation, now) == nil {
			// A rank this new index was never told about (not asked at
			// its start) offers its inventory: its own, authenticated word.
			c.offeredIndex(&hb)
			return
		}
		c.met.refused.WithLabelValues("unknown_rank_heartbeat").Inc()
		return
	}
	if err := c.checkIncarnation("heartbeat", hb.Rank, hb.Incarnation, now); err != nil {
		c.log.Debug("heartbeat refused", zap.Error(err))
		return
	}
	if hb.Incarnation >= ri.Incarnation {
		c.declareCapacity(hb.Rank, hb.Capacity) // the rank's budget (budget.go)
		c.offeredIndex(&hb)
	}
	b := c.hb.noteBeat(&hb, now)
	if b.gap > 0 && b.inc == hb.Incarnation {
		c.deaths.met.gaps.Observe(b.gap.Seconds())
	}
	c.provedAlive(hb.Rank, hb.Incarnation, now, time.Duration(hb.IntervalMS)*time.Millisecond,
		hb.Leaving || (b.inc == hb.Incarnation && b.leaving), "heartbeat")
	if hb.Leaving {
		c.log.Info("rank says it is leaving", zap.Stringer("rank", hb.Rank), zap.Uint64("incarnation", hb.Incarnation))
	}
	c.hb.mu.Lock()
	prev, seen := c.hb.prev[hb.Rank]
	c.hb.prev[hb.Rank] = hb
	recv, received := c.hb.received[hb.Rank]
	c.hb.mu.Unlock()
	if !seen || prev.Incarnation != hb.Incarnation {
		return
	}
	if known && ri.Incarnation > hb.Incarnation {
		return // a superseded incarnation still beating; its batches are fenced
	}
	var last uint64
	if known && ri.Incarnation == hb.Incarnation {
		last = ri.LastSeq
	}
	if received && recv.incarnation == hb.Incarnation {
		last = max(last, recv.seq) // handed to the index, still committing
	}
	if last >= prev.Seq {
		return
	}
	c.met.heartbeatGaps.Inc()
	c.log.Warn("rank's events lost in transit: resyncing", zap.Stringer("rank", hb.Rank),
		zap.Uint64("incarnation", hb.Incarnation), zap.Uint64("index_seq", last),
		zap.Uint64("announced_seq", prev.Seq))
	c.startResync(hb.Rank)
}

// offeredIndex acts on a heartbeat's OfferIndex (issue 29.2): a rank that
// saw this coordinator's signed index id change offers its inventory, and
// when the id is this index's the rank is resynced (unless a resync of it
// is running: the offer stops once the rank served the inventory). An id
// of another coordinator (a raft replica restarted on a lost directory,
// refilled by raft) or an older one is ignored; both are counted. The
// heartbeat arrived on the rank's own subject under its credential: the
// rank asks for its own resync, as a gap in its batches would; the resync
// caps and rate bound what it costs.
func (c *Coordinator) offeredIndex(hb *wire.Heartbeat) {
	if hb.OfferIndex == "" {
		return
	}
	if hb.OfferIndex != c.idx.ID() {
		c.met.indexOffers.WithLabelValues("other_index").Inc()
		return
	}
	c.drainMu.Lock()
	_, running := c.resyncing[hb.Rank]
	c.drainMu.Unlock()
	if running {
		return
	}
	c.met.indexOffers.WithLabelValues("resync").Inc()
	c.log.Info("rank offers its inventory to this index (it saw the index id change): resyncing", zap.Stringer("rank", hb.Rank),
		zap.Uint64("incarnation", hb.Incarnation), zap.String("index_id", hb.OfferIndex))
	c.startResync(hb.Rank)
}
