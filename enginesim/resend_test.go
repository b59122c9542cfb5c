package enginesim

import (
	"context"
	"errors"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/wire"
)

// TestResendAfterLostRegistration (campaign finding: 17 of 21 engine runs
// of seed 31 ended before a verdict because one message of a registration
// was dropped and the engine waited out its whole timeout): with
// ResendAfter the engine registers again after a lost delivery and gets
// the rankd's answer; without it the lost message costs the request.
func TestResendAfterLostRegistration(t *testing.T) {
	ecfg := bus.DefaultEmbeddedConfig()
	ecfg.Port, ecfg.Insecure = 0, true
	srv, err := bus.StartEmbedded(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := bus.Connect(srv.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	sc, err := LookupScenario("tp4dcp1")
	if err != nil {
		t.Fatal(err)
	}
	plan, err := NewPlan(sc, 1)
	if err != nil {
		t.Fatal(err)
	}
	host := cuda.HostConfig{Dir: t.TempDir(), UUID: "HOST-resend-test"}
	if err := os.Chmod(host.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	subj := wire.Subjects{Prefix: "kvt"}
	w, err := openWorker(0, "eng", plan, cuda.SpecHost, host, nc, subj, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	defer w.close()
	const session = "0123456789abcdef0123456789abcdef"
	var calls atomic.Int32
	sub, err := nc.Subscribe(subj.Engine(w.rank, "register"), func(m *nats.Msg) {
		if calls.Add(1) <= 2 {
			return // the first two deliveries are lost
		}
		_ = bus.Respond(m, &wire.RegisterReply{Namespace: plan.R.Namespace, Session: session})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()

	// Without ResendAfter: the lost delivery costs the request.
	w.resend = (&sim{cfg: Config{}}).resend(0)
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	err = w.register(ctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || calls.Load() != 1 {
		t.Fatalf("register without resend: %v after %d deliveries, want a deadline after 1", err, calls.Load())
	}

	// With it: sent again, answered.
	w.resend = (&sim{cfg: Config{ResendAfter: 200 * time.Millisecond}}).resend(0)
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.register(ctx); err != nil {
		t.Fatalf("register with ResendAfter 200ms: %v after %d deliveries", err, calls.Load())
	}
	if w.session != session || calls.Load() != 3 {
		t.Fatalf("session %q after %d deliveries, want %q after 3", w.session, calls.Load(), session)
	}
}
