package cuda

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"sort"
	"unsafe"
)

// Plans of the CUDA backend's Gather and Scatter: the tables that the copy
// kernels (kernels/kvcopy.cu) read. This file is pure Go, so the planning is
// tested without a GPU.
//
// A transfer is a list of segments. A segment is a piece of one object: a
// range of its packed bytes, starting at an object offset that is a multiple
// of 16, placed at a device address on the packed side. In direct mode each
// object is one segment whose packed side is the pinned host buffer itself
// (mapped into the device), and one kernel does everything. In staged mode
// the packed side is a device staging buffer of two halves; the objects are
// cut into batches that fit a half, a kernel packs (unpacks) a batch while
// the copy engine moves the other half to (from) the host buffer.

// Layout of kvcopy.cu's tables and launch shape.
const (
	kSegSize  = 48   // sizeof(struct Seg)
	kSpanSize = 24   // sizeof(struct Span)
	kThreads  = 256  // NT
	kTile     = 1024 // TILE: chunks of 16 bytes per block per step
	kFlagSum  = 1    // FLAG_SUM
	// kFlagNoStore makes kv_gather read and hash the device spans without
	// writing the packed side (FLAG_NOSTORE): the read-back pass of a
	// scatter.
	kFlagNoStore = 2
)

// kSeg is struct Seg.
type kSeg struct {
	packed, objOff, len, chunkBase uint64
	spanBase, nspans, sum          uint32
}

// kSpan is struct Span.
type kSpan struct {
	ptr, objOff, len uint64
}

// A kSpan has struct Span's size, and on a little-endian host its memory
// is the table entry the device reads (encode copies the spans as bytes).
var (
	_ [kSpanSize - unsafe.Sizeof(kSpan{})]struct{}
	_ [unsafe.Sizeof(kSpan{}) - kSpanSize]struct{}
)

// littleEndian: this host stores integers as the device reads them.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// xferObject is a validated object: its spans as device addresses, in order,
// with their offsets in the packed object.
type xferObject struct {
	hostOff uint64
	len     uint64
	spans   []kSpan
}

// stageRun is one copy-engine copy of a staged batch: len bytes between
// offset staging of the batch's half and offset host of the host buffer.
type stageRun struct {
	staging, host, len uint64
}

// xferBatch is one kernel launch.
type xferBatch struct {
	segs    []kSeg
	nchunks uint64
	half    int        // staged: which half of the staging buffer
	runs    []stageRun // staged: copies between the half and the host buffer
}

// xferPlan is a whole transfer.
type xferPlan struct {
	spans   []kSpan // all objects' spans; kSeg.spanBase indexes it
	first   []uint32
	batches []xferBatch
	staged  bool
	// units: the batches' segments are kv_sum_units' units (planUnits),
	// not kv_checksum's segments; nchunks counts units.
	units bool
	nobj  int
}

// chunksOf counts the 16-byte-aligned chunks that n bytes at addr touch.
func chunksOf(addr, n uint64) uint64 {
	if n == 0 {
		return 0
	}
	return (addr+n+15)/16 - addr/16
}

// deviceObjects turns a checked transfer into device-address objects: the
// checked spans are already the kernels' span table (their addresses are
// device addresses, the CUDA backend's space), so this is per object, and
// every object's spans are a piece of the one array (newPlan then uses it
// without a copy).
func deviceObjects[M comparable](t *checkedTransfer[M]) []xferObject {
	xobjs := make([]xferObject, len(t.objs))
	for i, o := range t.objs {
		xobjs[i] = xferObject{hostOff: o.hostOff, len: o.len, spans: t.objSpans(i)}
	}
	return xobjs
}

// sharedSpans returns the spans of every object as one slice when they lie
// back to back in one array (as deviceObjects makes them: each object's
// slice keeps the array's capacity behind it), else nil.
func sharedSpans(objs []xferObject) []kSpan {
	var first []kSpan
	n := 0
	for _, o := range objs {
		if len(o.spans) == 0 {
			continue
		}
		if first == nil {
			first, n = o.spans, len(o.spans)
			continue
		}
		if cap(first) <= n || &o.spans[0] != &first[:n+1][n] {
			return nil
		}
		n += len(o.spans)
	}
	if first == nil {
		return nil
	}
	return first[:n]
}

