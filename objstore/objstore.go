package objstore

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Sentinel errors.
var (
	// ErrConfig: a Config rule failed, or the credentials file is unusable.
	ErrConfig = errors.New("objstore: bad configuration")
	// ErrIO: the object store failed a request (network, server error,
	// refused credentials).
	ErrIO = errors.New("objstore: request failed")
)

// Config configures a Store. Start from DefaultConfig.
type Config struct {
	// Endpoint is the server's host:port (no scheme). Required.
	Endpoint string
	// Bucket is the bucket that holds the objects; it must exist (Open
	// checks). Required.
	Bucket string
	// Prefix is prepended to every object name ("kvtier/" keeps kvtier's
	// objects apart from others of the bucket). Default "".
	Prefix string
	// CredentialsFile names a JSON file {"access_key_id": ...,
	// "secret_access_key": ..., "session_token": ...} (session_token
	// optional) of mode 0600 or stricter. Required: credentials are never
	// taken from flags or the environment.
	CredentialsFile string
	// Insecure talks plain HTTP, to a loopback endpoint only (127.0.0.0/8,
	// ::1, localhost: a local test server) unless InsecureRemote. Default
	// false: HTTPS, with the system's roots plus CAFile.
	Insecure bool
	// InsecureRemote, with Insecure, also allows plain HTTP to an endpoint
	// off loopback: request signatures, object names and the KV bytes then
	// cross the network unencrypted, readable and alterable on the way
	// (reads are still verified, C5). Default false; a trusted network
	// only, like NATS's plaintext gossip off loopback.
	InsecureRemote bool
	// CAFile, when set, is a PEM bundle trusted besides the system roots
	// (a private S3 server's CA). Default "".
	CAFile string
	// Region is the bucket's region. Default "us-east-1".
	Region string
	// RequestTimeout bounds one request (header to the last body byte).
	// Default 60 s. Longer tolerates slower links for large objects; a hung
	// server holds a writer that long.
	RequestTimeout time.Duration
}

// DefaultConfig returns a Config with every default filled in; callers set
// Endpoint, Bucket and CredentialsFile.
func DefaultConfig() Config {
	return Config{Region: "us-east-1", RequestTimeout: 60 * time.Second}
}

// Validate checks every rule of c.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("objstore: "+format+": %w", append(args, ErrConfig)...)
	}
	switch {
	case c.Endpoint == "":
		return bad("no endpoint")
	case strings.Contains(c.Endpoint, "://") || strings.Contains(c.Endpoint, "/"):
		return bad("endpoint %q: want host:port without a scheme or path (HTTPS unless Insecure)", c.Endpoint)
	case c.Bucket == "":
		return bad("no bucket")
	case c.CredentialsFile == "":
		return bad("no credentials file (credentials are never taken from flags or the environment)")
	case c.Region == "":
		return bad("no region")
	case c.RequestTimeout <= 0:
		return bad("request timeout %v must be > 0", c.RequestTimeout)
	case strings.HasPrefix(c.Prefix, "/"):
		return bad("prefix %q must not start with /", c.Prefix)
	case c.InsecureRemote && !c.Insecure:
		return bad("insecure-remote allows plain HTTP off loopback, but the store talks HTTPS (Insecure not set)")
	case c.Insecure && !c.InsecureRemote && !loopbackHost(c.Endpoint):
		return bad("plain HTTP to %s, off loopback: credentials' signatures and KV bytes would cross the network unencrypted; use HTTPS (with a CA file for a private CA), or allow it explicitly (InsecureRemote)", c.Endpoint)
	}
	return nil
}

