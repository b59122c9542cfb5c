package cuda

// The copy-engine (DMA) path of Gather and Scatter, as both backends plan
// it: pure Go, so the rule and the copies are tested without a GPU.
//
// A packed object is contiguous in the host buffer, so every span is already
// one contiguous range on both sides. Spans that follow each other in the
// transfer and continue each other on both sides (host and device, in the
// same Mem) make one copy; spans of one width whose device addresses step by
// a constant pitch while their host ranges follow each other make one 2D
// copy (cuMemcpy2DAsync: pages of one pool with padding between them, or
// every other block). The copy engine then moves the bytes while no
// multiprocessor is held, and a checksum kernel that reads device memory
// (the pages: the source of a gather, the destination of a scatter)
// computes the same per-object partial sums as the copy kernels do.
//
// The rule (useDMA): a transfer goes by DMA when its copies average at
// least dmaMinCopy bytes. Each copy costs the host an enqueue call and the
// copy engine a descriptor, about as long as moving 64-128 KiB at PCIe
// Gen5 speed, so shorter copies (random 32 KiB pages, rows of a few hundred
// bytes) keep the copy kernels, which move any layout at the engine's rate.

// pathAuto applies the rule only where the backend enqueues its copies in
// batches (the driver's cuMemcpyBatchAsync, CUDA 12.8+; the host backend,
// which models it): with a driver call per copy the DMA path measured
// 0.24-0.89 of the copy engine on the H200, so auto kept the copy kernels
// everywhere; with batches, 0.98-1.00 on pages in runs of 512 KiB and
// 1 MiB, and vLLM's decode steps slowed less while a restore copied
// (BENCHMARKS.md, "The copy engine path with batched copies"). Runs
// averaging less than dmaMinCopy (a fragmented cache's 32-64 KiB pages)
// keep the kernels: a batched copy costs ~1 us of the driver's host time
// and the engine moves small copies slowly (8-10 KB rows about 12 GB/s on
// the H200; 64 KiB pages 0.84-0.99 of CE, the kernels 0.99).

// copyPath is how a Gather or Scatter moves its bytes.
type copyPath int

const (
	pathAuto copyPath = iota // by useDMA
	pathSM                   // copy kernels (CUDA: on the mapped buffer or through staging), checksum in the same pass
	pathDMA                  // copy-engine copies of the page runs, then a checksum pass over the device spans
)

// Names of the paths as Op.Path reports them.
const (
	PathSM  = "sm"
	PathDMA = "dma"
)

func (p copyPath) name() string {
	if p == pathDMA {
		return PathDMA
	}
	return PathSM
}

// parseCopyPath reads "auto", "sm" or "dma".
func parseCopyPath(s string) (copyPath, bool) {
	switch s {
	case "auto":
		return pathAuto, true
	case PathSM:
		return pathSM, true
	case PathDMA:
		return pathDMA, true
	}
	return pathAuto, false
}

const (
	// dmaMinCopy is the average copy size from which useDMA picks the
	// copy engine.
	dmaMinCopy = 256 << 10
	// dmaMaxPitch bounds the device pitch of a 2D copy: the driver's
	// CU_DEVICE_ATTRIBUTE_MAX_PITCH is 2^31-1 on every current GPU.
	dmaMaxPitch = 1<<31 - 1
)

// dmaCopy is one copy-engine copy: rows rows of width bytes, row k at
// device address dev + k*pitch (rows == 1: one contiguous range) and at
// host offset host + k*width of the host buffer, all in Mem mem (an index
// of checkedTransfer.mems). obj is the object of its first byte.
type dmaCopy struct {
	dev, pitch, host, width, rows uint64
	mem                           uint32
	obj                           int
}

func (c dmaCopy) bytes() uint64 { return c.width * c.rows }

// planDMA returns the copies of t, which must have memOf, in span order;
// ok is false, and nothing is returned, when they would be more than
// limit.
func planDMA[M comparable](t *checkedTransfer[M], limit int) (copies []dmaCopy, ok bool) {
	var c dmaCopy
	open := false
	for i, o := range t.objs {
		for k := o.first; k < o.first+o.n; k++ {
			sp := t.spans[k]
			h := o.hostOff + sp.objOff
			m := t.memOf[k]
			if open && m == c.mem && h == c.host+c.bytes() {
				switch {
				case c.rows == 1 && sp.ptr == c.dev+c.width:
					c.width += sp.len
					c.pitch = c.width
					continue
				case c.rows == 1 && sp.len == c.width && sp.ptr > c.dev && sp.ptr-c.dev >= c.width && sp.ptr-c.dev <= dmaMaxPitch:
					c.pitch = sp.ptr - c.dev
					c.rows = 2
					continue
				case c.rows > 1 && sp.len == c.width && sp.ptr == c.dev+c.rows*c.pitch:
					c.rows++
					continue
				}
			}
			if open {
				if len(copies) == limit {
					return nil, false
				}
				copies = append(copies, c)
			}
			c = dmaCopy{dev: sp.ptr, pitch: sp.len, host: h, width: sp.len, rows: 1, mem: m, obj: i}
			open = true
		}
	}
	if open {
		if len(copies) == limit {
			return nil, false
		}
		copies = append(copies, c)
	}
	return copies, true
}

// totalBytes is the packed length of every object of t.
func (t *checkedTransfer[M]) totalBytes() uint64 {
	var n uint64
	for _, o := range t.objs {
		n += o.len
	}
	return n
}

// useDMA applies the rule to t for a device whose path is p and which
// enqueues copies in batches or not: forced paths are kept (a transfer of
// no bytes always takes the copy kernels, which have nothing to do); in
// pathAuto the copy engine is used when the device batches its copies and
// they average at least dmaMinCopy bytes. It returns the copies when the
// answer is DMA.
func useDMA[M comparable](t *checkedTransfer[M], p copyPath, batched bool) ([]dmaCopy, bool) {
	total := t.totalBytes()
	if p == pathSM || total == 0 {
		return nil, false
	}
	if p == pathAuto && !batched {
		return nil, false
	}
	limit := -1 // never reached
	if p == pathAuto {
		limit = int(min(total/dmaMinCopy, 1<<30))
		if limit == 0 {
			return nil, false
		}
	}
	return planDMA(t, limit)
}

// sumsAfter says when a scatter's checksum batches can run: after[ci] is
// the number of batches (ends[b] is one past the last object of batch b)
// whose every byte is placed once copies[:ci+1] have landed. An object
// gets no more bytes once a later copy starts in a later object, since
// copies come in object order; after the last copy every batch is placed.
func sumsAfter(copies []dmaCopy, ends []int) []int {
	after := make([]int, len(copies))
	b := 0
	for ci := range copies {
		if ci+1 == len(copies) {
			b = len(ends)
		} else {
			for b < len(ends) && ends[b] <= copies[ci+1].obj {
				b++
			}
		}
		after[ci] = b
	}
	return after
}
