package enginesim

import (
	"context"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// TestStoreCarriesTheRequestsDeadline (issue 24): a store is sent with its
// request's bound as the engine's deadline (wire.HeaderDeadline), so a
// rankd waiting for L1 room answers by it; without a bound it is sent as
// it is.
func TestStoreCarriesTheRequestsDeadline(t *testing.T) {
	body := bus.Raw("KVS1")
	if got := withDeadline(context.Background(), body); string(got.(bus.Raw)) != "KVS1" {
		t.Fatalf("without a deadline: %#v", got)
	}
	dl := time.Now().Add(time.Minute)
	ctx, cancel := context.WithDeadline(context.Background(), dl)
	defer cancel()
	h, ok := withDeadline(ctx, body).(bus.Headed)
	if !ok || string(h.Body.(bus.Raw)) != "KVS1" {
		t.Fatalf("with a deadline: %#v", h)
	}
	if v := h.Header.Get(wire.HeaderDeadline); v != wire.FormatDeadline(dl) {
		t.Fatalf("header %q, want %q", v, wire.FormatDeadline(dl))
	}
}
