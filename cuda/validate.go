package cuda

import (
	"cmp"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sync"
	"unsafe"
)

// The rules of a Gather or Scatter, the same for every backend: which
// transfers are accepted does not depend on how the bytes are moved. A
// backend resolves each Mem (its memView) and takes the references;
// checkTransfer applies the rules. Pure Go, no cgo: it builds and is tested
// without a GPU.

// memView is what a backend tells checkTransfer about one Mem.
type memView struct {
	size uint64 // bytes of the Mem
	// space names the address space that base is an address in. Scatter
	// destinations are compared within a space, so views of one allocation
	// that alias are caught: the host backend's space is the allocation's
	// file name, the CUDA backend's "" (unified device addresses).
	space string
	base  uint64 // the address of the Mem's first byte in space
}

// checkedObject is an object that passed the checks: its packed length and
// its non-empty spans, spans[first:first+n] of the checked transfer.
type checkedObject struct {
	hostOff uint64
	len     uint64 // packed length
	first   int
	n       int
}

// memUse is a Mem of a transfer, what resolve said of it, and the span
// that uses it first.
type memUse[M any] struct {
	mem       M
	view      memView
	obj, span int
}

// checkedTransfer is a Gather or Scatter that passed the checks, with its
// Mems resolved to the backend's type M.
//
// The spans are the kernels' span table (struct Span, kSpan): each
// non-empty span as the address of its first byte in its Mem's space
// (view.base + Off; for the CUDA backend, whose space is unified device
// addresses, the device address), its offset in the packed object and its
// length, all objects' spans in order in one array. The array holds no
// pointers: at millions of spans a table the garbage collector scans
// costs more than the checks (issue 12.7).
type checkedTransfer[M comparable] struct {
	objs  []checkedObject
	spans []kSpan
	// memOf is the index in mems of each span's Mem; only when asked for
	// (the host backend: the CUDA backend needs addresses only).
	memOf []uint32
	mems  []memUse[M] // every Mem once, in order of first use
}

// checkOptions says what checkTransfer builds besides its verdict.
type checkOptions struct {
	// memOf: say each span's Mem (checkedTransfer.memOf).
	memOf bool
	// table, when its capacity holds every span of the transfer, is where
	// the span table is written, from its first entry; otherwise one is
	// allocated. The CUDA backend passes the pinned block it copies the
	// tables to the device from: the checked spans are written once,
	// where the device reads them, into memory already paged in.
	table []kSpan
}

// objSpans returns the spans of object i. The capacity behind the slice is
// the next objects' spans (newPlan's sharedSpans finds them); nothing
// appends to it.
func (t *checkedTransfer[M]) objSpans(i int) []kSpan {
	o := t.objs[i]
	return t.spans[o.first : o.first+o.n]
}

