package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/coordinator"
)

const exampleConf = "../../deploy/examples/coordinator.conf"

// TestServeExampleConfig: the example config parses with the real serve
// flags and, with the host-specific addresses and data dir overridden on
// the command line (which wins), starts and stops a coordinator.
func TestServeExampleConfig(t *testing.T) {
	dir := t.TempDir()
	creds := filepath.Join(t.TempDir(), "creds")
	if err := auth.Init(creds, nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // Run returns at once: start, then shut down
	var stdout, stderr bytes.Buffer
	rc := run(ctx, []string{"serve", "--config", exampleConf, "--data-dir", dir, "--creds-dir", creds,
		"--nats-host", "127.0.0.1", "--nats-port", "0", "--bind", "127.0.0.1:0", "--http", "127.0.0.1:0", "--log-level", "error"},
		&stdout, &stderr)
	if rc != exitOK || stderr.Len() != 0 {
		t.Fatalf("rc %d, stderr %q", rc, stderr.String())
	}
	if _, err := os.Stat(filepath.Join(dir, coordinator.IndexFile)); err != nil {
		t.Fatalf("the command line's --data-dir was not used: %v", err)
	}
}

// confWith writes the example config with old replaced by new and returns
// its path and the 1-based line of the change.
func confWith(t *testing.T, old, new string) (string, int) {
	t.Helper()
	data, err := os.ReadFile(exampleConf)
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.Index(data, []byte(old))
	if i < 0 {
		t.Fatalf("%q not in %s", old, exampleConf)
	}
	line := bytes.Count(data[:i], []byte("\n")) + 1
	p := filepath.Join(t.TempDir(), "coordinator.conf")
	if err := os.WriteFile(p, bytes.Replace(data, []byte(old), []byte(new), 1), 0o600); err != nil {
		t.Fatal(err)
	}
	return p, line
}

// TestServeConfigRefused: a typo in a key and a secret in the file stop
// serve before anything starts, naming the file, line and key.
func TestServeConfigRefused(t *testing.T) {
	for _, tc := range []struct{ old, new, msg string }{
		{"verdict-history =", "verdict-histroy =", `key "verdict-histroy" is not a flag of serve: flagfile: unknown key`},
		{"log-level = info", "gossip-key = c2VjcmV0c2VjcmV0c2VjcmV0", `key "gossip-key" holds a secret; give it on the command line or through its file flag: flagfile: secret in config file`},
		{"restore-deadline = 5s", "restore-deadline = 5", `key "restore-deadline": value "5" refused: flagfile: invalid value: parse error`},
	} {
		p, line := confWith(t, tc.old, tc.new)
		var stdout, stderr bytes.Buffer
		rc := run(context.Background(), []string{"serve", "--config", p, "--data-dir", t.TempDir()}, &stdout, &stderr)
		want := fmt.Sprintf("config %s:%d: %s\n", p, line, tc.msg)
		if rc != exitUsage || stderr.String() != want {
			t.Errorf("rc %d, stderr:\n%s\nwant:\n%s", rc, stderr.String(), want)
		}
		if strings.Contains(stderr.String(), "c2VjcmV0") {
			t.Errorf("the secret is echoed: %q", stderr.String())
		}
	}
}
