package rankd

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// heartbeats collects the rank's heartbeats.
func (h *harness) heartbeats(t *testing.T) <-chan wire.Heartbeat {
	t.Helper()
	beats := make(chan wire.Heartbeat, 256)
	sub, err := h.nc.Subscribe(h.subj.Heartbeat(h.rank), func(m *nats.Msg) {
		var hb wire.Heartbeat
		if err := json.Unmarshal(m.Data, &hb); err == nil {
			select {
			case beats <- hb:
			default:
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := h.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	return beats
}

// TestHeartbeatAnnouncesInterval: every heartbeat names the rank's
// interval, so the coordinator knows how long a silence confirms a death
// (issue 29.4), and says nothing of leaving while the rank serves.
func TestHeartbeatAnnouncesInterval(t *testing.T) {
	h := newHarness(t)
	beats := h.heartbeats(t)
	for range 2 {
		select {
		case hb := <-beats:
			if hb.IntervalMS != 100 || hb.Leaving || hb.Incarnation != h.d.inc {
				t.Fatalf("heartbeat %+v, want interval 100 ms, not leaving, incarnation %d", hb, h.d.inc)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no heartbeat within 10 s")
		}
	}
}

// TestLivenessProbe: the rank answers a liveness probe on its inventory
// subject with its identity and incarnation, at once, without taking a
// snapshot; a probe that also asks for a page is refused.
func TestLivenessProbe(t *testing.T) {
	h := newHarness(t)
	subject := h.subj.Inventory(h.rank)
	p, err := bus.Call[wire.RankProbe](h.ctx(), h.nc, subject, wire.InventoryRequest{Probe: true})
	if err != nil {
		t.Fatal(err)
	}
	if *p != (wire.RankProbe{Rank: h.rank, Incarnation: h.d.inc}) {
		t.Fatalf("probe answer %+v, want rank %s incarnation %d", *p, h.rank, h.d.inc)
	}
	if n := len(h.d.invs.snaps.order); n != 0 {
		t.Fatalf("a probe took %d inventory snapshots", n)
	}
	_, err = bus.Call[wire.RankProbe](h.ctx(), h.nc, subject, wire.InventoryRequest{Probe: true, Page: 1})
	var we *wire.Error
	if !errors.As(err, &we) || we.Code != wire.CodeBadRequest {
		t.Fatalf("probe naming a page: %v, want bad_request", err)
	}
}

// TestShutdownSaysLeaving (issue 28.2): a graceful shutdown says so on
// the rank's own heartbeat subject before it leaves gossip, so the
// coordinator acts on the gossip leave that follows; from then on probes
// say so too. Seen red with the announcement removed from Shutdown (no
// leaving heartbeat arrives).
func TestShutdownSaysLeaving(t *testing.T) {
	h := newHarness(t)
	beats := h.heartbeats(t)
	// Probes answered during the shutdown, until the connection closes.
	probes := make(chan wire.RankProbe, 64)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			p, err := bus.Call[wire.RankProbe](ctx, h.nc, h.subj.Inventory(h.rank), wire.InventoryRequest{Probe: true})
			cancel()
			if err == nil {
				select {
				case probes <- *p:
				default:
				}
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.d.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	close(stop)
	<-done
	var leaving *wire.Heartbeat
	deadline := time.After(5 * time.Second)
	for leaving == nil {
		select {
		case hb := <-beats:
			if hb.Leaving {
				leaving = &hb
			}
		case <-deadline:
			t.Fatal("no leaving heartbeat before the shutdown ended")
		}
	}
	if leaving.Rank != h.rank || leaving.Incarnation != h.d.inc || leaving.IntervalMS != 100 {
		t.Fatalf("leaving heartbeat %+v", *leaving)
	}
	close(probes)
	var said, before int
	for p := range probes {
		if p.Leaving {
			said++
		} else if said > 0 {
			t.Fatalf("a probe said not leaving after one said leaving: %+v", p)
		} else {
			before++
		}
	}
	t.Logf("probes during the shutdown: %d before the leaving notice, %d after", before, said)
}
