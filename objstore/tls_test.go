package objstore_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/objstore"
	"github.com/kvtier/kvtier/objstore/objstoretest"
)

// TestTLSWithCAFile (tiers4.3): the S3 server behind HTTPS (gofakes3 in an
// httptest TLS server, a certificate of its own CA) is reached through the
// CA file, byte-exact; without the CA file, or with another server's CA,
// the client refuses the certificate and nothing is sent; a CA file
// without a certificate is a configuration error.
func TestTLSWithCAFile(t *testing.T) {
	ctx := context.Background()
	srv := objstoretest.StartTLS(t)

	s, err := objstore.Open(ctx, srv.Config("tls/"))
	if err != nil {
		t.Fatalf("HTTPS with the server's CA file: %v", err)
	}
	defer s.Close()
	if !strings.HasPrefix(s.String(), "https://") {
		t.Fatalf("store %s, want https", s)
	}
	data := make([]byte, 1<<20+3)
	for i := range data {
		data[i] = byte(i*13 + i>>11)
	}
	if err := s.Put(ctx, "x.kvo", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	body, size, err := s.Open(ctx, "x.kvo", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(body)
	body.Close()
	if err != nil || size != int64(len(data)) || !bytes.Equal(got, data) {
		t.Fatalf("read over HTTPS: %d B of %d, err %v", len(got), len(data), err)
	}

	noCA := srv.Config("tls/")
	noCA.CAFile = ""
	conns := srv.Conns()
	if _, err := objstore.Open(ctx, noCA); !errors.Is(err, objstore.ErrIO) || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("HTTPS without the CA file: err %v, want ErrIO naming the certificate", err)
	}
	// Refused at the first handshake, not retried (minio-go retried it
	// 4-7 s: seen failing with 10 connections).
	if n := srv.Conns() - conns; n != 1 {
		t.Fatalf("HTTPS without the CA file: %d connections, want 1 (a certificate failure is not retried)", n)
	}
	wrongCA := srv.Config("tls/")
	wrongCA.CAFile = otherCA(t)
	if _, err := objstore.Open(ctx, wrongCA); !errors.Is(err, objstore.ErrIO) || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("HTTPS with another server's CA: err %v, want ErrIO naming the certificate", err)
	}
	// Plain HTTP to the HTTPS server (on loopback, so allowed) fails too.
	plain := srv.Config("tls/")
	plain.Insecure, plain.CAFile = true, ""
	if _, err := objstore.Open(ctx, plain); !errors.Is(err, objstore.ErrIO) {
		t.Fatalf("plain HTTP to the HTTPS server: err %v, want ErrIO", err)
	}

	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.pem")
	if err := os.Symlink(srv.CAFile, link); err != nil {
		t.Fatal(err)
	}
	for name, file := range map[string]string{"no PEM": notPEM, "missing": filepath.Join(dir, "none.pem"), "symlink": link} {
		c := srv.Config("tls/")
		c.CAFile = file
		if _, err := objstore.Open(ctx, c); !errors.Is(err, objstore.ErrConfig) {
			t.Errorf("CA file %s: err %v, want ErrConfig", name, err)
		}
	}
}

// otherCA writes a PEM file of a self-signed CA certificate for
// 127.0.0.1 that signed nothing the test server presents.
func otherCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "not the server's CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "other-ca.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestPlaintextOffLoopbackRefused (tiers4.3): plain HTTP is allowed to a
// loopback endpoint (a local test server) with Insecure; to any other
// endpoint only with InsecureRemote as well, like NATS's plaintext gossip
// off loopback. InsecureRemote alone (HTTPS) is a contradiction, refused.
// Seen failing before the rule: Validate accepted plain HTTP to
// 10.0.0.5:9000 and s3.example.com.
func TestPlaintextOffLoopbackRefused(t *testing.T) {
	for _, tc := range []struct {
		endpoint         string
		insecure, remote bool
		ok               bool
	}{
		{"127.0.0.1:9000", true, false, true},
		{"127.8.0.1:9000", true, false, true},
		{"[::1]:9000", true, false, true},
		{"localhost:9000", true, false, true},
		{"localhost", true, false, true},
		{"10.0.0.5:9000", true, false, false},
		{"s3.example.com", true, false, false},
		{"localhost.example.com:9000", true, false, false},
		{"[2001:db8::1]:9000", true, false, false},
		{"0.0.0.0:9000", true, false, false},
		{"10.0.0.5:9000", true, true, true},
		{"s3.example.com", true, true, true},
		{"s3.example.com", false, false, true},
		{"s3.example.com", false, true, false},
	} {
		c := objstore.DefaultConfig()
		c.Endpoint, c.Bucket, c.CredentialsFile, c.Insecure, c.InsecureRemote = tc.endpoint, "b", "/etc/s3.json", tc.insecure, tc.remote
		err := c.Validate()
		if tc.ok && err != nil || !tc.ok && !errors.Is(err, objstore.ErrConfig) {
			t.Errorf("endpoint %s insecure %v remote %v: err %v, want ok=%v", tc.endpoint, tc.insecure, tc.remote, err, tc.ok)
		}
	}
}
