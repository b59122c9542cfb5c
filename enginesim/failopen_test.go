package enginesim

import (
	"context"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/testutil"
)

func failOpenConfig(t *testing.T, url string) Config {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Scenario, cfg.Chunks, cfg.NATSURL = "tp4dcp1", 3, url
	cfg.Creds.Insecure = true
	cfg.Host = cuda.HostConfig{Dir: t.TempDir(), UUID: "HOST-failopen-test"}
	if err := os.Chmod(cfg.Host.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	cfg.Timeout, cfg.WaitPrefix, cfg.Compute = 2*time.Second, 0, 0
	cfg.Out = io.Discard
	if testing.Verbose() {
		cfg.Out = os.Stderr
	}
	return cfg
}

// closedURL is a NATS URL nobody listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "nats://" + addr
}

// TestFailOpenWithoutNATS: with the coordinator (and its NATS) down, a
// fail-open engine serves the prompt by computing it, within its attach
// bound, and every byte of every rank is the prompt's; without fail-open
// the same run is an error.
func TestFailOpenWithoutNATS(t *testing.T) {
	url := closedURL(t)
	cfg := failOpenConfig(t, url)
	if _, err := Run(context.Background(), cfg); err == nil {
		t.Fatal("a run that is not fail-open succeeded with kvtier down")
	}
	cfg = failOpenConfig(t, url)
	cfg.FailOpen, cfg.AttachWait = true, 500*time.Millisecond
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("fail-open run with kvtier down: %v", err)
	}
	if res.Attached || len(res.Recomputed) != 3 || len(res.CacheProblems) != 1 || !res.OK {
		t.Fatalf("attached %v, recomputed %v, problems %q, ok %v; want not attached, chunks 0-2 recomputed, one problem",
			res.Attached, res.Recomputed, res.CacheProblems, res.OK)
	}
	// What the engine waited on kvtier: the attach wait and one attempt
	// that fails at once (not connected). Computing the prompt itself is
	// the engine's own work and is not bounded here (under -race on a busy
	// machine it took 50 s).
	if res.AttachSeconds > 2.5 {
		t.Fatalf("fail-open run waited %.1f s on kvtier with an attach wait of 500ms", res.AttachSeconds)
	}
}

// TestFailOpenWithoutCoordinator: NATS is up but nobody answers the
// engine's subjects (coordinator and rankds down): the registration
// fails within the attach bound and the prompt is computed.
func TestFailOpenWithoutCoordinator(t *testing.T) {
	srv := testutil.NATS(t)
	cfg := failOpenConfig(t, srv.ClientURL())
	cfg.FailOpen, cfg.AttachWait = true, 300*time.Millisecond
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("fail-open run without a coordinator: %v", err)
	}
	if res.Attached || len(res.Recomputed) != 3 || !strings.Contains(strings.Join(res.CacheProblems, ";"), "register spec") {
		t.Fatalf("attached %v, recomputed %v, problems %q", res.Attached, res.Recomputed, res.CacheProblems)
	}
}

func TestFailOpenConfigIsChecked(t *testing.T) {
	cfg := failOpenConfig(t, "nats://127.0.0.1:1")
	cfg.AttachWait = time.Second
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "without fail-open") {
		t.Fatalf("attach wait without fail-open: %v", err)
	}
	cfg.FailOpen, cfg.Bench = true, true
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "fail-open with bench") {
		t.Fatalf("fail-open bench: %v", err)
	}
}