// loopbackHost reports whether endpoint (host or host:port) names a
// loopback address or localhost, without resolving anything.
func loopbackHost(endpoint string) bool {
	host := endpoint
	if h, _, err := net.SplitHostPort(endpoint); err == nil {
		host = h
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// readCA reads a PEM bundle (readOwnFile: not a symlink, a regular file,
// this user's or root's, writable by no one else, at most 4 MiB).
func readCA(path string) ([]byte, error) { return readOwnFile("CA file", path, false, 4<<20) }

// Credentials is the content of Config.CredentialsFile.
type Credentials struct {
	AccessKeyID     string `json:"access_key_id"`
	SecretAccessKey string `json:"secret_access_key"`
	SessionToken    string `json:"session_token,omitempty"`
}

// ReadCredentials reads a credentials file (readOwnFile: not a symlink, a
// regular file, this user's or root's, no group or other access, at most
// 64 KiB).
func ReadCredentials(path string) (Credentials, error) {
	var c Credentials
	b, err := readOwnFile("credentials file", path, true, 64<<10)
	if err != nil {
		return c, err
	}
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return c, fmt.Errorf("objstore: credentials file %s: want JSON {\"access_key_id\", \"secret_access_key\"}: %w", path, errors.Join(err, ErrConfig))
	}
	if c.AccessKeyID == "" || c.SecretAccessKey == "" {
		return c, fmt.Errorf("objstore: credentials file %s lacks access_key_id or secret_access_key: %w", path, ErrConfig)
	}
	return c, nil
}

// Store is one bucket and prefix of an S3-compatible object store. It is
// safe for concurrent use.
type Store struct {
	cfg    Config
	client *minio.Client
	tr     *http.Transport
}

// Open connects to the object store and checks that the bucket exists.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cred, err := ReadCredentials(cfg.CredentialsFile)
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{
		Proxy:                 nil, // never through a proxy from the environment
		DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: cfg.RequestTimeout,
		DisableCompression:    true,
	}
	if !cfg.Insecure {
		roots, err := x509.SystemCertPool()
		if err != nil || roots == nil {
			roots = x509.NewCertPool()
		}
		if cfg.CAFile != "" {
			pem, err := readCA(cfg.CAFile)
			if err != nil {
				return nil, err
			}
			if !roots.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("objstore: CA file %s holds no PEM certificate: %w", cfg.CAFile, ErrConfig)
			}
		}
		tr.TLSClientConfig = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	}
	opts := &minio.Options{
		Creds:        credentials.NewStaticV4(cred.AccessKeyID, cred.SecretAccessKey, cred.SessionToken),
		Secure:       !cfg.Insecure,
		Transport:    tr,
		Region:       cfg.Region,
		BucketLookup: minio.BucketLookupPath,
	}
	client, err := minio.New(cfg.Endpoint, opts)
	if err != nil {
		return nil, fmt.Errorf("objstore: client for %s: %w", cfg.Endpoint, errors.Join(err, ErrConfig))
	}
	s := &Store{cfg: cfg, client: client, tr: tr}
	rctx, cancel := context.WithTimeout(ctx, cfg.RequestTimeout)
	defer cancel()
	ok, err := s.bucketExists(rctx, opts)
	if err != nil {
		tr.CloseIdleConnections()
		return nil, fmt.Errorf("objstore: check bucket %q at %s: %w", cfg.Bucket, cfg.Endpoint, errors.Join(err, ErrIO))
	}
	if !ok {
		tr.CloseIdleConnections()
		return nil, fmt.Errorf("objstore: bucket %q does not exist at %s (objstore never creates buckets): %w", cfg.Bucket, cfg.Endpoint, ErrConfig)
	}
	return s, nil
}

// bucketExists checks the bucket, first with one attempt: minio-go retries
// every transport error but an x509.UnknownAuthorityError it no longer
// sees (Go wraps certificate failures in tls.CertificateVerificationError),
// so a server whose certificate this store refuses took 4-7 s of retries to
// fail. A certificate failure is final at once; any other failure of the
// single attempt is tried again with the client's retries. opts are the
// client's options.
func (s *Store) bucketExists(ctx context.Context, opts *minio.Options) (bool, error) {
	once := *opts
	once.MaxRetries = 1
	probe, err := minio.New(s.cfg.Endpoint, &once)
	if err != nil {
		return false, err
	}
	ok, err := probe.BucketExists(ctx, s.cfg.Bucket)
	var cve *tls.CertificateVerificationError
	var ua x509.UnknownAuthorityError
	var hn x509.HostnameError
	var ci x509.CertificateInvalidError
	if err == nil || errors.As(err, &cve) || errors.As(err, &ua) || errors.As(err, &hn) || errors.As(err, &ci) {
		return ok, err
	}
	return s.client.BucketExists(ctx, s.cfg.Bucket)
}

// Close closes the store's idle connections; requests in flight finish.
func (s *Store) Close() error {
	s.tr.CloseIdleConnections()
	return nil
}

