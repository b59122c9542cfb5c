package bus

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
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
	// PingInterval is how often the server pings a quiet client or route;
	// after MaxPingsOut unanswered pings it drops the connection (and its
	// subscriptions, so requests to a rank behind a partition fail with no
	// responders rather than time out). Default 2 s and 3: a peer cut off
	// is noticed within about 8 s (nats-server's default is 2 min).
	PingInterval time.Duration
	MaxPingsOut  int
	// Cluster, when its Host is set, joins this server to a NATS cluster
	// of embedded servers (several coordinators): clients of any server
	// reach the subscribers of every other, and a client whose server dies
	// reconnects to a survivor. Default: no cluster (Host "").
	Cluster ClusterConfig
}

// ClusterConfig configures the routes between the embedded NATS servers of
// several coordinators. Every server of the cluster needs the same Name,
// Username, Password and client users; each lists the route URLs of the
// others (listing itself is harmless).
type ClusterConfig struct {
	// Name is the NATS cluster name; servers of another name are refused.
	// Default "kvtier".
	Name string
	// Host is the route listen IP. Default "" (no cluster). Off loopback it
	// needs TLS unless EmbeddedConfig.Insecure.
	Host string
	// Port is the route port; 0 picks a free one (tests). Default 6222.
	Port int
	// Routes are the other servers' route URLs, nats-route://host:port,
	// without credentials (Username and Password are added). Default none:
	// this server only accepts routes from the others.
	Routes []string
	// Username and Password authenticate every route, both ways: a server
	// requires them from an incoming route and presents them on the routes
	// it opens (auth.RouteCredentials). Required unless Insecure. Default
	// "".
	Username, Password string
	// TLS, when set, encrypts every route: this server presents its
	// certificate and verifies the remote server's against RootCAs
	// (auth.RouteTLS). Default nil.
	TLS *tls.Config
}

// DefaultClusterConfig returns the defaults documented on ClusterConfig.
func DefaultClusterConfig() ClusterConfig { return ClusterConfig{Name: "kvtier", Port: 6222} }

// Enabled reports whether the config asks for a cluster.
func (c ClusterConfig) Enabled() bool { return c.Host != "" }

// Validate checks the cluster rules; insecure allows routes without
// credentials and, off loopback, without TLS.
func (c ClusterConfig) Validate(insecure bool) error {
	if !c.Enabled() {
		if len(c.Routes) > 0 {
			return fmt.Errorf("embedded NATS has %d routes but no cluster listen address: %w", len(c.Routes), ErrClusterConfig)
		}
		return nil
	}
	if net.ParseIP(c.Host) == nil {
		return fmt.Errorf("embedded NATS cluster host %q must be an IP address: %w", c.Host, ErrClusterConfig)
	}
	if c.Port < 0 || c.Port > 65535 {
		return fmt.Errorf("embedded NATS cluster port %d must be in [0, 65535]: %w", c.Port, ErrClusterConfig)
	}
	if c.Name == "" || strings.ContainsAny(c.Name, " \t\r\n") {
		return fmt.Errorf("embedded NATS cluster name %q must be one non-empty word: %w", c.Name, ErrClusterConfig)
	}
	for _, r := range c.Routes {
		u, err := url.Parse(r)
		if err != nil || u.Scheme != "nats-route" || u.Hostname() == "" || u.Port() == "" {
			return fmt.Errorf("route %q must be nats-route://host:port: %w", r, ErrClusterConfig)
		}
		if u.User != nil {
			return fmt.Errorf("route %q carries credentials in its URL; they come from the credentials dir (a URL is logged and shown): %w", u.Redacted(), ErrClusterConfig)
		}
	}
	if insecure {
		return nil
	}
	if c.Username == "" || c.Password == "" {
		return fmt.Errorf("embedded NATS cluster has no route credentials: every route must be authenticated (C9); give a credentials dir with a route secret or set insecure: %w", ErrInsecure)
	}
	if c.TLS == nil && !IsLoopback(c.Host) {
		return fmt.Errorf("embedded NATS cluster listens on %s, off loopback, without TLS; give a certificate or set insecure: %w", c.Host, ErrInsecure)
	}
	return nil
}

// routeURLs returns the route URLs with the route credentials in them.
func (c ClusterConfig) routeURLs() ([]*url.URL, error) {
	out := make([]*url.URL, 0, len(c.Routes))
	for _, r := range c.Routes {
		u, err := url.Parse(r)
		if err != nil {
			return nil, fmt.Errorf("route %q: %w: %w", r, ErrClusterConfig, err)
		}
		if c.Username != "" {
			u.User = url.UserPassword(c.Username, c.Password)
		}
		out = append(out, u)
	}
	return out, nil
}

// DefaultEmbeddedConfig returns the defaults documented on EmbeddedConfig.
func DefaultEmbeddedConfig() EmbeddedConfig {
	return EmbeddedConfig{Host: "127.0.0.1", Port: 4222, MaxPayload: 8 << 20, ReadyTimeout: 10 * time.Second,
		PingInterval: 2 * time.Second, MaxPingsOut: 3, Cluster: DefaultClusterConfig()}
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

// ErrClusterConfig: the embedded NATS cluster settings break a rule
// (malformed route URL, bad listen address).
var ErrClusterConfig = errors.New("bad embedded NATS cluster configuration")

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
	if err := cfg.Cluster.Validate(cfg.Insecure); err != nil {
		return nil, err
	}
	opts := &server.Options{
		Host:       cfg.Host,
		Port:       cfg.Port,
		MaxPayload: cfg.MaxPayload,
		NoSigs:     true,
		NoLog:      true,
		Nkeys:      cfg.Users,
		// Zero keeps nats-server's defaults (2 min, 2).
		PingInterval: cfg.PingInterval,
		MaxPingsOut:  cfg.MaxPingsOut,
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
	if cc := cfg.Cluster; cc.Enabled() {
		routes, err := cc.routeURLs()
		if err != nil {
			return nil, err
		}
		opts.Routes = routes
		opts.Cluster = server.ClusterOpts{Name: cc.Name, Host: cc.Host, Port: cc.Port,
			// Explicit routes are retried for as long as the server runs:
			// a killed server's peers reconnect when it is back.
			Username: cc.Username, Password: cc.Password, AuthTimeout: 2,
			PingInterval: cfg.PingInterval, MaxPingsOut: cfg.MaxPingsOut}
		if cc.Port == 0 {
			opts.Cluster.Port = server.RANDOM_PORT
		}
		if cc.TLS != nil {
			opts.Cluster.TLSConfig = cc.TLS
			opts.Cluster.TLSTimeout = 2
		}
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

// InProcessConn is a client connection to the server through memory
// (nats.InProcessServer): no socket, no TLS (the server offers it but does
// not require it of these), the credentials still checked.
func (e *Embedded) InProcessConn() (net.Conn, error) { return e.srv.InProcessConn() }

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

// ClusterAddr is the host:port the route listener listens on, "" without
// a cluster.
func (e *Embedded) ClusterAddr() string {
	a := e.srv.ClusterAddr()
	if a == nil {
		return ""
	}
	return net.JoinHostPort(a.IP.String(), strconv.Itoa(a.Port))
}

// NumRoutes is the number of routes to other servers this server has now.
func (e *Embedded) NumRoutes() int { return e.srv.NumRoutes() }

// Shutdown stops the server and waits for it; idempotent.
func (e *Embedded) Shutdown() {
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
}
