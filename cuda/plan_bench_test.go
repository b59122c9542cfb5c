package cuda

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// cpuTime is the CPU time (user + system) of the process so far: on a
// shared machine a better measure of host work than wall time.
func cpuTime() time.Duration { return rusage(syscall.RUSAGE_SELF) }

// clockThreadCPUTime is Linux's CLOCK_THREAD_CPUTIME_ID.
const clockThreadCPUTime = 3

// threadCPU is the CPU time of the calling thread so far (lock the
// goroutine to its thread), in nanoseconds (getrusage's thread times come
// in scheduler ticks of 4 ms here, too coarse for a stage): the host work
// of one stage, without the time it waited for a core or the garbage
// collector's background workers.
func threadCPU() time.Duration {
	var ts syscall.Timespec
	if _, _, e := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
}

func rusage(who int) time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(who, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// planMem is a Mem for planning benchmarks: no memory behind it.
// planMem is a Mem of size bytes at device address devBase+at.
type planMem struct{ size, at uint64 }

func (m *planMem) Size() uint64   { return m.size }
func (m *planMem) Release() error { return nil }

// The 561 B-row geometry of issue 12.7: rows of 561 B in 64-row pages of
// stride 64*561+37, objects of 256 rows each, back to back in the host
// buffer.
const (
	benchRow     = 561
	benchRows    = 256 // rows per object
	benchPerPage = 64
	benchStride  = benchPerPage*benchRow + 37
)

// rowSpanObjects builds the 561 B-row geometry with one span per row: nobj
// objects of 4 pages each, pages of object k at distinct places of one
// pool (not adjacent), the rows of a page in order.
func rowSpanObjects(nobj int) ([]Object, *planMem) {
	pool := &planMem{size: uint64(nobj*benchRows/benchPerPage) * benchStride}
	objs := make([]Object, nobj)
	var host uint64
	for k := range objs {
		spans := make([]Span, 0, benchRows)
		for p := range benchRows / benchPerPage {
			// Pages of an object spread over the pool (not adjacent).
			page := uint64((p*nobj + k) % (nobj * benchRows / benchPerPage))
			for r := range benchPerPage {
				spans = append(spans, Span{Mem: pool, Off: page*benchStride + uint64(r)*benchRow, Len: benchRow})
			}
		}
		objs[k] = Object{HostOff: host, Spans: spans}
		host += benchRows * benchRow
	}
	return objs, pool
}

// shuffledRowObjects builds what BenchmarkDriverTransfer's "one span per
// row" geometry transfers: every row of the pool's pages taken once, in
// random order, 256 rows per object: no two spans of the transfer are
// adjacent, so a scatter's overlap check sees one range per span.
func shuffledRowObjects(nobj int) ([]Object, *planMem) {
	pages := nobj * benchRows / benchPerPage
	pool := &planMem{size: uint64(pages+pages/4+1) * benchStride}
	r := rand.New(rand.NewPCG(benchRow, benchRows))
	perm := r.Perm(pages + pages/4 + 1)
	rows := make([]uint64, 0, nobj*benchRows)
	for _, p := range perm[:pages] {
		for k := range benchPerPage {
			rows = append(rows, uint64(p)*benchStride+uint64(k)*benchRow)
		}
	}
	r.Shuffle(len(rows), func(i, j int) { rows[i], rows[j] = rows[j], rows[i] })
	objs := make([]Object, nobj)
	var host uint64
	for i := range objs {
		spans := make([]Span, benchRows)
		for k := range spans {
			spans[k] = Span{Mem: pool, Off: rows[i*benchRows+k], Len: benchRow}
		}
		objs[i] = Object{HostOff: host, Spans: spans}
		host += benchRows * benchRow
	}
	return objs, pool
}

// tableBlock is a table block of n bytes for benchPlan, 8-byte aligned.
func tableBlock(n uint64) []byte {
	w := make([]uint64, (n+7)/8)
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(w))), n)
}

