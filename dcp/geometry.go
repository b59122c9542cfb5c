package dcp

import (
	"fmt"
	"math"
	"math/bits"
)

// Kind is the kind of a KV cache group.
type Kind uint8

const (
	// Attention pages hold BlockSize tokens per rank; a group's span on the
	// scheduler's sequence scales with DCP (BlockSize*W tokens per block).
	Attention Kind = iota + 1
	// SlidingWindow pages behave like Attention for geometry and transfer.
	SlidingWindow
	// Recurrent pages hold a state that covers BlockSize tokens of the
	// sequence; the span is not scaled by DCP.
	Recurrent
)

func (k Kind) String() string {
	switch k {
	case Attention:
		return "attention"
	case SlidingWindow:
		return "sliding_window"
	case Recurrent:
		return "recurrent"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// ParseKind parses the String form of a Kind.
func ParseKind(s string) (Kind, error) {
	for _, k := range []Kind{Attention, SlidingWindow, Recurrent} {
		if k.String() == s {
			return k, nil
		}
	}
	return 0, fmt.Errorf("unknown KV group kind %q (want attention, sliding_window or recurrent): %w", s, ErrGeometry)
}

// Group describes one KV cache group as the engine declares it: all of its
// layers share one page geometry, and each layer has its own pool.
type Group struct {
	// Name is informational (e.g. "full_attn", "mamba"); not part of identity.
	Name string `json:"name,omitempty"`
	Kind Kind   `json:"kind"`
	// MLA marks an attention group whose latent cache is identical on every
	// TP rank of a DCP rank (so one rank stores it and the others read it).
	MLA bool `json:"mla,omitempty"`
	// BlockSize is, for attention groups, the tokens one page holds on one
	// rank; for recurrent groups, the tokens one state page covers.
	BlockSize int `json:"block_size"`
	// Layers is the number of layers (pools) in the group.
	Layers int `json:"layers"`
	// SemanticBytes is the size of a page's semantic tensor shape.
	SemanticBytes uint64 `json:"semantic_bytes"`
	// PageBytes is the declared page size (page_size_bytes): what moves. It
	// may exceed SemanticBytes by an opaque, model-owned tail.
	PageBytes uint64 `json:"page_bytes"`
	// StrideBytes is the distance between consecutive blocks in a pool.
	// Bytes in [PageBytes, StrideBytes) are padding, never written.
	StrideBytes uint64 `json:"stride_bytes"`
	// KVFormat names the element encoding ("bf16", "fp8_ds_mla", "nvfp4").
	KVFormat string `json:"kv_format"`
}

// PageGeometry is a Group resolved against a Layout.
type PageGeometry struct {
	Group
	// Span is the number of tokens of the sequence one block covers:
	// BlockSize*W for attention groups, BlockSize for recurrent ones.
	Span int64
	// Slots is the number of physical slots a page is divided into.
	// Attention: BlockSize token rows when PageBytes splits evenly into
	// them, else 1 opaque slot. Recurrent: a state is not per token; under
	// DCP W > 1 it splits into W equal slots when PageBytes allows, else 1.
	Slots int
	// SlotBytes is PageBytes/Slots.
	SlotBytes uint64
	// Tiled reports Slots > 1: the page is rows of SlotBytes.
	Tiled bool
	// LogicalTokens is the number of tokens one block represents on a rank
	// (BlockSize), kept apart from Slots.
	LogicalTokens int
}

// Resolve validates g against l (contract C2) and derives its geometry.
func (g Group) Resolve(l Layout) (PageGeometry, error) {
	if err := l.Validate(); err != nil {
		return PageGeometry{}, err
	}
	name := g.Name
	if name == "" {
		name = g.Kind.String()
	}
	fail := func(format string, args ...any) (PageGeometry, error) {
		return PageGeometry{}, fmt.Errorf("group %q: "+format+": %w", append(append([]any{name}, args...), ErrGeometry)...)
	}
	switch g.Kind {
	case Attention, SlidingWindow, Recurrent:
	default:
		return fail("unknown kind %d", uint8(g.Kind))
	}
	switch {
	case g.MLA && g.Kind == Recurrent:
		return fail("MLA applies to attention groups, not %s", g.Kind)
	case g.BlockSize < 1:
		return fail("block size %d tokens must be >= 1", g.BlockSize)
	case g.Layers < 1:
		return fail("layer count %d must be >= 1", g.Layers)
	case g.SemanticBytes < 1:
		return fail("semantic page %d B must be >= 1", g.SemanticBytes)
	case g.SemanticBytes > g.PageBytes:
		return fail("semantic page %d B exceeds declared page %d B", g.SemanticBytes, g.PageBytes)
	case g.PageBytes > g.StrideBytes:
		return fail("declared page %d B exceeds block stride %d B", g.PageBytes, g.StrideBytes)
	case len(g.KVFormat) > 64:
		return fail("KV format name is %d bytes, limit 64", len(g.KVFormat))
	}
	pg := PageGeometry{Group: g, LogicalTokens: g.BlockSize, Slots: 1, SlotBytes: g.PageBytes}
	slots := g.BlockSize
	if g.Kind == Recurrent {
		pg.Span = int64(g.BlockSize)
		slots = l.DCP
	} else {
		if g.BlockSize%l.Interleave != 0 {
			return fail("DCP interleave %d does not divide block size %d", l.Interleave, g.BlockSize)
		}
		hi, lo := bits.Mul64(uint64(g.BlockSize), uint64(l.DCP))
		if hi != 0 || lo > math.MaxInt64 {
			return fail("span %d x %d overflows", g.BlockSize, l.DCP)
		}
		pg.Span = int64(lo)
	}
	if slots > 1 && g.PageBytes%uint64(slots) == 0 {
		pg.Slots, pg.SlotBytes, pg.Tiled = slots, g.PageBytes/uint64(slots), true
	}
	return pg, nil
}

// Padding returns the padding bytes after each page (StrideBytes-PageBytes).
func (g PageGeometry) Padding() uint64 { return g.StrideBytes - g.PageBytes }

// PoolBlocks returns how many whole pages a pool of poolBytes holds. The
// last page needs no padding after it.
func (g PageGeometry) PoolBlocks(poolBytes uint64) int64 {
	if poolBytes < g.PageBytes {
		return 0
	}
	n := (poolBytes-g.PageBytes)/g.StrideBytes + 1
	if n > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(n)
}

// PoolBytes returns the smallest pool holding blocks pages.
func (g PageGeometry) PoolBytes(blocks int64) uint64 {
	if blocks <= 0 {
		return 0
	}
	return uint64(blocks-1)*g.StrideBytes + g.PageBytes
}

// gcd and lcm of positive int64s; lcm reports overflow.
func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

func lcm(a, b int64) (int64, bool) {
	g := gcd(a, b)
	hi, lo := bits.Mul64(uint64(a/g), uint64(b))
	if hi != 0 || lo > math.MaxInt64 {
		return 0, false
	}
	return int64(lo), true
}

// SchedulerBlock returns the LCM of the spans of gs: the smallest token
// count at which every group's blocks end together.
func SchedulerBlock(gs []PageGeometry) (int64, error) {
	if len(gs) == 0 {
		return 0, fmt.Errorf("no KV groups: %w", ErrGeometry)
	}
	b := int64(1)
	for _, g := range gs {
		var ok bool
		if b, ok = lcm(b, g.Span); !ok {
			return 0, fmt.Errorf("scheduler block (LCM of group spans) overflows at group %q span %d: %w",
				g.Name, g.Span, ErrGeometry)
		}
	}
	return b, nil
}