func newPlan(objs []xferObject) (*xferPlan, error) {
	p := &xferPlan{nobj: len(objs), first: make([]uint32, len(objs))}
	if shared := sharedSpans(objs); shared != nil {
		if uint64(len(shared)) >= 1<<32 {
			return nil, fmt.Errorf("%w: more than 2^32 spans in one transfer", ErrOutOfRange)
		}
		n := uint32(0)
		for i, o := range objs {
			p.first[i] = n
			n += uint32(len(o.spans))
		}
		p.spans = shared
		return p, nil
	}
	n := 0
	for _, o := range objs {
		n += len(o.spans)
	}
	p.spans = make([]kSpan, 0, n)
	for i, o := range objs {
		if uint64(len(p.spans))+uint64(len(o.spans)) >= 1<<32 {
			return nil, fmt.Errorf("%w: more than 2^32 spans in one transfer", ErrOutOfRange)
		}
		p.first[i] = uint32(len(p.spans))
		p.spans = append(p.spans, o.spans...)
	}
	return p, nil
}

// spanAt returns the index in p.spans of the span of object i that holds
// object offset off.
func (p *xferPlan) spanAt(objs []xferObject, i int, off uint64) uint32 {
	sp := objs[i].spans
	k := sort.Search(len(sp), func(k int) bool { return sp[k].objOff > off }) - 1
	return p.first[i] + uint32(k)
}

// planDirect makes one batch whose packed side is the host buffer, mapped
// at device address hostBase.
func planDirect(objs []xferObject, hostBase uint64) (*xferPlan, error) {
	p, err := newPlan(objs)
	if err != nil {
		return nil, err
	}
	var b xferBatch
	for i, o := range objs {
		if o.len == 0 {
			continue
		}
		s := kSeg{
			packed:    hostBase + o.hostOff,
			len:       o.len,
			chunkBase: b.nchunks,
			spanBase:  p.first[i],
			nspans:    uint32(len(o.spans)),
			sum:       uint32(i),
		}
		b.segs = append(b.segs, s)
		b.nchunks += chunksOf(s.packed, s.len)
	}
	if len(b.segs) > 0 {
		p.batches = []xferBatch{b}
	}
	return p, nil
}

// minPiece is the smallest piece an object is cut into at the end of a
// staging half; a smaller remainder starts the next batch instead.
const minPiece = 4096

// planStaged cuts the objects into batches of at most half bytes each, for
// the two halves of a staging buffer at device addresses stage[0] and
// stage[1] (both 256-byte aligned). A piece keeps its host address's
// alignment mod 16 in the staging buffer; pieces adjacent in the host buffer
// are adjacent in staging and share one copy.
func planStaged(objs []xferObject, stage [2]uint64, half uint64) (*xferPlan, error) {
	if half < 2*minPiece {
		return nil, fmt.Errorf("cuda: staging half of %d B is too small", half)
	}
	p, err := newPlan(objs)
	if err != nil {
		return nil, err
	}
	p.staged = true
	var b *xferBatch
	var cur uint64 // bytes of the current half in use
	hostEnd := ^uint64(0)
	newBatch := func() {
		p.batches = append(p.batches, xferBatch{half: len(p.batches) % 2})
		b = &p.batches[len(p.batches)-1]
		cur = 0
		hostEnd = ^uint64(0)
	}
	newBatch()
	for i, o := range objs {
		for pos := uint64(0); pos < o.len; {
			h := o.hostOff + pos
			n := o.len - pos
			st := cur
			cont := h == hostEnd
			if !cont {
				st = (cur+15)&^15 + h%16
			}
			if st >= half || (n > half-st && half-st < minPiece) {
				if len(b.segs) > 0 {
					newBatch()
				}
				st, cont = h%16, false
			}
			if n > half-st {
				n = (half - st) &^ 15 // the next piece starts 16-aligned in the object
			}
			s := kSeg{
				packed:    stage[b.half] + st,
				objOff:    pos,
				len:       n,
				chunkBase: b.nchunks,
				spanBase:  p.spanAt(objs, i, pos),
				sum:       uint32(i),
			}
			s.nspans = p.first[i] + uint32(len(o.spans)) - s.spanBase
			b.segs = append(b.segs, s)
			b.nchunks += chunksOf(s.packed, n)
			if cont && len(b.runs) > 0 {
				b.runs[len(b.runs)-1].len += n
			} else {
				b.runs = append(b.runs, stageRun{staging: st, host: h, len: n})
			}
			cur, hostEnd = st+n, h+n
			pos += n
		}
	}
	if len(p.batches[len(p.batches)-1].segs) == 0 {
		p.batches = p.batches[:len(p.batches)-1]
	}
	return p, nil
}

