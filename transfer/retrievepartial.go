package transfer

import (
	"context"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
)

// Partial chunks (issue 24): an engine whose own prefix cache ends inside
// a chunk asks for the rest of it. The item's Skip says how many of the
// chunk's first blocks the engine holds; their pages (of every layer) are
// not placed, and Blocks name only the blocks after them, so no span of a
// skipped page exists and nothing can write it. The engine's blocks before
// Skip are its own, possibly shared with its other requests.
//
// Verification stays exact although the scatter places part of the
// object. A scatter computes the kvsum64 of what each cuda.Object's spans
// hold afterwards as an object of its own (word indexes from 0), so the
// placed pages cannot be summed at their offsets in the object by the
// device. Instead the source (this rank's L1, or a peer's) is hashed on
// the CPU, each word read once for two sums (partialSums): the whole
// object's kvsum64, which must equal the recorded one, and each layer's
// placed run's own kvsum64, which the scatter of that run (one
// cuda.Object per layer) must read back. A source byte wrong in a skipped
// or a placed page fails the first check before anything of the chunk is
// written (the check runs with the batch's verdicts, checkPartial); a
// placed byte that differs on the device from the verified source fails
// the second. The item's reported Sum is the whole object's, equal to the
// recorded one, so the coordinator's verdict is unchanged. The CPU cost
// is one pass over one object per group of the restore's first chunk.

// skipsBlocks reports whether an item of req skips blocks.
func skipsBlocks(req RetrieveRequest) bool {
	for i := range req.Items {
		if req.Items[i].Skip != 0 {
			return true
		}
	}
	return false
}

// placedSpans returns the spans of an item that skips the chunk's first
// skip blocks of group gi: for every layer in order, the pages of blocks
// (the chunk's blocks skip..), in object order less the skipped pages.
func (e *Engine) placedSpans(sp *space, gi int, blocks []int64, skip int) ([]cuda.Span, error) {
	res := sp.res
	g := res.Geometry[gi]
	n := res.BlocksPerChunk(gi)
	switch {
	case skip < 0 || skip >= n:
		return nil, fmt.Errorf("skips %d of the %d blocks of a chunk (0..%d may be skipped): %w", skip, n, n-1, ErrBadRequest)
	case skip+len(blocks) != n:
		return nil, fmt.Errorf("skips %d and names %d block ids; a chunk of %d tokens holds %d blocks of span %d: %w",
			skip, len(blocks), res.ChunkTokens, n, g.Span, ErrBadRequest)
	case g.PageBytes%8 != 0:
		// kvsum64's words must not straddle a skipped and a placed page
		// (partialSums).
		return nil, fmt.Errorf("skips blocks of group %d, whose pages of %d B are not a multiple of 8 B: %w", gi, g.PageBytes, ErrBadRequest)
	}
	return layerSpans(g, sp.pools[gi], blocks, false)
}

// partialSource is the source of an item that skips blocks, checked:
// where its object lies (buf at base), its kvsum64 and each layer's
// placed run's own (partialSums).
type partialSource struct {
	buf         cuda.HostBuf
	base, whole uint64
	runs        []uint64
	where       string
}

