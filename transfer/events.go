package transfer

import (
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// eventLog sequences placement events. Sequence numbers are assigned under
// Engine.mu together with the state change they describe, so Inventory is
// consistent with a sequence number; the publisher goroutine delivers them
// in order.
type eventLog struct {
	keep    bool // a publisher exists: buffer events for it
	seq     uint64
	pending []wire.Event
	kick    chan struct{}
}

func (l *eventLog) init(keep bool) {
	l.keep = keep
	l.kick = make(chan struct{}, 1)
}

// emitLocked records one placement change.
func (e *Engine) emitLocked(kind wire.EventKind, tier wire.Tier, key dcp.Key, size, sum uint64) {
	l := &e.ev
	l.seq++
	e.ctr.lastSeq.Store(l.seq)
	if !l.keep {
		return
	}
	if len(l.pending) >= e.cfg.EventBuffer {
		e.ctr.eventsDropped.Add(1)
		if e.ctr.eventsDropped.Load()&(e.ctr.eventsDropped.Load()-1) == 0 { // log at powers of two
			e.log.Error("event buffer full; dropping events (the coordinator will resync)",
				zap.Int("buffer", e.cfg.EventBuffer), zap.Uint64("dropped", e.ctr.eventsDropped.Load()))
		}
		return
	}
	l.pending = append(l.pending, wire.Event{Seq: l.seq, Kind: kind, Tier: tier, Key: key, Size: size, Sum: sum})
	if len(l.pending) == 1 {
		kick(l.kick)
	}
}

// publishLoop delivers buffered events in order, in batches. Close
// delivers what is left once every other goroutine has stopped.
func (e *Engine) publishLoop() {
	if e.cfg.Publisher == nil {
		return
	}
	for {
		select {
		case <-e.ev.kick:
		case <-e.life.Done():
			return
		}
		for e.publishBatch(true) {
		}
	}
}

// publishBatch publishes one batch; it reports whether one was taken.
func (e *Engine) publishBatch(retry bool) bool {
	e.mu.Lock()
	n := min(len(e.ev.pending), e.cfg.EventBatch)
	if n == 0 {
		e.mu.Unlock()
		return false
	}
	evs := slices.Clone(e.ev.pending[:n])
	e.ev.pending = e.ev.pending[n:]
	if len(e.ev.pending) == 0 {
		e.ev.pending = nil
	}
	e.mu.Unlock()

	b := wire.Batch{Rank: e.cfg.Rank, Incarnation: e.cfg.Incarnation, Events: evs}
	backoff := 10 * time.Millisecond
	for attempt := 0; ; attempt++ {
		err := e.cfg.Publisher.Publish(b)
		if err == nil {
			e.ctr.eventsPublished.Add(uint64(n))
			e.ctr.publishedThrough.Store(evs[n-1].Seq)
			return true
		}
		if !retry || attempt >= e.cfg.PublishRetries {
			e.ctr.eventsDropped.Add(uint64(n))
			e.log.Error("dropped an event batch after failed publishes (the coordinator will resync)",
				zap.Uint64("first_seq", evs[0].Seq), zap.Uint64("last_seq", evs[n-1].Seq), zap.Int("attempts", attempt+1), zap.Error(err))
			return true
		}
		e.log.Warn("publish failed; retrying", zap.Uint64("first_seq", evs[0].Seq), zap.Duration("backoff", backoff), zap.Error(err))
		select {
		case <-time.After(backoff):
		case <-e.life.Done():
			retry = false
		}
		backoff = min(2*backoff, time.Second)
	}
}

// Inventory returns every object this rank holds, consistent with event
// sequence Seq: applying this incarnation's events 1..Seq, in order, to an
// empty inventory gives exactly Objects. L1 lists committed objects; L2
// lists the objects this rank wrote (found by the rescan at New, or
// written since). Objects are sorted by key, then tier.
func (e *Engine) Inventory() wire.Inventory {
	e.mu.Lock()
	inv := wire.Inventory{Rank: e.cfg.Rank, Incarnation: e.cfg.Incarnation, Seq: e.ev.seq,
		Objects: make([]wire.Placement, 0, e.cat.ready+len(e.cat.l2)+len(e.l3s.objs))}
	for _, o := range e.cat.objs {
		if o.state == stReady {
			inv.Objects = append(inv.Objects, wire.Placement{Key: o.key, Tier: wire.L1, Size: o.size, Sum: o.sum})
		}
	}
	for k, ent := range e.cat.l2 {
		inv.Objects = append(inv.Objects, wire.Placement{Key: k, Tier: wire.L2, Size: ent.size, Sum: ent.sum})
	}
	for k, ent := range e.l3s.objs {
		inv.Objects = append(inv.Objects, wire.Placement{Key: k, Tier: wire.L3, Size: ent.size, Sum: ent.sum})
	}
	e.mu.Unlock()
	slices.SortFunc(inv.Objects, comparePlacement)
	return inv
}

func comparePlacement(a, b wire.Placement) int {
	if c := compareKey(a.Key, b.Key); c != 0 {
		return c
	}
	return int(a.Tier) - int(b.Tier)
}

func compareKey(a, b dcp.Key) int {
	if c := slices.Compare(a.NS[:], b.NS[:]); c != 0 {
		return c
	}
	if c := slices.Compare(a.Chunk[:], b.Chunk[:]); c != 0 {
		return c
	}
	if a.Shard != b.Shard {
		return int(a.Shard) - int(b.Shard)
	}
	return int(a.Group) - int(b.Group)
}
