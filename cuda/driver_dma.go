//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import "unsafe"

// dmaSumBatch is the size of the checksum batches of a DMA transfer: a
// scatter's checksum of one batch runs while the copy engine places the
// next, so only the last batch's checksum (about 15 us of HBM reads at
// this size) follows the copies.
const dmaSumBatch = 64 << 20

// dma moves a transfer's bytes with copy-engine copies on the stream S
// (cuMemcpyBatchAsync, up to dmaBatchCopies a call, where the driver has
// it: one driver call per copy cost the host about 10 us each, 189 ms of
// a 207 ms restore of 64 KiB pages on the H200; else a call per copy) and
// verifies them with kv_checksum on the kernel stream A (dma_plan.go).
// Gather: the checksum reads the source pages, which the copies only read
// too, so it runs beside them from the start. Scatter: the checksum of a
// batch reads its destination pages once every copy into them is done,
// while the engine places the next batches. Checksums hidden under copies
// take one block per multiprocessor, the exposed last batch of a scatter
// all it can use (sumBlocksPerSM). A starts after the work already on S;
// S ends by waiting for A, so later work on S is ordered after the whole
// transfer, checksums included.
func (e *enqueuer) dma(plan *xferPlan, ends []int, copies []dmaCopy, buf *driverHostBuf, scatter bool, flags uint32) {
	S, A := e.s.h, e.s.aux
	sum := flags&kFlagSum != 0
	if sum {
		e.wait(A, e.event(S))
		e.tables(A)
		if !scatter {
			for bi := range plan.batches {
				e.launchPer(A, e.s.d.sum, plan, bi, flags, sumBlocksPerSM)
			}
		}
	}
	var after []int
	if scatter && sum {
		after = sumsAfter(copies, ends)
	}
	var bq *batchQueue
	if e.s.d.batch {
		bq = &batchQueue{}
	}
	bi := 0
	for ci, c := range copies {
		if bq != nil {
			bq.add(c, buf, scatter)
			if len(bq.sizes) >= dmaBatchCopies {
				e.flush(bq)
			}
		} else {
			e.copyRun(c, buf, scatter)
		}
		if after != nil && after[ci] > bi {
			if bq != nil {
				e.flush(bq) // the checksum waits for these copies
			}
			e.wait(A, e.event(S))
			for ; bi < after[ci]; bi++ {
				perSM := sumBlocksPerSM
				if bi == len(plan.batches)-1 {
					perSM = copyBlocksPerSM // exposed: nothing is copied after it
				}
				e.launchPer(A, e.s.d.sum, plan, bi, flags, perSM)
			}
		}
	}
	if bq != nil {
		e.flush(bq)
	}
	if sum {
		e.sums(A)
		e.wait(S, e.event(A))
	}
}

// dmaBatchCopies is the most copies one cuMemcpyBatchAsync call takes: the
// copy engine starts on a batch while the next is built.
const dmaBatchCopies = 1024

// batchQueue collects copies for one cuMemcpyBatchAsync call: destination
// and source addresses (host ones as unified addresses) and sizes. A 2D
// copy goes as one copy per row.
type batchQueue struct {
	dsts, srcs []C.CUdeviceptr
	sizes      []C.size_t
}

func (q *batchQueue) add(c dmaCopy, buf *driverHostBuf, toDevice bool) {
	h := uint64(uintptr(buf.host)) + c.host
	for r := range c.rows {
		dev, host := c.dev+r*c.pitch, h+r*c.width
		if toDevice {
			q.dsts, q.srcs = append(q.dsts, C.CUdeviceptr(dev)), append(q.srcs, C.CUdeviceptr(host))
		} else {
			q.dsts, q.srcs = append(q.dsts, C.CUdeviceptr(host)), append(q.srcs, C.CUdeviceptr(dev))
		}
		q.sizes = append(q.sizes, C.size_t(c.width))
	}
}

// flush enqueues the queued copies on the stream S in one call.
func (e *enqueuer) flush(q *batchQueue) {
	if len(q.sizes) == 0 || e.err != nil {
		return
	}
	e.do("cuMemcpyBatchAsync", C.kv_memcpy_batch_async(e.s.d.ctx, &q.dsts[0], &q.srcs[0], &q.sizes[0],
		C.size_t(len(q.sizes)), e.s.h))
	q.dsts, q.srcs, q.sizes = q.dsts[:0], q.srcs[:0], q.sizes[:0]
}

// copyRun enqueues one copy on the stream S: a contiguous range with
// cuMemcpy{HtoD,DtoH}Async, rows of one width at a device pitch with
// cuMemcpy2DAsync.
func (e *enqueuer) copyRun(c dmaCopy, buf *driverHostBuf, toDevice bool) {
	if e.err != nil {
		return
	}
	ctx, S := e.s.d.ctx, e.s.h
	h := unsafe.Add(buf.host, c.host)
	switch {
	case c.rows > 1:
		dir := C.int(0)
		if toDevice {
			dir = 1
		}
		e.do("cuMemcpy2DAsync_v2", C.kv_memcpy2d_async(ctx, C.CUdeviceptr(c.dev), C.size_t(c.pitch), h,
			C.size_t(c.width), C.size_t(c.rows), dir, S))
	case toDevice:
		e.do("cuMemcpyHtoDAsync_v2", C.kv_memcpy_htod_async(ctx, C.CUdeviceptr(c.dev), h, C.size_t(c.width), S))
	default:
		e.do("cuMemcpyDtoHAsync_v2", C.kv_memcpy_dtoh_async(ctx, h, C.CUdeviceptr(c.dev), C.size_t(c.width), S))
	}
}
