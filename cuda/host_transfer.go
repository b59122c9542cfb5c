package cuda

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/kvtier/kvtier/checksum"
)

// transferPlan is a validated Gather or Scatter of the host backend: every
// range resolved to slices of mapped memory, every Mem referenced so that it
// stays mapped until the copy has run.
type transferPlan struct {
	objs []planObj
	mems []*hostMem // one reference each, dropped by unref
}

type planObj struct {
	host   []byte   // the packed object in the host buffer
	pieces [][]byte // its spans in device memory, in order
}

// segment is a byte range used for the overlap check: of a base allocation
// (scatter destinations, key = file name) or of the host buffer (gather
// destinations, key = "").
type segment struct {
	key        string
	start, end uint64
	obj, span  int
}

// planTransfer checks every span and host range of objs and references
// their memory. It fails, having changed nothing, if a span lies outside its
// Mem, a Mem or the buffer was released, a host range lies outside the
// buffer, or destinations overlap (scatter: spans of one base allocation,
// also through different views; gather: objects in the host buffer).
func planTransfer(hb HostBuf, objs []Object, scatter bool) (*transferPlan, error) {
	buf, err := hostBytes(hb)
	if err != nil {
		return nil, err
	}
	hostLen := uint64(len(buf))
	p := &transferPlan{objs: make([]planObj, len(objs))}
	var segs []segment
	type use struct{ obj, span int }
	firstUse := make(map[*hostMem]use)
	var order []*hostMem

	for i, o := range objs {
		var total uint64
		for j, sp := range o.Spans {
			hm, ok := sp.Mem.(*hostMem)
			if !ok || hm == nil {
				return nil, fmt.Errorf("%w: object %d span %d: Mem is a %T, not host backend memory", ErrBadHandle, i, j, sp.Mem)
			}
			if sp.Off > hm.size || sp.Len > hm.size-sp.Off {
				return nil, fmt.Errorf("%w: object %d span %d: [%d, +%d B) outside its Mem of %d B",
					ErrOutOfRange, i, j, sp.Off, sp.Len, hm.size)
			}
			if total+sp.Len < total {
				return nil, fmt.Errorf("%w: object %d: packed length overflows at span %d", ErrOutOfRange, i, j)
			}
			total += sp.Len
			if _, seen := firstUse[hm]; !seen {
				firstUse[hm] = use{i, j}
				order = append(order, hm)
			}
			if scatter && sp.Len > 0 {
				start := hm.off + sp.Off
				segs = append(segs, segment{hm.name, start, start + sp.Len, i, j})
			}
		}
		if o.HostOff > hostLen || total > hostLen-o.HostOff {
			return nil, fmt.Errorf("%w: object %d: host range [%d, +%d B) outside the host buffer of %d B",
				ErrOutOfRange, i, o.HostOff, total, hostLen)
		}
		if !scatter && total > 0 {
			segs = append(segs, segment{"", o.HostOff, o.HostOff + total, i, -1})
		}
	}
	if err := checkOverlap(segs); err != nil {
		return nil, err
	}

	for k, hm := range order {
		if err := hm.acquire(); err != nil {
			for _, got := range order[:k] {
				got.unref()
			}
			u := firstUse[hm]
			return nil, fmt.Errorf("object %d span %d: %w", u.obj, u.span, err)
		}
	}
	p.mems = order

	for i, o := range objs {
		po := &p.objs[i]
		po.pieces = make([][]byte, 0, len(o.Spans))
		var total uint64
		for _, sp := range o.Spans {
			hm := sp.Mem.(*hostMem)
			po.pieces = append(po.pieces, hm.data[sp.Off:sp.Off+sp.Len:sp.Off+sp.Len])
			total += sp.Len
		}
		po.host = buf[o.HostOff : o.HostOff+total : o.HostOff+total]
	}
	return p, nil
}

func checkOverlap(segs []segment) error {
	slices.SortFunc(segs, func(a, b segment) int {
		return cmp.Or(cmp.Compare(a.key, b.key), cmp.Compare(a.start, b.start))
	})
	var prev segment // of the segments so far with cur's key, the one ending last
	for k, cur := range segs {
		if k == 0 || prev.key != cur.key {
			prev = cur
			continue
		}
		if cur.start >= prev.end {
			if cur.end > prev.end {
				prev = cur
			}
			continue
		}
		if cur.key == "" {
			return fmt.Errorf("%w: objects %d and %d overlap in the host buffer: [%d, %d) and [%d, %d)",
				ErrOverlap, prev.obj, cur.obj, prev.start, prev.end, cur.start, cur.end)
		}
		return fmt.Errorf("%w: object %d span %d and object %d span %d both write [%d, %d) of allocation %s",
			ErrOverlap, prev.obj, prev.span, cur.obj, cur.span, cur.start, min(prev.end, cur.end), cur.key)
	}
	return nil
}

// run copies every object and stores its kvsum64 in sums. Gather hashes the
// bytes it packed into the host buffer, Scatter the packed bytes it read.
func (p *transferPlan) run(sums []uint64, scatter bool) {
	for i, o := range p.objs {
		var d checksum.Digest
		pos := 0
		for _, pc := range o.pieces {
			h := o.host[pos : pos+len(pc)]
			if scatter {
				copy(pc, h)
			} else {
				copy(h, pc)
			}
			d.Write(h)
			pos += len(pc)
		}
		sums[i] = d.Sum64()
	}
}

func (p *transferPlan) unref() {
	for _, hm := range p.mems {
		hm.unref()
	}
}
