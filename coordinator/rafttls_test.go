package coordinator

import (
	"bytes"
	"crypto/tls"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/internal/testutil"
)

// raftTLSDir makes a cluster CA and a raft peer certificate for each peer
// in a new directory (as 'coordinator init --tls-host ... --raft-ids ...'
// does in a credentials directory).
func raftTLSDir(tb testing.TB, peers []RaftPeer) string {
	tb.Helper()
	dir := tb.TempDir()
	if err := auth.InitTLS(dir, []string{"127.0.0.1"}); err != nil {
		tb.Fatal(err)
	}
	for _, p := range peers {
		if err := auth.IssueRaftCert(dir, p.ID, false); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

// useRaftTLS points rc at its id's certificate in dir and dir's CA.
func useRaftTLS(rc *RaftConfig, dir string) {
	rc.CertFile = filepath.Join(dir, auth.RaftCertFile(rc.ID))
	rc.CertKeyFile = filepath.Join(dir, auth.RaftCertKeyFile(rc.ID))
	rc.CAFile = filepath.Join(dir, auth.CAFile)
}

// TestRaftPortRefusesStrangers: the raft port of a running replicated
// coordinator speaks only TLS to a certificate of its cluster that names
// a voter. A plaintext raft RPC (what a stranger, or a peer still on the
// old key handshake, sends), a TLS client with no certificate, one whose
// certificate names a server outside the configuration, and the cluster's
// NATS server certificate (same CA, no raft id) are each refused at the
// handshake, counted, and never get a byte of raft's: the connection ends
// with at most a TLS alert. A voter's certificate is accepted (the
// control). Seen red with the id check removed from admit: the
// outsider's certificate was accepted.
func TestRaftPortRefusesStrangers(t *testing.T) {
	rc := newRaftCluster(t, 3, nil)
	l := rc.leader()
	c := rc.nodes[l]
	addr := rc.peers[l].Addr
	refused := func() float64 { return testutil.Metric(t, c.reg, "kvtier_raft_refused_connections_total") }
	before := refused()

	// A raw RequestVote (raft's rpcRequestVote type byte, then msgpack).
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = conn.Write(append([]byte{1}, bytes.Repeat([]byte{0x80}, 64)...))
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, _ := readAll(conn)
	conn.Close()
	if len(got) > 0 && got[0] != 0x15 { // an alert record at most
		t.Fatalf("a plaintext stranger read %d B starting %#x: raft answered it", len(got), got[0])
	}

	// TLS clients: none, an outsider of the cluster's CA, the NATS
	// server's certificate; then a voter's (accepted).
	dir := rc.tls
	if err := auth.IssueRaftCert(dir, "n9", false); err != nil {
		t.Fatal(err)
	}
	load := func(cert, key string) []tls.Certificate {
		kp, err := tls.LoadX509KeyPair(filepath.Join(dir, cert), filepath.Join(dir, key))
		if err != nil {
			t.Fatal(err)
		}
		return []tls.Certificate{kp}
	}
	voter := rc.peers[(l+1)%3].ID
	for _, tc := range []struct {
		name  string
		certs []tls.Certificate
		ok    bool
	}{
		{"no certificate", nil, false},
		{"n9, not a voter", load(auth.RaftCertFile("n9"), auth.RaftCertKeyFile("n9")), false},
		{"the NATS server's", load(auth.ServerCertFile, auth.ServerKeyFile), false},
		{"voter " + voter, load(auth.RaftCertFile(voter), auth.RaftCertKeyFile(voter)), true},
	} {
		conn, err := tls.Dial("tcp", addr, &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true, Certificates: tc.certs})
		if err != nil {
			t.Fatalf("%s: dial: %v", tc.name, err)
		}
		// TLS 1.3: the server judges the client's certificate after the
		// client's handshake ended; its verdict is the first read.
		_, _ = conn.Write([]byte{9}) // no raft RPC type: raft closes it
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, rerr := conn.Read(make([]byte, 16))
		conn.Close()
		alert := rerr != nil && strings.Contains(rerr.Error(), "remote error: tls")
		if alert == tc.ok {
			t.Errorf("%s: first read %v; want refused=%v", tc.name, rerr, !tc.ok)
		}
	}
	testutil.Eventually(t, 10*time.Second, "the 4 refusals counted", func() bool { return refused()-before >= 4 })
	time.Sleep(100 * time.Millisecond)
	if n := refused() - before; n != 4 {
		t.Fatalf("%v refusals counted, want 4 (the voter's connection was refused?)", n)
	}
}

func readAll(c net.Conn) ([]byte, error) {
	var out []byte
	buf := make([]byte, 512)
	for {
		n, err := c.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			return out, err
		}
	}
}