// tableEstimate is a table block size that mostly holds the tables of a
// transfer of nspans spans in nobj objects: the spans, a segment per
// object and per batch boundary, the partial sums.
func tableEstimate(nspans, nobj int) uint64 {
	return align16(uint64(nspans)*kSpanSize) + uint64(nobj+64)*kSegSize + 16 + uint64(nobj)*8
}

// jobCap is the size of the table block allocated for tables of size
// bytes: a power of two of at least 64 KiB, so that blocks are reused by
// transfers of similar sizes.
func jobCap(size uint64) uint64 {
	return max(uint64(64<<10), uint64(1)<<bits.Len64(size-1))
}

// spanTableOf is a table block as a span table (the spans come first in a
// block: tableLayout), for checkTransfer to write the checked spans into
// (checkOptions.table). b must be 8-byte aligned; a kSpan holds no
// pointers.
func spanTableOf(b []byte) []kSpan {
	if len(b) < kSpanSize {
		return nil
	}
	return unsafe.Slice((*kSpan)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/kSpanSize)
}

// tableLayout gives the byte offsets of a plan's tables in one block:
// spans, then each batch's segments, then nobj 8-byte partial sums.
type tableLayout struct {
	segs     []uint64 // offset of each batch's segments
	partials uint64
	size     uint64
}

// Every table starts 16-byte aligned, as the kernels may read a segment
// with vector loads.
func (p *xferPlan) layout() tableLayout {
	var l tableLayout
	off := align16(uint64(len(p.spans)) * kSpanSize)
	for _, b := range p.batches {
		l.segs = append(l.segs, off)
		off += uint64(len(b.segs)) * kSegSize
	}
	l.partials = align16(off)
	l.size = l.partials + uint64(p.nobj)*8
	return l
}

func align16(n uint64) uint64 { return (n + 15) &^ 15 }

// encode writes the spans and segments into buf (at least l.partials
// bytes), little-endian as the device reads them. The spans may already be
// in place at buf's start (checkOptions.table).
func (p *xferPlan) encode(buf []byte, l tableLayout) {
	le := binary.LittleEndian
	spanBytes := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(p.spans))), len(p.spans)*kSpanSize)
	switch {
	case len(p.spans) == 0:
	case littleEndian && &spanBytes[0] == &buf[0]:
		// checkTransfer wrote the spans into buf (checkOptions.table).
	case littleEndian:
		copy(buf, spanBytes)
	default:
		for k, s := range p.spans {
			b := buf[k*kSpanSize:]
			le.PutUint64(b[0:], s.ptr)
			le.PutUint64(b[8:], s.objOff)
			le.PutUint64(b[16:], s.len)
		}
	}
	for bi, bt := range p.batches {
		for k, s := range bt.segs {
			b := buf[l.segs[bi]+uint64(k)*kSegSize:]
			le.PutUint64(b[0:], s.packed)
			le.PutUint64(b[8:], s.objOff)
			le.PutUint64(b[16:], s.len)
			le.PutUint64(b[24:], s.chunkBase)
			le.PutUint32(b[32:], s.spanBase)
			le.PutUint32(b[36:], s.nspans)
			le.PutUint32(b[40:], s.sum)
			le.PutUint32(b[44:], 0)
		}
	}
}

// grid returns the number of blocks for a batch: one per tile, at most
// perSM blocks of every multiprocessor (the kernel strides over the rest).
func grid(nchunks uint64, sms, perSM int) uint32 {
	tiles := (nchunks + kTile - 1) / kTile
	limit := uint64(max(sms, 1)) * uint64(perSM)
	return uint32(max(min(tiles, limit), 1))
}

// unitGrid is grid for kv_sum_units: a warp per unit, at most perSM
// blocks of every multiprocessor (the warps stride over the rest).
func unitGrid(units uint64, sms, perSM int) uint32 {
	blocks := (units + kThreads/32 - 1) / (kThreads / 32)
	limit := uint64(max(sms, 1)) * uint64(perSM)
	return uint32(max(min(blocks, limit), 1))
}

// moveGrid is kv_move's grid for n bytes: a 16-byte piece a thread, at
// most 32 blocks (the tables of a 1 GiB batch are a few hundred KiB; the
// reads of mapped host memory are latency-bound, so more threads in flight
// help until PCIe's round trips do not).
func moveGrid(n uint64) uint32 {
	return uint32(min(max((n+16*kThreads-1)/(16*kThreads), 1), 32))
}

