package coordinator

import (
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// following is a replicator that does not decide: a raft coordinator that
// has lost the lead.
type following struct{ standalone }

func (following) decides() bool { return false }

// TestLookupPoolRefusesOnceNotLeading: a lookup or begin queued on the
// lookup pool by a raft leader that has since lost the lead is refused as
// retryable, not answered from a follower's state, and its handler never
// runs; while deciding it runs.
func TestLookupPoolRefusesOnceNotLeading(t *testing.T) {
	srv := testutil.NATS(t)
	nc, err := bus.Connect(srv.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	for _, tc := range []struct {
		name  string
		repl  replicator
		ran   int64
		error string
	}{
		{"leading", standalone{}, 1, ""},
		{"following", following{}, 0, "stopped leading"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &Coordinator{log: zap.NewNop(), met: newMetrics(), repl: tc.repl, nc: nc}
			p := newLookupWorkPool(c, 2)
			var ran atomic.Int64
			fn := p.handler(wire.CoordLookup, func(m *nats.Msg) {
				ran.Add(1)
				_ = m.Respond([]byte(`{"ok":{}}`))
			})
			sub, err := nc.Subscribe("pool."+tc.name, fn)
			if err != nil {
				t.Fatal(err)
			}
			rep, err := nc.Request("pool."+tc.name, nil, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if err := sub.Unsubscribe(); err != nil {
				t.Fatal(err)
			}
			p.close()
			if got := ran.Load(); got != tc.ran {
				t.Fatalf("handler ran %d times, want %d", got, tc.ran)
			}
			var r wire.Reply[struct{}]
			if err := json.Unmarshal(rep.Data, &r); err != nil {
				t.Fatalf("reply %s: %v", rep.Data, err)
			}
			we := r.Error
			switch {
			case tc.error == "" && we != nil:
				t.Fatalf("reply %s", rep.Data)
			case tc.error != "":
				if we == nil || we.Code != wire.CodeUnavailable || we.RetryAfterMS == 0 || !strings.Contains(we.Message, tc.error) {
					t.Fatalf("reply %s, want a retryable unavailable naming %q", rep.Data, tc.error)
				}
			}
		})
	}
}

// TestLookupPoolCloseWhileSending: a callback still sending when the pool
// closes (its subscription's drain gave up on it) is refused, as is one
// after the close, and neither sends on the closed queue; what was queued
// before is answered.
func TestLookupPoolCloseWhileSending(t *testing.T) {
	c := &Coordinator{log: zap.NewNop(), met: newMetrics(), repl: standalone{}}
	p := newLookupWorkPool(c, 1)
	release := make(chan struct{})
	var ran atomic.Int64
	fn := p.handler(wire.CoordLookup, func(*nats.Msg) {
		if ran.Add(1) == 1 {
			<-release
		}
	})
	refused := func() float64 {
		var m dto.Metric
		if err := c.met.replies.WithLabelValues(wire.CoordLookup, replyNoInbox).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetCounter().GetValue()
	}
	fn(&nats.Msg{}) // the worker takes it and waits
	testutil.Eventually(t, 10*time.Second, "the worker busy", func() bool { return ran.Load() == 1 })
	fn(&nats.Msg{}) // queued
	sent := make(chan struct{})
	go func() { fn(&nats.Msg{}); close(sent) }() // waits for room
	time.Sleep(50 * time.Millisecond)
	closed := make(chan struct{})
	go func() { p.close(); close(closed) }()
	select {
	case <-sent:
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting send was not refused by the close")
	}
	close(release)
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("close did not end")
	}
	const late = 20 // a send chosen at random over the refusal would show
	for range late {
		fn(&nats.Msg{})
	}
	if got := ran.Load(); got != 2 {
		t.Fatalf("%d requests handled, want the 2 queued before the close", got)
	}
	if got := refused(); got != 1+late {
		t.Fatalf("%v requests refused, want %d (the waiting one, the late ones)", got, 1+late)
	}
}
