//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import "unsafe"

// dma moves a transfer's bytes with copy-engine copies on the stream S
// (cuMemcpyBatchAsync, up to dmaBatchCopies a call, where the driver has
// it: one driver call per copy cost the host about 10 us each, 189 ms of
// a 207 ms restore of 64 KiB pages on the H200; else a call per copy) and
// verifies them with kv_checksum (kv_sum_units with DMATuning.UnitSums,
// where every span is word-aligned) on the kernel stream A (dma_plan.go).
// Gather: the checksum reads the source pages, which the copies only read
// too, so it runs beside them from the start. Scatter: the checksum of a
// batch reads its destination pages once every copy into them is done,
// while the engine places the next batches. Checksums hidden under copies
// take one block per multiprocessor (or DMATuning.SumBlocks in all), the
// exposed last batch of a scatter all it can use (sumBlocksPerSM). A
// starts after the work already on S; S ends by waiting for A, so later
// work on S is ordered after the whole transfer, checksums included.
func (e *enqueuer) dma(plan *xferPlan, ends []int, copies []dmaCopy, buf *driverHostBuf, scatter bool, flags uint32) {
	S, A := e.s.h, e.s.aux
	sum := flags&kFlagSum != 0
	fn := e.s.d.sum
	if plan.units {
		fn = e.s.d.sumUnits
	}
	if n := e.s.d.sumOnly; n > 0 {
		e.wait(A, e.event(S))
		e.tables(A)
		for bi := range plan.batches {
			e.launchPer(A, fn, plan, bi, flags, n, 0)
		}
		e.sums(A)
		e.wait(S, e.event(A))
		return
	}
	host, hidden := e.s.d.dmaTune.HostLaunch, e.s.d.dmaTune.SumBlocks
	if sum {
		if host {
			e.hostWait(e.event(S))
		} else {
			e.wait(A, e.event(S))
		}
		e.tables(A)
		if !scatter {
			for bi := range plan.batches {
				e.launchPer(A, fn, plan, bi, flags, sumBlocksPerSM, hidden)
			}
		}
	}
	var after []int
	if scatter && sum {
		after = sumsAfter(copies, ends)
	}
	var bq *batchQueue
	if e.s.d.batching() {
		bq = &batchQueue{toDevice: scatter}
	}
	q := &dmaQueue{limit: e.s.d.dmaTune.Queue}
	var order *scatterOrder
	if scatter && e.s.d.dmaTune.OrderScatters {
		order = &e.s.d.o.order
		order.mu.Lock()
		if order.ev != nil {
			e.wait(S, order.ev)
		}
	}
	bi := 0
	for ci, c := range copies {
		if bq != nil {
			bq.add(c, buf, scatter)
			if len(bq.sizes) >= dmaBatchCopies || q.full(bq.bytes) {
				e.flush(bq, q)
			}
		} else {
			e.copyRun(c, buf, scatter)
			e.queued(q, c.bytes())
		}
		if after != nil && after[ci] > bi {
			if bq != nil {
				e.flush(bq, q) // the checksum waits for these copies
			}
			if host {
				e.hostWait(e.event(S))
			} else {
				e.wait(A, e.event(S))
			}
			for ; bi < after[ci]; bi++ {
				perSM, limit := sumBlocksPerSM, hidden
				if bi == len(plan.batches)-1 {
					perSM, limit = copyBlocksPerSM, 0 // exposed: nothing is copied after it
				}
				e.launchPer(A, fn, plan, bi, flags, perSM, limit)
			}
		}
	}
	if bq != nil {
		e.flush(bq, q)
	}
	if order != nil {
		// The next scatter's copies follow these, not this checksum.
		e.recordOrder(order, S)
		order.mu.Unlock()
	}
	if sum {
		e.sums(A)
		e.wait(S, e.event(A))
	}
}

// recordOrder records o.ev (created on first use) after the work enqueued
// so far on S; o.mu is held.
func (e *enqueuer) recordOrder(o *scatterOrder, S C.CUstream) {
	if e.err != nil {
		return
	}
	if o.ev == nil {
		var ev C.CUevent
		if err := check("cuEventCreate", C.kv_event_create(e.s.d.ctx, &ev, C.KV_EVENT_DISABLE_TIMING)); err != nil {
			e.err = err
			return
		}
		o.ev = ev
	}
	e.do("cuEventRecord", C.kv_event_record(e.s.d.ctx, o.ev, S))
}

