package auth

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Raft peer certificates (issue 28.4): the raft port of replicated
// coordinators is mutual TLS 1.3, and every peer presents a certificate
// of the cluster CA (ca.pem, InitTLS) that names its raft server id as the
// URI kvtier://raft/<id>. A peer is who its certificate names: the
// transport checks that name against the raft configuration (package
// coordinator/replica), never the TCP address.
const (
	// RaftURIScheme and RaftURIHost make a raft peer's URI SAN,
	// kvtier://raft/<server id> (the id path-escaped).
	RaftURIScheme = "kvtier"
	RaftURIHost   = "raft"
	// MaxRaftIDLen bounds a raft server id that names files.
	MaxRaftIDLen = 128
)

// RaftURI is the URI a raft peer certificate for server id carries.
func RaftURI(id string) *url.URL {
	return &url.URL{Scheme: RaftURIScheme, Host: RaftURIHost, Path: "/" + id}
}

// RaftCertFile and RaftCertKeyFile are the file names of raft server id's
// certificate and key in a credentials directory.
func RaftCertFile(id string) string    { return "raft-" + id + ".pem" }
func RaftCertKeyFile(id string) string { return "raft-" + id + "-key.pem" }

// ValidRaftFileID checks that a raft server id can name files in a
// credentials directory: 1 to MaxRaftIDLen of [A-Za-z0-9._-], not starting
// with '.' or '-' (no path separator, nothing hidden).
func ValidRaftFileID(id string) error {
	if id == "" || len(id) > MaxRaftIDLen || id[0] == '.' || id[0] == '-' {
		return fmt.Errorf("raft server id %q must be 1 to %d characters, not starting with '.' or '-': %w", id, MaxRaftIDLen, ErrIdentity)
	}
	for _, r := range id {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("raft server id %q: character %q is not one of [A-Za-z0-9._-]: %w", id, r, ErrIdentity)
		}
	}
	return nil
}

// loadCA reads dir's cluster CA certificate and its key (0600).
func loadCA(dir string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	caPath, keyPath := filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile)
	certPEM, err := readPrivate(caPath, false)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, fmt.Errorf("no cluster CA in %s (%s): make one with 'coordinator creds tls --dir %s --host ...' "+
			"or 'coordinator init --tls-host': %w", dir, CAFile, dir, ErrCredsFile)
	}
	if err != nil {
		return nil, nil, err
	}
	ca, err := parseCertPEM(caPath, certPEM)
	if err != nil {
		return nil, nil, err
	}
	if !ca.IsCA {
		return nil, nil, fmt.Errorf("%s is not a CA certificate: %w", caPath, ErrCredsFile)
	}
	keyPEM, err := readPrivate(keyPath, true)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, fmt.Errorf("the cluster CA's key %s is absent: issue certificates where the operator keeps it: %w", keyPath, ErrCredsFile)
	}
	if err != nil {
		return nil, nil, err
	}
	blk, _ := pem.Decode(keyPEM)
	if blk == nil {
		return nil, nil, fmt.Errorf("%s holds no PEM key: %w", keyPath, ErrCredsFile)
	}
	key, err := x509.ParseECPrivateKey(blk.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("CA key %s: %w: %w", keyPath, ErrCredsFile, err)
	}
	if !key.PublicKey.Equal(ca.PublicKey) {
		return nil, nil, fmt.Errorf("CA key %s does not belong to %s: %w", keyPath, caPath, ErrCredsFile)
	}
	return ca, key, nil
}

func parseCertPEM(path string, data []byte) (*x509.Certificate, error) {
	blk, _ := pem.Decode(data)
	if blk == nil || blk.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("%s holds no PEM certificate: %w", path, ErrCredsFile)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("certificate %s: %w: %w", path, ErrCredsFile, err)
	}
	return c, nil
}