// checkTransfer checks objs against a host buffer of hostLen bytes. It
// fails if resolve fails for a span's Mem (a Mem of another backend or
// device), a span lies outside its Mem, an object's packed length overflows
// or its host range lies outside the buffer, or destinations overlap
// (scatter: spans in one address space, also through different views;
// gather: objects in the host buffer). Empty spans are checked and left
// out of the result. It takes no references.
//
// One pass over the spans does the checks and builds the span table; the
// overlap check needs no sort when each region's destinations come in
// increasing address order (overlapIn).
func checkTransfer[M comparable](objs []Object, hostLen uint64, scatter bool, opt checkOptions, resolve func(Mem) (M, memView, error)) (*checkedTransfer[M], error) {
	n := 0
	for _, o := range objs {
		n += len(o.Spans)
	}
	t := &checkedTransfer[M]{objs: make([]checkedObject, len(objs)), spans: opt.table[:0]}
	if cap(t.spans) < n {
		t.spans = make([]kSpan, 0, n)
	}
	memOf := opt.memOf
	if memOf {
		t.memOf = make([]uint32, 0, n)
	}
	seen := make(map[M]uint32)
	// dests: scatter: per Mem (index in t.mems), the ranges its spans
	// write; the lists are scratch, kept for the next transfer.
	var dests [][]destSpan
	if scatter {
		dl := destPool.Get().(*destLists)
		defer func() {
			for k := range dests {
				dests[k] = dests[k][:0]
			}
			dl.lists = dests[:0]
			destPool.Put(dl)
		}()
		dests = dl.lists[:0]
	}
	var host []destSpan // gather: the objects' host ranges
	// Consecutive spans mostly name the same Mem: it is resolved once per
	// run of spans, a span whose Mem is word for word the run's
	// (sameWords) continuing the run. The run's Mem, its size and base,
	// its index in t.mems.
	var (
		lastMem Mem
		size    uint64
		base    uint64
		mi      uint32
		cur     []destSpan // scatter: dests[mi] while the run lasts
	)
	spans := t.spans
	for i, o := range objs {
		first := len(spans)
		var total uint64
		for j := range o.Spans {
			sp := &o.Spans[j]
			if lastMem == nil || !sameWords(&sp.Mem, &lastMem) {
				if scatter && lastMem != nil {
					dests[mi] = cur
				}
				m, v, err := resolve(sp.Mem)
				if err != nil {
					return nil, fmt.Errorf("object %d span %d: %w", i, j, err)
				}
				k, ok := seen[m]
				if !ok {
					if len(t.mems) >= 1<<32-1 {
						return nil, fmt.Errorf("%w: more than 2^32 Mems in one transfer", ErrOutOfRange)
					}
					k = uint32(len(t.mems))
					seen[m] = k
					t.mems = append(t.mems, memUse[M]{m, v, i, j})
					if scatter {
						// A list kept from an earlier transfer, emptied, or a new one.
						if len(dests) < cap(dests) {
							dests = dests[:len(dests)+1]
						} else {
							dests = append(dests, nil)
						}
					}
				}
				lastMem, size, base, mi = sp.Mem, v.size, v.base, k
				if scatter {
					cur = dests[k]
				}
			}
			off, sl := sp.Off, sp.Len
			if off > size || sl > size-off {
				return nil, fmt.Errorf("%w: object %d span %d: [%d, +%d B) outside its Mem of %d B",
					ErrOutOfRange, i, j, off, sl, size)
			}
			if total+sl < total {
				return nil, fmt.Errorf("%w: object %d: packed length overflows at span %d", ErrOutOfRange, i, j)
			}
			if sl > 0 {
				start := base + off
				if scatter {
					// A span that continues its Mem's previous destination
					// (rows of one page) extends it: far fewer ranges to
					// check, and the same answer, since adjacent ranges
					// share no byte. An overlap found is named span by
					// span (exactDests).
					if k := len(cur) - 1; k >= 0 && cur[k].end == start {
						cur[k].end = start + sl
					} else {
						cur = append(cur, destSpan{start, start + sl})
					}
				}
				spans = append(spans, kSpan{ptr: start, objOff: total, len: sl})
				if memOf {
					t.memOf = append(t.memOf, mi)
				}
			}
			total += sl
		}
		if o.HostOff > hostLen || total > hostLen-o.HostOff {
			return nil, fmt.Errorf("%w: object %d: host range [%d, +%d B) outside the host buffer of %d B",
				ErrOutOfRange, i, o.HostOff, total, hostLen)
		}
		if !scatter && total > 0 {
			if k := len(host) - 1; k >= 0 && host[k].end == o.HostOff {
				host[k].end = o.HostOff + total
			} else {
				host = append(host, destSpan{o.HostOff, o.HostOff + total})
			}
		}
		t.objs[i] = checkedObject{hostOff: o.HostOff, len: total, first: first, n: len(spans) - first}
	}
	t.spans = spans
	if scatter && lastMem != nil {
		dests[mi] = cur
	}
	if scatter {
		if overlapInRegions(t.mems, dests) {
			return nil, nameOverlap(exactDests(objs, resolve), true)
		}
	} else if overlapIn(host) {
		return nil, nameOverlap(hostDests(t), false)
	}
	return t, nil
}

// destLists are the per-Mem destination lists of a scatter's check, kept
// in destPool between transfers with their capacity (a list that grew to
// millions of rows need not grow again), empty.
type destLists struct{ lists [][]destSpan }

var destPool = sync.Pool{New: func() any { return new(destLists) }}

// sameWords reports whether a and b hold the same dynamic type and the
// same data word, so that a == b; false says nothing (equal values boxed
// apart), and the caller then resolves the Mem again. Unlike ==, it costs
// no call into the runtime, once per span.
func sameWords(a, b *Mem) bool {
	x, y := (*[2]uintptr)(unsafe.Pointer(a)), (*[2]uintptr)(unsafe.Pointer(b))
	return x[0] == y[0] && x[1] == y[1]
}

