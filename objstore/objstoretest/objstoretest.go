// Package objstoretest starts an in-process S3 server (gofakes3,
// github.com/johannesboyne/gofakes3, backed by memory) for tests: a real
// S3 HTTP server on a loopback port that objstore's real client (minio-go)
// talks to, not a mock of the client.
package objstoretest

import (
	"encoding/json"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"

	"github.com/kvtier/kvtier/objstore"
)

// Server is a running in-process S3 server with one bucket.
type Server struct {
	// Endpoint is host:port of the plain-HTTP server.
	Endpoint string
	Bucket   string
	// CredentialsFile is a 0600 credentials file for objstore.
	CredentialsFile string
	Backend         *s3mem.Backend
	http            *httptest.Server
}

// Start starts a server with bucket "kvtier" and registers its shutdown
// with t.Cleanup.
func Start(t testing.TB) *Server {
	t.Helper()
	be := s3mem.New()
	if err := be.CreateBucket("kvtier"); err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(gofakes3.New(be).Server())
	t.Cleanup(hs.Close)
	creds := filepath.Join(t.TempDir(), "s3.json")
	b, _ := json.Marshal(objstore.Credentials{AccessKeyID: "kvtier-test", SecretAccessKey: "kvtier-test-secret"})
	if err := os.WriteFile(creds, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return &Server{Endpoint: strings.TrimPrefix(hs.URL, "http://"), Bucket: "kvtier", CredentialsFile: creds, Backend: be, http: hs}
}

// Config returns an objstore.Config for the server (plain HTTP) under
// prefix.
func (s *Server) Config(prefix string) objstore.Config {
	c := objstore.DefaultConfig()
	c.Endpoint, c.Bucket, c.CredentialsFile, c.Insecure, c.Prefix = s.Endpoint, s.Bucket, s.CredentialsFile, true, prefix
	return c
}

// Close stops the server (also done by t.Cleanup).
func (s *Server) Close() { s.http.Close() }
