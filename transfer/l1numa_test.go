package transfer

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/numa"
)

// busDevice is a device that reports a PCI bus id (the host backend has
// none), so that the engine looks its NUMA node up in sysfs.
type busDevice struct {
	cuda.Device
	bus string
}

func (d busDevice) Info() cuda.Info {
	in := d.Device.Info()
	in.PCIBus = d.bus
	return in
}

// fakeNUMASys points the engine at a sysfs with the online nodes and one
// GPU at 0000:3b:00.0 whose numa_node file says devNode.
func fakeNUMASys(t *testing.T, online, devNode string) {
	t.Helper()
	sys := t.TempDir()
	for p, s := range map[string]string{
		"devices/system/node/online":             online,
		"bus/pci/devices/0000:3b:00.0/numa_node": devNode,
	} {
		p = filepath.Join(sys, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	old := numaSys
	numaSys = sys
	t.Cleanup(func() { numaSys = old })
}

// roundTrip stores n chunks and restores them elsewhere, byte-exact.
func roundTrip(t *testing.T, e *Engine, r *rig, n int) {
	t.Helper()
	var cs []chunk
	var tgts [][][]int64
	for i := range n {
		cs = append(cs, r.newChunk(i, r.consecutiveN(i)))
		tgts = append(tgts, r.consecutiveN(n+i))
	}
	storeAll(t, e, r, "s", cs...)
	rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, cs, tgts))
	if err != nil {
		t.Fatal(err)
	}
	for i, it := range rr.Items {
		if !it.OK {
			t.Fatalf("item %d: %+v", i, it)
		}
		r.expectRestored(cs[i], tgts[i])
	}
	r.check("restored through bound L1")
}

// wantBound checks that L1 is bound to node 0: the placement the engine
// reports, and the kernel's policy of L1's first and last pages.
func wantBound(t *testing.T, e *Engine, mem []byte) {
	t.Helper()
	p := e.L1Placement()
	if p.Node != 0 || p.Why != "" || p.Sampled == 0 || p.Elsewhere != 0 || p.Absent != 0 || p.Bytes != uint64(len(mem)) {
		t.Fatalf("placement %+v of %d B; want node 0, every sampled page there", p, len(mem))
	}
	page := os.Getpagesize()
	for _, b := range [][]byte{mem, mem[len(mem)-page:]} {
		mode, nodes, err := numa.Policy(b)
		if err != nil || mode != numa.ModePreferred || !slices.Equal(nodes, []int{0}) {
			t.Fatalf("L1's policy: mode %d on %v, %v; want preferred on [0]", mode, nodes, err)
		}
	}
}

// TestL1NUMAExplicitNode: --l1-numa 0 binds private L1 to node 0 on any
// host (node 0 always exists): its pages carry the policy and are on node
// 0, stores and restores through it are byte-exact, and Close unmaps it.
func TestL1NUMAExplicitNode(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{32})
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1NUMA = numa.Node(0)
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	wantBound(t, e, e.l1mem)
	if e.l1map == nil {
		t.Fatal("bound L1 is not the engine's own mapping")
	}
	r.register(e)
	roundTrip(t, e, r, 8)
	closeEngine(t, e)
	if e.l1map != nil {
		t.Fatal("Close left bound L1 mapped")
	}
}

// TestL1NUMAAuto: auto binds L1 to the device's node read from sysfs on a
// two-node host, leaves it to the kernel when the node is unknown (-1) or
// the host has one node, and falls back (logged) when the bind fails.
func TestL1NUMAAuto(t *testing.T) {
	dev := openDevice(t, "")
	start := func(t *testing.T, online, devNode string) *Engine {
		fakeNUMASys(t, online, devNode)
		cfg := engineConfig(t, dev, 0, 1)
		cfg.Device = busDevice{Device: dev, bus: "00000000:3B:00.0"}
		return newEngine(t, cfg)
	}
	t.Run("device on node 0 of two", func(t *testing.T) {
		e := start(t, "0-1\n", "0\n")
		wantBound(t, e, e.l1mem)
		if p := e.L1Placement(); p.DeviceNode != 0 {
			t.Fatalf("device node %d, want 0", p.DeviceNode)
		}
		r := newRig(t, dev, c1Spec(), []int64{16})
		r.register(e)
		roundTrip(t, e, r, 4)
	})
	for _, tc := range []struct{ name, online, devNode, why string }{
		{"device node unknown", "0-1\n", "-1\n", "the device's NUMA node is unknown: "},
		{"one node", "0\n", "0\n", "the host has one NUMA node"},
		// This host has no node 1 (one-node test machines): mbind refuses
		// it and auto keeps the unbound path.
		{"bind fails", "0-1\n", "1\n", "bind failed: numa: mbind"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "bind fails" {
				if nodes, _ := numa.OnlineNodes(numa.SysRoot); slices.Contains(nodes, 1) {
					t.Skip("this host has a node 1: the bind would succeed")
				}
			}
			e := start(t, tc.online, tc.devNode)
			p := e.L1Placement()
			if p.Node != -1 || !strings.HasPrefix(p.Why, tc.why) || e.l1map != nil || p.Bytes != uint64(len(e.l1mem)) ||
				tc.devNode == "-1\n" && !strings.HasSuffix(p.Why, "0000:3b:00.0/numa_node says -1 (the platform does not report it)") {
				t.Fatalf("placement %+v (own mapping %t); want unbound, why %q...", p, e.l1map != nil, tc.why)
			}
		})
	}
}

// TestL1NUMARefused: an explicit node the host lacks fails New with
// ErrConfig naming the node and the host's nodes.
func TestL1NUMARefused(t *testing.T) {
	dev := openDevice(t, "")
	fakeNUMASys(t, "0-1\n", "0\n")
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L1NUMA = numa.Node(5)
	e, err := New(cfg)
	if err == nil {
		_ = e.Close(testCtx(t))
		t.Fatal("New accepted node 5 on a host of nodes 0,1")
	}
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "node 5 ") || !strings.Contains(err.Error(), "(nodes 0,1)") {
		t.Fatalf("New: %v; want ErrConfig naming node 5 and nodes 0,1", err)
	}
}

// TestL1NUMAHostL1: host-shared L1 is bound the same way: the segment's
// data region (a tmpfs file's pages) carries the policy and is on node 0.
func TestL1NUMAHostL1(t *testing.T) {
	dev := openDevice(t, "")
	cfg := engineConfig(t, dev, 0, 1)
	cfg.HostL1Dir = filepath.Join(t.TempDir(), "l1")
	cfg.L1NUMA = numa.Node(0)
	e := newEngine(t, cfg)
	wantBound(t, e, e.cat.seg.Data())
	r := newRig(t, dev, c1Spec(), []int64{16})
	r.register(e)
	roundTrip(t, e, r, 4)
}
