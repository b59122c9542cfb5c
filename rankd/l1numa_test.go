package rankd

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/numa"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestConfigL1NUMA: --l1-numa defaults to auto; auto, off and a node
// number are accepted; "" (zero means zero, STYLE 23) and anything else
// are refused naming the value.
func TestConfigL1NUMA(t *testing.T) {
	c := DefaultConfig(wire.Rank{Instance: "eng", TPRank: 0})
	c.TPSize, c.Join, c.Insecure = 1, []string{"127.0.0.1:7946"}, true
	if c.L1NUMA != "auto" {
		t.Fatalf("default L1NUMA %q, want auto", c.L1NUMA)
	}
	for _, s := range []string{"auto", "off", "0", "3"} {
		c.L1NUMA = s
		if err := c.Validate(); err != nil {
			t.Errorf("L1NUMA %q: %v", s, err)
		}
	}
	for _, s := range []string{"", "on", "-1", "1024", "node0"} {
		c.L1NUMA = s
		if err := c.Validate(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), `L1 NUMA placement "`+s+`"`) {
			t.Errorf("L1NUMA %q: %v, want ErrConfig naming it", s, err)
		}
	}
}

// TestL1NUMAGauge: kvtier_rankd_l1_numa_node says where L1 is: node 0
// when --l1-numa 0 bound it there, -1 when off. (Auto on this machine
// depends on its NUMA layout; transfer's TestL1NUMAAuto covers it.)
func TestL1NUMAGauge(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want float64
	}{{"0", 0}, {"off", -1}} {
		t.Run(tc.spec, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.L1NUMA = tc.spec })
			if v := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_l1_numa_node"); v != tc.want {
				t.Fatalf("kvtier_rankd_l1_numa_node = %v, want %v", v, tc.want)
			}
			if v := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_l1_numa_pages_elsewhere"); v != 0 {
				t.Fatalf("kvtier_rankd_l1_numa_pages_elsewhere = %v, want 0", v)
			}
			want := numa.Off
			if tc.spec == "0" {
				want = numa.Node(0)
			}
			if h.d.tc.L1NUMA != want {
				t.Fatalf("transfer config L1NUMA %v, want %v", h.d.tc.L1NUMA, want)
			}
		})
	}
}

// TestCopyEngineBatchingGauge: kvtier_rankd_copy_engine_batching is the
// device's answer (the host backend models a driver that batches: 1). The
// driver's refusal turning it to 0 is TestDriverBatchRefused's (GPU).
func TestCopyEngineBatchingGauge(t *testing.T) {
	h := newHarness(t, func(*Config) {})
	if ok, err := cuda.CopyEngineBatching(h.d.dev); !ok || err != nil {
		t.Fatalf("host backend: CopyEngineBatching = %v, %v; want true, nil", ok, err)
	}
	if v := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_copy_engine_batching"); v != 1 {
		t.Fatalf("kvtier_rankd_copy_engine_batching = %v, want 1", v)
	}
	// The host backend has no kv_move: none counted (the driver's count is
	// TestDriverSMControlDuplex's, GPU).
	if v := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_sm_control_transfers_total"); v != 0 {
		t.Fatalf("kvtier_rankd_sm_control_transfers_total = %v, want 0", v)
	}
}

// TestRestoreTuningReachesTheEngine: the rankd's restore batch, pace
// window and ramps are what its transfer engine runs with.
func TestRestoreTuningReachesTheEngine(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.RetrieveBatchBytes, c.RestorePaceWindow, c.RetrieveRamp, c.RetrieveTailRamp, c.Streams = 256<<20, 16*time.Millisecond, 0, 2, 3
	})
	if tc := h.d.tc; tc.RetrieveBatchBytes != 256<<20 || tc.RetrievePaceWindow != 16*time.Millisecond || tc.RetrieveRamp != 0 || tc.RetrieveTailRamp != 2 || tc.Streams != 3 {
		t.Fatalf("transfer config: batch %d, window %v, ramp %d, tail ramp %d, streams %d; want 256 MiB, 16ms, 0, 2, 3", tc.RetrieveBatchBytes, tc.RetrievePaceWindow, tc.RetrieveRamp, tc.RetrieveTailRamp, tc.Streams)
	}
}
