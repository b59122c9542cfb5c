package rankd

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// fakeCoord stands in for the coordinator's event subject and the NATS
// connection of the publisher. It keeps the C7 rules of one rank: a batch
// that continues the applied sequence is applied, one at or below it is a
// duplicate (acknowledged, nothing applied), one past a gap is answered
// with a resync and not applied. Replies are delivered in order by one
// goroutine, as NATS delivers them to a subscription. A policy decides,
// per request, to answer, to drop the reply (the sender times out), to
// answer with an error code, or to answer twice.
type fakeCoord struct {
	t      *testing.T
	policy func(call int, first uint64) action

	mu      sync.Mutex // guards the following
	cb      nats.MsgHandler
	calls   int
	handed  int      // replies handed to the subscriber
	sent    []uint64 // first sequence of every request, in arrival order
	applied []uint64 // first sequence of every applied batch
	last    uint64   // highest applied sequence
	queue   []*nats.Msg
	held    []*nats.Msg // replies held back by actHold
	release bool        // held replies may go
	wake    chan struct{}
	closed  bool
	wg      sync.WaitGroup
}

type action int

const (
	actAck action = iota
	actDrop
	actUnavailable
	actBadRequest
	actTwice
	actHold      // queue the reply until releaseHeld
	actLoseReply // apply the batch, then lose its reply
)

func newFakeCoord(t *testing.T, policy func(call int, first uint64) action) *fakeCoord {
	f := &fakeCoord{t: t, policy: policy, wake: make(chan struct{}, 1)}
	if f.policy == nil {
		f.policy = func(int, uint64) action { return actAck }
	}
	f.wg.Add(1)
	go f.deliver()
	t.Cleanup(f.close)
	return f
}

func (f *fakeCoord) NewRespInbox() string { return "_INBOX.fake" }

func (f *fakeCoord) IsConnected() bool { return true }

func (f *fakeCoord) Stats() nats.Statistics { return nats.Statistics{} }

func (f *fakeCoord) Subscribe(_ string, cb nats.MsgHandler) (*nats.Subscription, error) {
	f.mu.Lock()
	f.cb = cb
	f.mu.Unlock()
	return nil, nil
}

func (f *fakeCoord) PublishRequest(_, reply string, data []byte) error {
	var b wire.Batch
	if err := b.UnmarshalBinary(data); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	first, last := b.Events[0].Seq, b.Events[len(b.Events)-1].Seq
	f.sent = append(f.sent, first)
	act := f.policy(f.calls, first)
	var rep wire.Reply[wire.EventAck]
	switch act {
	case actDrop:
		return nil
	case actUnavailable:
		rep.Error = &wire.Error{Code: wire.CodeUnavailable, Message: "x"}
	case actBadRequest:
		rep.Error = &wire.Error{Code: wire.CodeBadRequest, Message: "x"}
	default:
		switch {
		case first == f.last+1:
			f.last = last
			f.applied = append(f.applied, first)
			rep.OK = &wire.EventAck{AppliedThrough: f.last}
		case first <= f.last:
			rep.OK = &wire.EventAck{AppliedThrough: f.last}
		default:
			rep.OK = &wire.EventAck{AppliedThrough: f.last, Resync: true}
		}
	}
	if act == actLoseReply {
		return nil
	}
	out, _ := json.Marshal(rep)
	m := &nats.Msg{Subject: reply, Data: out}
	switch act {
	case actHold:
		f.held = append(f.held, m)
		if f.release {
			f.queue, f.held = append(f.queue, f.held...), nil
		}
	case actTwice:
		f.queue = append(f.queue, m, m)
	default:
		f.queue = append(f.queue, m)
	}
	select {
	case f.wake <- struct{}{}:
	default:
	}
	return nil
}

// releaseHeld lets the held replies (and later ones) go.
func (f *fakeCoord) releaseHeld() {
	f.mu.Lock()
	f.release = true
	f.queue, f.held = append(f.queue, f.held...), nil
	f.mu.Unlock()
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

func (f *fakeCoord) deliver() {
	defer f.wg.Done()
	for {
		f.mu.Lock()
		q, cb, closed := f.queue, f.cb, f.closed
		f.queue = nil
		f.mu.Unlock()
		if closed {
			return
		}
		for _, m := range q {
			f.mu.Lock()
			f.handed++
			f.mu.Unlock()
			cb(m)
		}
		if len(q) == 0 {
			<-f.wake
		}
	}
}

func (f *fakeCoord) close() {
	f.mu.Lock()
	f.closed = true
	f.mu.Unlock()
	select {
	case f.wake <- struct{}{}:
	default:
	}
	f.wg.Wait()
}

func (f *fakeCoord) snapshot() (sent, applied []uint64, calls int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.sent), slices.Clone(f.applied), f.calls
}