// overlapInRegions reports whether two destinations of a scatter share a
// byte, given the ranges dests[k] that the spans of Mem mems[k] write.
// Ranges of Mems whose views are disjoint (distinct allocations, or views
// of one allocation that do not intersect) cannot share a byte, so the
// Mems are grouped into regions of intersecting views of one space, and
// each region is checked alone: one Mem's ranges in place, those of
// several Mems together.
func overlapInRegions[M any](mems []memUse[M], dests [][]destSpan) bool {
	type view struct {
		space      string
		start, end uint64 // end saturates at 2^64-1
		k          int
	}
	vs := make([]view, 0, len(mems))
	for k, u := range mems {
		if len(dests[k]) == 0 {
			continue
		}
		end := u.view.base + u.view.size
		if end < u.view.base {
			end = ^uint64(0)
		}
		vs = append(vs, view{u.view.space, u.view.base, end, k})
	}
	if len(vs) == 1 {
		return overlapIn(dests[vs[0].k])
	}
	slices.SortFunc(vs, func(a, b view) int {
		return cmp.Or(cmp.Compare(a.space, b.space), cmp.Compare(a.start, b.start))
	})
	for i := 0; i < len(vs); {
		j, end := i+1, vs[i].end
		for j < len(vs) && vs[j].space == vs[i].space && vs[j].start < end {
			end = max(end, vs[j].end)
			j++
		}
		if j == i+1 {
			if overlapIn(dests[vs[i].k]) {
				return true
			}
		} else {
			var all []destSpan
			for _, v := range vs[i:j] {
				all = append(all, dests[v.k]...)
			}
			if overlapIn(all) {
				return true
			}
		}
		i = j
	}
	return false
}

// exactDests lists every destination span of a scatter that passed the
// per-span checks, one range per span, for naming the spans that overlap.
func exactDests[M comparable](objs []Object, resolve func(Mem) (M, memView, error)) []destRange {
	var ds []destRange
	for i, o := range objs {
		for j, sp := range o.Spans {
			if _, v, err := resolve(sp.Mem); err == nil && sp.Len > 0 {
				start := v.base + sp.Off
				ds = append(ds, destRange{v.space, start, start + sp.Len, i, j})
			}
		}
	}
	return ds
}

// hostDests lists the host range of every non-empty object of a gather,
// for naming the objects that overlap.
func hostDests[M comparable](t *checkedTransfer[M]) []destRange {
	var ds []destRange
	for i, o := range t.objs {
		if o.len > 0 {
			ds = append(ds, destRange{"", o.hostOff, o.hostOff + o.len, i, -1})
		}
	}
	return ds
}

// acquire takes a reference on every Mem of t, in order of first use. If
// one fails (a released Mem), it drops the references it took and names the
// span that first used that Mem.
func (t *checkedTransfer[M]) acquire(acquire func(M) error, unref func(M)) error {
	for k, u := range t.mems {
		if err := acquire(u.mem); err != nil {
			for _, got := range t.mems[:k] {
				unref(got.mem)
			}
			return fmt.Errorf("object %d span %d: %w", u.obj, u.span, err)
		}
	}
	return nil
}

// destSpan is a non-empty range [start, end) of one address space that a
// transfer writes.
type destSpan struct{ start, end uint64 }

// overlapIn reports whether two of the non-empty ranges ds share a byte.
// It may overwrite ds. Ranges given in increasing address order are
// checked in one pass without a sort; otherwise they are sorted by start:
// a large set as packed keys in ds' own memory (overlapPacked), where
// they fit.
func overlapIn(ds []destSpan) bool {
	switch scanSorted(ds) {
	case disjoint:
		return false
	case overlapping:
		return true
	}
	if over, ok := overlapPages(ds); ok {
		return over
	}
	if len(ds) >= radixMin && len(ds) < math.MaxUint32 { // radixSortKeys counts in 32 bits
		if over, ok := overlapPacked(ds); ok {
			return over
		}
	}
	return scanSorted(sortSpans(ds)) == overlapping
}

