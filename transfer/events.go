package transfer

import (
	"cmp"
	"slices"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// EventSource is the pull side of the engine's placement events (STYLE 30,
// after etcd raft's Ready/Advance): the consumer (rankd's publisher) takes
// the next batch when it has room for one, sends it, and acknowledges it
// once the coordinator has acknowledged it; the engine's buffer is the only
// queue, and nothing in the engine retries. *Engine implements it when
// Config.KeepEvents is set. Safe for one consumer goroutine at a time
// alongside the engine's own; the engine never calls into the consumer.
type EventSource interface {
	// Ready receives (a 1-buffered wake-up) after an event arrives when no
	// event was waiting to be taken; a consumer that found NextEvents empty
	// waits on it. A wake-up may find nothing (it is latched, not counted).
	Ready() <-chan struct{}
	// NextEvents takes the next batch of events not yet taken, at most
	// Config.EventBatch of them, in sequence order; false when none waits.
	// The batch is the consumer's own (a copy). Taken events stay in the
	// buffer, counted against Config.EventBuffer, until acknowledged: the
	// consumer keeps the batches it took for as long as it may send them
	// again.
	NextEvents() (wire.Batch, bool)
	// AckEvents releases every taken event with a sequence number at most
	// through. Events not yet taken are never released by it.
	AckEvents(through uint64)
	// EventBacklog returns the events held (taken and not acknowledged, or
	// waiting) and the batches the waiting ones make, as NextEvents will
	// hand them out.
	EventBacklog() (held, waitingBatches int)
}

var _ EventSource = (*Engine)(nil)

// eventLog sequences placement events and holds them for the consumer.
// Sequence numbers are assigned under Engine.mu together with the state
// change they describe, so Inventory is consistent with a sequence number.
// Guarded by Engine.mu.
type eventLog struct {
	keep bool // Config.KeepEvents: hold events for a consumer
	seq  uint64
	// held are the events not yet acknowledged, in sequence order (with
	// gaps where events were dropped): held[:taken] were handed out by
	// NextEvents, held[taken:] wait. len(held) <= Config.EventBuffer.
	held  []wire.Event
	taken int
	ready chan struct{} // 1-buffered: see EventSource.Ready
}

func (l *eventLog) init(keep bool) {
	l.keep = keep
	l.ready = make(chan struct{}, 1)
}

// emitLocked records one placement change. With the buffer full (taken and
// unacknowledged events included) the event is dropped and counted: the
// sequence gap makes the coordinator resync from Inventory (C7).
func (e *Engine) emitLocked(kind wire.EventKind, tier wire.Tier, key dcp.Key, size, sum uint64) {
	l := &e.ev
	l.seq++
	e.ctr.lastSeq.Store(l.seq)
	if !l.keep {
		return
	}
	if len(l.held) >= e.cfg.EventBuffer {
		e.ctr.eventsDropped.Add(1)
		if e.ctr.eventsDropped.Load()&(e.ctr.eventsDropped.Load()-1) == 0 { // log at powers of two
			e.log.Error("event buffer full; dropping events (the coordinator will resync)",
				zap.Int("buffer", e.cfg.EventBuffer), zap.Int("taken_unacknowledged", l.taken),
				zap.Uint64("dropped", e.ctr.eventsDropped.Load()))
		}
		return
	}
	l.held = append(l.held, wire.Event{Seq: l.seq, Kind: kind, Tier: tier, Key: key, Size: size, Sum: sum})
	if len(l.held) == l.taken+1 {
		kick(l.ready)
	}
}

// Ready implements EventSource.
func (e *Engine) Ready() <-chan struct{} { return e.ev.ready }

// NextEvents implements EventSource. It works after Close too: the events
// emitted until Close returned stay for the consumer.
func (e *Engine) NextEvents() (wire.Batch, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	l := &e.ev
	n := min(len(l.held)-l.taken, e.cfg.EventBatch)
	if n == 0 {
		return wire.Batch{}, false
	}
	evs := slices.Clone(l.held[l.taken : l.taken+n])
	l.taken += n
	return wire.Batch{Rank: e.cfg.Rank, Incarnation: e.cfg.Incarnation, Events: evs}, true
}

// AckEvents implements EventSource.
func (e *Engine) AckEvents(through uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	l := &e.ev
	n, found := slices.BinarySearchFunc(l.held[:l.taken], through, func(ev wire.Event, s uint64) int {
		return cmp.Compare(ev.Seq, s)
	})
	if found {
		n++
	}
	if n == 0 {
		return
	}
	e.ctr.eventsPublished.Add(uint64(n))
	e.ctr.publishedThrough.Store(l.held[n-1].Seq)
	l.held = l.held[n:]
	l.taken -= n
	if len(l.held) == 0 {
		l.held = nil // let the backing array go
	}
}

// EventBacklog implements EventSource.
func (e *Engine) EventBacklog() (held, waitingBatches int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	waiting := len(e.ev.held) - e.ev.taken
	return len(e.ev.held), (waiting + e.cfg.EventBatch - 1) / e.cfg.EventBatch
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
