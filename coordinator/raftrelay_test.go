package coordinator

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestRaftRelayCannotRewriteEntries (issue 28.4): a relay on the path to
// a follower's raft port, which holds no key or certificate, passes every
// handshake through and then rewrites an entry the leader replicates: the
// recorded sum of a stored object. With the old transport (a pre-shared
// key handshake, then plaintext) the follower applied the forged sum and
// its index differed from the others' (red: "n3's index differs"). Over
// mutual TLS the relay cannot find the entry in the ciphertext; it alters
// the first record sent to n3 after the entry was proposed that is large
// enough to carry it, whichever connection it rides (raft replicates over
// pooled connections, a new one when the pool is empty), the record fails
// its MAC at the follower, which drops the connection (counted: as an
// integrity error on an established connection, as a refused handshake
// when the record was a new connection's encrypted TLS 1.3 handshake),
// applies nothing of it, and gets the true entry from the leader over
// another connection: every replica's index is byte-identical and holds
// the true sum.
func TestRaftRelayCannotRewriteEntries(t *testing.T) {
	relay := newTamperRelay(t)
	rc := newRaftCluster(t, 3, func(c *Config) {
		if c.Raft.ID != "n3" {
			return
		}
		// Peers reach n3 at its configured address, where the relay
		// listens; n3 itself listens behind it.
		c.Raft.Advertise = c.Raft.Bind
		c.Raft.Bind = relay.start(c.Raft.Bind)
	})
	l := rc.leader()
	if rc.peers[l].ID == "n3" {
		if err := node(rc.nodes[l]).TransferLeadership("n1", rc.peers[0].Addr); err != nil {
			t.Fatal(err)
		}
		testutil.Eventually(t, 20*time.Second, "n3 no longer leading", func() bool { return !serving(rc.nodes[2]) })
		l = rc.leader()
	}
	ns := retryCall[wire.RegisterReply](t, rc.nc, rc.subj.Coord(wire.CoordRegister), testSpec(1)).Namespace
	rc.converged() // n3 has every entry so far, through long-lived connections

	// The batch to forge: event 1's sum replaced by another, same length.
	r := wire.Rank{Instance: "eng", TPRank: 0}
	b := storeBatch(r, 1, 0, ns, chain(ns, 4, 77), wire.L2)
	forged := *b
	forged.Events = append([]wire.Event(nil), b.Events...)
	forged.Events[1].Sum ^= 0x5a5a5a5a5a5a5a5a
	orig, err := b.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	fake, err := forged.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	lo, hi := diffRange(orig, fake)
	lo, hi = max(lo-16, 0), min(hi+16, len(orig))
	if bytes.Count(orig, orig[lo:hi]) != 1 {
		t.Fatal("marker not unique in the batch")
	}
	refused0 := testutil.Metric(t, rc.nodes[2].reg, "kvtier_raft_refused_connections_total")
	relay.arm(orig[lo:hi], fake[lo:hi], len(orig))
	if ack, werr := rc.send(b); werr != nil || ack.AppliedThrough != 4 {
		t.Fatalf("batch: ack %+v err %v", ack, werr)
	}
	testutil.Eventually(t, 20*time.Second, "the relay to rewrite what the leader sent n3", func() bool { return relay.tampered.Load() > 0 })
	relay.disarm()
	rc.converged()
	for i, c := range rc.nodes {
		h := c.idx.Get(b.Events[1].Key)
		if len(h) != 1 || h[0].Sum != b.Events[1].Sum {
			t.Fatalf("%s holds %+v for the forged object, want one copy with sum %#x", rc.peers[i].ID, h, b.Events[1].Sum)
		}
	}
	broken := testutil.Metric(t, rc.nodes[2].reg, "kvtier_raft_conn_integrity_errors_total")
	refused := testutil.Metric(t, rc.nodes[2].reg, "kvtier_raft_refused_connections_total") - refused0
	if broken+refused < 1 {
		t.Fatalf("n3 counted %v connections failing their TLS record check and %v handshakes refused since the relay was armed; the relay altered %d",
			broken, refused, relay.tampered.Load())
	}
}

// diffRange is the smallest [lo, hi) outside which a and b (same length)
// are equal.
func diffRange(a, b []byte) (int, int) {
	lo, hi := 0, len(a)
	for lo < hi && a[lo] == b[lo] {
		lo++
	}
	for hi > lo && a[hi-1] == b[hi-1] {
		hi--
	}
	return lo, hi
}

