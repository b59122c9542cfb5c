package campaign

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
)

func TestReadFrame(t *testing.T) {
	in := "INFO {\"a\":1}\r\nPUB a.b 5\r\nhello\r\nHPUB x r 12 14\r\nNATS/1.0\r\n\r\nhi\r\nMSG s 1 _R.x 0\r\n\r\nPING\r\nPUB bad\r\n"
	r := bufio.NewReader(strings.NewReader(in))
	want := []struct {
		s   string
		msg bool
	}{{"INFO {\"a\":1}\r\n", false}, {"PUB a.b 5\r\nhello\r\n", true}, {"HPUB x r 12 14\r\nNATS/1.0\r\n\r\nhi\r\n", true},
		{"MSG s 1 _R.x 0\r\n\r\n", true}, {"PING\r\n", false}}
	for i, w := range want {
		fr, msg, err := ReadFrame(r)
		if err != nil || string(fr) != w.s || msg != w.msg {
			t.Fatalf("frame %d: %q %v %v, want %q %v", i, fr, msg, err, w.s, w.msg)
		}
	}
	if _, _, err := ReadFrame(r); err == nil || !strings.Contains(err.Error(), "PUB line has 2 fields, want >= 3") {
		t.Fatalf("short PUB line: %v", err)
	}
}

// TestProxyFrameFaults: through the proxy, a dropped frame vanishes, a
// duplicated one arrives twice, a reordered one arrives after its
// successor, control lines pass in order.
func TestProxyFrameFaults(t *testing.T) {
	up, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	got := make(chan []byte, 1)
	go func() {
		c, err := up.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		b, _ := io.ReadAll(c)
		got <- b
	}()
	p, err := NewProxy("127.0.0.1:0", up.Addr().String(), zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.Inject(NATSDrop, 0, 1)
	p.Inject(NATSDup, 0, 1)
	p.Inject(NATSReorder, 0, 1)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	// Frames 1 (dropped), 2 (duplicated), 3 (held), 4 (overtakes 3).
	_, _ = io.WriteString(c, "CONNECT {}\r\nPUB a 1\r\n1\r\nPUB a 1\r\n2\r\nSUB x 1\r\nPUB a 1\r\n3\r\nPUB a 1\r\n4\r\nPING\r\n")
	c.Close()
	b := <-got
	want := "CONNECT {}\r\nPUB a 1\r\n2\r\nPUB a 1\r\n2\r\nSUB x 1\r\nPUB a 1\r\n4\r\nPUB a 1\r\n3\r\nPING\r\n"
	if !bytes.Equal(b, []byte(want)) {
		t.Fatalf("upstream got\n%q\nwant\n%q", b, want)
	}
	if p.Dropped.Load() != 1 || p.Duplicated.Load() != 1 || p.Reordered.Load() != 1 || p.Frames.Load() != 4 {
		t.Fatalf("counters frames %d dropped %d dup %d reordered %d", p.Frames.Load(), p.Dropped.Load(), p.Duplicated.Load(), p.Reordered.Load())
	}
}

// TestProxyReorderAloneStillArrives: a reordered frame with no successor
// is not held forever: it goes out on its own (seen failing before the
// hold timer: the reply of a request waited for the next message).
func TestProxyReorderAloneStillArrives(t *testing.T) {
	up, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	got := make(chan string, 1)
	go func() {
		c, err := up.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		r := bufio.NewReader(c)
		fr, _, err := ReadFrame(r)
		if err != nil {
			got <- err.Error()
			return
		}
		got <- string(fr)
	}()
	p, err := NewProxy("127.0.0.1:0", up.Addr().String(), zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.Inject(NATSReorder, 0, 1)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "PUB req _INBOX.1 2\r\nhi\r\n") // and the connection stays open
	if s := <-got; s != "PUB req _INBOX.1 2\r\nhi\r\n" {
		t.Fatalf("upstream got %q", s)
	}
	if p.Reordered.Load() != 1 {
		t.Fatalf("reordered %d", p.Reordered.Load())
	}
}
