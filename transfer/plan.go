package transfer

import (
	"math"
	"slices"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
)

// Planning a retrieve: the checks of every item and its target spans.
//
// planRetrieveChecked is the reference: item by item, a map of every
// (group, block) seen, each page's extent built by dcp and bounds-checked
// per layer. On the H200 it took 18.1 ms of a 55.5 ms restore of 1.3 GB
// (768 items, 99,264 spans, 49,000 map entries; issue 25.4). planFast
// does the same checks in a few passes over flat arrays: the limits of
// each group are derived once per retrieve from the session's pools, a
// block's bounds check is one comparison against the highest block whose
// page lies inside every layer's pool, duplicates are found with a bitmap
// per group (or by sorting when the ids are sparse), and every span lives
// in one allocation. It accepts exactly what the reference accepts and
// returns the same spans (TestPlanFastMatchesChecked); when it refuses,
// the reference runs to name the bad item in its words.

// planGroup is what planning needs of one group of a session.
type planGroup struct {
	pools        []cuda.Mem
	stride, page uint64
	blocks       int // block ids per item (BlocksPerChunk)
	shard        int // the shard this rank reads
	// maxID is the highest block id whose page lies inside every layer's
	// pool: [id*stride, id*stride+page) within the pool; -1 if none.
	maxID int64
	// lo, hi and count are the smallest and largest requested block ids
	// and how many were requested (duplicates counted).
	lo, hi int64
	count  int
	// bits marks the block ids seen, bit id-lo (nil: ids collects them
	// for a sort instead, the range being far wider than the count).
	bits []uint64
	ids  []int64
}

// blockRun is the extent [off, end) in every layer's pool of a run of an
// item's blocks whose pages continue each other.
type blockRun struct{ off, end uint64 }

// planBitmapSlack is how many 64-bit words a group's duplicate bitmap may
// have beyond one per requested block before the ids are sorted instead.
const planBitmapSlack = 1024

// planFast returns each item's target spans for TP rank tp, or false
// when any check fails (or the geometry is one it leaves to the
// reference: a group without pools, a zero stride or page).
func planFast(res *dcp.Resolved, pools [][]cuda.Mem, tp int, req RetrieveRequest) ([][]cuda.Span, bool) {
	if len(req.Items) > MaxStoreChunks*dcp.MaxGroups || len(pools) != len(res.Groups) {
		return nil, false
	}
	gs := make([]planGroup, len(res.Groups))
	for gi := range gs {
		geo := &res.Geometry[gi]
		g := &gs[gi]
		*g = planGroup{pools: pools[gi], stride: geo.StrideBytes, page: geo.PageBytes,
			blocks: res.BlocksPerChunk(gi), shard: res.ReadShard(gi, tp), maxID: math.MaxInt64, lo: math.MaxInt64, hi: -1}
		if len(g.pools) == 0 || g.stride == 0 || g.page == 0 {
			return nil, false
		}
		for _, m := range g.pools {
			size := m.Size()
			if size < g.page {
				g.maxID = -1
				break
			}
			// id*stride+page <= size, so id*stride cannot overflow.
			if id := (size - g.page) / g.stride; id < uint64(g.maxID) {
				g.maxID = int64(id)
			}
		}
	}
	// Pass 1: every item's fields, its block count and bounds.
	total := 0
	for _, it := range req.Items {
		if it.Group < 0 || it.Group >= len(gs) {
			return nil, false
		}
		g := &gs[it.Group]
		if it.Key.NS != req.Namespace || int(it.Key.Group) != it.Group || int(it.Key.Shard) != g.shard ||
			len(it.Blocks) != g.blocks {
			return nil, false
		}
		for _, b := range it.Blocks {
			if b < 0 || b > g.maxID {
				return nil, false
			}
			g.lo, g.hi = min(g.lo, b), max(g.hi, b)
		}
		g.count += len(it.Blocks)
		total += len(it.Blocks) * len(g.pools)
	}
	// Duplicates: no block of a group is written twice, within an item or
	// across items.
	words := 0
	for gi := range gs {
		g := &gs[gi]
		if g.count > 0 && uint64(g.hi-g.lo)/64 < uint64(g.count)+planBitmapSlack {
			words += int(uint64(g.hi-g.lo)/64) + 1
		}
	}
	bitmap := make([]uint64, words)
	for gi := range gs {
		g := &gs[gi]
		switch {
		case g.count == 0:
		case uint64(g.hi-g.lo)/64 < uint64(g.count)+planBitmapSlack:
			n := int(uint64(g.hi-g.lo)/64) + 1
			g.bits, bitmap = bitmap[:n:n], bitmap[n:]
		default:
			g.ids = make([]int64, 0, g.count)
		}
	}
	for _, it := range req.Items {
		g := &gs[it.Group]
		if g.bits == nil {
			g.ids = append(g.ids, it.Blocks...)
			continue
		}
		for _, b := range it.Blocks {
			d := uint64(b - g.lo)
			w, bit := d/64, uint64(1)<<(d%64)
			if g.bits[w]&bit != 0 {
				return nil, false
			}
			g.bits[w] |= bit
		}
	}
	for gi := range gs {
		if ids := gs[gi].ids; ids != nil {
			slices.Sort(ids)
			for k := 1; k < len(ids); k++ {
				if ids[k] == ids[k-1] {
					return nil, false
				}
			}
		}
	}
	// Pass 2: the spans, layer-major then block order, all in one array.
	// The blocks of an item whose pages continue each other are one run,
	// the same in every layer's pool (a group's pools share stride and
	// page), so the runs are found once per item and each pool gets a
	// span per run: the spans appendSpan would make page by page, at a
	// fraction of the work (the 8B pages: 16 blocks of a chunk one run,
	// 64 spans instead of 1,024 appends).
	blocks := 0
	for gi := range gs {
		blocks += gs[gi].count
	}
	runs := make([]blockRun, 0, blocks)
	bounds := make([]int, len(req.Items)+1)
	total = 0
	for i, it := range req.Items {
		g := &gs[it.Group]
		first := len(runs)
		for _, b := range it.Blocks {
			off := uint64(b) * g.stride
			if n := len(runs); n > first && runs[n-1].end == off {
				runs[n-1].end += g.page
				continue
			}
			runs = append(runs, blockRun{off: off, end: off + g.page})
		}
		bounds[i+1] = len(runs)
		total += (len(runs) - first) * len(g.pools)
	}
	all := make([]cuda.Span, 0, total)
	out := make([][]cuda.Span, len(req.Items))
	for i, it := range req.Items {
		first := len(all)
		for _, m := range gs[it.Group].pools {
			for _, r := range runs[bounds[i]:bounds[i+1]] {
				s := cuda.Span{Mem: m, Off: r.off, Len: r.end - r.off}
				if len(all) > first {
					all = appendSpan(all, s)
				} else {
					all = append(all, s)
				}
			}
		}
		out[i] = all[first:len(all):len(all)]
	}
	return out, true
}