// tamperRelay forwards TCP connections to a raft port. Armed, it attacks
// what peers send (client to server) after their handshake: in a plaintext
// stream it replaces every occurrence of a marker with a forgery of the
// same length; in a TLS stream (which starts with a handshake record,
// 0x16 0x03 0x01), where no marker can be seen, it flips one byte inside
// the first application-data record of at least minLen bytes sent after
// it was armed, on whichever connection, and passes everything else
// untouched, so raft can recover.
type tamperRelay struct {
	t        testing.TB
	once     sync.Once
	ln       net.Listener
	target   string
	tampered atomic.Int64

	mu          sync.Mutex // guards the following
	marker, fwd []byte
	minLen      int
	armed       bool
	flipped     bool // the one TLS record of this arming is altered
	conns       map[*relayConn]bool
	wg          sync.WaitGroup
}

type relayConn struct {
	a, b net.Conn
}

func newTamperRelay(t testing.TB) *tamperRelay {
	r := &tamperRelay{t: t, conns: map[*relayConn]bool{}}
	t.Cleanup(r.close)
	return r
}

// start listens on addr (once) and returns the address it forwards to.
func (r *tamperRelay) start(addr string) string {
	r.once.Do(func() {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			r.t.Fatalf("relay listen %s: %v", addr, err)
		}
		r.ln = ln
		r.target = "127.0.0.1:" + strconv.Itoa(testutil.FreePort(r.t))
		r.wg.Add(1)
		go r.accept()
	})
	return r.target
}

func (r *tamperRelay) arm(marker, fwd []byte, minLen int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.marker, r.fwd, r.minLen, r.armed, r.flipped = marker, fwd, minLen, true, false
}

func (r *tamperRelay) disarm() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.armed = false
}

func (r *tamperRelay) close() {
	if r.ln != nil {
		_ = r.ln.Close()
	}
	r.mu.Lock()
	for c := range r.conns {
		_ = c.a.Close()
		_ = c.b.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
}

func (r *tamperRelay) accept() {
	defer r.wg.Done()
	for {
		a, err := r.ln.Accept()
		if err != nil {
			return
		}
		b, err := net.Dial("tcp", r.target)
		if err != nil {
			_ = a.Close()
			continue
		}
		c := &relayConn{a: a, b: b}
		r.mu.Lock()
		r.conns[c] = true
		r.mu.Unlock()
		r.wg.Add(2)
		go func() { // server to client: untouched
			defer r.wg.Done()
			_, _ = io.Copy(a, b)
			_ = a.Close()
		}()
		go func() {
			defer r.wg.Done()
			r.forward(c)
			_ = b.Close()
			r.mu.Lock()
			delete(r.conns, c)
			r.mu.Unlock()
		}()
	}
}

// forward copies client to server, rewriting while armed.
func (r *tamperRelay) forward(c *relayConn) {
	buf := make([]byte, 64<<10)
	var pending []byte
	isTLS := -1 // unknown until 3 bytes
	for {
		n, err := c.a.Read(buf)
		pending = append(pending, buf[:n]...)
		if isTLS < 0 && len(pending) >= 3 {
			isTLS = 0
			if bytes.Equal(pending[:3], []byte{0x16, 0x03, 0x01}) {
				isTLS = 1
			}
		}
		var out []byte
		switch isTLS {
		case 1:
			out, pending = r.tlsRecords(pending)
		case 0:
			out, pending = r.plain(pending)
		}
		if len(out) > 0 {
			if _, werr := c.b.Write(out); werr != nil {
				return
			}
		}
		if err != nil {
			if len(pending) > 0 && !errors.Is(err, net.ErrClosed) {
				_, _ = c.b.Write(pending)
			}
			return
		}
	}
}

// plain replaces the marker while armed; a tail that could be the start
// of a marker is held back until the next read.
func (r *tamperRelay) plain(p []byte) (out, keep []byte) {
	r.mu.Lock()
	armed, marker, fwd := r.armed, r.marker, r.fwd
	r.mu.Unlock()
	if !armed {
		return p, nil
	}
	if k := bytes.Count(p, marker); k > 0 {
		p = bytes.ReplaceAll(p, marker, fwd)
		r.tampered.Add(int64(k))
	}
	for h := min(len(marker)-1, len(p)); h > 0; h-- {
		if bytes.HasPrefix(marker, p[len(p)-h:]) {
			return p[:len(p)-h], append([]byte(nil), p[len(p)-h:]...)
		}
	}
	return p, nil
}

// tlsRecords passes whole TLS records, flipping a byte of the first large
// application-data record while armed.
func (r *tamperRelay) tlsRecords(p []byte) (out, keep []byte) {
	at := 0
	for len(p)-at >= 5 {
		n := int(binary.BigEndian.Uint16(p[at+3:]))
		if len(p)-at < 5+n {
			break
		}
		r.mu.Lock()
		hit := r.armed && !r.flipped && p[at] == 23 && n >= r.minLen
		if hit {
			r.flipped = true
		}
		r.mu.Unlock()
		if hit {
			p[at+5+n/2] ^= 0x01
			r.tampered.Add(1)
		}
		at += 5 + n
	}
	return p[:at], append([]byte(nil), p[at:]...)
}
