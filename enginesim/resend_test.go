package enginesim

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestResendAfterLostRegistration (campaign finding: 17 of 21 engine runs
// of seed 31 ended before a verdict because one message of a registration
// was dropped and the engine waited out its whole timeout): with
// ResendAfter the engine sends the registration again after a lost
// delivery, as the same message (same reply subject, same bytes: the
// rankd answers a redelivery with its first session instead of
// registering again and superseding it, seen in the raft campaign as
// stores refused stale_session), and gets the answer; without it the lost
// message costs the request.
func TestResendAfterLostRegistration(t *testing.T) {
	srv := testutil.NATS(t)
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
	var mu sync.Mutex
	var replies []string
	sub, err := nc.Subscribe(subj.Engine(w.rank, "register"), func(m *nats.Msg) {
		mu.Lock()
		replies = append(replies, m.Reply)
		mu.Unlock()
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
	w.resendEvery = 0
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	err = w.register(ctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || calls.Load() != 1 {
		t.Fatalf("register without resend: %v after %d deliveries, want a deadline after 1", err, calls.Load())
	}

	// With it: sent again, answered.
	w.resendEvery = 200 * time.Millisecond
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.register(ctx); err != nil {
		t.Fatalf("register with ResendAfter 200ms: %v after %d deliveries", err, calls.Load())
	}
	if w.session != session || calls.Load() != 3 {
		t.Fatalf("session %q after %d deliveries, want %q after 3", w.session, calls.Load(), session)
	}
	mu.Lock()
	defer mu.Unlock()
	if replies[1] != replies[2] {
		t.Fatalf("the resend used reply subject %s, the first send %s: the rankd would register it again", replies[2], replies[1])
	}
}