// overlapPages is overlapIn for ranges of one length whose starts lie a
// whole number of lengths apart: pages of a pool, at block indices in the
// order the engine's block table gives them. Two such ranges overlap only
// when they start together, so one pass over a bitmap of the starts'
// indices decides, without a sort. On this project's VM it checks 2.5 ns a
// range against 14.7-15.5 sorted (BenchmarkCheckOverlap), and a 16-token
// restore batch of an 8-layer model, a pool a layer, was checked in 13 ns
// a span against 30 (BenchmarkPlanSmallChunks pools=8). ok is false, and
// nothing is decided, when the ranges are not so, or when the bitmap
// would take more than 8 bytes a range (starts far apart) or more than
// maxPageBits (millions of pages of a large pool in random order, which
// the radix sort checks faster, its passes staying in cache).
func overlapPages(ds []destSpan) (overlap, ok bool) {
	l := ds[0].end - ds[0].start
	if l == 0 || len(ds) > maxPageBits {
		return false, false
	}
	lo, hi := ds[0].start, ds[0].start
	for _, d := range ds {
		if d.end-d.start != l {
			return false, false
		}
		lo, hi = min(lo, d.start), max(hi, d.start)
	}
	if slots := (hi-lo)/l + 1; slots > 64*uint64(len(ds)) || slots > maxPageBits {
		return false, false
	}
	seen := make([]uint64, (hi-lo)/l/64+1)
	for _, d := range ds {
		off := d.start - lo
		if off%l != 0 {
			return false, false
		}
		i := off / l
		w, b := i/64, uint64(1)<<(i%64)
		if seen[w]&b != 0 {
			return true, true // two ranges of one length at one start
		}
		seen[w] |= b
	}
	return false, true
}

// overlapPacked is overlapIn for a large set by radix sort of packed keys:
// each range as one 64-bit key, its start's offset from the lowest start
// above its length, when the widest offset and the longest length fit in
// 64 bits together (ok false: they do not, and ds is unchanged). Sorted
// keys order the ranges by start. The keys take the first half of ds'
// memory (key i is written after range i is read, and lies at or below
// it), the sort's scratch the second: half the bytes a sort of the ranges
// moves, and nothing allocated.
func overlapPacked(ds []destSpan) (overlap, ok bool) {
	lo, hi, long := ds[0].start, ds[0].start, uint64(0)
	for _, d := range ds {
		lo, hi, long = min(lo, d.start), max(hi, d.start), max(long, d.end-d.start)
	}
	width, lb := uint(bits.Len64(hi-lo)), uint(bits.Len64(long))
	if width+lb > 64 {
		return false, false
	}
	n := len(ds)
	words := unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(ds))), 2*n)
	keys, tmp := words[:n:n], words[n:]
	for i := range n {
		d := ds[i]
		keys[i] = (d.start-lo)<<lb | (d.end - d.start)
	}
	keys = radixSortKeys(keys, tmp, lb, lb+width)
	mask := uint64(1)<<lb - 1
	var end uint64 // of the ranges so far, which are disjoint: the last one's
	for k, key := range keys {
		start := key >> lb
		if k > 0 && start < end {
			return true, true
		}
		end = start + key&mask
	}
	return false, true
}

// radixSortKeys sorts keys by their bits [from, to), least significant
// digit first, using tmp (as long as keys) as scratch, and returns the
// sorted keys (in keys' array or tmp's). One pass reads every digit's
// counts; a digit that every key shares costs no pass.
func radixSortKeys(keys, tmp []uint64, from, to uint) []uint64 {
	const maxDigits = (64 + radixBits - 1) / radixBits
	var count [maxDigits][1 << radixBits]uint32
	nd := int((to - from + radixBits - 1) / radixBits)
	for _, k := range keys {
		k >>= from
		for d := range nd {
			count[d][(k>>(uint(d)*radixBits))&(1<<radixBits-1)]++
		}
	}
	for d := range nd {
		c := &count[d]
		shift := from + uint(d)*radixBits
		if c[(keys[0]>>shift)&(1<<radixBits-1)] == uint32(len(keys)) {
			continue
		}
		sum := uint32(0)
		for i, v := range c {
			c[i] = sum
			sum += v
		}
		for _, k := range keys {
			b := (k >> shift) & (1<<radixBits - 1)
			tmp[c[b]] = k
			c[b]++
		}
		keys, tmp = tmp, keys
	}
	return keys
}

// The verdicts of scanSorted.
const (
	disjoint = iota
	overlapping
	unsorted
)

