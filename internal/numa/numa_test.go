package numa

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestParseSpec(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Spec
		bad  bool
	}{
		{"auto", Auto, false}, {"off", Off, false}, {"0", Node(0), false}, {"7", Node(7), false},
		{"1023", Node(1023), false}, {"1024", Off, true}, {"-1", Off, true}, {"", Off, true},
		{"Auto", Off, true}, {"1 ", Off, true}, {"0x1", Off, true},
	} {
		got, err := ParseSpec(tc.in)
		if (err != nil) != tc.bad || got != tc.want {
			t.Errorf("ParseSpec(%q) = %v, %v; want %v, error %t", tc.in, got, err, tc.want, tc.bad)
		}
		if tc.bad && !errors.Is(err, ErrBadSpec) {
			t.Errorf("ParseSpec(%q): %v is not ErrBadSpec", tc.in, err)
		}
		if !tc.bad && got.String() != tc.in {
			t.Errorf("%q round-trips as %q", tc.in, got.String())
		}
	}
	if Off != (Spec{}) {
		t.Error("the zero Spec is not Off")
	}
}

func TestChoose(t *testing.T) {
	two, one := []int{0, 1}, []int{0}
	for _, tc := range []struct {
		name      string
		spec      Spec
		dev       int
		host      []int
		want      int
		whyPrefix string
	}{
		{"auto, device on node 1 of 2", Auto, 1, two, 1, ""},
		{"auto, device on node 0 of 2", Auto, 0, two, 0, ""},
		{"auto, device node unknown", Auto, -1, two, -1, "the device's NUMA node is unknown"},
		{"auto, one node", Auto, 0, one, -1, "the host has one NUMA node"},
		{"auto, device node offline", Auto, 3, two, -1, "the device's node 3 is not online"},
		{"off", Off, 1, two, -1, "off by configuration"},
		{"explicit node on one node host", Node(0), -1, one, 0, ""},
		{"explicit node overrides the device's", Node(0), 1, two, 0, ""},
	} {
		got, why, err := Choose(tc.spec, tc.dev, tc.host)
		if err != nil || got != tc.want || !strings.HasPrefix(why, tc.whyPrefix) || (tc.want >= 0) != (why == "") {
			t.Errorf("%s: Choose = %d, %q, %v; want %d, %q...", tc.name, got, why, err, tc.want, tc.whyPrefix)
		}
	}
	_, _, err := Choose(Node(2), 0, two)
	if !errors.Is(err, ErrBadSpec) || !strings.Contains(err.Error(), "node 2 ") || !strings.Contains(err.Error(), "(nodes 0,1)") {
		t.Errorf("a node the host lacks: %v; want ErrBadSpec naming node 2 and nodes 0,1", err)
	}
}

func TestParseNodeList(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []int
	}{
		{"0\n", []int{0}}, {"0-1\n", []int{0, 1}}, {"0,2-3", []int{0, 2, 3}}, {"3,0-1,1", []int{0, 1, 3}},
	} {
		got, err := ParseNodeList(tc.in)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("ParseNodeList(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	for _, in := range []string{"", "\n", "a", "1-0", "0-", "-1", "0,,1", "0-2000"} {
		if got, err := ParseNodeList(in); err == nil {
			t.Errorf("ParseNodeList(%q) = %v, want an error", in, got)
		}
	}
}