// checkPartial hashes the source of every item of idx that skips blocks
// and is not failed yet, and fails each whose object does not hash to its
// recorded sum. It runs before the batch's verdicts are final, without
// Engine.mu (the objects are pinned, peers' slots leased).
func (r *retrieval) checkPartial(idx []int) {
	e := r.e
	res := r.sp.res
	for _, i := range idx {
		it := r.req.Items[i]
		if it.Skip == 0 || r.res.Items[i].Reason != ReasonNone {
			continue
		}
		ps := &partialSource{}
		var recorded uint64
		if peer := r.peer[i]; peer != nil {
			ps.buf, ps.base, recorded = peer.m.buf, peer.v.Off, peer.v.Sum
			ps.where = fmt.Sprintf("the L1 of TP rank %d", peer.m.tp)
		} else if o := r.objs[i]; o != nil {
			e.mu.Lock()
			ps.base, recorded = e.cat.off(o), o.sum
			e.mu.Unlock()
			ps.buf, ps.where = e.l1buf, "L1"
		} else {
			continue
		}
		page := res.Geometry[it.Group].PageBytes
		n := res.BlocksPerChunk(it.Group)
		layers := len(r.sp.pools[it.Group])
		size := res.ObjectSize(it.Group)
		if uint64(layers)*uint64(n)*page != size {
			r.fail(i, fmt.Errorf("%s: %d pools x %d blocks x %d B is not the object's %d B: %w", it.Key, layers, n, page, size, ErrCorrupt))
			continue
		}
		src := ps.buf.Bytes()[ps.base : ps.base+size]
		ps.whole, ps.runs = partialSums(src, page, layers, n, it.Skip, func(f func()) bool { return e.goroutines.Go("retrieve-partial-sum", f) })
		if ps.whole != recorded {
			r.partialFailed(i, fmt.Errorf("%s in %s hashes to kvsum64 %016x, recorded %016x; nothing of its chunk written: %w",
				it.Key, ps.where, ps.whole, recorded, ErrCorrupt))
			continue
		}
		if r.partial == nil {
			r.partial = make(map[int]*partialSource)
		}
		r.partial[i] = ps
	}
}

// scatterPartial places items that skip blocks, each from its checked
// source, and verifies what each layer's scatter read back.
func (r *retrieval) scatterPartial(ctx context.Context, items []int) {
	for _, i := range items {
		r.scatterPartialItem(ctx, i)
	}
}

func (r *retrieval) scatterPartialItem(ctx context.Context, i int) {
	e := r.e
	it := r.req.Items[i]
	ps := r.partial[i]
	if ps == nil { // prepare scatters only items checkPartial passed
		r.fail(i, fmt.Errorf("%s: a partial item without a checked source: %w", it.Key, ErrCorrupt))
		return
	}
	res := r.sp.res
	page := res.Geometry[it.Group].PageBytes
	n := res.BlocksPerChunk(it.Group)
	layers := len(ps.runs)
	if e.hooks.partialChecked != nil {
		e.hooks.partialChecked(it.Key, ps.buf.Bytes()[ps.base:ps.base+res.ObjectSize(it.Group)])
	}
	per := n - it.Skip
	objs := make([]cuda.Object, layers)
	for li := range objs {
		objs[li] = cuda.Object{HostOff: ps.base + uint64(li*n+it.Skip)*page, Spans: r.spans[i][li*per : (li+1)*per]}
	}
	sums, ok := r.scatterFrom(ctx, ps.buf, slices.Repeat([]int{i}, layers), objs)
	if !ok {
		if r.peer[i] != nil {
			e.ctr.peerL1Failures.Add(1)
		}
		return
	}
	for li, s := range sums {
		if s != ps.runs[li] {
			r.partialFailed(i, fmt.Errorf("the scatter of layer %d of %s (blocks %d.. of %d) from %s read back kvsum64 %016x, the verified source %016x: %w",
				li, it.Key, it.Skip, n, ps.where, s, ps.runs[li], ErrCorrupt))
			return
		}
	}
	ir := &r.res.Items[i]
	ir.OK, ir.Sum = true, ps.whole
	placed := uint64(layers*per) * page
	if r.tl != nil {
		r.tl.Bytes += placed
	}
	e.ctr.objectsRestored.Add(1)
	if r.peer[i] != nil {
		e.ctr.peerL1Reads.Add(1)
		e.ctr.peerL1Bytes.Add(placed)
	} else {
		e.ctr.bytesRetrievedL1.Add(placed)
	}
}

// partialFailed fails item i on a checksum mismatch: this rank's L1 object
// is dropped (as verifyScatter drops one), a peer's counted.
func (r *retrieval) partialFailed(i int, err error) {
	e := r.e
	r.fail(i, err)
	if r.peer[i] != nil {
		e.ctr.peerL1Failures.Add(1)
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	o := r.objs[i]
	e.ctr.checksumL1.Add(1)
	e.log.Error("L1 object failed verification in a partial retrieve; dropped", zap.Stringer("key", o.key), zap.Error(err))
	e.dropLocked(o)
}