// scanSorted checks ds in its order: disjoint if every range starts at or
// after the end of the one before it (then no two share a byte),
// overlapping if a range starts inside the one before it (they share its
// first byte), else unsorted (a range starts before the one before it,
// and the order says nothing).
func scanSorted(ds []destSpan) int {
	for k := 1; k < len(ds); k++ {
		prev, cur := ds[k-1], ds[k]
		if cur.start >= prev.end {
			continue
		}
		if cur.start >= prev.start {
			return overlapping
		}
		return unsorted
	}
	return disjoint
}

// maxPageBits bounds overlapPages' bitmap: 256 KiB.
const maxPageBits = 1 << 21

// radixMin is the number of ranges from which overlapIn and sortSpans
// radix sort.
const radixMin = 1024

// radixBits is the width of a digit of the radix sorts: 256 buckets,
// whose write positions stay in the first-level cache while a pass moves
// the keys. On this project's 2-core VM, sorting 3.8 M packed keys of a
// 2.4 GB pool (BenchmarkOverlapInShuffled, thread CPU per range) took
// 23-30 ns with 8-bit digits (4 passes), 33-38 with 9 to 11 bits (3-4
// passes), 39-44 with 16 bits (2 passes) and 42-46 with 7.
const radixBits = 8

// sortSpans sorts ds by start and returns the sorted ranges, in ds' array
// or in one of its own. Large sets are radix sorted, least significant
// digit first, on the starts' offsets from the lowest start: only the
// digits in which the starts differ cost a pass.
func sortSpans(ds []destSpan) []destSpan {
	if len(ds) < radixMin {
		slices.SortFunc(ds, func(a, b destSpan) int { return cmp.Compare(a.start, b.start) })
		return ds
	}
	lo, hi := ds[0].start, ds[0].start
	for _, d := range ds {
		lo, hi = min(lo, d.start), max(hi, d.start)
	}
	width := uint(bits.Len64(hi - lo))
	tmp := make([]destSpan, len(ds))
	var count [1 << radixBits]int
	for shift := uint(0); shift < width; shift += radixBits {
		clear(count[:])
		for _, d := range ds {
			count[((d.start-lo)>>shift)&(1<<radixBits-1)]++
		}
		sum := 0
		for k, c := range count {
			count[k] = sum
			sum += c
		}
		for _, d := range ds {
			k := ((d.start - lo) >> shift) & (1<<radixBits - 1)
			tmp[count[k]] = d
			count[k]++
		}
		ds, tmp = tmp, ds
	}
	return ds
}

// destRange is a destination of a transfer as an overlap is named: the
// range a scatter span writes in its address space, or the host range of a
// gathered object (span -1).
type destRange struct {
	space      string
	start, end uint64
	obj, span  int
}

// nameOverlap returns the error for destinations of which two share a
// byte (overlapIn found them), naming two that do. ds is not modified.
func nameOverlap(ds []destRange, scatter bool) error {
	order := make([]int, 0, len(ds))
	for i, d := range ds {
		if d.end > d.start {
			order = append(order, i)
		}
	}
	slices.SortFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(ds[a].space, ds[b].space), cmp.Compare(ds[a].start, ds[b].start))
	})
	prev := -1 // of the ranges so far in the current space, the one ending last
	for _, k := range order {
		if prev < 0 || ds[prev].space != ds[k].space {
			prev = k
			continue
		}
		if ds[k].start >= ds[prev].end {
			if ds[k].end > ds[prev].end {
				prev = k
			}
			continue
		}
		was, cur := ds[prev], ds[k]
		if !scatter {
			return fmt.Errorf("%w: objects %d and %d overlap in the host buffer: [%d, %d) and [%d, %d)",
				ErrOverlap, was.obj, cur.obj, was.start, was.end, cur.start, cur.end)
		}
		end := min(was.end, cur.end)
		where := fmt.Sprintf("[%d, %d) of allocation %s", cur.start, end, cur.space)
		if cur.space == "" {
			where = fmt.Sprintf("[%#x, %#x) of unified device memory", cur.start, end)
		}
		return fmt.Errorf("%w: object %d span %d and object %d span %d both write %d B at %s",
			ErrOverlap, was.obj, was.span, cur.obj, cur.span, end-cur.start, where)
	}
	// Not reached: the check found an overlap that naming did not.
	return fmt.Errorf("%w: destinations of the transfer overlap", ErrOverlap)
}
