package testutil

import (
	"testing"

	"github.com/kvtier/kvtier/internal/netutil"
)

// FreePort returns a port free for both TCP and UDP on 127.0.0.1 that no
// earlier call in this process (nor any netutil.PickPort) returned; it
// fails tb when it finds none. netutil's doc says when to prefer a port
// the kernel chooses instead.
func FreePort(tb testing.TB) int {
	tb.Helper()
	p, err := netutil.PickPort()
	if err != nil {
		tb.Fatal(err)
	}
	return p
}
