package objstore_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/objstore"
	"github.com/kvtier/kvtier/objstore/objstoretest"
)

func open(t *testing.T, srv *objstoretest.Server, prefix string) *objstore.Store {
	t.Helper()
	s, err := objstore.Open(context.Background(), srv.Config(prefix))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// TestRoundTrip: put, ranged read, list under the prefix, delete, against
// the in-process S3 server (gofakes3) through minio-go.
func TestRoundTrip(t *testing.T) {
	ctx := context.Background()
	srv := objstoretest.Start(t)
	s := open(t, srv, "p/")
	other := open(t, srv, "q/")
	data := make([]byte, 3<<20+17)
	for i := range data {
		data[i] = byte(i*7 + i>>9)
	}
	if err := s.Put(ctx, "a/x.kvo", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	if err := other.Put(ctx, "a/y.kvo", bytes.NewReader(data[:10]), 10); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, 1, 4096, int64(len(data)) - 1} {
		body, size, err := s.Open(ctx, "a/x.kvo", off, 0)
		if err != nil {
			t.Fatalf("open at %d: %v", off, err)
		}
		got, err := io.ReadAll(body)
		body.Close()
		if err != nil || size != int64(len(data))-off || !bytes.Equal(got, data[off:]) {
			t.Fatalf("read from %d: %d B of %d (size %d), err %v", off, len(got), len(data)-int(off), size, err)
		}
	}
	body, size, err := s.Open(ctx, "a/x.kvo", 5, 100)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(body)
	body.Close()
	if err != nil || size != 100 || !bytes.Equal(got, data[5:105]) {
		t.Fatalf("read of 100 B from 5: %d B (size %d), err %v", len(got), size, err)
	}
	var names []string
	if err := s.List(ctx, "a/", func(n string, size int64) error {
		names = append(names, n)
		if size != int64(len(data)) {
			t.Errorf("%s listed with %d B", n, size)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(names) != 1 || names[0] != "a/x.kvo" {
		t.Fatalf("listed %q, want [a/x.kvo] (the other prefix's object is not ours)", names)
	}
	if err := s.Delete(ctx, "a/x.kvo"); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "a/x.kvo"); err != nil {
		t.Fatalf("deleting a missing object: %v", err)
	}
	if _, _, err := s.Open(ctx, "a/x.kvo", 0, 0); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("open after delete: %v, want fs.ErrNotExist", err)
	}
}

// TestConfigRefusals: credentials only from a private file, endpoint
// without a scheme, an existing bucket.
func TestConfigRefusals(t *testing.T) {
	srv := objstoretest.Start(t)
	dir := t.TempDir()
	open := filepath.Join(dir, "open.json")
	if err := os.WriteFile(open, []byte(`{"access_key_id":"a","secret_access_key":"b"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty.json")
	if err := os.WriteFile(empty, []byte(`{"access_key_id":"a"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, mod := range map[string]func(*objstore.Config){
		"world-readable credentials": func(c *objstore.Config) { c.CredentialsFile = open },
		"no secret":                  func(c *objstore.Config) { c.CredentialsFile = empty },
		"no credentials file":        func(c *objstore.Config) { c.CredentialsFile = "" },
		"scheme in endpoint":         func(c *objstore.Config) { c.Endpoint = "http://" + c.Endpoint },
		"missing bucket":             func(c *objstore.Config) { c.Bucket = "nope" },
	} {
		c := srv.Config("")
		mod(&c)
		if _, err := objstore.Open(context.Background(), c); !errors.Is(err, objstore.ErrConfig) {
			t.Errorf("%s: err %v, want ErrConfig", name, err)
		}
	}
	// TLS by default: the plain-HTTP server is not spoken to as HTTPS.
	c := srv.Config("")
	c.Insecure = false
	if _, err := objstore.Open(context.Background(), c); !errors.Is(err, objstore.ErrIO) {
		t.Fatalf("HTTPS to a plain-HTTP server: err %v, want ErrIO", err)
	}
}
