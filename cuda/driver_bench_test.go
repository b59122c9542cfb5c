//go:build cgo && linux

package cuda

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkDriverTransfer measures Gather (D2H) and Scatter (H2D) of the
// seed geometries of DESIGN.md on CUDA device 0 against the copy-engine
// ceiling measured in the same run: one cuMemcpyDtoHAsync / HtoDAsync of a
// contiguous buffer as large as the transfers, into and out of the same
// pinned host buffer. Each measurement moves about KVTIER_BENCH_GB (default
// 2) gigabytes between random, distinct pages and back-to-back objects in
// the host buffer; it is timed with CUDA events on the stream, behind a
// Delay that covers the host's planning, so the times are device times;
// the median of KVTIER_BENCH_REPS (default 5) repetitions counts. Each
// transfer runs in both copy modes of the copy kernels (kernel on the
// mapped host buffer; kernel to device staging plus copy engine) and on
// the DMA path (copy-engine copies of the page runs, kv_checksum over the
// pages), with and without the kvsum64 checksum. Run it with
//
//	go test -run '^$' -bench DriverTransfer -benchtime 1x ./cuda
//
// KVTIER_BENCH_ONLY=text measures only the geometries whose name has text
// ("slab": the small objects one per L1 slab). It logs a Markdown table
// (BENCHMARKS.md) and reports, per geometry and direction, the ratio of
// the mode the device picks to the ceiling.
func BenchmarkDriverTransfer(b *testing.B) {
	d, err := openDriver(0)
	if err != nil {
		b.Skipf("CUDA backend not available: %v", err)
	}
	defer d.Close()
	gb := envFloat("KVTIER_BENCH_GB", 2)
	reps := int(envFloat("KVTIER_BENCH_REPS", 5))
	total := uint64(gb * (1 << 30))

	bx := newBenchEnv(b, d, total)
	defer bx.close()

	geoms := []benchGeom{
		{name: "561 B rows, 64-row pages (stride 64*561+37), 4 pages/object", width: 64 * 561, stride: 64*561 + 37, perObj: 4},
		{name: "561 B rows, one span per row, 256 rows/object", width: 64 * 561, stride: 64*561 + 37, perObj: 256, rowSpans: 561},
		{name: "656 B rows, 64-row pages, 4 pages/object", width: 64 * 656, stride: 64 * 656, perObj: 4},
		{name: "177,408 B opaque pages, stride 200,000", width: 177408, stride: 200000, perObj: 1},
		{name: "1,085,440 B opaque pages", width: 1085440, stride: 1085440, perObj: 1},
		{name: "64 KiB pages, 4 pages/object", width: 65536, stride: 65536, perObj: 4},
		{name: "8 KiB pages, 8 pages/object, an object per 1 MiB slab", width: 8192, stride: 8192, perObj: 8, hostStep: 1 << 20},
		{name: "32 KiB pages, 8 pages/object, an object per 1 MiB slab", width: 32768, stride: 32768, perObj: 8, hostStep: 1 << 20},
	}
	var rows []string
	only := os.Getenv("KVTIER_BENCH_ONLY") // geometries whose name has this, if set
	for _, g := range geoms {
		if !strings.Contains(g.name, only) {
			continue
		}
		for _, scatter := range []bool{false, true} {
			r := bx.run(b, g, scatter, reps)
			rows = append(rows, r.row())
			b.ReportMetric(r.auto(), "ratio-"+shortName(g.name)+"-"+strings.Fields(r.dir)[0])
		}
	}
	// Printed, not logged: benchmark logs are cut to ten lines.
	fmt.Printf("\ndevice: %s (%s), %d multiprocessors; %.2f GB per transfer, median of %d\n\n%s\n%s\n%s\n\n",
		d.info.Name, d.info.UUID, d.sms, float64(total)/1e9, reps, benchHeader, benchRule, strings.Join(rows, "\n"))
}

