package replica

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"go.uber.org/zap"
)

// The raft port authenticates every connection, both ways, before raft
// reads a byte of it: a pre-shared key handshake (the key is raft.key in
// the credentials directory, written by 'coordinator init').
//
//	server -> client  ns (32 random bytes)
//	client -> server  nc (32 random bytes), HMAC-SHA256(key, "kvtier-raft client" | ns | nc)
//	server -> client  HMAC-SHA256(key, "kvtier-raft server" | ns | nc)
//
// Both nonces are fresh per connection, so a recorded handshake is worth
// nothing, and the two labels keep one side's proof from being reflected
// as the other's. A peer without the key is closed before its first
// AppendEntries or RequestVote is read (counted in
// kvtier_raft_refused_connections_total). The traffic after the handshake
// is authenticated only at its start, not encrypted: run the raft port on
// a network where an attacker cannot inject into an established TCP
// stream, or put it behind a VPN.

const (
	// NonceSize is the length of each side's handshake nonce.
	NonceSize   = 32
	raftMACSize = sha256.Size
	// raftHandshakeTimeout bounds one handshake; a silent stranger holds
	// one of raftMaxHandshakes slots that long.
	raftHandshakeTimeout = 2 * time.Second
	raftMaxHandshakes    = 64
)

func raftMAC(key []byte, label string, ns, nc []byte) []byte {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(label))
	h.Write(ns)
	h.Write(nc)
	return h.Sum(nil)
}

// raftServerHandshake proves the client knows the key, then proves we do.
func raftServerHandshake(conn net.Conn, key []byte) error {
	_ = conn.SetDeadline(time.Now().Add(raftHandshakeTimeout))
	defer func() { _ = conn.SetDeadline(time.Time{}) }()
	ns := make([]byte, NonceSize)
	if _, err := rand.Read(ns); err != nil {
		return err
	}
	if _, err := conn.Write(ns); err != nil {
		return fmt.Errorf("send nonce: %w", err)
	}
	msg := make([]byte, NonceSize+raftMACSize)
	if _, err := io.ReadFull(conn, msg); err != nil {
		return fmt.Errorf("read client proof: %w: %w", ErrAuth, err)
	}
	nc := msg[:NonceSize]
	if !hmac.Equal(msg[NonceSize:], raftMAC(key, "kvtier-raft client", ns, nc)) {
		return fmt.Errorf("client proof does not match the raft key: %w", ErrAuth)
	}
	if _, err := conn.Write(raftMAC(key, "kvtier-raft server", ns, nc)); err != nil {
		return fmt.Errorf("send server proof: %w", err)
	}
	return nil
}

// ClientHandshake answers the server's challenge and checks its proof.
func ClientHandshake(conn net.Conn, key []byte, deadline time.Time) error {
	_ = conn.SetDeadline(deadline)
	defer func() { _ = conn.SetDeadline(time.Time{}) }()
	ns := make([]byte, NonceSize)
	if _, err := io.ReadFull(conn, ns); err != nil {
		return fmt.Errorf("read server nonce: %w: %w", ErrAuth, err)
	}
	nc := make([]byte, NonceSize)
	if _, err := rand.Read(nc); err != nil {
		return err
	}
	if _, err := conn.Write(append(append([]byte(nil), nc...), raftMAC(key, "kvtier-raft client", ns, nc)...)); err != nil {
		return fmt.Errorf("send client proof: %w", err)
	}
	proof := make([]byte, raftMACSize)
	if _, err := io.ReadFull(conn, proof); err != nil {
		return fmt.Errorf("read server proof: %w: %w", ErrAuth, err)
	}
	if !hmac.Equal(proof, raftMAC(key, "kvtier-raft server", ns, nc)) {
		return fmt.Errorf("server proof does not match the raft key: %w", ErrAuth)
	}
	return nil
}

// Transport is a raft.StreamLayer over TCP whose connections have passed
// the key handshake. Accepted connections are handshaken on goroutines of
// their own (at most raftMaxHandshakes at once), so a silent stranger
// never delays a peer.
type Transport struct {
	ln        net.Listener
	key       []byte
	advertise net.Addr
	log       *zap.Logger
	refused   func()

	// cut is a fault seam (tests): while set, every connection of this
	// stream fails its reads and writes and dials fail, as if the node
	// were partitioned from its peers.
	cut    atomic.Bool
	liveMu sync.Mutex // guards live
	live   map[*cuttableConn]struct{}

	conns chan net.Conn
	done  chan struct{}
	slots chan struct{}
	wg    sync.WaitGroup
	once  sync.Once
}