// batchSource stands in for the transfer engine's event buffer
// (transfer.EventSource) in the publisher's tests and benchmarks: whole
// batches, at most limit of them held (taken and unacknowledged included);
// Publish refuses beyond it, where the engine drops the events.
type batchSource struct {
	limit int
	ready chan struct{}

	mu    sync.Mutex // guards the following
	held  []wire.Batch
	taken int    // held[:taken] were taken by NextEvents
	takes int    // batches taken (each batch once: never re-served)
	nexts int    // NextEvents calls, empty ones included
	acked uint64 // highest sequence acknowledged
}

var _ transfer.EventSource = (*batchSource)(nil)

func newBatchSource(limit int) *batchSource {
	return &batchSource{limit: limit, ready: make(chan struct{}, 1)}
}

func (s *batchSource) Ready() <-chan struct{} { return s.ready }

func (s *batchSource) NextEvents() (wire.Batch, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nexts++
	if s.taken == len(s.held) {
		return wire.Batch{}, false
	}
	s.taken++
	s.takes++
	return s.held[s.taken-1], true
}

func (s *batchSource) AckEvents(through uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.taken > 0 && s.held[0].Events[len(s.held[0].Events)-1].Seq <= through {
		s.acked = max(s.acked, s.held[0].Events[len(s.held[0].Events)-1].Seq)
		s.held = s.held[1:]
		s.taken--
	}
}

func (s *batchSource) EventBacklog() (held, waitingBatches int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range s.held {
		held += len(b.Events)
	}
	return held, len(s.held) - s.taken
}

// push adds b, or refuses it when limit batches are held.
func (s *batchSource) push(b wire.Batch) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.held) >= s.limit {
		return fmt.Errorf("test event source full (%d batches): %w", s.limit, ErrUnavailable)
	}
	s.held = append(s.held, b)
	if len(s.held) == s.taken+1 {
		select {
		case s.ready <- struct{}{}:
		default:
		}
	}
	return nil
}

func (s *batchSource) counts() (takes, nexts int, acked uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.takes, s.nexts, s.acked
}

// newPublisher (tests and benchmarks) is a publisher fed by a batchSource
// of at most limit batches: p.Publish adds a batch to it, p.pending counts
// the batches it holds.
func newPublisher(subject string, timeout time.Duration, limit, window int, log *zap.Logger, met *metrics) *publisher {
	p := newEventPublisher(subject, timeout, window, log, met)
	p.setSource(newBatchSource(limit))
	return p
}

func (p *publisher) testSource() *batchSource {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.src.(*batchSource)
}

// Publish (tests and benchmarks) adds b to the publisher's batchSource.
func (p *publisher) Publish(b wire.Batch) error { return p.testSource().push(b) }

// pending (tests and benchmarks) is the batches the batchSource holds: not
// yet acknowledged by the coordinator.
func (p *publisher) pending() int {
	s := p.testSource()
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.held)
}

// batch is one event with sequence seq.
func batch(seq uint64) wire.Batch {
	return wire.Batch{Rank: wire.Rank{Instance: "e", TPRank: 0}, Incarnation: 1,
		Events: []wire.Event{{Seq: seq, Kind: wire.Stored, Tier: wire.L1}}}
}