func TestParseNodeFile(t *testing.T) {
	for in, want := range map[string]int{"-1\n": -1, "0\n": 0, "1": 1, "7\n": 7} {
		if got, err := ParseNodeFile(in); err != nil || got != want {
			t.Errorf("ParseNodeFile(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-2", "x", "1.0", "99999"} {
		if got, err := ParseNodeFile(in); err == nil || got != -1 {
			t.Errorf("ParseNodeFile(%q) = %d, %v; want -1 and an error", in, got, err)
		}
	}
}

func TestSysfsBusID(t *testing.T) {
	for in, want := range map[string]string{
		"0000:3B:00.0":     "0000:3b:00.0", // cuDeviceGetPCIBusId
		"00000000:3B:00.0": "0000:3b:00.0", // NVML
		"00000001:C1:1F.7": "0001:c1:1f.7",
		"3b:00.0":          "0000:3b:00.0",
	} {
		if got, err := SysfsBusID(in); err != nil || got != want {
			t.Errorf("SysfsBusID(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "../../x", "0000:3b:00", "0000:3b:00.8", "0000:3b:20.0", "0000:3b/../00.0",
		"0000:100:00.0", "10000:3b:00.0", "0000:3b:00.0:1", "0000::00.0"} {
		if got, err := SysfsBusID(in); err == nil {
			t.Errorf("SysfsBusID(%q) = %q, want an error", in, got)
		}
	}
}

// fakeSys builds a sysfs tree with the online node list and one device.
func fakeSys(t *testing.T, online, bus, numaNode string) string {
	t.Helper()
	sys := t.TempDir()
	write := func(p, s string) {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if online != "" {
		write(filepath.Join(sys, "devices/system/node/online"), online)
	}
	if bus != "" {
		write(filepath.Join(sys, "bus/pci/devices", bus, "numa_node"), numaNode)
	}
	return sys
}

func TestDeviceNodeSysfs(t *testing.T) {
	sys := fakeSys(t, "0-1\n", "0000:c1:00.0", "1\n")
	if n, why := DeviceNode(sys, "00000000:C1:00.0"); n != 1 || why != "" {
		t.Errorf("DeviceNode = %d, %q; want 1", n, why)
	}
	if n, why := DeviceNode(sys, "0000:3b:00.0"); n != -1 || !strings.Contains(why, "no such file") {
		t.Errorf("missing device: %d, %q", n, why)
	}
	if n, why := DeviceNode(sys, ""); n != -1 || why == "" {
		t.Errorf("no bus id: %d, %q", n, why)
	}
	if n, why := DeviceNode(sys, "../../../etc"); n != -1 || !strings.Contains(why, "PCI bus id") {
		t.Errorf("a path for a bus id: %d, %q", n, why)
	}
	vm := fakeSys(t, "0\n", "0000:00:05.0", "-1\n")
	if n, why := DeviceNode(vm, "0000:00:05.0"); n != -1 || !strings.Contains(why, "-1") {
		t.Errorf("numa_node -1: %d, %q", n, why)
	}
	if nodes, err := OnlineNodes(sys); err != nil || !slices.Equal(nodes, []int{0, 1}) {
		t.Errorf("OnlineNodes = %v, %v", nodes, err)
	}
	if nodes, err := OnlineNodes(t.TempDir()); err != nil || !slices.Equal(nodes, []int{0}) {
		t.Errorf("OnlineNodes without NUMA = %v, %v; want [0]", nodes, err)
	}
	if nodes, err := OnlineNodes(SysRoot); err != nil || len(nodes) == 0 || nodes[0] < 0 {
		t.Errorf("this host's OnlineNodes = %v, %v", nodes, err)
	}
}

// TestBindNode0: memory bound to node 0 carries the policy (the kernel
// reads it back from the mapping), its touched pages are on node 0 by both
// move_pages and get_mempolicy, and untouched ones are absent, not
// misplaced. Node 0 exists on every Linux host.
func TestBindNode0(t *testing.T) {
	const size = 64<<10 + 100
	b, err := Map(size)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := Unmap(b); err != nil {
			t.Error(err)
		}
	}()
	if len(b)%os.Getpagesize() != 0 || len(b) < size {
		t.Fatalf("Map(%d) gave %d B", size, len(b))
	}
	if mode, _, err := Policy(b); err != nil || mode != ModeDefault {
		t.Fatalf("fresh mapping: policy %d, %v; want default", mode, err)
	}
	if p, err := Sample(b, 8); err != nil || p.Absent != p.Sampled || p.Sampled != 8 {
		t.Fatalf("before populate: %+v, %v; want 8 absent", p, err)
	}
	if err := Bind(b, 0); err != nil {
		t.Fatal(err)
	}
	mode, nodes, err := Policy(b[len(b)-os.Getpagesize():])
	if err != nil || mode != ModePreferred || !slices.Equal(nodes, []int{0}) {
		t.Fatalf("after Bind: policy %d on %v, %v; want preferred on [0]", mode, nodes, err)
	}
	if err := Populate(b); err != nil {
		t.Fatal(err)
	}
	p, err := Sample(b, 1000)
	pages := len(b) / os.Getpagesize()
	if err != nil || p.Sampled != pages || p.On(0) != pages || p.Elsewhere(0) != 0 || p.Absent != 0 {
		t.Fatalf("after populate: %+v, %v; want all %d pages on node 0", p, err, pages)
	}
	for _, off := range []int{0, len(b) - 1} {
		if n, err := PageNode(b[off:]); err != nil || n != 0 {
			t.Errorf("get_mempolicy node of byte %d: %d, %v; want 0", off, n, err)
		}
	}
	for _, c := range b {
		if c != 0 {
			t.Fatal("populate changed the memory")
		}
	}
}

// TestBindRefused: a node outside the kernel's range or one the host lacks
// is refused by mbind with the node named; a misaligned start is refused.
func TestBindRefused(t *testing.T) {
	b, err := Map(8192)
	if err != nil {
		t.Fatal(err)
	}
	defer Unmap(b)
	hostNodes, err := OnlineNodes(SysRoot)
	if err != nil {
		t.Fatal(err)
	}
	missing := hostNodes[len(hostNodes)-1] + 1
	if err := Bind(b, missing); err == nil || !strings.Contains(err.Error(), "node "+itoa(missing)) {
		t.Errorf("Bind to absent node %d: %v; want an error naming it", missing, err)
	}
	if err := Bind(b, MaxNode+1); !errors.Is(err, ErrBadSpec) {
		t.Errorf("Bind to node %d: %v; want ErrBadSpec", MaxNode+1, err)
	}
	if err := Bind(b[1:], 0); err == nil || !strings.Contains(err.Error(), "page-aligned") {
		t.Errorf("misaligned Bind: %v", err)
	}
	if mode, _, _ := Policy(b); mode != ModeDefault {
		t.Errorf("a refused Bind left policy %d", mode)
	}
}

func itoa(n int) string { return FormatNodes([]int{n}) }
