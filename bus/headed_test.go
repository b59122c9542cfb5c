package bus

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestCallSendsHeaders: a Headed request arrives with its headers and its
// body encoded as Call encodes a body alone (JSON, a Raw as it is), also
// through CallRetry; a plain request carries no header.
func TestCallSendsHeaders(t *testing.T) {
	srv := testutil.NATS(t)
	nc, err := Connect(srv.ClientURL(), "test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	type seen struct {
		deadline string
		data     string
	}
	got := make(chan seen, 4)
	sub, err := nc.Subscribe("t.h", func(m *nats.Msg) {
		got <- seen{m.Header.Get(wire.HeaderDeadline), string(m.Data)}
		Respond(m, &ping{N: 1})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	hdr := nats.Header{wire.HeaderDeadline: []string{"123"}}
	for _, tc := range []struct {
		req  any
		want seen
	}{
		{Headed{Header: hdr, Body: ping{N: 7}}, seen{"123", `{"n":7}`}},
		{Headed{Header: hdr, Body: Raw("KVS1")}, seen{"123", "KVS1"}},
		{ping{N: 7}, seen{"", `{"n":7}`}},
	} {
		if _, err := CallRetry[ping](ctx, nc, "t.h", tc.req, NoResponders()); err != nil {
			t.Fatal(err)
		}
		if s := <-got; s != tc.want {
			t.Fatalf("%T request arrived as %+v, want %+v", tc.req, s, tc.want)
		}
	}
}
