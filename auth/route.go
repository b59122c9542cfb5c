package auth

import (
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
)

// Route credentials: the embedded NATS servers of several coordinators
// authenticate the routes between them with one shared secret (a route
// user and password, nats-server's cluster authorization), and encrypt
// them with the cluster CA's server certificate when the directory has one.
const (
	// RouteSecretFile holds the route password, base64 of 32 random bytes
	// (mode 0600). Every coordinator of a cluster needs the same one.
	RouteSecretFile = "route.secret"
	// RouteUser is the user name every route presents.
	RouteUser = "kvtier-route"
)

// InitRouteSecret writes a new route secret into dir. It refuses to
// overwrite one (ErrExists): a secret replaced on one coordinator only cuts
// it off from the others.
func InitRouteSecret(dir string) error {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return fmt.Errorf("route secret: %w", err)
	}
	return writeNew(filepath.Join(dir, RouteSecretFile), []byte(base64.StdEncoding.EncodeToString(key)+"\n"), 0o600)
}

// RouteCredentials reads dir's route secret (0600, owned by this user, no
// symlink) and returns the route user and password. A missing file wraps
// fs.ErrNotExist.
func RouteCredentials(dir string) (user, password string, err error) {
	path := filepath.Join(dir, RouteSecretFile)
	data, err := readPrivate(path, true)
	if err != nil {
		return "", "", err
	}
	secret := string(bytes.TrimSpace(data))
	key, err := base64.StdEncoding.DecodeString(secret)
	if err != nil {
		return "", "", fmt.Errorf("route secret %s is not base64: %w: %w", path, ErrCredsFile, err)
	}
	if len(key) < 16 {
		return "", "", fmt.Errorf("route secret %s holds %d bytes; want at least 16: %w", path, len(key), ErrCredsFile)
	}
	return RouteUser, secret, nil
}

// RouteTLS returns the TLS config of the routes: dir's server certificate,
// presented both when accepting and when opening a route, and the cluster
// CA (ca.pem) that verifies the remote server's certificate. It returns
// nil, nil when dir has no server certificate; a certificate without a CA
// is refused (a route could not verify its peer).
func RouteTLS(dir string) (*tls.Config, error) {
	cfg, err := ServerTLS(dir)
	if err != nil || cfg == nil {
		return nil, err
	}
	caPath := filepath.Join(dir, CAFile)
	caPEM, err := readPrivate(caPath, false)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("route TLS: %s has a server certificate but no %s to verify the other servers with: %w", dir, CAFile, ErrCredsFile)
	}
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("route TLS: %s holds no PEM certificate: %w", caPath, ErrCredsFile)
	}
	cfg.RootCAs = pool
	return cfg, nil
}
