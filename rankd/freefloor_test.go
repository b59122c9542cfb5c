package rankd

import (
	"math"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestL2FreeFloor (issue 24): by default an L2 keeps the larger of 1 GiB
// and 5 % of its file system free, the size read from the L2 directory or,
// before the engine creates it, its nearest existing parent; a percentage
// of 0 leaves the bytes alone, both 0 no floor (zero means zero), no L2 no
// floor. A percentage outside [0, 100) is refused.
func TestL2FreeFloor(t *testing.T) {
	dir := t.TempDir()
	fs := fileSystemBytes(dir)
	if fs == 0 || fs == wire.CapacityUnbounded {
		t.Fatalf("file system of %s: %d B", dir, fs)
	}
	def := max(1<<30, uint64(float64(fs)*0.05))
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want uint64
	}{
		{"default", func(c *Config) { c.L2Dir = dir }, def},
		{"default, directory not made yet", func(c *Config) { c.L2Dir = filepath.Join(dir, "a", "b") }, def},
		{"bytes only", func(c *Config) { c.L2Dir, c.L2FreeFloorPercent = dir, 0 }, 1 << 30},
		{"percent only", func(c *Config) { c.L2Dir, c.L2FreeFloorBytes, c.L2FreeFloorPercent = dir, 0, 50 }, uint64(float64(fs) * 0.5)},
		{"off", func(c *Config) { c.L2Dir, c.L2FreeFloorBytes, c.L2FreeFloorPercent = dir, 0, 0 }, 0},
		{"no L2", func(c *Config) {}, 0},
	} {
		cfg := DefaultConfig(wire.Rank{Instance: "eng", TPRank: 0})
		tc.mod(&cfg)
		if got := l2FreeFloor(&cfg); got != tc.want {
			t.Errorf("%s: floor %d B, want %d B", tc.name, got, tc.want)
		}
	}
	for _, p := range []float64{5, -1, 100, math.NaN()} {
		cfg := DefaultConfig(wire.Rank{Instance: "eng", TPRank: 0})
		cfg.Join, cfg.TPSize = []string{"127.0.0.1:7946"}, 1
		cfg.Insecure = true
		cfg.L2FreeFloorPercent = p
		if err := cfg.Validate(); (err == nil) != (p == 5) {
			t.Errorf("L2FreeFloorPercent %v: Validate %v", p, err)
		}
	}
}
