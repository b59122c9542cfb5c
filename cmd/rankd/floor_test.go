package main

import (
	"flag"
	"testing"
)

// TestL2FreeFloorFlag (issue 24): without --l2-free-floor a rank keeps the
// larger of 1 GiB and 5 % of the L2 file system free (an unbounded L2
// filled a 64 GiB disk and the coordinator's index on it failed); a value
// replaces the whole default, what it does not name being 0 (STYLE 23:
// "0" is no floor, "2GiB" no percentage); a bad value names the flag.
func TestL2FreeFloorFlag(t *testing.T) {
	base := []string{"--instance", "e0", "--insecure", "--join", "127.0.0.1:7946"}
	for _, tc := range []struct {
		flag    string
		bytes   uint64
		percent float64
	}{
		{"", 1 << 30, 5},
		{"0", 0, 0},
		{"2GiB", 2 << 30, 0},
		{"10%", 0, 10},
		{"3GiB, 2.5%", 3 << 30, 2.5},
		{"1%,512MiB", 512 << 20, 1},
	} {
		args := base
		if tc.flag != "" {
			args = append(append([]string(nil), base...), "--l2-free-floor", tc.flag)
		}
		cfg, _, err := parseFlags(flag.NewFlagSet("rankd", flag.ContinueOnError), args)
		if err != nil {
			t.Fatalf("--l2-free-floor %q: %v", tc.flag, err)
		}
		if cfg.L2FreeFloorBytes != tc.bytes || cfg.L2FreeFloorPercent != tc.percent {
			t.Fatalf("--l2-free-floor %q: %d B, %v %%; want %d B, %v %%", tc.flag, cfg.L2FreeFloorBytes, cfg.L2FreeFloorPercent, tc.bytes, tc.percent)
		}
		if err := cfg.Validate(); err != nil {
			t.Fatalf("--l2-free-floor %q: %v", tc.flag, err)
		}
	}
	for _, bad := range []string{"5%,6%", "1GiB,2GiB", "x%", "100%", "-1%", "lots"} {
		args := append(append([]string(nil), base...), "--l2-free-floor", bad)
		if _, _, err := parseFlags(flag.NewFlagSet("rankd", flag.ContinueOnError), args); err == nil {
			t.Fatalf("--l2-free-floor %q accepted", bad)
		}
	}
	if got := formatFloor(1<<30, 5); got != "1GiB,5%" {
		t.Fatalf("formatFloor(1 GiB, 5) = %q", got)
	}
}
