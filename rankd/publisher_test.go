package rankd

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/wire"
)

// fakeCoord answers event batch requests: it fails the first `fail`
// requests (timeouts), then acknowledges, recording every batch it saw.
type fakeCoord struct {
	mu    sync.Mutex
	fail  int
	code  string // error code to answer with instead of an ack, once
	seen  []uint64
	calls int
}

func (f *fakeCoord) RequestWithContext(ctx context.Context, subj string, data []byte) (*nats.Msg, error) {
	var b wire.Batch
	if err := b.UnmarshalBinary(data); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.fail > 0 {
		f.fail--
		return nil, context.DeadlineExceeded
	}
	if f.code != "" {
		code := f.code
		f.code = ""
		out, _ := json.Marshal(wire.Reply[wire.EventAck]{Error: &wire.Error{Code: code, Message: "x"}})
		return &nats.Msg{Data: out}, nil
	}
	f.seen = append(f.seen, b.Events[0].Seq)
	out, _ := json.Marshal(wire.Reply[wire.EventAck]{OK: &wire.EventAck{AppliedThrough: b.Events[len(b.Events)-1].Seq}})
	return &nats.Msg{Data: out}, nil
}

func batch(seq uint64) wire.Batch {
	return wire.Batch{Rank: wire.Rank{Instance: "e", TPRank: 0}, Incarnation: 1,
		Events: []wire.Event{{Seq: seq, Kind: wire.Stored, Tier: wire.L1}}}
}

// Batches go out in order, a timed-out batch is sent again before the next
// one, and flush returns once everything was acknowledged.
func TestPublisherOrderRetryFlush(t *testing.T) {
	met := newMetrics("e/0")
	p := newPublisher("s", time.Second, 100, zaptest.NewLogger(t), met)
	fc := &fakeCoord{fail: 3}
	for i := uint64(1); i <= 10; i++ {
		if err := p.Publish(batch(i)); err != nil {
			t.Fatal(err)
		}
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { p.run(stop); close(done) }()
	p.setConn(fc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if n := p.flush(ctx); n != 0 {
		t.Fatalf("%d batches left after flush", n)
	}
	close(stop)
	<-done
	fc.mu.Lock()
	defer fc.mu.Unlock()
	for i, s := range fc.seen {
		if s != uint64(i+1) {
			t.Fatalf("acknowledged order %v", fc.seen)
		}
	}
	if len(fc.seen) != 10 || fc.calls != 13 {
		t.Fatalf("%d acknowledged in %d calls, want 10 in 13", len(fc.seen), fc.calls)
	}
	if err := p.Publish(batch(11)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Publish after flush: %v", err)
	}
}

// A full queue refuses batches (the engine retries and then drops them);
// a batch the coordinator rejects for good is dropped, not retried forever.
func TestPublisherBoundsAndRejects(t *testing.T) {
	p := newPublisher("s", time.Second, 2, zaptest.NewLogger(t), newMetrics("e/0"))
	if err := p.Publish(batch(1)); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(batch(2)); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(batch(3)); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("third batch into a queue of 2: %v", err)
	}
	fc := &fakeCoord{code: wire.CodeBadRequest}
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
	if len(fc.seen) != 1 || fc.seen[0] != 2 {
		t.Fatalf("acknowledged %v, want [2] (1 rejected and dropped)", fc.seen)
	}
}