// hostWait blocks until ev is done (DMATuning.HostLaunch).
func (e *enqueuer) hostWait(ev C.CUevent) {
	if e.err == nil {
		e.do("cuEventSynchronize", C.kv_event_synchronize(e.s.d.ctx, ev))
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
	bytes      uint64
	toDevice   bool
}

func (q *batchQueue) add(c dmaCopy, buf *driverHostBuf, toDevice bool) {
	h := uint64(uintptr(buf.host)) + c.host
	for r := range c.rows {
		q.addRange(c.dev+r*c.pitch, h+r*c.width, c.width, toDevice)
	}
}

// addRange queues one copy of n bytes between device address dev and the
// host's unified address host.
func (q *batchQueue) addRange(dev, host, n uint64, toDevice bool) {
	if toDevice {
		q.dsts, q.srcs = append(q.dsts, C.CUdeviceptr(dev)), append(q.srcs, C.CUdeviceptr(host))
	} else {
		q.dsts, q.srcs = append(q.dsts, C.CUdeviceptr(host)), append(q.srcs, C.CUdeviceptr(dev))
	}
	q.sizes = append(q.sizes, C.size_t(n))
	q.bytes += n
}

// dmaQueue bounds the bytes of a transfer's copies in flight
// (DMATuning.Queue): an event after each group of copies, and the
// enqueue waits on the oldest while more than limit bytes are behind it.
type dmaQueue struct {
	limit   uint64
	pending uint64 // bytes enqueued since the last event
	marks   []dmaMark
	total   uint64 // bytes behind the marks
}

type dmaMark struct {
	ev    C.CUevent
	bytes uint64
}

// full reports whether n more bytes queued make a group worth an event:
// half the limit, so the engine has the other half to work on meanwhile.
func (q *dmaQueue) full(n uint64) bool { return q.limit > 0 && q.pending+n >= q.limit/2 }

// queued accounts n bytes just enqueued on S and, past half the limit,
// marks them with an event and waits until at most limit bytes are in
// flight.
func (e *enqueuer) queued(q *dmaQueue, n uint64) {
	if q.limit == 0 || e.err != nil {
		return
	}
	q.pending += n
	if q.pending < q.limit/2 {
		return
	}
	q.marks = append(q.marks, dmaMark{e.event(e.s.h), q.pending})
	q.total += q.pending
	q.pending = 0
	for q.total > q.limit && len(q.marks) > 1 && e.err == nil {
		m := q.marks[0]
		e.do("cuEventSynchronize", C.kv_event_synchronize(e.s.d.ctx, m.ev))
		q.marks, q.total = q.marks[1:], q.total-m.bytes
	}
}

// flush enqueues the queued copies on the stream S: in one call, or one
// call each (DMATuning.EachCopy).
func (e *enqueuer) flush(q *batchQueue, dq *dmaQueue) {
	if len(q.sizes) == 0 || e.err != nil {
		return
	}
	if e.s.d.dmaTune.EachCopy {
		e.each(q)
	} else {
		e.batch(q)
	}
	if dq != nil {
		e.queued(dq, q.bytes)
	}
	q.dsts, q.srcs, q.sizes, q.bytes = q.dsts[:0], q.srcs[:0], q.sizes[:0], 0
}

// batch enqueues the queued copies on the stream S in one
// cuMemcpyBatchAsync call.
func (e *enqueuer) batch(q *batchQueue) {
	err := e.s.d.refuseBatch
	if err == nil {
		flags := C.uint(1) // prefer to overlap with compute
		if e.s.d.dmaTune.NoOverlapHint {
			flags = 0
		}
		err = check("cuMemcpyBatchAsync", C.kv_memcpy_batch_async(e.s.d.ctx, &q.dsts[0], &q.srcs[0], &q.sizes[0],
			C.size_t(len(q.sizes)), flags, e.s.h))
	}
	switch {
	case err == nil:
	case !batchRefusal(err):
		if e.err == nil {
			e.err = err // not a refusal: the transfer fails, the device keeps batching
		}
	default:
		// A driver that exports the call but refuses it: enqueue the same
		// copies one call each (any the refused call did enqueue are copied
		// twice, the same bytes) and stop batching on this device, which
		// also turns auto's picks back to the kernels.
		e.s.d.batchRefused.CompareAndSwap(nil, &err)
		e.each(q)
	}
}

// each enqueues the queued copies on the stream S one call each.
func (e *enqueuer) each(q *batchQueue) {
	dir, name := C.int(0), "cuMemcpyDtoHAsync_v2"
	if q.toDevice {
		dir, name = 1, "cuMemcpyHtoDAsync_v2"
	}
	e.do(name, C.kv_memcpy_each_async(e.s.d.ctx, &q.dsts[0], &q.srcs[0], &q.sizes[0], C.size_t(len(q.sizes)), dir, e.s.h))
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
