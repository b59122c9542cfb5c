package replica

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// BenchmarkRaftStream measures what the raft port's TLS costs on its own
// (issue 28.4): a connection of the raft stream layer (mutual TLS 1.3,
// AES-GCM) against a plain TCP connection (the old transport after its
// handshake), on loopback in one process. "rpc" is a 256 B request
// answered by 64 B (a heartbeat or vote round trip; ns/op is the round
// trip); "append" streams 64 KiB writes one way (an AppendEntries of a
// large batch; MB/s). "dial" is one new connection and its handshake.
//
//	go test -run '^$' -bench RaftStream ./coordinator/replica/
func BenchmarkRaftStream(b *testing.B) {
	dir := caDir(b, "n1", "n2")
	n1, n2 := startNode(b, loadTLS(b, dir, "n1")), startNode(b, loadTLS(b, dir, "n2"))
	cfg := []raft.Server{server("n1", n1.addr()), server("n2", n2.addr())}
	n1.setConfig(cfg...)
	n2.setConfig(cfg...)
	pair := func(b *testing.B, tlsOn bool) (client, srv net.Conn) {
		if tlsOn {
			c, err := n2.Dial(n1.addr(), 5*time.Second)
			if err != nil {
				b.Fatal(err)
			}
			s, err := n1.Accept()
			if err != nil {
				b.Fatal(err)
			}
			return c, s
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		defer ln.Close()
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			b.Fatal(err)
		}
		s, err := ln.Accept()
		if err != nil {
			b.Fatal(err)
		}
		return c, s
	}
	for _, mode := range []struct {
		name string
		tls  bool
	}{{"tcp", false}, {"tls", true}} {
		b.Run("rpc/"+mode.name, func(b *testing.B) {
			c, s := pair(b, mode.tls)
			defer c.Close()
			defer s.Close()
			done := make(chan struct{})
			go func() {
				defer close(done)
				req, rep := make([]byte, 256), make([]byte, 64)
				for {
					if _, err := io.ReadFull(s, req); err != nil {
						return
					}
					if _, err := s.Write(rep); err != nil {
						return
					}
				}
			}()
			req, rep := make([]byte, 256), make([]byte, 64)
			for b.Loop() {
				if _, err := c.Write(req); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, rep); err != nil {
					b.Fatal(err)
				}
			}
			c.Close()
			<-done
		})
		b.Run("append/"+mode.name, func(b *testing.B) {
			c, s := pair(b, mode.tls)
			defer c.Close()
			defer s.Close()
			done := make(chan int64)
			go func() {
				n, _ := io.Copy(io.Discard, s)
				done <- n
			}()
			buf := make([]byte, 64<<10)
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			c.Close()
			<-done
		})
	}
	b.Run("dial/tls", func(b *testing.B) {
		for b.Loop() {
			c, err := n2.Dial(n1.addr(), 5*time.Second)
			if err != nil {
				b.Fatal(err)
			}
			s, err := n1.Accept()
			if err != nil {
				b.Fatal(err)
			}
			c.Close()
			s.Close()
		}
	})
}
