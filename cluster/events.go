package cluster

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// MemberState is a member's state as this node sees it.
//
// There is no "suspect" state: memberlist v0.7.0 tells its delegates nothing
// when it starts suspecting a member or when the suspicion is refuted, and
// keeps that state private, so a snapshot could only guess. A suspected
// member is reported alive until it is declared dead (at most
// DetectorConfig.SuspicionFor(n).Max later) or refutes.
type MemberState uint8

const (
	// StateAlive: the member answers probes, or has not yet been declared
	// dead.
	StateAlive MemberState = iota + 1
	// StateDead: the failure detector declared it dead; it stopped answering
	// (crash, kill -9, partition, hang). Its L1 is gone or unreachable.
	StateDead
	// StateLeft: it announced a graceful leave.
	StateLeft
)

func (s MemberState) String() string {
	switch s {
	case StateAlive:
		return "alive"
	case StateDead:
		return "dead"
	case StateLeft:
		return "left"
	}
	return fmt.Sprintf("state(%d)", uint8(s))
}

// Member is one member as this node sees it.
type Member struct {
	// Name is the member's Config.NodeName, stable across its restarts.
	Name string
	// ID is the memberlist node name, Name@Incarnation: one per process
	// start. Two starts of one Name are two members with different IDs.
	ID string
	// Addr is the member's gossip address, host:port.
	Addr string
	// State is alive, dead or left.
	State MemberState
	// Since is when this node saw the member enter State (local clock).
	Since time.Time
	// Meta is the member's last gossiped Meta.
	Meta Meta
	// Local is true for this node itself.
	Local bool
}

// EventType is what happened to a member.
type EventType uint8

const (
	// EventJoin: a member became alive: a first join, a new incarnation of a
	// known Name (the owner fences the older incarnations), or a member
	// coming back after it was declared dead or left (a false death or a
	// healed partition: same ID and incarnation; resync it, do not trust
	// what was fenced at its death).
	EventJoin EventType = iota + 1
	// EventUpdate: an alive member changed its Meta (UpdateMeta).
	EventUpdate
	// EventLeave: a member left gracefully (Leave).
	EventLeave
	// EventDead: the failure detector declared a member dead.
	EventDead
)

func (t EventType) String() string {
	switch t {
	case EventJoin:
		return "join"
	case EventUpdate:
		return "update"
	case EventLeave:
		return "leave"
	case EventDead:
		return "dead"
	}
	return fmt.Sprintf("event(%d)", uint8(t))
}

// Event is one membership change.
type Event struct {
	Type EventType
	// Member is the member's state right after the change.
	Member Member
	// At is when memberlist reported the change to this node.
	At time.Time
	// Seq numbers the events of one Subscription from 1 without gaps; a gap
	// means events were dropped because the subscriber fell behind, and the
	// subscriber must resync from Cluster.Members.
	Seq uint64
}

// Subscription receives membership events from the Cluster's single event
// goroutine, in the order memberlist reported them. Deliveries never block
// that goroutine (nor memberlist): an event that does not fit in the
// channel's buffer is dropped, counted in Dropped and in
// kvtier_cluster_events_dropped_total, logged, and leaves a gap in Seq.
// The channel is closed by Close or by Cluster.Shutdown.
type Subscription struct {
	ch      chan Event
	c       *Cluster
	seq     uint64 // owned by the event goroutine
	dropped atomic.Uint64
}

// C returns the event channel.
func (s *Subscription) C() <-chan Event { return s.ch }

// Dropped returns how many events were dropped for this subscription.
func (s *Subscription) Dropped() uint64 { return s.dropped.Load() }

// Close stops deliveries and closes the channel. Idempotent.
func (s *Subscription) Close() {
	s.c.unsubscribe(s)
}

// eventQueue is the unbounded FIFO between memberlist's callbacks and the
// event goroutine: a push never blocks (bounded by the rate of membership
// changes, which memberlist itself bounds), and the event goroutine does
// the fan-out.
type eventQueue struct {
	mu     sync.Mutex // guards the following
	items  []Event
	closed bool

	signal chan struct{} // capacity 1: "items is not empty"
}

func newEventQueue() *eventQueue {
	return &eventQueue{signal: make(chan struct{}, 1)}
}

// push appends ev unless the queue is closed.
func (q *eventQueue) push(ev Event) {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return
	}
	q.items = append(q.items, ev)
	q.mu.Unlock()
	select {
	case q.signal <- struct{}{}:
	default:
	}
}

// take removes and returns everything queued.
func (q *eventQueue) take() []Event {
	q.mu.Lock()
	defer q.mu.Unlock()
	items := q.items
	q.items = nil
	return items
}

// close makes later pushes no-ops.
func (q *eventQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
}
