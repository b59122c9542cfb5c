package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/auth"
)

// TestServeNATSClusterRefused: the NATS cluster flags are secure by
// default: a route listener off loopback without TLS, a credentials dir
// without a route secret, and an external NATS beside an embedded cluster
// stop serve; 'creds route-secret' adds the missing secret, after which the
// same serve starts (and, its context cancelled, stops).
func TestServeNATSClusterRefused(t *testing.T) {
	creds := filepath.Join(t.TempDir(), "creds")
	if err := auth.Init(creds, nil); err != nil {
		t.Fatal(err)
	}
	serveArgs := func(extra ...string) []string {
		return append([]string{"serve", "--data-dir", t.TempDir(), "--creds-dir", creds, "--nats-host", "127.0.0.1", "--nats-port", "0",
			"--bind", "127.0.0.1:0", "--http", "", "--log-level", "error"}, extra...)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a serve that starts returns at once
	for _, tc := range []struct {
		name string
		args []string
		rc   int
		msg  string
	}{
		{"off loopback without TLS", serveArgs("--nats-cluster", "0.0.0.0:0"), exitFail,
			"embedded NATS cluster listens on 0.0.0.0, off loopback, without TLS"},
		{"external NATS and a cluster", serveArgs("--nats", "nats://127.0.0.1:4222", "--nats-cluster", "127.0.0.1:0"), exitUsage,
			"an external NATS (nats://127.0.0.1:4222) and an embedded NATS cluster (listen \"127.0.0.1\", 0 routes) exclude each other"},
		{"route with credentials", serveArgs("--nats-cluster", "127.0.0.1:0", "--nats-routes", "nats-route://u:p@127.0.0.1:1"), exitUsage,
			"carries credentials in its URL"},
	} {
		var stdout, stderr bytes.Buffer
		rc := run(ctx, tc.args, &stdout, &stderr)
		if rc != tc.rc || !strings.Contains(stderr.String(), tc.msg) {
			t.Errorf("%s: rc %d, stderr %q; want rc %d with %q", tc.name, rc, stderr.String(), tc.rc, tc.msg)
		}
		if strings.Contains(stderr.String(), "u:p@") {
			t.Errorf("%s: a route password is echoed: %q", tc.name, stderr.String())
		}
	}

	// A directory from before route secrets.
	if err := os.Remove(filepath.Join(creds, auth.RouteSecretFile)); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	if rc := run(ctx, serveArgs("--nats-cluster", "127.0.0.1:0"), &stdout, &stderr); rc != exitFail ||
		!strings.Contains(stderr.String(), "coordinator creds route-secret") {
		t.Fatalf("no route secret: rc %d, stderr %q", rc, stderr.String())
	}
	stdout.Reset()
	stderr.Reset()
	if rc := run(ctx, []string{"creds", "route-secret", "--dir", creds}, &stdout, &stderr); rc != exitOK {
		t.Fatalf("creds route-secret: rc %d, %s", rc, stderr.String())
	}
	if rc := run(ctx, []string{"creds", "route-secret", "--dir", creds}, &stdout, &stderr); rc != exitFail ||
		!strings.Contains(stderr.String(), "exists") {
		t.Fatalf("second creds route-secret: rc %d, %q; want a refusal to overwrite", rc, stderr.String())
	}
	stderr.Reset()
	if rc := run(ctx, serveArgs("--nats-cluster", "127.0.0.1:0"), &stdout, &stderr); rc != exitOK {
		t.Fatalf("serve with a route secret: rc %d, stderr %q", rc, stderr.String())
	}
}
