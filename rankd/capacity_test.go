package rankd

import (
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestDeclaredCapacity: L1 always; L2 its bound, else the size of its file
// system, none without L2; L3 its bound, else unbounded, none without L3.
func TestDeclaredCapacity(t *testing.T) {
	dir := t.TempDir()
	fs := fileSystemBytes(dir)
	if fs == 0 || fs == wire.CapacityUnbounded {
		t.Fatalf("file system of %s: %d B", dir, fs)
	}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want wire.Capacity
	}{
		{"L1 only", func(c *Config) {}, wire.Capacity{L1Bytes: 1 << 30}},
		{"L2 bounded", func(c *Config) { c.L2Dir, c.L2Bytes = dir, 5<<30 }, wire.Capacity{L1Bytes: 1 << 30, L2Bytes: 5 << 30}},
		{"L2 unbounded", func(c *Config) { c.L2Dir = dir }, wire.Capacity{L1Bytes: 1 << 30, L2Bytes: fs}},
		{"L2 unreadable", func(c *Config) { c.L2Dir = dir + "/missing" }, wire.Capacity{L1Bytes: 1 << 30, L2Bytes: wire.CapacityUnbounded}},
		{"L3 bounded", func(c *Config) { c.L3.Endpoint, c.L3Bytes = "127.0.0.1:9000", 7 }, wire.Capacity{L1Bytes: 1 << 30, L3Bytes: 7}},
		{"L3 unbounded", func(c *Config) { c.L3.Endpoint = "127.0.0.1:9000" }, wire.Capacity{L1Bytes: 1 << 30, L3Bytes: wire.CapacityUnbounded}},
	} {
		cfg := DefaultConfig(wire.Rank{Instance: "eng", TPRank: 0})
		cfg.L1Bytes = 1 << 30
		tc.mod(&cfg)
		if got := declaredCapacity(&cfg); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}
