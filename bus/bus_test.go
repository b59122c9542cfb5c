package bus

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

func TestMain(m *testing.M) { testutil.Main(m) }

type ping struct {
	N int `json:"n"`
}

func TestEmbeddedRequestReply(t *testing.T) {
	srv := testutil.NATS(t)
	nc, err := Connect(srv.ClientURL(), "test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	sub, err := nc.Subscribe("t.ping", func(m *nats.Msg) {
		var p ping
		if err := Decode(m, &p); err != nil {
			RespondError(m, wire.CodeBadRequest, err.Error())
			return
		}
		Respond(m, &ping{N: p.N + 1})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := Call[ping](ctx, nc, "t.ping", ping{N: 41})
	if err != nil || got.N != 42 {
		t.Fatalf("Call = %+v, %v", got, err)
	}
	// Unknown fields are rejected with a stable code.
	_, err = Call[ping](ctx, nc, "t.ping", map[string]any{"n": 1, "bogus": true})
	var we *wire.Error
	if !errors.As(err, &we) || we.Code != wire.CodeBadRequest {
		t.Fatalf("unknown field: err = %v, want %s", err, wire.CodeBadRequest)
	}
	// Trailing garbage is rejected.
	msg, err := nc.RequestWithContext(ctx, "t.ping", []byte(`{"n":1} {"n":2}`))
	if err != nil || !strings.Contains(string(msg.Data), wire.CodeBadRequest) {
		t.Fatalf("trailing data: %v %s", err, msg.Data)
	}
}
