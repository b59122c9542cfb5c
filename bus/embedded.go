package bus

import (
	"errors"
	"fmt"
	"net"
	"strconv"
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
}

// DefaultEmbeddedConfig returns the defaults documented on EmbeddedConfig.
func DefaultEmbeddedConfig() EmbeddedConfig {
	return EmbeddedConfig{Host: "127.0.0.1", Port: 4222, MaxPayload: 8 << 20, ReadyTimeout: 10 * time.Second}
}

// Embedded is a running in-process NATS server.
type Embedded struct {
	srv *server.Server
}

// StartEmbedded starts a NATS server in this process.
func StartEmbedded(cfg EmbeddedConfig) (*Embedded, error) {
	if cfg.MaxPayload <= 0 {
		return nil, fmt.Errorf("embedded NATS max payload %d must be > 0", cfg.MaxPayload)
	}
	opts := &server.Options{
		Host:       cfg.Host,
		Port:       cfg.Port,
		MaxPayload: cfg.MaxPayload,
		NoSigs:     true,
		NoLog:      true,
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
	return &Embedded{srv: srv}, nil
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