func NewTransport(bind string, advertise net.Addr, key []byte, log *zap.Logger, refused func()) (*Transport, error) {
	ln, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, fmt.Errorf("listen for raft on %s: %w", bind, err)
	}
	if advertise == nil {
		advertise = ln.Addr()
	}
	if ta, ok := advertise.(*net.TCPAddr); ok && ta.IP.IsUnspecified() {
		_ = ln.Close()
		return nil, fmt.Errorf("raft address %s is unspecified; give an address peers reach (advertise): %w", advertise, ErrConfig)
	}
	s := &Transport{ln: ln, key: key, advertise: advertise, log: log, refused: refused,
		conns: make(chan net.Conn), done: make(chan struct{}), slots: make(chan struct{}, raftMaxHandshakes)}
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
}

func (s *Transport) acceptLoop() {
	defer s.wg.Done()
	for {
		conn, err := s.ln.Accept()
		if err != nil {
			select {
			case <-s.done:
				return
			default:
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
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() { <-s.slots }()
			if err := raftServerHandshake(conn, s.key); err != nil {
				s.refused()
				s.log.Warn("raft connection refused", zap.Stringer("remote", conn.RemoteAddr()), zap.Error(err))
				_ = conn.Close()
				return
			}
			select {
			case s.conns <- s.track(conn):
			case <-s.done:
				_ = conn.Close()
			}
		}()
	}
}

// Accept returns the next authenticated connection.
func (s *Transport) Accept() (net.Conn, error) {
	select {
	case c := <-s.conns:
		return c, nil
	case <-s.done:
		return nil, net.ErrClosed
	}
}

// Close stops listening and waits for the handshakes in progress.
func (s *Transport) Close() error {
	var err error
	s.once.Do(func() {
		close(s.done)
		err = s.ln.Close()
		s.wg.Wait()
		// raft's transport leaves accepted and pooled connections open:
		// close them, so its connection goroutines (here and at the
		// peers) end.
		s.liveMu.Lock()
		for c := range s.live {
			_ = c.Conn.Close()
		}
		s.liveMu.Unlock()
	})
	return err
}

// Addr is the address peers reach this node at.
func (s *Transport) Addr() net.Addr { return s.advertise }

// Dial connects to a peer and runs the client side of the handshake.
func (s *Transport) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	if s.cut.Load() {
		return nil, fmt.Errorf("raft peer %s: partitioned (fault seam)", addr)
	}
	d := net.Dialer{Timeout: timeout}
	conn, err := d.Dial("tcp", string(addr))
	if err != nil {
		return nil, err
	}
	if err := ClientHandshake(conn, s.key, time.Now().Add(max(timeout, raftHandshakeTimeout))); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("raft peer %s: %w", addr, err)
	}
	return s.track(conn), nil
}

func (s *Transport) track(conn net.Conn) *cuttableConn {
	c := &cuttableConn{Conn: conn, s: s}
	s.liveMu.Lock()
	if s.live == nil {
		s.live = make(map[*cuttableConn]struct{})
	}
	s.live[c] = struct{}{}
	s.liveMu.Unlock()
	return c
}

// partition cuts (or heals) every connection of this node's raft
// transport: the fault seam tests isolate a node with.
func (s *Transport) Partition(on bool) {
	s.cut.Store(on)
	if !on {
		return
	}
	s.liveMu.Lock()
	defer s.liveMu.Unlock()
	for c := range s.live {
		_ = c.Conn.Close()
	}
}

func (c *cuttableConn) Close() error {
	c.s.liveMu.Lock()
	delete(c.s.live, c)
	c.s.liveMu.Unlock()
	return c.Conn.Close()
}

// cuttableConn fails while its stream is cut (the partition seam).
type cuttableConn struct {
	net.Conn
	s *Transport
}

var errPartitioned = errors.New("raft connection cut (partition fault seam)")

func (c *cuttableConn) Read(p []byte) (int, error) {
	if c.s.cut.Load() {
		_ = c.Conn.Close()
		return 0, errPartitioned
	}
	n, err := c.Conn.Read(p)
	if c.s.cut.Load() {
		_ = c.Conn.Close()
		return 0, errPartitioned
	}
	return n, err
}

func (c *cuttableConn) Write(p []byte) (int, error) {
	if c.s.cut.Load() {
		_ = c.Conn.Close()
		return 0, errPartitioned
	}
	return c.Conn.Write(p)
}