// median returns the median of v.
func median(v []time.Duration) time.Duration {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// planStages is the host time of the stages of planning one transfer:
// checks, device objects, staged plan, encoded tables.
type planStages [4]time.Duration

func (s planStages) total() time.Duration { return s[0] + s[1] + s[2] + s[3] }

// medianStages returns the repetition of median total time, and the
// median of each stage on its own.
func medianStages(v []planStages) (mid, each planStages) {
	s := slices.Clone(v)
	slices.SortFunc(s, func(a, b planStages) int { return cmp.Compare(a.total(), b.total()) })
	mid = s[len(s)/2]
	for k := range each {
		col := make([]time.Duration, len(v))
		for i := range v {
			col[i] = v[i][k]
		}
		slices.Sort(col)
		each[k] = col[len(col)/2]
	}
	return mid, each
}

// benchPlan runs the host side of a staged Gather or Scatter of objs the
// way driverStream.transfer does (checks writing the span table into the
// table block when it is large enough, device objects, staged plan, the
// other tables encoded into the block), once to warm up (the device's pool
// then holds a large enough block, as it does after the first transfer of
// a size), then b.N times, and reports per span the medians of the
// repetitions: each stage's wall time and thread CPU time, and the
// process's CPU time (which includes the GC's background work). On a
// loaded machine the CPU times are the figures to compare.
func benchPlan(b *testing.B, objs []Object, scatter bool) {
	nspans := 0
	var hostLen uint64
	for _, o := range objs {
		nspans += len(o.Spans)
		hostLen = max(hostLen, o.HostOff+o.Len())
	}
	resolve := func(m Mem) (*planMem, memView, error) {
		fm := m.(*planMem)
		return fm, memView{size: fm.size, base: devBase + fm.at}, nil
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var buf []byte // the table block, reused as the device's pool reuses them
	run := func() (wall, cpu, proc planStages) {
		var tw, tc, tp [5]time.Duration
		mark := func(k int) {
			tw[k], tc[k], tp[k] = time.Duration(time.Now().UnixNano()), threadCPU(), cpuTime()
		}
		mark(0)
		var opt checkOptions
		if uint64(len(buf)) >= tableEstimate(nspans, len(objs)) {
			opt.table = spanTableOf(buf)
		}
		t, err := checkTransfer(objs, hostLen, scatter, opt, resolve)
		if err != nil {
			b.Fatal(err)
		}
		mark(1)
		xobjs := deviceObjects(t)
		mark(2)
		p, err := planStaged(xobjs, [2]uint64{stageBase, stageBase + 32<<20}, 32<<20)
		if err != nil {
			b.Fatal(err)
		}
		mark(3)
		lay := p.layout()
		if uint64(len(buf)) < lay.size {
			big := tableBlock(jobCap(lay.size))
			p.encode(big, lay)
			buf = big
		} else {
			p.encode(buf, lay)
		}
		mark(4)
		for k := range 4 {
			wall[k], cpu[k], proc[k] = tw[k+1]-tw[k], tc[k+1]-tc[k], tp[k+1]-tp[k]
		}
		return wall, cpu, proc
	}
	run()
	var walls, cpus, procs []planStages
	for b.Loop() {
		w, c, p := run()
		walls, cpus, procs = append(walls, w), append(cpus, c), append(procs, p)
	}
	wall, wallEach := medianStages(walls)
	_, cpuEach := medianStages(cpus)
	proc, _ := medianStages(procs)
	cpu, _ := medianStages(cpus)
	per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(nspans) }
	b.ReportMetric(per(wall.total()), "ns/span")
	b.ReportMetric(per(cpu.total()), "thread-cpu-ns/span")
	b.ReportMetric(per(proc.total()), "cpu-ns/span")
	dir := "gather"
	if scatter {
		dir = "scatter"
	}
	fmt.Printf("%s: %s of %d spans, median of %d: wall %.1f ns/span (stages' medians: check %.1f, device objects %.1f, staged plan %.1f, encode %.1f); thread CPU %.1f (%.1f, %.1f, %.1f, %.1f); process CPU %.1f\n",
		b.Name(), dir, nspans, len(walls), per(wall.total()), per(wallEach[0]), per(wallEach[1]), per(wallEach[2]), per(wallEach[3]),
		per(cpu.total()), per(cpuEach[0]), per(cpuEach[1]), per(cpuEach[2]), per(cpuEach[3]), per(proc.total()))
}

// BenchmarkPlanRowSpans measures the host side of planning a scatter of
// 561 B rows as one span per row (the rows of a page in order), per stage
// and per span: the transfer checks (checkTransfer: bounds, Mems, the
// overlap check of the destination spans), the device-address objects,
// the staged plan, and the encoded tables, medians of the repetitions
// (benchPlan). Not asserted anywhere.
//
//	go test -run '^$' -bench PlanRowSpans -benchtime 5x ./cuda
func BenchmarkPlanRowSpans(b *testing.B) {
	for _, nobj := range []int{1024, 14848} { // 262,144 and 3.8 M spans
		b.Run(fmt.Sprintf("spans=%d", nobj*benchRows), func(b *testing.B) {
			objs, _ := rowSpanObjects(nobj)
			benchPlan(b, objs, true)
		})
	}
}

// BenchmarkPlanShuffledRows is the planning of BenchmarkDriverTransfer's
// "one span per row" transfers (rows in random order, 3.8 M spans of
// 561 B: 2.1 GB), gather and scatter: the host side of the staged enqueue
// that benchmark times on the GPU, without the driver calls.
//
//	go test -run '^$' -bench PlanShuffledRows -benchtime 5x ./cuda
func BenchmarkPlanShuffledRows(b *testing.B) {
	objs, _ := shuffledRowObjects(14848)
	for _, scatter := range []bool{false, true} {
		name := "gather"
		if scatter {
			name = "scatter"
		}
		b.Run(name, func(b *testing.B) { benchPlan(b, objs, scatter) })
	}
}

// BenchmarkPlanChecksums is the host side of a DMA transfer's checksum
// tables for one 300 MiB restore batch of the 8B pages (600 objects of
// one 512 KiB run each): kv_checksum's plan (a segment per object) against
// kv_sum_units' (a segment per 64 KiB piece, 4,800), each with its tables
// encoded into a reused block. Not asserted anywhere.
//
//	go test -run '^$' -bench PlanChecksums ./cuda
func BenchmarkPlanChecksums(b *testing.B) {
	const obj = 512 << 10
	objs := make([]xferObject, (300<<20)/obj)
	for i := range objs {
		ptr := uint64(1<<32) + uint64(i)*3*obj
		objs[i] = xferObject{hostOff: uint64(i) * obj, len: obj, spans: []kSpan{{ptr: ptr, len: obj}}}
	}
	var buf []byte
	for _, kernel := range []string{"kv_checksum", "kv_sum_units"} {
		units := kernel == "kv_sum_units"
		b.Run(kernel, func(b *testing.B) {
			for b.Loop() {
				var p *xferPlan
				var err error
				if units {
					var ok bool
					if p, _, ok, err = planUnits(objs, 1<<30); !ok && err == nil {
						b.Fatal("planUnits refused word-aligned spans")
					}
				} else {
					p, _, err = planSums(objs, 1<<30)
				}
				if err != nil {
					b.Fatal(err)
				}
				l := p.layout()
				if uint64(len(buf)) < l.size {
					buf = make([]byte, l.size)
				}
				p.encode(buf, l)
			}
		})
	}
}

// BenchmarkPlanSmallChunks is the host side of one restore batch of
// 16-token chunks of an 8-layer model, as a rankd enqueues it
// (hf_roundtrip.py --kv-heads 2 --chunks 1024, two batches a restore):
// 512 objects of eight 8 KiB pages at random places of a pool, an object
// per 1 MiB slab of L1. On an H100 the rankd's enqueue of such a batch
// took ~1 ms (stop 62): the host side, not the copy, set the restore's pace.
//
//	go test -run '^$' -bench PlanSmallChunks -benchtime 200x ./cuda
//
// pools=8 is the layout of a model's layers as torch allocates them, a
// pool each: an object's page of each layer is in another allocation, at
// the same random block of each.
func BenchmarkPlanSmallChunks(b *testing.B) {
	const nobj, per, page = 512, 8, 8192
	for _, pools := range []int{1, per} {
		objs := make([]Object, nobj)
		r := rand.New(rand.NewPCG(nobj, per))
		if pools == 1 {
			pool := &planMem{size: 4 * nobj * per * page}
			perm := r.Perm(4 * nobj * per)
			for i := range objs {
				spans := make([]Span, per)
				for k := range spans {
					spans[k] = Span{Mem: pool, Off: uint64(perm[i*per+k]) * page, Len: page}
				}
				objs[i] = Object{HostOff: uint64(i) << 20, Spans: spans}
			}
		} else {
			const size = 4 * nobj * page
			mems := make([]*planMem, pools)
			for k := range mems {
				mems[k] = &planMem{size: size, at: uint64(k) * (size + 1<<21)}
			}
			perm := r.Perm(4 * nobj)
			for i := range objs {
				spans := make([]Span, per)
				for k := range spans {
					spans[k] = Span{Mem: mems[k], Off: uint64(perm[i]) * page, Len: page}
				}
				objs[i] = Object{HostOff: uint64(i) << 20, Spans: spans}
			}
		}
		for _, scatter := range []bool{false, true} {
			name := "gather"
			if scatter {
				name = "scatter"
			}
			b.Run(fmt.Sprintf("pools=%d/%s", pools, name), func(b *testing.B) { benchPlan(b, objs, scatter) })
		}
	}
}
