package replica

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/internal/group"
	"go.uber.org/zap"
)

// The raft port is mutual TLS 1.3 (issue 28.4). Both sides present a raft
// peer certificate of the cluster CA that names their raft server id
// (auth.IssueRaftCert: the URI kvtier://raft/<id>), and each checks the
// other's before raft reads or writes a byte:
//
//   - dialling, the peer must be the server the raft configuration places
//     at the address dialled (its certificate names that id), so a relay,
//     a squatter on a peer's address or another voter answering there is
//     refused;
//   - accepting, the peer's certificate must name a server of the current
//     configuration other than this one (any raft peer of the cluster while
//     this node has no configuration yet: a new server waiting to be
//     added). hashicorp/raft's transport does not hand the id an RPC
//     claims to the stream layer, so that claim is not compared with the
//     certificate: a voter's certificate lets it speak, as any voter can.
//
// After the handshake every record is encrypted and MACed (AEAD), so a
// byte altered on the path fails that record's check: the receiver drops
// the connection (counted in kvtier_raft_conn_integrity_errors_total) and
// applies nothing of it; raft resends on a new connection. Refused
// handshakes, either way, are counted in
// kvtier_raft_refused_connections_total and logged with the reason.
//
// There is no pre-shared key any more (raft.key, the HMAC handshake of
// issue 16): it authenticated a connection's start only, and a relay that
// passed the handshake through could rewrite entries after it. A stolen
// certificate and key are what a stolen raft.key was; they live in the
// same directory on the same host, so a second secret beside them would
// not stop the thief who reads one (docs/scale-out.md, "Raft port").

const (
	// raftHandshakeTimeout bounds one TLS handshake; a silent stranger
	// holds one of raftMaxHandshakes slots that long.
	raftHandshakeTimeout = 5 * time.Second
	raftMaxHandshakes    = 64
)

// TransportConfig is what a raft stream layer needs.
type TransportConfig struct {
	// Bind is the TCP listen address.
	Bind string
	// Advertise is the address peers reach this node at; nil: the bound
	// address (which must not be unspecified).
	Advertise net.Addr
	// TLS is this server's certificate and the cluster CA (LoadTLS). Its
	// ID must be this server's raft id. Required.
	TLS *auth.RaftTLS
	// Peers is the configuration the transport checks peers against until
	// SetServers gives it raft's (the bootstrap peers; may be empty).
	Peers []Peer
	// Logger gets refusals (Warn). Required.
	Logger *zap.Logger
	// Refused counts a connection refused at its handshake (either way);
	// Broken an established connection whose TLS records failed their
	// integrity check. nil: not counted.
	Refused, Broken func()
}

// Transport is a raft.StreamLayer of mutual TLS 1.3 connections whose
// peers' certificates name the raft servers they are (above). Accepted
// connections are handshaken on goroutines of their own (at most
// raftMaxHandshakes at once), so a silent stranger never delays a peer.
type Transport struct {
	ln        net.Listener
	creds     *auth.RaftTLS
	advertise net.Addr
	log       *zap.Logger
	refused   func()
	broken    func()
	peers     []Peer
	// servers returns raft's current configuration once SetServers ran.
	servers atomic.Pointer[func() []raft.Server]

	// cut is a fault seam (tests): while set, every connection of this
	// stream fails its reads and writes and dials fail, as if the node
	// were partitioned from its peers.
	cut    atomic.Bool
	liveMu sync.Mutex // guards live
	live   map[*peerConn]struct{}

	// ctx ends with Close: handshakes in progress are abandoned.
	ctx    context.Context
	cancel context.CancelFunc
	conns  chan net.Conn
	slots  chan struct{}
	// g starts the accept loop and one goroutine per handshake; Close
	// closes it (a connection accepted after that is closed unanswered)
	// and waits for it.
	g    *group.Group
	once sync.Once
}

// NewTransport listens on cfg.Bind and starts accepting.
func NewTransport(cfg TransportConfig) (*Transport, error) {
	if cfg.TLS == nil || cfg.Logger == nil {
		return nil, fmt.Errorf("raft transport needs its TLS material and a logger: %w", ErrConfig)
	}
	ln, err := net.Listen("tcp", cfg.Bind)
	if err != nil {
		return nil, fmt.Errorf("listen for raft on %s: %w", cfg.Bind, err)
	}
	advertise := cfg.Advertise
	if advertise == nil {
		advertise = ln.Addr()
	}
	if ta, ok := advertise.(*net.TCPAddr); ok && ta.IP.IsUnspecified() {
		_ = ln.Close()
		return nil, fmt.Errorf("raft address %s is unspecified; give an address peers reach (advertise): %w", advertise, ErrConfig)
	}
	nop := func() {}
	s := &Transport{ln: ln, creds: cfg.TLS, advertise: advertise, log: cfg.Logger, refused: cfg.Refused, broken: cfg.Broken,
		peers: cfg.Peers, conns: make(chan net.Conn), slots: make(chan struct{}, raftMaxHandshakes), g: group.New("raft-transport")}
	if s.refused == nil {
		s.refused = nop
	}
	if s.broken == nil {
		s.broken = nop
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.g.Go("raft-accept", s.acceptLoop) // a new group is open
	return s, nil
}

// SetServers makes f (raft's latest configuration) what peers are checked
// against from now on.
func (s *Transport) SetServers(f func() []raft.Server) { s.servers.Store(&f) }

// configuration returns the servers peers are checked against.
func (s *Transport) configuration() []raft.Server {
	if f := s.servers.Load(); f != nil {
		return (*f)()
	}
	out := make([]raft.Server, 0, len(s.peers))
	for _, p := range s.peers {
		out = append(out, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.ID), Address: raft.ServerAddress(p.Addr)})
	}
	return out
}