const (
	benchHeader = "| geometry | dir | CE ceiling GB/s | direct GB/s (ratio) | staged GB/s (ratio) | DMA GB/s (ratio) | auto picks | auto ratio | checksum cost (auto mode) |"
	benchRule   = "|---|---|---|---|---|---|---|---|---|"
)

// shortName makes a metric unit of a geometry name: its first two words,
// without spaces or commas.
func shortName(s string) string {
	f := strings.Fields(strings.ReplaceAll(s, ",", ""))
	return strings.Join(f[:min(2, len(f))], "")
}

func envFloat(name string, def float64) float64 {
	if v, err := strconv.ParseFloat(os.Getenv(name), 64); err == nil && v > 0 {
		return v
	}
	return def
}

// benchGeom is a pool of pages: page b is [b*stride, b*stride+width).
// An object is perObj pages, or, with rowSpans, perObj rows of rowSpans
// bytes each taken from random pages.
type benchGeom struct {
	name                  string
	width, stride, perObj uint64
	rowSpans              uint64
	// hostStep, if not 0, places an object every hostStep bytes of the
	// host buffer instead of back to back: one object per L1 slab, as a
	// rankd's small chunks sit (a copy-engine run each when staged).
	hostStep uint64
}

type benchEnv struct {
	d     *driverDevice
	s     *driverStream
	hb    *driverHostBuf
	ce    uint64 // device buffer for the ceiling
	total uint64
	tm    *timer
}

func newBenchEnv(b *testing.B, d *driverDevice, total uint64) *benchEnv {
	bx := &benchEnv{d: d, total: total}
	s, err := d.NewStream()
	if err != nil {
		b.Fatal(err)
	}
	bx.s = s.(*driverStream)
	hb, err := d.AllocHost(total + 4096)
	if err != nil {
		b.Fatal(err)
	}
	bx.hb = hb.(*driverHostBuf)
	fillRandom(bx.hb.buf, 1)
	if bx.ce, err = d.rawAlloc(total); err != nil {
		b.Fatal(err)
	}
	if bx.tm, err = d.newTimer(); err != nil {
		b.Fatal(err)
	}
	return bx
}

func (bx *benchEnv) close() {
	bx.tm.close()
	bx.d.rawFree(bx.ce)
	bx.hb.Release()
	bx.s.Close()
}

func fillRandom(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 99))
	for i := 0; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		for k := range 8 {
			b[i+k] = byte(v >> (8 * k))
		}
	}
}

// timed runs enqueue on the bench stream behind a Delay of gate (so the
// device starts only once everything is enqueued) and returns the device
// time between events recorded around it, and the host time enqueue took.
func (bx *benchEnv) timed(b *testing.B, gate time.Duration, enqueue func() error) (dev, host time.Duration) {
	if err := bx.s.Delay(gate); err != nil {
		b.Fatal(err)
	}
	if err := bx.tm.begin(bx.s); err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	if err := enqueue(); err != nil {
		b.Fatal(err)
	}
	host = time.Since(start)
	dev, err := bx.tm.finish(bx.s)
	if err != nil {
		b.Fatal(err)
	}
	if host > gate*9/10 {
		fmt.Printf("warning: enqueuing took %v, the gate is %v: the time includes host work\n", host, gate)
	}
	bx.s.mu.Lock()
	bx.s.reapLocked()
	bx.s.mu.Unlock()
	return dev, host
}

// ceiling times one contiguous copy-engine copy of n bytes.
func (bx *benchEnv) ceiling(b *testing.B, n uint64, h2d bool) time.Duration {
	t, _ := bx.timed(b, 20*time.Millisecond, func() error { return bx.s.copyCE(bx.hb.host, bx.ce, n, h2d) })
	return t
}

type benchResult struct {
	geom     string
	dir      string
	bytes    uint64
	ce       time.Duration
	t        map[string]time.Duration // "direct", "staged", "dma", and each with "-nosum"
	autoMode string
}

const dmaBenchCopies = 100_000

func gbps(n uint64, t time.Duration) float64 { return float64(n) / t.Seconds() / 1e9 }

