package cuda

import "github.com/kvtier/kvtier/checksum"

// transferPlan is a validated Gather or Scatter of the host backend: every
// range resolved to slices of mapped memory, every Mem referenced so that it
// stays mapped until the copy has run.
type transferPlan struct {
	objs []planObj
	mems []*hostMem // one reference each, dropped by unref
	// The DMA path (dma_plan.go), when copies is not nil: the copies, the
	// host buffer and the view base of each Mem (a copy's device address
	// less its Mem's base is its offset in the Mem's mapping).
	copies []dmaCopy
	buf    []byte
	bases  []uint64
}

type planObj struct {
	host   []byte   // the packed object in the host buffer
	pieces [][]byte // its spans in device memory, in order
}

// hostBatched: the host backend models a driver with cuMemcpyBatchAsync
// (the H200's, CUDA 13), so auto takes the DMA path where the GPU does and
// the tests run it.
const hostBatched = true

// planTransfer checks objs (checkTransfer) and references their memory. It
// fails, having changed nothing, if the buffer was released, a rule of
// checkTransfer is broken or a Mem was released. It picks the copy path as
// the CUDA backend does (useDMA), for a device whose path is path.
func planTransfer(hb HostBuf, objs []Object, scatter bool, path copyPath) (*transferPlan, error) {
	buf, err := hostBytes(hb)
	if err != nil {
		return nil, err
	}
	t, err := checkTransfer(objs, uint64(len(buf)), scatter, checkOptions{memOf: true}, resolveHostMem)
	if err != nil {
		return nil, err
	}
	if err := t.acquire((*hostMem).acquire, (*hostMem).unref); err != nil {
		return nil, err
	}
	p := &transferPlan{objs: make([]planObj, len(objs)), mems: make([]*hostMem, len(t.mems))}
	for k, u := range t.mems {
		p.mems[k] = u.mem
	}
	if copies, ok := useDMA(t, path, hostBatched); ok {
		p.copies, p.buf, p.bases = copies, buf, make([]uint64, len(t.mems))
		for k, u := range t.mems {
			p.bases[k] = u.view.base
		}
	}
	for i, o := range t.objs {
		po := &p.objs[i]
		po.pieces = make([][]byte, o.n)
		for j, sp := range t.objSpans(i) {
			u := t.mems[t.memOf[o.first+j]]
			off := sp.ptr - u.view.base // the span's address is in the file
			end := off + sp.len
			po.pieces[j] = u.mem.data[off:end:end]
		}
		end := o.hostOff + o.len
		po.host = buf[o.hostOff:end:end]
	}
	return p, nil
}

// resolveHostMem tells checkTransfer about a span's Mem. A host backend
// allocation is a file: views of one alias where their ranges of the file
// intersect.
func resolveHostMem(m Mem) (*hostMem, memView, error) {
	hm, err := asHostMem(m, "span")
	if err != nil {
		return nil, memView{}, err
	}
	return hm, memView{size: hm.size, space: hm.name, base: hm.off}, nil
}

// path is the copy path the plan takes.
func (p *transferPlan) path() copyPath {
	if p.copies != nil {
		return pathDMA
	}
	return pathSM
}

// run copies every object and stores its kvsum64 in sums. On the SM path,
// as the copy kernels do, Gather hashes the bytes it packed into the host
// buffer; Scatter hashes the bytes it placed, read back from each
// destination span after copying into it, in span order.
func (p *transferPlan) run(sums []uint64, scatter bool) {
	if p.copies != nil {
		p.runDMA(sums, scatter)
		return
	}
	for i, o := range p.objs {
		var d checksum.Digest
		pos := 0
		for _, pc := range o.pieces {
			h := o.host[pos : pos+len(pc)]
			if scatter {
				copy(pc, h)
				d.Write(pc)
			} else {
				copy(h, pc)
				d.Write(h)
			}
			pos += len(pc)
		}
		sums[i] = d.Sum64()
	}
}

// runDMA is the DMA path: every copy row by row, as the copy engine moves
// it, and then the checksum pass over the spans in device memory (a
// gather's source, a scatter's destination once every copy has landed), as
// kv_checksum reads them.
func (p *transferPlan) runDMA(sums []uint64, scatter bool) {
	for _, c := range p.copies {
		data := p.mems[c.mem].data
		off := c.dev - p.bases[c.mem]
		for r := range c.rows {
			dev := data[off+r*c.pitch:][:c.width]
			host := p.buf[c.host+r*c.width:][:c.width]
			if scatter {
				copy(dev, host)
			} else {
				copy(host, dev)
			}
		}
	}
	for i, o := range p.objs {
		var d checksum.Digest
		for _, pc := range o.pieces {
			d.Write(pc)
		}
		sums[i] = d.Sum64()
	}
}

func (p *transferPlan) unref() {
	for _, hm := range p.mems {
		hm.unref()
	}
}