// runPublisher publishes batches 1..n, runs p against fc until flush
// returns, and stops it.
func runPublisher(t *testing.T, p *publisher, fc *fakeCoord, n int) {
	t.Helper()
	for i := uint64(1); i <= uint64(n); i++ {
		if err := p.Publish(batch(i)); err != nil {
			t.Fatal(err)
		}
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { p.run(stop); close(done) }()
	defer func() { close(stop); <-done }()
	p.setConn(fc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if left := p.flush(ctx); left != 0 {
		sent, applied, _ := fc.snapshot()
		t.Fatalf("%d batches left after flush; sent %v, applied %v", left, sent, applied)
	}
}

// wantApplied fails unless the fake applied batches 1..n, each once, in
// order.
func wantApplied(t *testing.T, fc *fakeCoord, n int) {
	t.Helper()
	_, applied, _ := fc.snapshot()
	want := make([]uint64, n)
	for i := range want {
		want[i] = uint64(i + 1)
	}
	if !slices.Equal(applied, want) {
		t.Fatalf("applied %v, want %v", applied, want)
	}
}

// Batches go out in order, timed-out batches are sent again, and flush
// returns once everything was acknowledged.
func TestPublisherOrderRetryFlush(t *testing.T) {
	p := newPublisher("s", 100*time.Millisecond, 100, 4, zaptest.NewLogger(t), newMetrics("e/0"))
	fc := newFakeCoord(t, func(call int, _ uint64) action {
		if call <= 3 {
			return actDrop
		}
		return actAck
	})
	runPublisher(t, p, fc, 10)
	wantApplied(t, fc, 10)
	if _, _, calls := fc.snapshot(); calls <= 10 {
		t.Fatalf("%d requests for 10 batches with 3 dropped replies", calls)
	}
	// The resends came from the window: each batch was taken once, and
	// every one was acknowledged to the source.
	if takes, _, acked := p.testSource().counts(); takes != 10 || acked != 10 {
		t.Fatalf("%d batches taken, acknowledged through %d; want 10 and 10", takes, acked)
	}
}

// The window fills: with window w, w batches are in flight before the
// first acknowledgement, and never more. (With window 1 this publisher
// never gets its first acknowledgement here, and flush fails.)
func TestPublisherWindowFills(t *testing.T) {
	const w = 4
	p := newPublisher("s", 5*time.Second, 100, w, zaptest.NewLogger(t), newMetrics("e/0"))
	var fc *fakeCoord
	fc = newFakeCoord(t, func(call int, _ uint64) action {
		if call == w {
			go fc.releaseHeld() // not under fc.mu
		}
		if call == w+1 && fc.handed == 0 { // the policy runs under fc.mu
			t.Errorf("request %d sent before any acknowledgement arrived", call)
		}
		return actHold
	})
	runPublisher(t, p, fc, 3*w)
	wantApplied(t, fc, 3*w)
	sent, _, _ := fc.snapshot()
	if !slices.Equal(sent[:w], []uint64{1, 2, 3, 4}) {
		t.Fatalf("first window sent %v", sent[:w])
	}
}

// An error on one batch makes the publisher send again from it: the batches
// after it that the coordinator saw past the gap were answered with a
// resync and never applied; the resend applies every batch once, in order.
func TestPublisherResendFromFirstUnacknowledged(t *testing.T) {
	p := newPublisher("s", 5*time.Second, 100, 4, zaptest.NewLogger(t), newMetrics("e/0"))
	failedOnce := false
	fc := newFakeCoord(t, func(_ int, first uint64) action {
		if first == 2 && !failedOnce {
			failedOnce = true
			return actUnavailable
		}
		return actAck
	})
	runPublisher(t, p, fc, 8)
	wantApplied(t, fc, 8)
	sent, _, _ := fc.snapshot()
	// The second time batch 2 goes out, every later batch follows it in
	// order, each once.
	i := slices.Index(sent[2:], 2) + 2
	if i < 2 || !slices.Equal(sent[i:], []uint64{2, 3, 4, 5, 6, 7, 8}) {
		t.Fatalf("sent %v: want a resend of 2..8 after the failure of 2", sent)
	}
}

// A lost acknowledgement: the batch was applied, the publisher times out
// and sends it (and what followed) again; the coordinator's duplicates
// change nothing, and replies delivered twice are taken once.
func TestPublisherLostAckAndDuplicateReplies(t *testing.T) {
	p := newPublisher("s", 150*time.Millisecond, 100, 3, zaptest.NewLogger(t), newMetrics("e/0"))
	dropped := false
	fc := newFakeCoord(t, func(_ int, first uint64) action {
		if first == 3 && !dropped {
			dropped = true
			return actLoseReply
		}
		return actTwice
	})
	runPublisher(t, p, fc, 7)
	wantApplied(t, fc, 7)
	sent, _, _ := fc.snapshot()
	if slices.Index(sent[3:], 3) < 0 {
		t.Fatalf("sent %v: batch 3 never sent again after its reply was lost", sent)
	}
}

// A batch the coordinator rejects for good is dropped, not retried
// forever: it is acknowledged to the engine (released), like the batch
// after it, which the coordinator answers with a resync.
func TestPublisherDropsRejectedBatch(t *testing.T) {
	p := newPublisher("s", time.Second, 2, 2, zaptest.NewLogger(t), newMetrics("e/0"))
	for i := uint64(1); i <= 2; i++ {
		if err := p.Publish(batch(i)); err != nil {
			t.Fatal(err)
		}
	}
	fc := newFakeCoord(t, func(call int, _ uint64) action {
		if call == 1 {
			return actBadRequest
		}
		return actAck
	})
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { p.run(stop); close(done) }()
	p.setConn(fc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if n := p.flush(ctx); n != 0 {
		t.Fatalf("%d left", n)
	}
	close(stop)
	<-done
	// Batch 1 was rejected and dropped; batch 2 then lies past a gap: the
	// coordinator answers it with a resync, and the publisher is done.
	sent, applied, _ := fc.snapshot()
	if !slices.Equal(sent, []uint64{1, 2}) || len(applied) != 0 {
		t.Fatalf("sent %v applied %v, want [1 2] sent and nothing applied", sent, applied)
	}
	if _, _, acked := p.testSource().counts(); acked != 2 {
		t.Fatalf("acknowledged through %d, want 2", acked)
	}
}

// TestPublisherPullsOnlyWithRoom (STYLE 30): with the coordinator stalled
// (it holds every reply), the publisher takes window batches from the
// engine's buffer and no more, however many wait, and nothing spins: no
// further NextEvents call while the stall lasts; nothing is acknowledged
// to the engine before the coordinator replied. Once it answers,
// everything is taken once, sent in order, applied in order and released.
func TestPublisherPullsOnlyWithRoom(t *testing.T) {
	const w, n = 4, 20
	p := newPublisher("s", 5*time.Second, 100, w, zaptest.NewLogger(t), newMetrics("e/0"))
	src := p.testSource()
	fc := newFakeCoord(t, func(int, uint64) action { return actHold })
	for i := uint64(1); i <= n; i++ {
		if err := p.Publish(batch(i)); err != nil {
			t.Fatal(err)
		}
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { p.run(stop); close(done) }()
	defer func() { close(stop); <-done }()
	p.setConn(fc)
	testutil.Eventually(t, 10*time.Second, "a full window sent", func() bool { _, _, calls := fc.snapshot(); return calls == w })
	_, nexts0, _ := src.counts()
	// More events arrive while the coordinator is stalled; give the
	// publisher time to misbehave (a wait with nothing to poll for).
	for i := uint64(n + 1); i <= n+5; i++ {
		if err := p.Publish(batch(i)); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(300 * time.Millisecond)
	takes, nexts, acked := src.counts()
	if takes != w || nexts != nexts0 || acked != 0 {
		t.Fatalf("stalled coordinator: %d batches taken, NextEvents called %d times (%d at the full window), acknowledged through %d; want %d taken, no more calls, nothing acknowledged",
			takes, nexts, nexts0, acked, w)
	}
	if _, _, calls := fc.snapshot(); calls != w {
		t.Fatalf("%d requests while stalled with a window of %d (the ack timeout is 5 s)", calls, w)
	}
	if st := p.status(); st.QueuedBatches != n+5 {
		t.Fatalf("status: %d batches queued, want %d", st.QueuedBatches, n+5)
	}
	fc.releaseHeld()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if left := p.flush(ctx); left != 0 {
		t.Fatalf("%d batches left after the coordinator resumed", left)
	}
	wantApplied(t, fc, n+5)
	sent, _, _ := fc.snapshot()
	if !slices.IsSorted(sent) || len(sent) != n+5 {
		t.Fatalf("sent %v: want each batch once, in order", sent)
	}
	if takes, _, acked := src.counts(); takes != n+5 || acked != n+5 || p.pending() != 0 {
		t.Fatalf("after the stall: %d taken, acknowledged through %d, %d held; want %d, %d, 0", takes, acked, p.pending(), n+5, n+5)
	}
}
