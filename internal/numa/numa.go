// Package numa places host memory on a NUMA node: it finds the node of a
// PCI device (the GPU a rankd serves) from sysfs, chooses L1's node from an
// operator's setting, binds a mapping's pages to it with mbind(2) before
// they are first touched, and reads back where sampled pages are
// (move_pages(2) in query mode). No numactl, no libnuma, no cgo.
//
// On a multi-socket host each GPU hangs off one socket; pinned memory on
// the other socket costs every DMA a trip across the socket link, and
// eight GPUs restoring at once need the memory bandwidth of every socket,
// not of the one the process happened to start on.
package numa

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// ErrBadSpec is a placement setting that cannot be honoured: a malformed
// spec, or a node this host does not have.
var ErrBadSpec = errors.New("numa: bad placement")

// SysRoot is where sysfs is mounted.
const SysRoot = "/sys"

// MaxNode bounds node numbers (the kernel's MAX_NUMNODES is at most 1024).
const MaxNode = 1023

// Spec is where memory should go: Off (the zero value: wherever the kernel
// puts it), Auto (the device's node, when known and the host has more than
// one) or Node(n) (node n, on any host that has it).
type Spec struct {
	mode mode
	node int
}

type mode uint8

const (
	modeOff mode = iota
	modeAuto
	modeNode
)

// Off leaves placement to the kernel (first touch, the process's policy).
var Off = Spec{}

// Auto places memory on the device's node when it is known and the host
// has more than one node; otherwise it is Off.
var Auto = Spec{mode: modeAuto}

// Node places memory on node n.
func Node(n int) Spec { return Spec{mode: modeNode, node: n} }

// String is the spec as ParseSpec reads it: "off", "auto" or the node.
func (s Spec) String() string {
	switch s.mode {
	case modeAuto:
		return "auto"
	case modeNode:
		return strconv.Itoa(s.node)
	}
	return "off"
}

// ParseSpec reads "auto", "off" or a node number (0..MaxNode).
func ParseSpec(s string) (Spec, error) {
	switch s {
	case "auto":
		return Auto, nil
	case "off":
		return Off, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || n > MaxNode {
		return Off, fmt.Errorf("%w: %q: want auto, off or a node number 0..%d", ErrBadSpec, s, MaxNode)
	}
	return Node(n), nil
}

// Choose decides the node for spec, given the device's node (-1: unknown)
// and the host's online nodes. It returns -1 and the reason when memory is
// not to be bound; an explicit node the host does not have is an error
// naming it and the host's nodes.
func Choose(spec Spec, deviceNode int, hostNodes []int) (node int, why string, err error) {
	switch spec.mode {
	case modeOff:
		return -1, "off by configuration", nil
	case modeNode:
		if !slices.Contains(hostNodes, spec.node) {
			return -1, "", fmt.Errorf("%w: node %d is not an online NUMA node of this host (nodes %s)", ErrBadSpec, spec.node, FormatNodes(hostNodes))
		}
		return spec.node, "", nil
	}
	switch {
	case deviceNode < 0:
		return -1, "the device's NUMA node is unknown", nil
	case len(hostNodes) <= 1:
		return -1, "the host has one NUMA node", nil
	case !slices.Contains(hostNodes, deviceNode):
		return -1, fmt.Sprintf("the device's node %d is not online (nodes %s)", deviceNode, FormatNodes(hostNodes)), nil
	}
	return deviceNode, "", nil
}

// ParseNodeList reads a kernel node list such as "0", "0-1" or "0,2-3"
// (/sys/devices/system/node/online), sorted and without duplicates.
func ParseNodeList(s string) ([]int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, fmt.Errorf("numa: empty node list")
	}
	var nodes []int
	for part := range strings.SplitSeq(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := parseNode(lo)
		if err != nil {
			return nil, fmt.Errorf("numa: node list %q: %w", s, err)
		}
		b := a
		if isRange {
			if b, err = parseNode(hi); err != nil {
				return nil, fmt.Errorf("numa: node list %q: %w", s, err)
			}
			if b < a {
				return nil, fmt.Errorf("numa: node list %q: range %d-%d runs backwards", s, a, b)
			}
		}
		for n := a; n <= b; n++ {
			nodes = append(nodes, n)
		}
	}
	slices.Sort(nodes)
	return slices.Compact(nodes), nil
}

func parseNode(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || n > MaxNode {
		return 0, fmt.Errorf("node %q: want 0..%d", s, MaxNode)
	}
	return n, nil
}

// FormatNodes writes nodes as a comma-separated list ("0,1").
func FormatNodes(nodes []int) string {
	s := make([]string, len(nodes))
	for i, n := range nodes {
		s[i] = strconv.Itoa(n)
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ",")
}

// ParseNodeFile reads a PCI device's numa_node file: a node number, or -1
// when the platform does not say (one-node hosts, many VMs).
func ParseNodeFile(s string) (int, error) {
	t := strings.TrimSpace(s)
	if t == "-1" {
		return -1, nil
	}
	n, err := parseNode(t)
	if err != nil {
		return -1, fmt.Errorf("numa: numa_node %q: %w", s, err)
	}
	return n, nil
}

// SysfsBusID turns a PCI bus id as CUDA or NVML write it ("0000:3B:00.0",
// "00000000:3B:00.0") into the name of its sysfs directory
// ("0000:3b:00.0"). Anything else is refused: the id becomes a path.
func SysfsBusID(bus string) (string, error) {
	bad := fmt.Errorf("numa: PCI bus id %q: want [domain:]bus:device.function in hex", bus)
	parts := strings.Split(strings.ToLower(strings.TrimSpace(bus)), ":")
	if len(parts) == 2 {
		parts = append([]string{"0"}, parts...)
	}
	if len(parts) != 3 {
		return "", bad
	}
	devFn := strings.Split(parts[2], ".")
	if len(devFn) != 2 {
		return "", bad
	}
	var v [4]uint64
	limits := [4]uint64{0xffffffff, 0xff, 0x1f, 0x7}
	for i, f := range []string{parts[0], parts[1], devFn[0], devFn[1]} {
		x, err := strconv.ParseUint(f, 16, 32)
		if f == "" || err != nil || x > limits[i] {
			return "", bad
		}
		v[i] = x
	}
	if v[0] > 0xffff {
		return "", bad // sysfs names have 4 hex digits of domain
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", v[0], v[1], v[2], v[3]), nil
}

// DeviceNode is the NUMA node of the PCI device bus under sysfs root sys:
// -1 when unknown (no bus id, no such device, or the platform reports -1),
// with the reason.
func DeviceNode(sys, bus string) (node int, why string) {
	if bus == "" {
		return -1, "the device has no PCI bus id (host backend?)"
	}
	id, err := SysfsBusID(bus)
	if err != nil {
		return -1, err.Error()
	}
	p := filepath.Join(sys, "bus", "pci", "devices", id, "numa_node")
	b, err := os.ReadFile(p)
	if err != nil {
		return -1, fmt.Sprintf("read %s: %v", p, err)
	}
	n, err := ParseNodeFile(string(b))
	if err != nil {
		return -1, fmt.Sprintf("%s: %v", p, err)
	}
	if n < 0 {
		return -1, p + " says -1 (the platform does not report it)"
	}
	return n, ""
}

// OnlineNodes reads the host's online nodes under sysfs root sys. A kernel
// without NUMA has no such file: one node, 0.
func OnlineNodes(sys string) ([]int, error) {
	p := filepath.Join(sys, "devices", "system", "node", "online")
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return []int{0}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("numa: %w", err)
	}
	return ParseNodeList(string(b))
}
