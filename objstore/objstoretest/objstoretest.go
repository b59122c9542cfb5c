// Package objstoretest starts an in-process S3 server (gofakes3,
// github.com/johannesboyne/gofakes3, backed by memory) for tests: a real
// S3 HTTP server on a loopback port that objstore's real client (minio-go)
// talks to, not a mock of the client.
package objstoretest

import (
	"encoding/json"
	"encoding/pem"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
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
	// CAFile, for a server started by StartTLS, is a PEM file of the
	// certificate that signs the server's (httptest's own CA); "" for
	// plain HTTP.
	CAFile  string
	Backend *s3mem.Backend
	http    *httptest.Server
	conns   atomic.Int64
}

// Conns is how many connections clients have opened to the server.
func (s *Server) Conns() int64 { return s.conns.Load() }

// Start starts a server with bucket "kvtier" and registers its shutdown
// with t.Cleanup.
func Start(t testing.TB) *Server { return start(t, false) }

// StartTLS starts a server like Start behind HTTPS: httptest's TLS server,
// with a certificate for 127.0.0.1 signed by a CA that CAFile holds.
func StartTLS(t testing.TB) *Server { return start(t, true) }

func start(t testing.TB, tls bool) *Server {
	t.Helper()
	be := s3mem.New()
	if err := be.CreateBucket("kvtier"); err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewUnstartedServer(gofakes3.New(be).Server())
	// Refused handshakes are what TLS tests provoke: not logged.
	hs.Config.ErrorLog = log.New(io.Discard, "", 0)
	s := &Server{Bucket: "kvtier", Backend: be, http: hs}
	hs.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			s.conns.Add(1)
		}
	}
	if tls {
		hs.StartTLS()
	} else {
		hs.Start()
	}
	t.Cleanup(hs.Close)
	dir := t.TempDir()
	creds := filepath.Join(dir, "s3.json")
	b, _ := json.Marshal(objstore.Credentials{AccessKeyID: "kvtier-test", SecretAccessKey: "kvtier-test-secret"})
	if err := os.WriteFile(creds, b, 0o600); err != nil {
		t.Fatal(err)
	}
	s.CredentialsFile = creds
	s.Endpoint = strings.TrimPrefix(strings.TrimPrefix(hs.URL, "http://"), "https://")
	if tls {
		s.CAFile = filepath.Join(dir, "ca.pem")
		ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: hs.Certificate().Raw})
		if err := os.WriteFile(s.CAFile, ca, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// Config returns an objstore.Config for the server under prefix: plain
// HTTP (Insecure, on loopback) for Start's, HTTPS trusting CAFile for
// StartTLS's.
func (s *Server) Config(prefix string) objstore.Config {
	c := objstore.DefaultConfig()
	c.Endpoint, c.Bucket, c.CredentialsFile, c.Prefix = s.Endpoint, s.Bucket, s.CredentialsFile, prefix
	c.Insecure, c.CAFile = s.CAFile == "", s.CAFile
	return c
}

// Close stops the server (also done by t.Cleanup).
func (s *Server) Close() { s.http.Close() }
