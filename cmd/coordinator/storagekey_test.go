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

// TestInitWritesStorageKey (issue 28.1): 'coordinator init' writes
// storage.key (0600); for a directory made before that, 'creds
// storage-key' adds one without touching the other files, and refuses to
// overwrite it.
func TestInitWritesStorageKey(t *testing.T) {
	ctx := context.Background()
	creds := filepath.Join(t.TempDir(), "creds")
	var stdout, stderr bytes.Buffer
	if rc := run(ctx, []string{"init", "--dir", creds, "--instance", "engine0", "--tp-size", "2"}, &stdout, &stderr); rc != exitOK {
		t.Fatalf("init: rc %d, %s", rc, stderr.String())
	}
	key := filepath.Join(creds, auth.StorageKeyFile)
	if st, err := os.Stat(key); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("storage key after init: %v, %v; want mode 0600", st, err)
	}
	if _, err := auth.LoadStorageKey(key); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(key); err != nil {
		t.Fatal(err)
	}
	users, err := os.ReadFile(filepath.Join(creds, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	if rc := run(ctx, []string{"creds", "storage-key", "--dir", creds}, &stdout, &stderr); rc != exitOK {
		t.Fatalf("creds storage-key: rc %d, %s", rc, stderr.String())
	}
	if _, err := auth.LoadStorageKey(key); err != nil {
		t.Fatal(err)
	}
	if after, err := os.ReadFile(filepath.Join(creds, auth.UsersFile)); err != nil || !bytes.Equal(after, users) {
		t.Fatalf("creds storage-key changed the users file: %v", err)
	}
	stderr.Reset()
	if rc := run(ctx, []string{"creds", "storage-key", "--dir", creds}, &stdout, &stderr); rc != exitFail ||
		!strings.Contains(stderr.String(), "exists") {
		t.Fatalf("second creds storage-key: rc %d, %q; want a refusal to overwrite", rc, stderr.String())
	}
}
