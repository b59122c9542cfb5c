package rankd

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// TestDuplicateRegisterDelivery: one register request delivered twice (the
// same bytes to the same reply subject, as a duplicating network or broker
// does) is answered twice with the same session and supersedes nothing; a
// new register request (its own reply subject) still supersedes it. Found
// by the fault campaign (issue 17): on the unfixed code the second delivery
// registered again and superseded the engine's own session, so every store
// it then sent was refused stale_session (the second reply here named a
// new session superseding the first).
func TestDuplicateRegisterDelivery(t *testing.T) {
	h := newHarness(t)
	e := newEngine(t, h)
	ctx := h.ctx()
	data, err := json.Marshal(e.registerReq(t))
	if err != nil {
		t.Fatal(err)
	}
	inbox := nats.NewInbox()
	sub, err := h.nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	subject := h.subj.Engine(h.rank, OpRegister)
	for range 2 {
		if err := h.nc.PublishRequest(subject, inbox, data); err != nil {
			t.Fatal(err)
		}
	}
	var got []wire.RegisterReply
	for i := range 2 {
		m, err := sub.NextMsg(20 * time.Second)
		if err != nil {
			t.Fatalf("reply %d: %v", i, err)
		}
		var rep wire.Reply[wire.RegisterReply]
		if err := json.Unmarshal(m.Data, &rep); err != nil || rep.OK == nil {
			t.Fatalf("reply %d: %s (%v)", i, m.Data, err)
		}
		got = append(got, *rep.OK)
	}
	if got[0].Session == "" || got[0] != got[1] || got[0].Superseded != "" {
		t.Fatalf("duplicate delivery answered %+v then %+v, want one session twice, superseding nothing", got[0], got[1])
	}
	reg, err := bus.Call[wire.RegisterReply](ctx, h.nc, subject, e.registerReq(t))
	if err != nil {
		t.Fatal(err)
	}
	if reg.Superseded != got[0].Session || reg.Session == got[0].Session {
		t.Fatalf("a new register request: %+v, want a new session superseding %s", reg, got[0].Session)
	}
}
