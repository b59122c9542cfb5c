package rankd

import (
	"errors"
	"testing"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// TestRefusedGoroutinesAnswerUnavailable: once Shutdown has closed the
// daemon's groups, an engine request and an inventory request that arrive
// are answered with code unavailable, not left to time out (STYLE 22).
// The groups are closed by hand here, with the subscriptions still
// serving, as in the moments between Shutdown closing them and draining.
func TestRefusedGoroutinesAnswerUnavailable(t *testing.T) {
	h := newHarness(t)
	ctx := h.ctx()
	if _, err := bus.Call[StatusReply](ctx, h.nc, h.subj.Engine(h.rank, OpStatus), struct{}{}); err != nil {
		t.Fatalf("status before the groups close: %v", err)
	}
	h.d.requests.Close()
	h.d.goroutines.Close()

	var we *wire.Error
	_, err := bus.Call[StatusReply](ctx, h.nc, h.subj.Engine(h.rank, OpStatus), struct{}{})
	if !errors.As(err, &we) || we.Code != wire.CodeUnavailable {
		t.Fatalf("status with the requests group closed: %v, want code %s", err, wire.CodeUnavailable)
	}
	_, err = bus.Call[wire.InventoryPage](ctx, h.nc, h.subj.Inventory(h.rank), wire.InventoryRequest{})
	if !errors.As(err, &we) || we.Code != wire.CodeUnavailable {
		t.Fatalf("inventory with the daemon's group closed: %v, want code %s", err, wire.CodeUnavailable)
	}
}
