package netutil

import (
	"net"
	"strconv"
	"sync"
	"testing"
)

// TestPickPortNeverTwice: ports picked at once from several goroutines are
// all different, in 20000-31999, and free for TCP and UDP when returned.
// 1,200 picks from 12,000 ports repeat some port about 60 times over
// unless PickPort remembers what it handed out.
func TestPickPortNeverTwice(t *testing.T) {
	var mu sync.Mutex
	seen := map[int]int{}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 150 {
				p, err := PickPort()
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				seen[p]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(seen) != 1200 {
		t.Fatalf("1200 picks gave %d different ports", len(seen))
	}
	for p := range seen {
		if p < 20000 || p >= 32000 {
			t.Errorf("port %d outside 20000-31999", p)
		}
	}
	p, err := PickPort()
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("port %d not free for TCP: %v", p, err)
	}
	l.Close()
	u, err := net.ListenPacket("udp", addr)
	if err != nil {
		t.Fatalf("port %d not free for UDP: %v", p, err)
	}
	u.Close()
}
