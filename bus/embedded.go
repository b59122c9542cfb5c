package bus

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// EmbeddedConfig configures the NATS server the coordinator embeds.
type EmbeddedConfig struct {
	// Host is the listen address. Default "127.0.0.1"; use "0.0.0.0" for
	// rankds on other hosts.
	Host string
	// Port is the client port; 0 picks a free port. Default 4222.
	Port int
	// MaxPayload bounds one message in bytes. Default 8 MiB: large enough
	// for an inventory page, small enough to bound a bad client.
	MaxPayload int32
	// ReadyTimeout bounds the wait for the server to accept clients.
	// Default 10 s.
	ReadyTimeout time.Duration
	// Users are the nkey users the server accepts, each with its
	// permissions (auth.Users.ServerUsers). Default nil. Empty means no
	// authentication at all: StartEmbedded refuses that unless Insecure.
	Users []*server.NkeyUser
	// Insecure lets the server run without Users: anyone who reaches the
	// port may read and forge every message (C9). Default false.
	Insecure bool
	// TLS, when set, makes the server require TLS from every client.
	// Default nil. StartEmbedded refuses a non-loopback Host without it
	// unless Insecure.
	TLS *tls.Config
}

// DefaultEmbeddedConfig returns the defaults documented on EmbeddedConfig.
func DefaultEmbeddedConfig() EmbeddedConfig {
	return EmbeddedConfig{Host: "127.0.0.1", Port: 4222, MaxPayload: 8 << 20, ReadyTimeout: 10 * time.Second}
}

// Embedded is a running in-process NATS server.
type Embedded struct {
	srv *server.Server

	mu   sync.Mutex // guards opts
	opts *server.Options
}

// ErrInsecure: the configuration would run NATS without authentication or
// without TLS off loopback, and Insecure was not set.
var ErrInsecure = errors.New("insecure NATS configuration")

// IsLoopback reports whether host (an IP) only listens on loopback.
func IsLoopback(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// StartEmbedded starts a NATS server in this process.
func StartEmbedded(cfg EmbeddedConfig) (*Embedded, error) {
	if cfg.MaxPayload <= 0 {
		return nil, fmt.Errorf("embedded NATS max payload %d must be > 0", cfg.MaxPayload)
	}
	if !cfg.Insecure {
		if len(cfg.Users) == 0 {
			return nil, fmt.Errorf("embedded NATS has no users: every connection must be authenticated (C9); give credentials or set insecure: %w", ErrInsecure)
		}
		if cfg.TLS == nil && !IsLoopback(cfg.Host) {
			return nil, fmt.Errorf("embedded NATS listens on %s, off loopback, without TLS; give a certificate or set insecure: %w", cfg.Host, ErrInsecure)
		}
	}
	opts := &server.Options{
		Host:       cfg.Host,
		Port:       cfg.Port,
		MaxPayload: cfg.MaxPayload,
		NoSigs:     true,
		NoLog:      true,
		Nkeys:      cfg.Users,
	}
	if cfg.TLS != nil {
		opts.TLSConfig = cfg.TLS
		opts.TLS = true
		opts.TLSVerify = false
		opts.TLSTimeout = 2
	}
	if cfg.Port == 0 {
		opts.Port = server.RANDOM_PORT
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embedded NATS: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(cfg.ReadyTimeout) {
		srv.Shutdown()
		return nil, errors.New("embedded NATS: not ready for connections within " + cfg.ReadyTimeout.String())
	}
	return &Embedded{srv: srv, opts: opts}, nil
}

// SetUsers replaces the accepted users (credential rotation, a new
// identity): new connections authenticate against users; connections of
// users no longer present are closed by the server.
func (e *Embedded) SetUsers(users []*server.NkeyUser) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(users) == 0 && len(e.opts.Nkeys) > 0 {
		return fmt.Errorf("embedded NATS: refusing to reload an empty users list: %w", ErrInsecure)
	}
	o := e.opts.Clone()
	o.Nkeys = users
	if err := e.srv.ReloadOptions(o); err != nil {
		return fmt.Errorf("embedded NATS: reload users: %w", err)
	}
	e.opts = o
	return nil
}

// ClientURL is the URL clients connect to.
func (e *Embedded) ClientURL() string { return e.srv.ClientURL() }

// Addr is the host:port the server listens on.
func (e *Embedded) Addr() string {
	a := e.srv.Addr()
	if a == nil {
		return ""
	}
	if ta, ok := a.(*net.TCPAddr); ok {
		return net.JoinHostPort(ta.IP.String(), strconv.Itoa(ta.Port))
	}
	return a.String()
}

// Shutdown stops the server and waits for it; idempotent.
func (e *Embedded) Shutdown() {
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
}