// String names the store for logs: endpoint, bucket and prefix.
func (s *Store) String() string {
	scheme := "https"
	if s.cfg.Insecure {
		scheme = "http"
	}
	return scheme + "://" + s.cfg.Endpoint + "/" + s.cfg.Bucket + "/" + s.cfg.Prefix
}

func (s *Store) full(name string) string { return s.cfg.Prefix + name }

// Put stores size bytes from r under name, replacing any object of that
// name; it returns once the server acknowledged the whole object.
func (s *Store) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	_, err := s.client.PutObject(ctx, s.cfg.Bucket, s.full(name), r, size, minio.PutObjectOptions{
		ContentType:      "application/octet-stream",
		DisableMultipart: size <= 5<<30,
	})
	if err != nil {
		return fmt.Errorf("objstore: put %s (%d B): %w", name, size, errors.Join(err, ErrIO))
	}
	return nil
}

// Open returns the bytes of name from offset off: n of them, or to the
// end when n is 0 (or the object ends first), and how many body holds. A
// missing object gives an error wrapping fs.ErrNotExist. The caller closes
// body; ctx bounds the reads of body too.
func (s *Store) Open(ctx context.Context, name string, off, n int64) (io.ReadCloser, int64, error) {
	opts := minio.GetObjectOptions{}
	if off > 0 || n > 0 {
		end := int64(0)
		if n > 0 {
			end = off + n - 1
		}
		if err := opts.SetRange(off, end); err != nil {
			return nil, 0, fmt.Errorf("objstore: get %s from %d B (%d B): %w", name, off, n, errors.Join(err, ErrConfig))
		}
	}
	obj, err := s.client.GetObject(ctx, s.cfg.Bucket, s.full(name), opts)
	if err != nil {
		return nil, 0, s.getErr(name, err)
	}
	st, err := obj.Stat()
	if err != nil {
		obj.Close()
		return nil, 0, s.getErr(name, err)
	}
	return &body{obj: obj, name: name}, st.Size, nil
}

// body is an object being read. minio-go's Stat is a HEAD and the GET
// comes with the first Read: an object deleted in between reads as an
// error wrapping fs.ErrNotExist, as a missing one opens.
type body struct {
	obj  *minio.Object
	name string
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.obj.Read(p)
	if err != nil && err != io.EOF && minio.ToErrorResponse(err).Code == minio.NoSuchKey {
		err = fmt.Errorf("objstore: %s deleted while opened: %w", b.name, fs.ErrNotExist)
	}
	return n, err
}

func (b *body) Close() error { return b.obj.Close() }

func (s *Store) getErr(name string, err error) error {
	switch minio.ToErrorResponse(err).Code {
	case minio.NoSuchKey:
		return fmt.Errorf("objstore: %s: %w", name, fs.ErrNotExist)
	case minio.InvalidRange:
		return fmt.Errorf("objstore: %s: range beyond the object: %w", name, errors.Join(err, ErrIO))
	}
	return fmt.Errorf("objstore: get %s: %w", name, errors.Join(err, ErrIO))
}

// Delete removes name; a missing object is not an error.
func (s *Store) Delete(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	if err := s.client.RemoveObject(ctx, s.cfg.Bucket, s.full(name), minio.RemoveObjectOptions{}); err != nil {
		if minio.ToErrorResponse(err).Code == minio.NoSuchKey {
			return nil
		}
		return fmt.Errorf("objstore: delete %s: %w", name, errors.Join(err, ErrIO))
	}
	return nil
}

// List calls fn with the name (without the store's prefix) and size of
// every object whose name starts with prefix, in lexical order, until fn
// returns an error (which List returns).
func (s *Store) List(ctx context.Context, prefix string, fn func(name string, size int64) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the listing goroutine of minio-go
	for oi := range s.client.ListObjects(ctx, s.cfg.Bucket, minio.ListObjectsOptions{Prefix: s.full(prefix), Recursive: true}) {
		if oi.Err != nil {
			return fmt.Errorf("objstore: list %s: %w", prefix, errors.Join(oi.Err, ErrIO))
		}
		if err := fn(strings.TrimPrefix(oi.Key, s.cfg.Prefix), oi.Size); err != nil {
			return err
		}
	}
	return ctx.Err()
}
