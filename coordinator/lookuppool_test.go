package coordinator

import (
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
