package cuda

import (
	"cmp"
	"fmt"
	"math"
	"slices"
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

// checkedSpan is a span that passed the checks.
type checkedSpan[M any] struct {
	mem    M
	off    uint64 // start in mem
	len    uint64
	objOff uint64 // start in the packed object
}

// checkedObject is an object that passed the checks.
type checkedObject[M any] struct {
	hostOff uint64
	len     uint64 // packed length
	spans   []checkedSpan[M]
}

// memUse is a Mem of a transfer and the span that uses it first.
type memUse[M any] struct {
	mem       M
	obj, span int
}

// checkedTransfer is a Gather or Scatter that passed the checks, with its
// Mems resolved to the backend's type M.
type checkedTransfer[M comparable] struct {
	objs []checkedObject[M]
	mems []memUse[M] // every Mem once, in order of first use
}

// checkTransfer checks objs against a host buffer of hostLen bytes. It
// fails if resolve fails for a span's Mem (a Mem of another backend or
// device), a span lies outside its Mem, an object's packed length overflows
// or its host range lies outside the buffer, or destinations overlap
// (scatter: spans in one address space, also through different views;
// gather: objects in the host buffer). It takes no references.
func checkTransfer[M comparable](objs []Object, hostLen uint64, scatter bool, resolve func(Mem) (M, memView, error)) (*checkedTransfer[M], error) {
	n := 0
	for _, o := range objs {
		n += len(o.Spans)
	}
	all := make([]checkedSpan[M], 0, n) // one allocation for every object's spans
	t := &checkedTransfer[M]{objs: make([]checkedObject[M], len(objs))}
	seen := make(map[M]struct{})
	var dsts []destRange
	// Consecutive spans mostly name the same Mem: it is resolved once per
	// run of spans (a Mem that resolve accepted is of the backend's
	// comparable type, so comparing it with the next span's is safe).
	var (
		lastMem Mem
		lastM   M
		lastV   memView
	)
	for i, o := range objs {
		first := len(all)
		var total uint64
		for j, sp := range o.Spans {
			m, v := lastM, lastV
			if lastMem == nil || sp.Mem != lastMem {
				var err error
				if m, v, err = resolve(sp.Mem); err != nil {
					return nil, fmt.Errorf("object %d span %d: %w", i, j, err)
				}
				if _, ok := seen[m]; !ok {
					seen[m] = struct{}{}
					t.mems = append(t.mems, memUse[M]{m, i, j})
				}
				lastMem, lastM, lastV = sp.Mem, m, v
			}
			if sp.Off > v.size || sp.Len > v.size-sp.Off {
				return nil, fmt.Errorf("%w: object %d span %d: [%d, +%d B) outside its Mem of %d B",
					ErrOutOfRange, i, j, sp.Off, sp.Len, v.size)
			}
			if total+sp.Len < total {
				return nil, fmt.Errorf("%w: object %d: packed length overflows at span %d", ErrOutOfRange, i, j)
			}
			if scatter && sp.Len > 0 {
				start := v.base + sp.Off
				// A span that continues the previous destination (rows of
				// one page) extends it: far fewer ranges to sort, and the
				// same answer, since adjacent ranges share no byte. An
				// overlap found is named span by span (exactDests).
				if k := len(dsts) - 1; k >= 0 && dsts[k].end == start && dsts[k].space == v.space {
					dsts[k].end = start + sp.Len
				} else {
					dsts = append(dsts, destRange{v.space, start, start + sp.Len, i, j})
				}
			}
			all = append(all, checkedSpan[M]{mem: m, off: sp.Off, len: sp.Len, objOff: total})
			total += sp.Len
		}
		if o.HostOff > hostLen || total > hostLen-o.HostOff {
			return nil, fmt.Errorf("%w: object %d: host range [%d, +%d B) outside the host buffer of %d B",
				ErrOutOfRange, i, o.HostOff, total, hostLen)
		}
		if !scatter && total > 0 {
			dsts = append(dsts, destRange{"", o.HostOff, o.HostOff + total, i, -1})
		}
		t.objs[i] = checkedObject[M]{hostOff: o.HostOff, len: total, spans: all[first:len(all):len(all)]}
	}
	if err := checkOverlap(dsts, scatter); err != nil {
		if scatter {
			return nil, checkOverlap(exactDests(objs, resolve), true)
		}
		return nil, err
	}
	return t, nil
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

// destRange is a destination of a transfer for the overlap check: the range
// a scatter span writes in its address space, or the host range of a
// gathered object (span -1).
type destRange struct {
	space      string
	start, end uint64
	obj, span  int
}

// checkOverlap rejects destinations that share a byte: ranges of one
// address space for a scatter, host ranges for a gather. ds is not
// modified.
func checkOverlap(ds []destRange, scatter bool) error {
	if len(ds) > math.MaxInt32 {
		return fmt.Errorf("%w: %d destination ranges in one transfer", ErrOutOfRange, len(ds))
	}
	keys := sortDests(ds)
	var prev destKey // of the ranges so far in cur's space, the one ending last
	for k, key := range keys {
		if k == 0 || prev.space != key.space {
			prev = key
			continue
		}
		if key.start >= prev.end {
			if key.end > prev.end {
				prev = key
			}
			continue
		}
		was, cur := ds[prev.i], ds[key.i]
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
	return nil
}

// destKey is a destRange as sorted and scanned: its address space numbered,
// its index in the ranges, its start and end.
type destKey struct {
	space      uint32
	i          int32
	start, end uint64
}

// sortDests returns the order of ds in which the ranges of one address
// space are adjacent, each space's by start (the spaces themselves in no
// particular order, which is all checkOverlap needs), as keys whose space
// numbers say where a space's ranges begin. len(ds) <= math.MaxInt32. Spaces are few (one
// per allocation), so each range's space is numbered once and the sort
// compares integers only: comparing the space strings inside the sort was
// most of a restore's host time on the H200 (a 1.3 GB restore of 8 KiB
// pages spent ~30 ms sorting), so large sets are radix sorted.
func sortDests(ds []destRange) []destKey {
	ids := map[string]uint32{}
	keys := make([]destKey, len(ds))
	last, lastID := "", uint32(0)
	for i := range ds {
		sp := ds[i].space
		if i == 0 || sp != last {
			id, ok := ids[sp]
			if !ok {
				id = uint32(len(ids))
				ids[sp] = id
			}
			last, lastID = sp, id
		}
		keys[i] = destKey{space: lastID, i: int32(i), start: ds[i].start, end: ds[i].end}
	}
	if len(keys) < radixMin {
		slices.SortFunc(keys, func(a, b destKey) int {
			return cmp.Or(cmp.Compare(a.space, b.space), cmp.Compare(a.start, b.start))
		})
	} else {
		keys = radixSortKeys(keys, len(ids))
	}
	return keys
}

// radixMin is the number of ranges from which sortDests radix sorts.
const radixMin = 1024

// radixSortKeys sorts keys by (space, start) with a least-significant-digit
// radix sort: 16-bit digits of start (a digit every key shares, such as the
// high bits of one allocation's addresses, costs one counting pass and no
// move), then the space number. Stable, O(len(keys)) per digit. It returns
// the sorted keys, in keys' array or in one of its own.
func radixSortKeys(keys []destKey, spaces int) []destKey {
	tmp := make([]destKey, len(keys))
	var count [1 << 16]int
	for shift := uint(0); shift < 64; shift += 16 {
		clear(count[:])
		for _, k := range keys {
			count[(k.start>>shift)&0xffff]++
		}
		if count[(keys[0].start>>shift)&0xffff] == len(keys) {
			continue // every key has this digit
		}
		sum := 0
		for d, c := range count {
			count[d] = sum
			sum += c
		}
		for _, k := range keys {
			d := (k.start >> shift) & 0xffff
			tmp[count[d]] = k
			count[d]++
		}
		keys, tmp = tmp, keys
	}
	if spaces < 2 {
		return keys
	}
	at := make([]int, spaces+1)
	for _, k := range keys {
		at[k.space+1]++
	}
	for i := 1; i <= spaces; i++ {
		at[i] += at[i-1]
	}
	for _, k := range keys {
		tmp[at[k.space]] = k
		at[k.space]++
	}
	return tmp
}
