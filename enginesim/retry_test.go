package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// TestCallRetryingWaitsOutUnavailable: a coordinator answering unavailable
// (as while it opens its index) is asked again until it answers; a final
// error code is returned at once, without a second try.
func TestCallRetryingWaitsOutUnavailable(t *testing.T) {
	srv := testutil.NATS(t)
	nc, err := bus.Connect(srv.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var calls atomic.Int32
	sub, err := nc.Subscribe("coord.register", func(m *nats.Msg) {
		var rep any = wire.Reply[wire.RegisterReply]{OK: &wire.RegisterReply{}}
		switch n := calls.Add(1); {
		case n <= 2:
			rep = wire.Reply[struct{}]{Error: &wire.Error{Code: wire.CodeUnavailable, Message: "index opening", RetryAfterMS: 1}}
		case n == 3:
			rep = wire.Reply[struct{}]{Error: &wire.Error{Code: wire.CodeInternal, Message: "commit failed"}}
		}
		data, _ := json.Marshal(rep)
		_ = m.Respond(data)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := callRetrying[wire.RegisterReply](ctx, nc, "coord.register", struct{}{}, bus.NoResponders()); err != nil {
		t.Fatalf("callRetrying: %v", err)
	}
	if n := calls.Load(); n != 4 {
		t.Fatalf("%d calls, want 4 (2 unavailable, 1 internal, then ok)", n)
	}
	sub2, err := nc.Subscribe("coord.lookup", func(m *nats.Msg) {
		calls.Add(1)
		data, _ := json.Marshal(wire.Reply[struct{}]{Error: &wire.Error{Code: wire.CodeUnknownNamespace, Message: "never registered"}})
		_ = m.Respond(data)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub2.Unsubscribe()
	_, err = callRetrying[wire.LookupReply](ctx, nc, "coord.lookup", struct{}{}, bus.NoResponders())
	var we *wire.Error
	if !errors.As(err, &we) || we.Code != wire.CodeUnknownNamespace || calls.Load() != 5 {
		t.Fatalf("final error: %v after %d calls; want unknown_namespace after 5", err, calls.Load())
	}
}
