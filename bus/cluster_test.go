package bus

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// startPair starts two embedded servers routed to each other (insecure:
// package auth tests the authenticated routes).
func startPair(t *testing.T) (a, b *Embedded) {
	t.Helper()
	start := func(routes ...string) *Embedded {
		cfg := DefaultEmbeddedConfig()
		cfg.Port, cfg.Insecure = 0, true
		cfg.Cluster.Host, cfg.Cluster.Port, cfg.Cluster.Routes = "127.0.0.1", 0, routes
		srv, err := StartEmbedded(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Shutdown)
		return srv
	}
	a = start()
	b = start("nats-route://" + a.ClusterAddr())
	deadline := time.Now().Add(10 * time.Second)
	for a.NumRoutes() == 0 || b.NumRoutes() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("servers not routed within 10 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return a, b
}

func waitInterest(t *testing.T, nc *nats.Conn, subject string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := nc.Request(subject, []byte(`{"n":0}`), time.Second)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no responder on %s within 10 s: %v", subject, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestClientsMoveToSurvivingServer: a responder and a requester on server
// A, each holding both URLs, move to B when A dies; the responder's
// subscription follows it, and requests are answered again.
func TestClientsMoveToSurvivingServer(t *testing.T) {
	a, b := startPair(t)
	urls := a.ClientURL() + "," + b.ClientURL()
	resp, err := Connect(urls, "responder", nats.DontRandomize())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Close()
	if _, err := resp.Subscribe("t.ping", func(m *nats.Msg) {
		var p ping
		_ = Decode(m, &p)
		_ = Respond(m, &ping{N: p.N + 1})
	}); err != nil {
		t.Fatal(err)
	}
	req, err := Connect(urls, "requester", nats.DontRandomize())
	if err != nil {
		t.Fatal(err)
	}
	defer req.Close()
	if resp.ConnectedUrl() != a.ClientURL() || req.ConnectedUrl() != a.ClientURL() {
		t.Fatalf("clients on %s and %s, want both on A %s", resp.ConnectedUrl(), req.ConnectedUrl(), a.ClientURL())
	}
	waitInterest(t, req, "t.ping")

	a.Shutdown()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, err := CallRetry[ping](ctx, req, "t.ping", ping{N: 1}, Retry{Idempotent: true, Attempt: time.Second, Backoff: DefaultBackoff()})
	if err != nil || got.N != 2 {
		t.Fatalf("after A died: %+v, %v", got, err)
	}
	if resp.ConnectedUrl() != b.ClientURL() || req.ConnectedUrl() != b.ClientURL() {
		t.Fatalf("clients on %q and %q after A died, want B %s", resp.ConnectedUrl(), req.ConnectedUrl(), b.ClientURL())
	}
}

// TestCallRetryNoResponders: a request nobody is subscribed to yet (the
// responder still moving to another server) fails at once with Call and
// is answered with CallRetry once the responder is there; a responder's
// error reply is not resent; without Idempotent a timeout is not resent.
func TestCallRetryNoResponders(t *testing.T) {
	srv := testutil.NATS(t)
	nc, err := Connect(srv.ClientURL(), "test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := Call[ping](ctx, nc, "t.late", ping{N: 1}); !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("Call with nobody subscribed: %v, want ErrNoResponders", err)
	}
	late, err := Connect(srv.ClientURL(), "late")
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	subscribed := make(chan error, 1)
	go func() {
		time.Sleep(200 * time.Millisecond) // the responder arrives later
		_, err := late.Subscribe("t.late", func(m *nats.Msg) {
			var p ping
			_ = Decode(m, &p)
			if p.N < 0 {
				_ = RespondError(m, wire.CodeBadRequest, fmt.Sprintf("n %d < 0", p.N))
				return
			}
			_ = Respond(m, &ping{N: p.N + 1})
		})
		if err == nil {
			err = late.Flush()
		}
		subscribed <- err
	}()
	got, err := CallRetry[ping](ctx, nc, "t.late", ping{N: 1}, NoResponders())
	if err != nil || got.N != 2 {
		t.Fatalf("CallRetry: %+v, %v", got, err)
	}
	if err := <-subscribed; err != nil {
		t.Fatal(err)
	}
	if _, err := CallRetry[ping](ctx, nc, "t.late", ping{N: -1}, Retry{Idempotent: true, Backoff: DefaultBackoff()}); err == nil ||
		err.Error() != "bad_request: n -1 < 0" {
		t.Fatalf("error reply: %v, want it returned as is", err)
	}
	// A responder that never answers: without Idempotent, one attempt.
	silent, err := nc.Subscribe("t.silent", func(*nats.Msg) {})
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Unsubscribe()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	r := Retry{Attempt: 50 * time.Millisecond, Backoff: DefaultBackoff()}
	for _, idem := range []bool{false, true} {
		r.Idempotent = idem
		ok := r.Retryable(context.DeadlineExceeded)
		if ok != idem {
			t.Fatalf("Retryable(deadline) = %v with Idempotent %v", ok, idem)
		}
	}
	sctx, scancel := context.WithTimeout(ctx, 2*time.Second)
	defer scancel()
	r.Idempotent = false
	if _, err := CallRetry[ping](sctx, nc, "t.silent", ping{}, r); !errors.Is(err, context.DeadlineExceeded) || sctx.Err() != nil {
		t.Fatalf("silent responder, not idempotent: %v (ctx %v); want one attempt ending at its 50 ms bound", err, sctx.Err())
	}
}

// TestRetryFor: a responder that never comes is given up on after For.
func TestRetryFor(t *testing.T) {
	calls := 0
	r := Retry{For: 300 * time.Millisecond, Backoff: Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}}
	err := r.Do(context.Background(), func(context.Context) error { calls++; return nats.ErrNoResponders })
	if !errors.Is(err, nats.ErrNoResponders) || calls < 2 {
		t.Fatalf("Do: %v after %d calls; want ErrNoResponders after several", err, calls)
	}
	calls = 0
	err = r.Do(context.Background(), func(context.Context) error { calls++; return errors.New("decided") })
	if err == nil || err.Error() != "decided" || calls != 1 {
		t.Fatalf("Do with a final error: %v after %d calls; want it after 1", err, calls)
	}
}

func TestBackoffDelay(t *testing.T) {
	b := Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond}
	for attempt, want := range []time.Duration{20, 40, 80, 160, 320, 500, 500} {
		want *= time.Millisecond
		for range 100 {
			if d := b.Delay(attempt); d < want/2 || d > want {
				t.Fatalf("Delay(%d) = %v, want in [%v, %v]", attempt, d, want/2, want)
			}
		}
	}
	if d := b.Delay(1000); d < 250*time.Millisecond || d > 500*time.Millisecond {
		t.Fatalf("Delay(1000) = %v, want capped at 500 ms", d)
	}
}