// admit decides whether an accepting handshake's peer, named id by its
// verified certificate, may speak raft to this node.
func (s *Transport) admit(id string) error {
	if id == s.creds.ID {
		return fmt.Errorf("peer certificate names this server's own id %q: %w", id, ErrAuth)
	}
	servers := s.configuration()
	if len(servers) == 0 {
		return nil // no configuration yet: any raft peer of the cluster (waiting to be added)
	}
	for _, sv := range servers {
		if string(sv.ID) == id {
			return nil
		}
	}
	return fmt.Errorf("peer certificate names raft server %q, not in this node's configuration %v: %w", id, ids(servers), ErrAuth)
}

// expect returns the id the configuration places at addr.
func (s *Transport) expect(addr raft.ServerAddress) (string, error) {
	servers := s.configuration()
	for _, sv := range servers {
		if sv.Address == addr {
			return string(sv.ID), nil
		}
	}
	return "", fmt.Errorf("raft address %s is not in this node's configuration %v, so no server id to expect there: %w", addr, ids(servers), ErrAuth)
}

func ids(servers []raft.Server) []string {
	out := make([]string, 0, len(servers))
	for _, sv := range servers {
		out = append(out, string(sv.ID))
	}
	return out
}

func (s *Transport) baseTLS() *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{s.creds.Cert},
		// Every handshake is a full one: each checks the peer's
		// certificate against the configuration and the clock of now.
		SessionTicketsDisabled: true,
	}
}

// serverTLS is the accepting side: a client certificate is required, and
// VerifyConnection checks its chain, its client role and its id.
func (s *Transport) serverTLS() *tls.Config {
	c := s.baseTLS()
	c.ClientAuth = tls.RequireAnyClientCert
	c.VerifyConnection = func(cs tls.ConnectionState) error {
		id, err := auth.VerifyRaftPeer(cs.PeerCertificates, s.creds.Roots, x509.ExtKeyUsageClientAuth)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrAuth, err)
		}
		return s.admit(id)
	}
	return c
}

// clientTLS is the dialling side for a peer that must be raft server want.
func (s *Transport) clientTLS(want string) *tls.Config {
	c := s.baseTLS()
	cert := s.creds.Cert
	c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }
	// A raft peer is named by its server id, not by a host name: the
	// default host name check is replaced by VerifyConnection's, which
	// verifies the chain against the cluster CA and the id.
	c.InsecureSkipVerify = true
	c.VerifyConnection = func(cs tls.ConnectionState) error {
		id, err := auth.VerifyRaftPeer(cs.PeerCertificates, s.creds.Roots, x509.ExtKeyUsageServerAuth)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrAuth, err)
		}
		if id != want {
			return fmt.Errorf("the raft configuration places server %q here, but its certificate names %q: %w", want, id, ErrAuth)
		}
		return nil
	}
	return c
}