// IssueRaftCert writes a raft peer certificate for server id into dir
// (RaftCertFile, 0644, and RaftCertKeyFile, 0600), signed by dir's cluster
// CA (ca.pem and ca-key.pem): a P-256 key, valid for CertValidity or until
// the CA expires if sooner, for both TLS client and server use, naming id
// only as RaftURI(id). It refuses to overwrite unless replace is set
// (renewal: the new pair replaces the old one by rename; restart that
// coordinator to load it).
func IssueRaftCert(dir, id string, replace bool) error {
	if err := ValidRaftFileID(id); err != nil {
		return err
	}
	ca, caKey, err := loadCA(dir)
	if err != nil {
		return err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now()
	notAfter := now.Add(CertValidity)
	if ca.NotAfter.Before(notAfter) {
		notAfter = ca.NotAfter
	}
	if !notAfter.After(now) {
		return fmt.Errorf("the cluster CA %s expired at %s: %w", filepath.Join(dir, CAFile), ca.NotAfter.Format(time.RFC3339), ErrCredsFile)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "kvtier raft " + id},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{RaftURI(id)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("create raft certificate for %s: %w", id, err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	files := []struct {
		name string
		data []byte
		mode os.FileMode
	}{
		{RaftCertKeyFile(id), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600},
		{RaftCertFile(id), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644},
	}
	if !replace {
		for _, f := range files {
			if _, err := os.Lstat(filepath.Join(dir, f.name)); err == nil {
				return fmt.Errorf("%s exists (renew with --replace): %w", filepath.Join(dir, f.name), ErrExists)
			}
		}
	}
	// The key first: a crash between the renames leaves a new key with the
	// old certificate, which LoadRaftTLS refuses by name, not silently.
	for _, f := range files {
		path := filepath.Join(dir, f.name)
		tmp := path + ".tmp"
		_ = os.Remove(tmp)
		if err := writeNew(tmp, f.data, f.mode); err != nil {
			return err
		}
		if err := replaceFile(tmp, path); err != nil {
			return fmt.Errorf("install %s: %w", path, err)
		}
	}
	return nil
}

// RaftPeerID returns the raft server id a peer certificate names: its one
// kvtier://raft/<id> URI. A certificate with none (a NATS server
// certificate of the same CA) or with several is refused.
func RaftPeerID(c *x509.Certificate) (string, error) {
	id, n := "", 0
	for _, u := range c.URIs {
		if u.Scheme != RaftURIScheme || u.Host != RaftURIHost {
			continue
		}
		n++
		id = strings.TrimPrefix(u.Path, "/")
	}
	switch {
	case n == 0:
		return "", fmt.Errorf("certificate %q names no raft server (no %s://%s/ URI): %w", c.Subject.CommonName, RaftURIScheme, RaftURIHost, ErrPeerCert)
	case n > 1:
		return "", fmt.Errorf("certificate %q names %d raft servers, want one: %w", c.Subject.CommonName, n, ErrPeerCert)
	case id == "":
		return "", fmt.Errorf("certificate %q names an empty raft server id: %w", c.Subject.CommonName, ErrPeerCert)
	}
	return id, nil
}

// VerifyRaftPeer checks a peer's certificate chain (leaf first, as TLS
// delivered it) against the cluster CA in roots, now, for usage (the
// peer's role in this connection: ExtKeyUsageServerAuth for a server we
// dialled, ExtKeyUsageClientAuth for a client we accepted), and returns
// the raft server id it names. Every refusal wraps ErrPeerCert.
func VerifyRaftPeer(chain []*x509.Certificate, roots *x509.CertPool, usage x509.ExtKeyUsage) (string, error) {
	if len(chain) == 0 {
		return "", fmt.Errorf("peer presented no certificate: %w", ErrPeerCert)
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
		return "", fmt.Errorf("certificate %q: %w: %w", chain[0].Subject.CommonName, ErrPeerCert, err)
	}
	return RaftPeerID(chain[0])
}

// RaftTLS is one raft server's TLS material.
type RaftTLS struct {
	// Cert is this server's certificate and key, presented both when
	// accepting and when dialling.
	Cert tls.Certificate
	// ID is the raft server id Cert names.
	ID string
	// Roots holds the cluster CA every peer's certificate must chain to.
	Roots *x509.CertPool
	// NotAfter is when Cert expires.
	NotAfter time.Time
}

// LoadRaftTLS reads a raft peer certificate, its key (0600, owned by this
// user, no symlink) and the cluster CA, and checks that the certificate
// chains to that CA now and names exactly one raft server id. Errors name
// the file and the rule and wrap ErrCredsFile (files) or ErrPeerCert (the
// certificate itself).
func LoadRaftTLS(certFile, keyFile, caFile string) (*RaftTLS, error) {
	certPEM, err := readPrivate(certFile, false)
	if err != nil {
		return nil, fmt.Errorf("raft certificate: %w", err)
	}
	keyPEM, err := readPrivate(keyFile, true)
	if err != nil {
		return nil, fmt.Errorf("raft certificate key: %w", err)
	}
	caPEM, err := readPrivate(caFile, false)
	if err != nil {
		return nil, fmt.Errorf("raft CA: %w", err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("raft certificate %s with key %s: %w: %w", certFile, keyFile, ErrCredsFile, err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("raft CA %s holds no PEM certificate: %w", caFile, ErrCredsFile)
	}
	chain := make([]*x509.Certificate, 0, len(cert.Certificate))
	for _, der := range cert.Certificate {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, fmt.Errorf("raft certificate %s: %w: %w", certFile, ErrCredsFile, err)
		}
		chain = append(chain, c)
	}
	// Both roles: this certificate is presented when dialling and when
	// accepting.
	id, err := VerifyRaftPeer(chain, roots, x509.ExtKeyUsageServerAuth)
	if err == nil {
		_, err = VerifyRaftPeer(chain, roots, x509.ExtKeyUsageClientAuth)
	}
	if err != nil {
		return nil, fmt.Errorf("raft certificate %s against CA %s: %w", certFile, caFile, err)
	}
	return &RaftTLS{Cert: cert, ID: id, Roots: roots, NotAfter: chain[0].NotAfter}, nil
}
