package dcp

import (
	"fmt"
	"math"
	"math/bits"
)

// Extent is a byte range [Off, Off+Len) of one layer's pool.
type Extent struct {
	Off uint64
	Len uint64
}

// PageExtent returns the declared page of block id: [id*stride,
// id*stride+PageBytes). The padding after it is never part of an extent.
func (g PageGeometry) PageExtent(id int64) (Extent, error) {
	if id < 0 {
		return Extent{}, fmt.Errorf("block id %d is negative: %w", id, ErrBlock)
	}
	hi, off := bits.Mul64(uint64(id), g.StrideBytes)
	if hi != 0 || off > math.MaxUint64-g.PageBytes {
		return Extent{}, fmt.Errorf("block id %d x stride %d B overflows 64 bits: %w", id, g.StrideBytes, ErrBlock)
	}
	return Extent{Off: off, Len: g.PageBytes}, nil
}

// SlotExtent returns slot s of block id. For an opaque page the only slot is
// the whole declared page.
func (g PageGeometry) SlotExtent(id int64, s int) (Extent, error) {
	if s < 0 || s >= g.Slots {
		return Extent{}, fmt.Errorf("slot %d outside the %d slots of a %q page: %w", s, g.Slots, g.Name, ErrBlock)
	}
	e, err := g.PageExtent(id)
	if err != nil {
		return Extent{}, err
	}
	return Extent{Off: e.Off + uint64(s)*g.SlotBytes, Len: g.SlotBytes}, nil
}

// Extents returns the declared page of every block in ids, in order, for one
// layer's pool of poolBytes (0 = unchecked). Duplicates are allowed (a
// gather may read a page twice); an id whose page does not lie inside the
// pool is rejected, naming it.
func (g PageGeometry) Extents(ids []int64, poolBytes uint64) ([]Extent, error) {
	out := make([]Extent, 0, len(ids))
	for _, id := range ids {
		e, err := g.PoolExtent(id, poolBytes)
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

// PoolExtent is Extents for one id, without a slice: the declared page of
// block id in one layer's pool of poolBytes (0 = unchecked), or the error
// naming it.
func (g PageGeometry) PoolExtent(id int64, poolBytes uint64) (Extent, error) {
	e, err := g.PageExtent(id)
	if err != nil {
		return Extent{}, err
	}
	if poolBytes != 0 && e.Off+e.Len > poolBytes {
		return Extent{}, fmt.Errorf("block id %d: page [%d, %d) lies outside the %d B pool (%d blocks): %w",
			id, e.Off, e.Off+e.Len, poolBytes, g.PoolBlocks(poolBytes), ErrBlock)
	}
	return e, nil
}

// PackedSize returns the bytes of an object holding n blocks of every layer
// of the group: n*Layers*PageBytes.
func (g PageGeometry) PackedSize(n int) uint64 {
	return uint64(n) * uint64(g.Layers) * g.PageBytes
}
