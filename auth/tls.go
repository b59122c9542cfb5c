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
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// TLS file names inside a credentials directory.
const (
	// CAKeyFile is the cluster CA's private key (0600): keep it with the
	// operator, it signs server certificates.
	CAKeyFile = "ca-key.pem"
	// ServerCertFile and ServerKeyFile are the embedded NATS server's
	// certificate (signed by the CA) and key (0600).
	ServerCertFile = "server.pem"
	ServerKeyFile  = "server-key.pem"
)

// CertValidity is how long InitTLS's certificates are valid.
const CertValidity = 365 * 24 * time.Hour

// InitTLS writes a self-signed cluster CA and a server certificate for
// hosts (IP addresses or DNS names) into dir. It refuses to overwrite.
func InitTLS(dir string, hosts []string) error {
	if len(hosts) == 0 {
		return fmt.Errorf("server certificate needs at least one host: %w", ErrIdentity)
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now()
	ca := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "kvtier cluster CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(CertValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("create CA certificate: %w", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	srv := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "kvtier NATS"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(CertValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			srv.IPAddresses = append(srv.IPAddresses, ip)
		} else {
			srv.DNSNames = append(srv.DNSNames, h)
		}
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srv, caCert, &srvKey.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("create server certificate: %w", err)
	}
	for _, f := range []struct {
		name string
		typ  string
		der  []byte
		key  *ecdsa.PrivateKey
		mode os.FileMode
	}{
		{CAFile, "CERTIFICATE", caDER, nil, 0o644},
		{CAKeyFile, "", nil, caKey, 0o600},
		{ServerCertFile, "CERTIFICATE", srvDER, nil, 0o644},
		{ServerKeyFile, "", nil, srvKey, 0o600},
	} {
		der, typ := f.der, f.typ
		if f.key != nil {
			if der, err = x509.MarshalECPrivateKey(f.key); err != nil {
				return err
			}
			typ = "EC PRIVATE KEY"
		}
		if err := writeNew(filepath.Join(dir, f.name), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), f.mode); err != nil {
			return err
		}
	}
	return nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

// ServerTLS loads dir's server certificate and key (the key 0600, no
// symlink). It returns nil, nil when dir has no server certificate.
func ServerTLS(dir string) (*tls.Config, error) {
	certPath, keyPath := filepath.Join(dir, ServerCertFile), filepath.Join(dir, ServerKeyFile)
	certPEM, err := readPrivate(certPath, false)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	keyPEM, err := readPrivate(keyPath, true)
	if err != nil {
		return nil, err
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("server certificate %s: %w: %w", certPath, ErrCredsFile, err)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
}
