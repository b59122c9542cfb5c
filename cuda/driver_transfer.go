//go:build cgo && linux

package cuda

/*
#include "driver_cgo.h"
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"
	"unsafe"
)

// Gather packs objs into dst and computes their kvsum64 in the same pass.
func (s *driverStream) Gather(dst HostBuf, objs []Object) (*Op, error) {
	return s.transfer(dst, objs, false, kFlagSum)
}

// Scatter places the packed objects of src into their spans and, once every
// span is placed, reads them back from device memory and computes the
// kvsum64 of what they hold.
func (s *driverStream) Scatter(src HostBuf, objs []Object) (*Op, error) {
	return s.transfer(src, objs, true, kFlagSum)
}

// resolve checks a transfer (checkTransfer) before anything is enqueued and
// takes a reference on the buffer and every Mem it uses. The returned
// functions drop them. When an idle table block can hold the span table,
// the checks write it there (checkOptions.table) and resolve returns the
// block, which the caller then owns; otherwise the block is nil. A transfer
// that fails the checks never allocates a block.
//
// It also applies the rule of the DMA path (useDMA) to the checked
// transfer: copies, when not nil, are the copy-engine copies the transfer
// takes instead of the copy kernels.
func (s *driverStream) resolve(hb HostBuf, objs []Object, scatter bool) (*driverHostBuf, []xferObject, *job, []func() error, []dmaCopy, error) {
	buf, ok := hb.(*driverHostBuf)
	if !ok || buf == nil {
		return nil, nil, nil, nil, nil, fmt.Errorf("%w: host buffer is a %T, not a CUDA backend buffer", ErrBadHandle, hb)
	}
	if buf.d.ctx != s.d.ctx {
		return nil, nil, nil, nil, nil, fmt.Errorf("%w: host buffer of another device", ErrBadHandle)
	}
	n := 0
	for _, o := range objs {
		n += len(o.Spans)
	}
	// The DMA path needs each span's Mem: a copy never runs from one
	// allocation into another, even where their addresses meet.
	path := s.d.copyPath()
	opt := checkOptions{memOf: path != pathSM}
	var j *job
	if n > 0 {
		if j = s.d.idleJob(tableEstimate(n, len(objs))); j != nil {
			opt.table = j.spanTable()
		}
	}
	fail := func(err error) (*driverHostBuf, []xferObject, *job, []func() error, []dmaCopy, error) {
		if j != nil {
			s.d.putJob(j)
		}
		return nil, nil, nil, nil, nil, err
	}
	t, err := checkTransfer(objs, buf.size, scatter, opt, s.d.resolveMem)
	if err != nil {
		return fail(err)
	}
	xobjs := deviceObjects(t)
	copies, _ := useDMA(t, path, s.d.batching())
	if !buf.life.acquire() {
		return fail(fmt.Errorf("%w: host buffer of %d B", ErrReleased, buf.size))
	}
	if err := t.acquire((*driverMem).acquire, func(m *driverMem) { m.life.unref() }); err != nil {
		buf.life.unref()
		return fail(err)
	}
	unref := make([]func() error, 0, 1+len(t.mems))
	unref = append(unref, buf.life.unref)
	for _, u := range t.mems {
		unref = append(unref, u.mem.life.unref)
	}
	return buf, xobjs, j, unref, copies, nil
}

// copyPath is the device's copy path: a forced copy mode (direct or
// staged, for tests and benchmarks) is one of the copy kernels' modes, so
// it implies the SM path unless a path is forced too.
func (d *driverDevice) copyPath() copyPath {
	if d.path == pathAuto && d.mode != modeAuto {
		return pathSM
	}
	return d.path
}

// resolveMem tells checkTransfer about a span's Mem. Device addresses are
// unified: views of one allocation alias where their addresses intersect.
// The base is the Mem's device address, so the checked spans' addresses
// are the device addresses the kernels use (deviceObjects).
func (d *driverDevice) resolveMem(m Mem) (*driverMem, memView, error) {
	dm, err := d.asMem(m, "span")
	if err != nil {
		return nil, memView{}, err
	}
	return dm, memView{size: dm.size, base: dm.ptr}, nil
}

// Staging policy of modeAuto: the copy engine pays off once a transfer is
// large and its objects make long contiguous runs in the host buffer (one
// copy per run); otherwise the kernel works on the mapped buffer directly.
// Scatters and gathers take one bound. Stop 63 staged scatters from 64 KiB
// runs, which sped up four rankds sharing an H100 (16-token restores of
// 64 KiB objects, one per L1 slab: 0.330 of CE against 0.297 direct,
// begin to verdict, one call) but slowed one rankd, the shape of a rankd
// per GPU (0.119 against 0.144 and 0.104 against 0.121 in two pairs on one
// card; BENCHMARKS.md, stop 64): its staged enqueue took 2.7-3.9 ms against
// 1.4-2.0 direct. Objects stored back to back (larger than a slab) make
// long runs and stage either way. --copy-path sm-staged forces staging
// for GPUs that several rankds share.
const (
	autoStageMinTotal = 8 << 20
	autoStageMinRun   = 512 << 10
)

// staged reports whether a transfer of objs in the SM path goes through
// the device staging buffer (modeStaged) rather than the mapped host
// buffer (modeDirect).
func (d *driverDevice) staged(objs []xferObject) bool {
	switch d.mode {
	case modeDirect:
		return false
	case modeStaged:
		return true
	}
	var total, runs uint64
	end := ^uint64(0)
	for _, o := range objs {
		if o.len == 0 {
			continue
		}
		if o.hostOff != end {
			runs++
		}
		total += o.len
		end = o.hostOff + o.len
	}
	return runs > 0 && total >= autoStageMinTotal && total/runs >= autoStageMinRun
}

// transfer validates, plans and enqueues a Gather or Scatter.
func (s *driverStream) transfer(hb HostBuf, objs []Object, scatter bool, flags uint32) (*Op, error) {
	what := "gather"
	if scatter {
		what = "scatter"
	}
	buf, xobjs, j, unref, copies, err := s.resolve(hb, objs, scatter)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	path := pathSM
	if copies != nil {
		path = pathDMA
	}
	st := &opState{
		s:     s,
		what:  fmt.Sprintf("%s of %d objects (%s)", what, len(objs), path.name()),
		path:  path.name(),
		lens:  make([]uint64, len(objs)),
		sums:  make([]uint64, len(objs)),
		job:   j, // holds the span table, if not nil; dropped with st
		unref: unref,
	}
	for i, o := range xobjs {
		st.lens[i] = o.len
	}

	s.lockEnqueue()
	defer s.unlockEnqueue()
	if err := s.refuseLocked(); err != nil {
		st.drop()
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	s.reapLocked()
	staged := path == pathSM && s.d.staged(xobjs)
	if path == pathSM {
		st.mode = ModeDirect
		if staged {
			st.mode = ModeStaged
		}
	}
	var plan *xferPlan
	var ends []int // DMA: the checksum batches' object ranges
	if path == pathDMA {
		if err := s.ensureAuxLocked(); err != nil {
			st.drop()
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		ok := false
		if s.d.dmaTune.UnitSums {
			plan, ends, ok, err = planUnits(xobjs, s.d.dmaTune.SumBatch)
		}
		if err == nil && !ok {
			plan, ends, err = planSums(xobjs, s.d.dmaTune.SumBatch)
		}
	} else if staged {
		if err := s.ensureStageLocked(); err != nil {
			st.drop()
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		plan, err = planStaged(xobjs, [2]uint64{s.stage, s.stage + s.half}, s.half)
	} else {
		plan, err = planDirect(xobjs, buf.dptr)
	}
	if err != nil {
		st.drop()
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	lay := plan.layout()
	if lay.size == 0 && st.job != nil {
		// No tables (and no spans in the block): a job without a layout
		// of this transfer must not reach the enqueuer or poll.
		s.d.putJob(st.job)
		st.job = nil
	}
	if lay.size > 0 {
		if st.job == nil || st.job.cap < lay.size {
			// The span table is in Go memory or in a block too small for
			// all the tables: encode copies it into a block that holds
			// them, before the old block goes back.
			big, err := s.d.getJob(lay.size)
			if err != nil {
				st.drop()
				return nil, fmt.Errorf("%s: %w", what, err)
			}
			old := st.job
			st.job = big
			big.lay = lay
			plan.encode(big.buf, lay)
			if old != nil {
				s.d.putJob(old)
			}
		} else {
			st.job.lay = lay
			plan.encode(st.job.buf, lay)
		}
	}
	fn := s.d.gather
	if scatter {
		fn = s.d.scatter
	}
	e := enqueuer{s: s, st: st, readBack: scatter && flags&kFlagSum != 0, smc: s.d.smControl(scatter)}
	e.smcSums = e.smc || s.d.smSums(scatter)
	if e.smc && st.job != nil && st.job.lay.size > 0 {
		s.d.moveTransfers.Add(1)
	}
	st.start = time.Now()
	switch {
	case path == pathDMA:
		e.dma(plan, ends, copies, buf, scatter, flags)
	case staged:
		e.staged(plan, buf, fn, scatter, flags)
	default:
		e.direct(plan, fn, flags)
	}
	if e.err != nil {
		// Part of the work may be enqueued: let it drain before the
		// tables and references go back.
		C.kv_stream_synchronize(s.d.ctx, s.h)
		if s.aux != nil {
			C.kv_stream_synchronize(s.d.ctx, s.aux)
		}
		st.drop()
		return nil, s.failLocked(st.what, e.err)
	}
	st.busy = &s.d.busy[direction(scatter)]
	st.busy.Add(1)
	return s.finishLocked(st)
}

func direction(scatter bool) int {
	if scatter {
		return 1
	}
	return 0
}

// smControl reports whether a transfer in direction scatter enqueued now
// moves its tables and sums with kv_move (DMATuning.SMControl, or
// SMControlDuplex with a transfer of the other direction in flight).
func (d *driverDevice) smControl(scatter bool) bool {
	return d.dmaTune.SMControl || d.dmaTune.SMControlDuplex && d.busy[1-direction(scatter)].Load() > 0
}

// smSums reports whether a transfer in direction scatter brings its
// partial sums back with kv_move whatever smControl chose for its tables
// (DMATuning.SMSumsScatter).
func (d *driverDevice) smSums(scatter bool) bool { return scatter && d.dmaTune.SMSumsScatter }

// ensureAuxLocked creates the kernel stream of staged and DMA transfers,
// on first use.
func (s *driverStream) ensureAuxLocked() error {
	if s.aux == nil {
		var aux C.CUstream
		if err := check("cuStreamCreate", C.kv_stream_create(s.d.ctx, &aux)); err != nil {
			return fmt.Errorf("cuda: kernel stream: %w", err)
		}
		s.d.o.mu.Lock() // drain reads aux under it
		s.aux = aux
		s.d.o.mu.Unlock()
	}
	return nil
}

// ensureStageLocked creates the kernel stream and the staging buffer of
// staged transfers, on first use.
func (s *driverStream) ensureStageLocked() error {
	if err := s.ensureAuxLocked(); err != nil {
		return err
	}
	if s.stage == 0 {
		half := s.d.stageHalf &^ 255 // keeps both halves 256-byte aligned
		if half == 0 {
			half = defaultStageHalf
		}
		// Stream-ordered: it never waits for the device, and work on the
		// stream after this point may use it.
		var p C.CUdeviceptr
		if err := check("cuMemAllocAsync", C.kv_mem_alloc_async(s.d.ctx, &p, C.size_t(2*half), s.h)); err != nil {
			return fmt.Errorf("cuda: staging buffer of %d B: %w", 2*half, err)
		}
		s.stage, s.half = uint64(p), half
	}
	return nil
}

// enqueuer issues the driver calls of one transfer and keeps the first
// error; after an error it issues nothing more.
type enqueuer struct {
	s   *driverStream
	st  *opState
	err error
	// readBack: a scatter's sums come from reading the placed spans back
	// from device memory after every batch is placed (kv_gather with
	// FLAG_NOSTORE), not from the values the scatter kernel wrote; the
	// scatter kernels then run without FLAG_SUM.
	readBack bool
	// smc: the tables and sums go by kv_move (driverDevice.smControl);
	// smcSums: the sums do (smc, or driverDevice.smSums).
	smc, smcSums bool
}

// scatterFlags is what the scatter kernels run with.
func (e *enqueuer) scatterFlags(flags uint32) uint32 {
	if e.readBack {
		return flags &^ kFlagSum
	}
	return flags
}

// verify enqueues the read-back pass of batch bi of a scatter on h, after
// the batch's scatter kernel. Destination spans never overlap, so a batch
// read back once it is placed holds what the transfer leaves there.
func (e *enqueuer) verify(h C.CUstream, plan *xferPlan, bi int, flags uint32) {
	if e.readBack {
		e.launch(h, e.s.d.gather, plan, bi, flags|kFlagNoStore)
	}
}

func (e *enqueuer) do(op string, r C.CUresult) {
	if e.err == nil {
		e.err = check(op, r)
	}
}

// event records an internal event on h, owned by the operation.
func (e *enqueuer) event(h C.CUstream) C.CUevent {
	if e.err != nil {
		return nil
	}
	ev, err := e.s.record(h)
	if err != nil {
		e.err = err
		return nil
	}
	e.st.events = append(e.st.events, ev)
	return ev
}

func (e *enqueuer) wait(h C.CUstream, ev C.CUevent) {
	if e.err == nil {
		e.do("cuStreamWaitEvent", C.kv_stream_wait_event(e.s.d.ctx, h, ev))
	}
}

// tables copies the plan's tables and zeroed partial sums to the device,
// on h, in one copy-engine copy: the zeroes are written on the host
// first (the block's sums region is the op's own until its sums are read
// back), not by cuMemsetD8Async, whose fill would be one more piece of
// work on the GPU's compute engine, where each piece from this context
// can cost the engine's own user (vLLM's forward) a context switch.
func (e *enqueuer) tables(h C.CUstream) {
	j := e.st.job
	if j == nil || e.err != nil || j.lay.size == 0 {
		return
	}
	clear(j.buf[j.lay.partials:j.lay.size])
	if e.smc {
		e.move(h, j.dev, j.hostDev, j.lay.size)
		return
	}
	e.do("cuMemcpyHtoDAsync_v2", C.kv_memcpy_htod_async(e.s.d.ctx, C.CUdeviceptr(j.dev), j.host, C.size_t(j.lay.size), h))
}

// move copies n bytes from src to dst on h with kv_move (DMATuning.SMControl).
func (e *enqueuer) move(h C.CUstream, dst, src, n uint64) {
	e.do("cuLaunchKernel", C.kv_launch_move(e.s.d.ctx, e.s.d.move, C.uint(moveGrid(n)), kThreads, h,
		C.CUdeviceptr(dst), C.CUdeviceptr(src), C.ulonglong(n)))
}

// sums copies the partial sums back to the pinned table block, on h.
func (e *enqueuer) sums(h C.CUstream) {
	j := e.st.job
	if j == nil || e.err != nil {
		return
	}
	if n := j.lay.size - j.lay.partials; n > 0 && e.smcSums {
		e.move(h, j.hostDev+j.lay.partials, j.dev+j.lay.partials, n)
	} else if n > 0 {
		e.do("cuMemcpyDtoHAsync_v2", C.kv_memcpy_dtoh_async(e.s.d.ctx, unsafe.Add(j.host, j.lay.partials), C.CUdeviceptr(j.dev+j.lay.partials), C.size_t(n), h))
	}
}

func (e *enqueuer) launch(h C.CUstream, fn C.CUfunction, plan *xferPlan, bi int, flags uint32) {
	e.launchPer(h, fn, plan, bi, flags, copyBlocksPerSM, 0)
}

// launchPer launches fn over batch bi with at most perSM blocks of every
// multiprocessor; limit > 0 bounds the grid to that many blocks in all
// (DMATuning.SumBlocks): the kernels stride over what a smaller grid leaves.
func (e *enqueuer) launchPer(h C.CUstream, fn C.CUfunction, plan *xferPlan, bi int, flags uint32, perSM int, limit uint32) {
	if e.err != nil {
		return
	}
	j, b := e.st.job, &plan.batches[bi]
	blocks := grid(b.nchunks, e.s.d.sms, perSM)
	if plan.units {
		blocks = unitGrid(b.nchunks, e.s.d.sms, perSM)
		e.s.d.unitLaunches.Add(1)
	}
	if limit > 0 {
		blocks = min(blocks, limit)
	}
	e.do("cuLaunchKernel", C.kv_launch_copy(e.s.d.ctx, fn, C.uint(blocks), kThreads, h,
		C.CUdeviceptr(j.dev+j.lay.segs[bi]), C.uint(len(b.segs)), C.CUdeviceptr(j.dev), C.ulonglong(b.nchunks),
		C.CUdeviceptr(j.dev+j.lay.partials), C.uint(flags)))
}

// direct: one kernel reads or writes the mapped host buffer.
func (e *enqueuer) direct(plan *xferPlan, fn C.CUfunction, flags uint32) {
	h := e.s.h
	e.tables(h)
	for bi := range plan.batches {
		e.launch(h, fn, plan, bi, e.scatterFlags(flags))
		e.verify(h, plan, bi, flags)
	}
	e.sums(h)
}

// staged pipelines kernels on the aux stream A with copy-engine copies on
// the stream S through the two halves of the staging buffer. Gather: A
// packs batch i into half i%2 (after the copies of batch i-2 have drained
// it), S copies it to the host buffer. Scatter: S copies batch i into half
// i%2 (after the kernel of batch i-2 has drained it), A unpacks it. S ends
// by waiting for A, so later work on S is ordered after the whole transfer.
func (e *enqueuer) staged(plan *xferPlan, buf *driverHostBuf, fn C.CUfunction, scatter bool, flags uint32) {
	S, A := e.s.h, e.s.aux
	half := [2]uint64{e.s.stage, e.s.stage + e.s.half}
	var bq *batchQueue
	if e.s.d.batching() {
		bq = &batchQueue{toDevice: scatter}
	}
	e.wait(A, e.event(S)) // kernels after the work already on S
	e.tables(A)
	drained := make([]C.CUevent, len(plan.batches))
	for bi := range plan.batches {
		b := &plan.batches[bi]
		if !scatter {
			if bi >= 2 {
				e.wait(A, drained[bi-2])
			}
			e.launch(A, fn, plan, bi, flags)
			e.wait(S, e.event(A))
			e.stageRuns(bq, b.runs, half[b.half], buf, false)
			drained[bi] = e.event(S)
		} else {
			if bi >= 2 {
				e.wait(S, drained[bi-2])
			}
			e.stageRuns(bq, b.runs, half[b.half], buf, true)
			e.wait(A, e.event(S))
			e.launch(A, fn, plan, bi, e.scatterFlags(flags))
			drained[bi] = e.event(A)
			// After drained: the read-back reads the spans, not the
			// staging half, and hides under the copy of the next batch.
			e.verify(A, plan, bi, flags)
		}
	}
	e.sums(A)
	e.wait(S, e.event(A))
}

// stageRuns enqueues a staged batch's copies between the staging half at
// device address stage and the host buffer on the stream S: in one
// cuMemcpyBatchAsync call where the device batches (an object per slab of
// L1 makes a run per object: 1,024 runs of 64 KiB for a 64 MiB restore of
// 16-token chunks, whose copies one call each would cost the host ~10 us
// apiece), else one call per run.
func (e *enqueuer) stageRuns(bq *batchQueue, runs []stageRun, stage uint64, buf *driverHostBuf, toDevice bool) {
	ctx, S := e.s.d.ctx, e.s.h
	for _, r := range runs {
		switch {
		case e.err != nil:
			return
		case bq != nil:
			bq.addRange(stage+r.staging, uint64(uintptr(buf.host))+r.host, r.len, toDevice)
			if len(bq.sizes) >= dmaBatchCopies {
				e.flush(bq, nil)
			}
		case toDevice:
			e.do("cuMemcpyHtoDAsync_v2", C.kv_memcpy_htod_async(ctx, C.CUdeviceptr(stage+r.staging), unsafe.Add(buf.host, r.host), C.size_t(r.len), S))
		default:
			e.do("cuMemcpyDtoHAsync_v2", C.kv_memcpy_dtoh_async(ctx, unsafe.Add(buf.host, r.host), C.CUdeviceptr(stage+r.staging), C.size_t(r.len), S))
		}
	}
	if bq != nil {
		e.flush(bq, nil)
	}
}

// job is the table block of one transfer: pinned host memory the host
// writes the tables into and reads the partial sums from, and device memory
// the kernels read them from. Idle jobs are kept for reuse by the device.
type job struct {
	host    unsafe.Pointer
	hostDev uint64 // host's device address (kv_move reads and writes it)
	buf     []byte
	dev     uint64
	cap     uint64
	lay     tableLayout
}

// maxIdleJobs bounds the table blocks a device keeps for reuse.
const maxIdleJobs = 16

// getJob returns an idle table block of at least size bytes from the
// ordinal's pool, or allocates one.
func (d *driverDevice) getJob(size uint64) (*job, error) {
	if j := d.idleJob(size); j != nil {
		return j, nil
	}
	return d.newJob(jobCap(size))
}

// idleJob takes the smallest idle table block of at least size bytes from
// the ordinal's pool; nil if none is that large.
func (d *driverDevice) idleJob(size uint64) *job {
	o := d.o
	o.mu.Lock()
	defer o.mu.Unlock()
	best := -1
	for i, j := range o.jobs {
		if j.cap >= size && (best < 0 || j.cap < o.jobs[best].cap) {
			best = i
		}
	}
	if best < 0 {
		return nil
	}
	j := o.jobs[best]
	o.jobs = slices.Delete(o.jobs, best, best+1)
	return j
}

// spanTable is the block's memory as a span table, for checkTransfer to
// write the checked spans into; pinned memory is page-aligned.
func (j *job) spanTable() []kSpan { return spanTableOf(j.buf) }

func (d *driverDevice) newJob(c uint64) (*job, error) {
	host, hostDev, err := d.pinned(c)
	if err != nil {
		return nil, fmt.Errorf("cuda: transfer tables of %d B: %w", c, err)
	}
	var p C.CUdeviceptr
	if err := check("cuMemAlloc_v2", C.kv_mem_alloc(d.ctx, &p, C.size_t(c))); err != nil {
		C.kv_mem_free_host(d.ctx, host)
		return nil, fmt.Errorf("cuda: transfer tables of %d B: %w", c, err)
	}
	return &job{host: host, hostDev: hostDev, buf: unsafe.Slice((*byte)(host), c), dev: uint64(p), cap: c}, nil
}

// putJob returns a table block to the ordinal's pool.
func (d *driverDevice) putJob(j *job) {
	o := d.o
	o.mu.Lock()
	if len(o.jobs) < maxIdleJobs {
		o.jobs = append(o.jobs, j)
		o.mu.Unlock()
		return
	}
	o.mu.Unlock()
	o.freeLater(func() error { return j.free(d) })
}

func (j *job) free(d *driverDevice) error {
	return errors.Join(
		check("cuMemFreeHost", C.kv_mem_free_host(d.ctx, j.host)),
		check("cuMemFree_v2", C.kv_mem_free(d.ctx, C.CUdeviceptr(j.dev))),
	)
}

// partials reads the n partial sums the device copied back.
func (j *job) partials(n int) []uint64 {
	out := make([]uint64, n)
	b := j.buf[j.lay.partials:]
	for i := range out {
		out[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	return out
}
