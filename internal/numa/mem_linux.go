package numa

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"syscall"
	"unsafe"
)

// Memory policy modes and flags (linux/mempolicy.h).
const (
	mpolDefault   = 0
	mpolPreferred = 1
	mpolFNode     = 1 << 0 // get_mempolicy: return a node, not a policy
	mpolFAddr     = 1 << 1 // get_mempolicy: the policy of the page at addr
	madvPopulateW = 23     // MADV_POPULATE_WRITE (Linux 5.14)
	maskWords     = (MaxNode + 1) / 64
)

// Map maps size bytes (rounded up to whole pages) of anonymous, private,
// read-write memory. Nothing is touched: Bind it before Populate. Unmap
// frees it.
func Map(size uint64) ([]byte, error) {
	page := uint64(os.Getpagesize())
	n := (size + page - 1) &^ (page - 1)
	if size == 0 || n > uint64(int(^uint(0)>>1)) {
		return nil, fmt.Errorf("numa: cannot map %d B", size)
	}
	b, err := syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("numa: map %d B: %w", n, err)
	}
	return b, nil
}

// Unmap unmaps a mapping from Map.
func Unmap(b []byte) error {
	if err := syscall.Munmap(b); err != nil {
		return fmt.Errorf("numa: unmap %d B: %w", len(b), err)
	}
	return nil
}

// Bind sets the policy of the pages of b (page-aligned start) to prefer
// node: pages faulted from now on are allocated there while it has free
// memory, elsewhere when it has none (MPOL_PREFERRED: a full node degrades
// bandwidth instead of failing the daemon; Placement counts such pages).
// Pages already present are not moved. For a shared memory file the policy
// is the file's, for every process that maps it.
func Bind(b []byte, node int) error {
	if len(b) == 0 {
		return fmt.Errorf("numa: bind of 0 B")
	}
	if node < 0 || node > MaxNode {
		return fmt.Errorf("%w: node %d outside 0..%d", ErrBadSpec, node, MaxNode)
	}
	if p := uintptr(unsafe.Pointer(&b[0])); p%uintptr(os.Getpagesize()) != 0 {
		return fmt.Errorf("numa: bind: start %#x is not page-aligned", p)
	}
	var mask [maskWords]uint64
	mask[node/64] = 1 << (node % 64)
	// maxnode counts one more than the mask's bits (the kernel subtracts one).
	_, _, e := syscall.Syscall6(syscall.SYS_MBIND, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), mpolPreferred,
		uintptr(unsafe.Pointer(&mask[0])), uintptr(len(mask)*64+1), 0)
	if e != 0 {
		return fmt.Errorf("numa: mbind %d B at %p to node %d: %w", len(b), &b[0], node, e)
	}
	return nil
}

// Policy reads the policy of the page at the start of b: the mode
// (MPOL_PREFERRED after Bind) and its nodes.
func Policy(b []byte) (mode int, nodes []int, err error) {
	if len(b) == 0 {
		return 0, nil, fmt.Errorf("numa: policy of 0 B")
	}
	var mask [maskWords]uint64
	var m int32
	_, _, e := syscall.Syscall6(syscall.SYS_GET_MEMPOLICY, uintptr(unsafe.Pointer(&m)), uintptr(unsafe.Pointer(&mask[0])),
		uintptr(len(mask)*64), uintptr(unsafe.Pointer(&b[0])), mpolFAddr, 0)
	if e != 0 {
		return 0, nil, fmt.Errorf("numa: get_mempolicy at %p: %w", &b[0], e)
	}
	for i := range len(mask) * 64 {
		if mask[i/64]&(1<<(i%64)) != 0 {
			nodes = append(nodes, i)
		}
	}
	return int(m), nodes, nil
}

// PageNode is the node of the page at b[0], faulting it in (a read) when
// it is not present: get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR).
func PageNode(b []byte) (int, error) {
	if len(b) == 0 {
		return -1, fmt.Errorf("numa: page node of 0 B")
	}
	var n int32
	_, _, e := syscall.Syscall6(syscall.SYS_GET_MEMPOLICY, uintptr(unsafe.Pointer(&n)), 0, 0,
		uintptr(unsafe.Pointer(&b[0])), mpolFNode|mpolFAddr, 0)
	if e != 0 {
		return -1, fmt.Errorf("numa: node of the page at %p: %w", &b[0], e)
	}
	return int(n), nil
}

// Populate faults in every page of b for writing (MADV_POPULATE_WRITE, or
// a write of each page's first byte on kernels before 5.14), so that its
// pages are allocated now, under b's policy. b must be fresh memory (all
// zero): the fallback writes zeros.
func Populate(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	err := syscall.Madvise(b, madvPopulateW)
	if err == nil {
		return nil
	}
	if !errors.Is(err, syscall.EINVAL) {
		return fmt.Errorf("numa: populate %d B: %w", len(b), err)
	}
	page := os.Getpagesize()
	for i := 0; i < len(b); i += page {
		b[i] = 0
	}
	return nil
}

// Placement is where sampled pages of a mapping are.
type Placement struct {
	Sampled int         // pages asked about
	Nodes   map[int]int // node -> pages found there
	Absent  int         // pages not present (never touched, or swapped out)
}

// On is the number of sampled pages on node.
func (p Placement) On(node int) int { return p.Nodes[node] }

// Elsewhere is the number of present sampled pages not on node.
func (p Placement) Elsewhere(node int) int {
	n := 0
	for k, v := range p.Nodes {
		if k != node {
			n += v
		}
	}
	return n
}

// Sample asks the kernel where up to n pages of b are, spread evenly from
// its first page to its last (move_pages(2) with no target: a query that
// moves nothing and faults nothing in).
func Sample(b []byte, n int) (Placement, error) {
	page := os.Getpagesize()
	pages := (len(b) + page - 1) / page
	if pages == 0 || n < 1 {
		return Placement{}, fmt.Errorf("numa: sample %d pages of %d B", n, len(b))
	}
	n = min(n, pages)
	addrs := make([]uintptr, n)
	for i := range n {
		idx := 0
		if n > 1 {
			idx = i * (pages - 1) / (n - 1)
		}
		addrs[i] = uintptr(unsafe.Pointer(&b[idx*page]))
	}
	status := make([]int32, n)
	_, _, e := syscall.Syscall6(syscall.SYS_MOVE_PAGES, 0, uintptr(n), uintptr(unsafe.Pointer(&addrs[0])), 0,
		uintptr(unsafe.Pointer(&status[0])), 0)
	if e != 0 {
		return Placement{}, fmt.Errorf("numa: move_pages query of %d pages: %w", n, e)
	}
	runtime.KeepAlive(b)
	p := Placement{Sampled: n, Nodes: map[int]int{}}
	for _, s := range status {
		if s >= 0 {
			p.Nodes[int(s)]++
		} else {
			p.Absent++ // -ENOENT: not present; -EFAULT: not mapped
		}
	}
	return p, nil
}

// ModePreferred is the mode Policy reports for memory Bind bound.
const ModePreferred = mpolPreferred

// ModeDefault is the mode of memory nobody bound.
const ModeDefault = mpolDefault