func (s *Transport) acceptLoop() {
	for {
		conn, err := s.ln.Accept()
		if err != nil {
			if s.ctx.Err() != nil {
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			s.log.Error("raft listener failed", zap.Error(err))
			return
		}
		select {
		case s.slots <- struct{}{}:
		default:
			s.refused()
			s.log.Warn("raft connection refused: too many handshakes in progress", zap.Stringer("remote", conn.RemoteAddr()),
				zap.Int("limit", raftMaxHandshakes))
			_ = conn.Close()
			continue
		}
		if !s.g.Go("raft-handshake", func() { s.handshake(conn) }) {
			// Close has begun: the peer redials the next leader or the
			// restarted node.
			<-s.slots
			_ = conn.Close()
		}
	}
}

// handshake authenticates one accepted connection and hands it to Accept.
func (s *Transport) handshake(conn net.Conn) {
	defer func() { <-s.slots }()
	tc := tls.Server(conn, s.serverTLS())
	ctx, cancel := context.WithTimeout(s.ctx, raftHandshakeTimeout)
	err := tc.HandshakeContext(ctx)
	cancel()
	if err != nil {
		s.refused()
		s.log.Warn("raft connection refused", zap.Stringer("remote", conn.RemoteAddr()), zap.Error(err))
		_ = conn.Close()
		return
	}
	select {
	case s.conns <- s.track(tc, conn):
	case <-s.ctx.Done():
		_ = conn.Close()
	}
}

// Accept returns the next connection whose peer passed the handshake.
func (s *Transport) Accept() (net.Conn, error) {
	select {
	case c := <-s.conns:
		return c, nil
	case <-s.ctx.Done():
		return nil, net.ErrClosed
	}
}

// Close stops listening, abandons the handshakes in progress and waits
// for them.
func (s *Transport) Close() error {
	var err error
	s.once.Do(func() {
		s.cancel()
		s.g.Close()
		err = s.ln.Close()
		s.g.Wait()
		// raft's transport leaves accepted and pooled connections open:
		// close them, so its connection goroutines (here and at the
		// peers) end.
		s.liveMu.Lock()
		for c := range s.live {
			_ = c.raw.Close()
		}
		s.liveMu.Unlock()
	})
	return err
}

// Addr is the address peers reach this node at.
func (s *Transport) Addr() net.Addr { return s.advertise }

// Dial connects to the server the configuration places at addr and
// completes the TLS handshake only if its certificate names that server.
func (s *Transport) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	if s.cut.Load() {
		return nil, fmt.Errorf("raft peer %s: partitioned (fault seam)", addr)
	}
	want, err := s.expect(addr)
	if err != nil {
		s.refused()
		return nil, err
	}
	ctx, cancel := context.WithTimeout(s.ctx, max(timeout, raftHandshakeTimeout))
	defer cancel()
	d := net.Dialer{Timeout: timeout}
	conn, err := d.DialContext(ctx, "tcp", string(addr))
	if err != nil {
		return nil, err
	}
	tc := tls.Client(conn, s.clientTLS(want))
	if err := tc.HandshakeContext(ctx); err != nil {
		_ = conn.Close()
		s.refused()
		var rh tls.RecordHeaderError
		if errors.As(err, &rh) {
			err = fmt.Errorf("raft peer %s at %s does not speak TLS: %w (a coordinator older than raft TLS speaks the old key handshake: upgrade it)", want, addr, err)
		} else {
			err = fmt.Errorf("raft peer %s at %s: TLS handshake: %w", want, addr, err)
		}
		s.log.Warn("raft peer refused", zap.String("peer_id", want), zap.String("addr", string(addr)), zap.Error(err))
		return nil, err
	}
	return s.track(tc, conn), nil
}

func (s *Transport) track(tc *tls.Conn, raw net.Conn) *peerConn {
	c := &peerConn{Conn: tc, raw: raw, s: s}
	s.liveMu.Lock()
	if s.live == nil {
		s.live = make(map[*peerConn]struct{})
	}
	s.live[c] = struct{}{}
	s.liveMu.Unlock()
	return c
}

// Partition cuts (or heals) every connection of this node's raft
// transport: the fault seam tests isolate a node with.
func (s *Transport) Partition(on bool) {
	s.cut.Store(on)
	if !on {
		return
	}
	s.liveMu.Lock()
	defer s.liveMu.Unlock()
	for c := range s.live {
		_ = c.raw.Close()
	}
}

// peerConn is an established raft connection: TLS over raw. It counts a
// failed record check once, and fails while its stream is cut (the
// partition seam).
type peerConn struct {
	*tls.Conn
	raw    net.Conn
	s      *Transport
	broken atomic.Bool
}

var errPartitioned = errors.New("raft connection cut (partition fault seam)")

func (c *peerConn) Close() error {
	c.s.liveMu.Lock()
	delete(c.s.live, c)
	c.s.liveMu.Unlock()
	if c.s.cut.Load() {
		return c.raw.Close()
	}
	return c.Conn.Close()
}

func (c *peerConn) Read(p []byte) (int, error) {
	if c.s.cut.Load() {
		_ = c.raw.Close()
		return 0, errPartitioned
	}
	n, err := c.Conn.Read(p)
	if c.s.cut.Load() {
		_ = c.raw.Close()
		return 0, errPartitioned
	}
	// crypto/tls reports what it detected itself (a record that fails its
	// MAC, a malformed record) as a "local error"; an EOF or a closed
	// socket is not one.
	var op *net.OpError
	if err != nil && errors.As(err, &op) && op.Op == "local error" && c.broken.CompareAndSwap(false, true) {
		c.s.broken()
		c.s.log.Warn("raft connection dropped: a TLS record failed its integrity check (altered on the path?)",
			zap.Stringer("remote", c.raw.RemoteAddr()), zap.Error(err))
	}
	return n, err
}

func (c *peerConn) Write(p []byte) (int, error) {
	if c.s.cut.Load() {
		_ = c.raw.Close()
		return 0, errPartitioned
	}
	return c.Conn.Write(p)
}