func (r benchResult) ratio(mode string) float64 { return r.ce.Seconds() / r.t[mode].Seconds() }

func (r benchResult) auto() float64 { return r.ratio(r.autoMode) }

func (r benchResult) row() string {
	cost := (r.t[r.autoMode].Seconds() - r.t[r.autoMode+"-nosum"].Seconds()) / r.t[r.autoMode+"-nosum"].Seconds()
	col := func(mode string) string {
		if _, ok := r.t[mode]; !ok {
			return "not measured"
		}
		return fmt.Sprintf("%.1f (%.3f)", gbps(r.bytes, r.t[mode]), r.ratio(mode))
	}
	return fmt.Sprintf("| %s | %s | %.1f | %s | %s | %s | %s | %.3f | %+.1f%% |",
		r.geom, r.dir, gbps(r.bytes, r.ce), col("direct"), col("staged"), col("dma"),
		r.autoMode, r.auto(), 100*cost)
}

// run measures one geometry in one direction.
func (bx *benchEnv) run(b *testing.B, g benchGeom, scatter bool, reps int) benchResult {
	d := bx.d
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	objBytes := g.perObj * g.width
	if g.rowSpans > 0 {
		objBytes = g.perObj * g.rowSpans
	}
	nobj := bx.total / max(objBytes, g.hostStep)
	pages := nobj * g.perObj
	if g.rowSpans > 0 {
		pages = nobj * g.perObj / (g.width / g.rowSpans)
	}
	blocks := pages + pages/4 + 1
	pool, err := d.Alloc(blocks * g.stride)
	if err != nil {
		b.Fatalf("%s: pool of %d B: %v", g.name, blocks*g.stride, err)
	}
	defer pool.Release()
	chunk := make([]byte, 64<<20)
	fillRandom(chunk, 7)
	for off := uint64(0); off < pool.Size(); off += uint64(len(chunk)) {
		n := min(uint64(len(chunk)), pool.Size()-off)
		if err := d.Write(pool, off, chunk[:n]); err != nil {
			b.Fatal(err)
		}
	}

	// Random distinct pages (rows) for the objects, back to back in the
	// host buffer.
	r := rand.New(rand.NewPCG(uint64(g.width), uint64(g.perObj)))
	perm := r.Perm(int(blocks))
	objs := make([]Object, nobj)
	var host uint64
	if g.rowSpans == 0 {
		for i := range objs {
			spans := make([]Span, g.perObj)
			for k := range spans {
				spans[k] = Span{Mem: pool, Off: uint64(perm[uint64(i)*g.perObj+uint64(k)]) * g.stride, Len: g.width}
			}
			objs[i] = Object{HostOff: host, Spans: spans}
			host += max(objBytes, g.hostStep)
		}
	} else {
		rowsPerPage := g.width / g.rowSpans
		rows := make([]uint64, 0, pages*rowsPerPage)
		for _, p := range perm[:pages] {
			for k := range rowsPerPage {
				rows = append(rows, uint64(p)*g.stride+k*g.rowSpans)
			}
		}
		r.Shuffle(len(rows), func(i, j int) { rows[i], rows[j] = rows[j], rows[i] })
		for i := range objs {
			spans := make([]Span, g.perObj)
			for k := range spans {
				spans[k] = Span{Mem: pool, Off: rows[uint64(i)*g.perObj+uint64(k)], Len: g.rowSpans}
			}
			objs[i] = Object{HostOff: host, Spans: spans}
			host += objBytes
		}
	}
	moved := nobj * objBytes
	res := benchResult{geom: g.name, dir: "gather D2H", bytes: moved, t: map[string]time.Duration{}}
	if scatter {
		res.dir = "scatter H2D"
	}
	xo := make([]xferObject, len(objs))
	for i, o := range objs {
		xo[i] = xferObject{hostOff: o.HostOff, len: o.Len()}
	}
	d.mode, d.path = modeAuto, pathAuto
	res.autoMode = "direct"
	if d.staged(xo) {
		res.autoMode = "staged"
	}
	t, err := checkTransfer(objs, bx.hb.size, scatter, checkOptions{memOf: true}, d.resolveMem)
	if err != nil {
		b.Fatal(err)
	}
	if _, dma := useDMA(t, pathAuto, d.batch); dma {
		res.autoMode = "dma"
	}
	// The DMA path is measured where it makes at most dmaBenchCopies
	// copies: one per 561 B row would take the host seconds to enqueue.
	modes := []string{"direct", "staged"}
	if _, ok := planDMA(t, dmaBenchCopies); ok {
		modes = append(modes, "dma")
	}
	batched := d.batch
	if g.hostStep > 0 && batched {
		// staged with a driver call per run, against the batched runs
		modes = append(modes, "staged-each")
	}

	// The gate must outlast the host's enqueuing; it adapts to the host
	// time of the previous repetition, starting generous.
	gates := map[string]time.Duration{}
	gateFor := func(key string) time.Duration {
		if g, ok := gates[key]; ok {
			return g
		}
		return 2 * time.Second
	}
	samples := map[string][]time.Duration{}
	var ce []time.Duration
	enq := map[string][]time.Duration{} // host time of each mode's enqueue with the checksum (validation, plan, tables, driver calls)
	for rep := range reps + 1 {
		c := bx.ceiling(b, moved, scatter)
		for _, mode := range modes {
			for _, sum := range []bool{true, false} {
				d.mode, d.path, d.batch = modeDirect, pathSM, batched
				switch mode {
				case "staged":
					d.mode = modeStaged
				case "staged-each":
					d.mode, d.batch = modeStaged, false
				case "dma":
					d.mode, d.path = modeAuto, pathDMA
				}
				flags := uint32(0)
				key := mode + "-nosum"
				if sum {
					flags, key = kFlagSum, mode
				}
				var op *Op
				t, hostT := bx.timed(b, gateFor(key), func() error {
					var err error
					op, err = bx.s.transfer(bx.hb, objs, scatter, flags)
					return err
				})
				if err := op.Wait(ctx); err != nil {
					b.Fatal(err)
				}
				gates[key] = max(20*time.Millisecond, hostT*3/2+10*time.Millisecond)
				if rep > 0 { // the first repetition warms up
					samples[key] = append(samples[key], t)
					if sum {
						enq[key] = append(enq[key], hostT)
					}
				}
			}
		}
		if rep > 0 {
			ce = append(ce, c)
		}
	}
	d.mode, d.path, d.batch = modeAuto, pathAuto, batched
	res.ce = median(ce)
	for k, v := range samples {
		res.t[k] = median(v)
	}
	nspans := 0
	for _, o := range objs {
		nspans += len(o.Spans)
	}
	he := median(enq["staged"])
	if g.hostStep > 0 {
		var parts []string
		for _, m := range modes {
			h := median(enq[m])
			parts = append(parts, fmt.Sprintf("%s %v (%.1f ns/span)", m, h.Round(time.Microsecond), float64(h.Nanoseconds())/float64(max(nspans, 1))))
		}
		fmt.Printf("%s, %s: host enqueue by mode: %s\n", g.name, res.dir, strings.Join(parts, ", "))
	}
	fmt.Printf("%s, %s: %d objects, %.2f GB: CE %.1f GB/s; direct %.1f, staged %.1f (a call per run %.1f), dma %.1f GB/s; without checksum direct %.1f, staged %.1f, dma %.1f GB/s; host enqueue (staged) %v for %d spans = %.1f ns/span\n",
		g.name, res.dir, len(objs), float64(moved)/1e9, gbps(moved, res.ce),
		gbps(moved, res.t["direct"]), gbps(moved, res.t["staged"]), gbps(moved, res.t["staged-each"]), gbps(moved, res.t["dma"]),
		gbps(moved, res.t["direct-nosum"]), gbps(moved, res.t["staged-nosum"]), gbps(moved, res.t["dma-nosum"]),
		he.Round(time.Microsecond), nspans, float64(he.Nanoseconds())/float64(max(nspans, 1)))
	return res
}