// Blocks per multiprocessor: the copy kernels fill every multiprocessor
// (8 blocks of 256 threads, what PCIe needs in flight). kv_checksum only
// reads HBM: where it runs under copy-engine copies that take 20-200 times
// as long (a gather's, every scatter batch but the last) it takes one block
// per multiprocessor, an eighth of its threads, leaving room on every
// multiprocessor for the model's kernels; the last batch of a scatter,
// which nothing hides, takes them all.
const (
	copyBlocksPerSM = 8
	sumBlocksPerSM  = 1
)

// kUnitBytes is the most bytes of one kv_sum_units unit: a warp's work,
// 128 16-byte loads a lane. Long spans (page runs) are cut into units of
// this size, so that a transfer of a few long runs still spreads over
// every multiprocessor; a multiple of 16 keeps each unit's alignment.
const kUnitBytes = 64 << 10

// planUnits makes the batches of kv_sum_units for a DMA transfer, as
// planSums does for kv_checksum (whole objects, batches of at least batch
// bytes, ends alike), or reports ok false when a span does not suit it:
// every span must start at an 8-aligned device address and object offset,
// so that each 8-byte word of the object is read whole from one span (an
// object's spans follow each other, so every span but the last then ends
// on a word too). The span table is kept (the block holds it at its
// start), unread by the kernel.
func planUnits(objs []xferObject, batch uint64) (p *xferPlan, ends []int, ok bool, err error) {
	units := 0
	for _, o := range objs {
		for _, sp := range o.spans {
			if sp.ptr%8 != 0 || sp.objOff%8 != 0 {
				return nil, nil, false, nil
			}
			units += int((sp.len + kUnitBytes - 1) / kUnitBytes)
		}
	}
	if p, err = newPlan(objs); err != nil {
		return nil, nil, false, err
	}
	p.units = true
	// Every batch's units in one array, each batch a piece of it: a
	// transfer of 300 MiB of 512 KiB objects is 4,800 units, and growing
	// a slice per batch cost more than the units themselves.
	all := make([]kSeg, 0, units)
	from := 0
	var bytes uint64
	for i, o := range objs {
		for _, sp := range o.spans {
			for off := uint64(0); off < sp.len; off += kUnitBytes {
				all = append(all, kSeg{
					packed: sp.ptr + off,
					objOff: sp.objOff + off,
					len:    min(kUnitBytes, sp.len-off),
					sum:    uint32(i),
				})
			}
		}
		bytes += o.len
		if bytes >= batch || i == len(objs)-1 {
			if n := len(all) - from; n > 0 {
				if uint64(n) >= 1<<32 {
					return nil, nil, false, fmt.Errorf("%w: more than 2^32 checksum units in one batch", ErrOutOfRange)
				}
				p.batches = append(p.batches, xferBatch{segs: all[from:len(all):len(all)], nchunks: uint64(n)})
				ends = append(ends, i+1)
			}
			from, bytes = len(all), 0
		}
	}
	return p, ends, true, nil
}

// planSums makes the batches of the checksum kernel of a DMA transfer
// (kv_checksum): whole objects, batches of at least batch bytes (the last
// may be less), so that a scatter's checksum of one batch runs while the
// copy engine places the next. The packed side is virtual: segment s
// starts at address 16*chunkBase of its batch, never dereferenced (the
// kernel reads only the spans), so every chunk holds two whole words of
// its object. ends[b] is one past the last object of batch b.
func planSums(objs []xferObject, batch uint64) (p *xferPlan, ends []int, err error) {
	if p, err = newPlan(objs); err != nil {
		return nil, nil, err
	}
	var b xferBatch
	var bytes uint64
	for i, o := range objs {
		if o.len > 0 {
			s := kSeg{
				packed:    16 * b.nchunks,
				len:       o.len,
				chunkBase: b.nchunks,
				spanBase:  p.first[i],
				nspans:    uint32(len(o.spans)),
				sum:       uint32(i),
			}
			b.segs = append(b.segs, s)
			b.nchunks += chunksOf(s.packed, s.len)
			bytes += o.len
		}
		if bytes >= batch || i == len(objs)-1 {
			if len(b.segs) > 0 {
				p.batches = append(p.batches, b)
				ends = append(ends, i+1)
			}
			b, bytes = xferBatch{}, 0
		}
	}
	return p, ends, nil
}
