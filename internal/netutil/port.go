package netutil

import (
	"errors"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
)

// handedOut holds every port PickPort has returned in this process: two
// daemons started in the same test or lab must never be given the same
// port, even when the first has not bound it yet.
var handedOut = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// PickPort returns a port free for both TCP and UDP on 127.0.0.1
// (memberlist needs both) that no earlier call in this process returned.
// Ports come from 20000-31999, below Linux's ephemeral range (32768 up),
// so the local end of some process's outgoing connection cannot take one
// between this check and the bind.
func PickPort() (int, error) {
	for range 1000 {
		port := 20000 + rand.IntN(12000)
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		u, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		l.Close()
		if err != nil {
			continue
		}
		u.Close()
		handedOut.Lock()
		dup := handedOut.ports[port]
		handedOut.ports[port] = true
		handedOut.Unlock()
		if dup {
			continue
		}
		return port, nil
	}
	return 0, errors.New("netutil: no free TCP+UDP port in 20000-31999 after 1000 tries")
}
