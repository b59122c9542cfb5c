//go:build cgo && linux

package cuda

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkDriverDMA compares the two copy paths of Gather and Scatter on
// CUDA device 0 at the 8B model's geometry (Llama-3.1-8B: 32 layers, 8 KV
// heads of 128 bf16, blocks of 16 tokens; objects of 256-token chunks,
// spans layer-major then block order, as rankd plans them) in both pool
// layouts: block_major (one pool per layer, 64 KiB pages) and kv_split
// (K and V pools per layer, 32 KiB pages). Each chunk's blocks are
// consecutive (a fresh prompt: one copy per pool and chunk, 1 MiB or
// 512 KiB) or shuffled over the pool (a fragmented cache: one copy per
// page). For KVTIER_BENCH_GBS (default "0.5,1.3") gigabytes per transfer
// it prints the GB/s of the copy kernels' path (sm: staged, as auto picks
// it for long host runs), of the DMA path and of the copy-engine ceiling
// (one contiguous copy), device time between CUDA events behind a gate
// that covers the host's planning, median of KVTIER_BENCH_REPS (default
// 5); which path auto takes; and both directions at once (a gather and a
// scatter of as many bytes on two streams, from one start to the later
// end): combined GB/s and its ratio to the single-direction ceiling (the
// faster of the two directions). Verification is on in every transfer,
// and the two paths' gather sums must agree. Run it with
//
//	go test -run '^$' -bench DriverDMA -benchtime 1x ./cuda
//
// To separate what rankd's restores have that this process's do not,
// KVTIER_BENCH_HOST=register packs into a /dev/shm mapping registered
// with RegisterHost (rankd's L1) instead of an AllocHost buffer, and
// KVTIER_BENCH_POOLS=ipc allocates the pools in a second process (this
// binary again, as dmaHolder) and maps them through CUDA IPC, as rankd
// maps an engine's; KVTIER_BENCH_ORDER=shuffled or consecutive keeps one
// block order.
func BenchmarkDriverDMA(b *testing.B) {
	d, err := openDriver(0)
	if err != nil {
		b.Skipf("CUDA backend not available: %v", err)
	}
	defer d.Close()
	hasBatch := d.batch
	defer func() { d.path, d.mode, d.batch = pathAuto, modeAuto, hasBatch }()
	reps := int(envFloat("KVTIER_BENCH_REPS", 5))
	var sizes []float64
	for _, f := range strings.Split(envString("KVTIER_BENCH_GBS", "0.5,1.3"), ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || v <= 0 {
			b.Fatalf("KVTIER_BENCH_GBS: %q is not a positive number", f)
		}
		sizes = append(sizes, v)
	}
	src := dmaSource{host: envString("KVTIER_BENCH_HOST", "alloc"), pools: envString("KVTIER_BENCH_POOLS", "own")}
	if (src.host != "alloc" && src.host != "register") || (src.pools != "own" && src.pools != "ipc") {
		b.Fatalf("KVTIER_BENCH_HOST=%q (alloc | register), KVTIER_BENCH_POOLS=%q (own | ipc)", src.host, src.pools)
	}
	orders := []bool{false, true}
	switch envString("KVTIER_BENCH_ORDER", "both") {
	case "consecutive":
		orders = orders[:1]
	case "shuffled":
		orders = orders[1:]
	}
	var single, duplex []string
	for _, gb := range sizes {
		for _, lay := range []dmaLayout{{"block_major", 32, 64 << 10}, {"kv_split", 64, 32 << 10}} {
			for _, shuffled := range orders {
				s, du := runDMABench(b, d, src, lay, shuffled, uint64(gb*1e9), reps)
				single = append(single, s...)
				duplex = append(duplex, du)
			}
		}
	}
	// Printed, not logged: benchmark logs are cut to ten lines.
	fmt.Printf("\ndevice: %s (%s), %d multiprocessors; median of %d; DMA rule: copies averaging >= %d KiB; cuMemcpyBatchAsync: %v; host buffers: %s, pools: %s\n\n%s\n%s\n%s\n\n%s\n%s\n%s\n\n",
		d.info.Name, d.info.UUID, d.sms, reps, dmaMinCopy>>10, hasBatch, src.host, src.pools,
		"| layout | blocks | GB | dir | CE GB/s | SM path GB/s (ratio) | DMA path GB/s (ratio) | DMA, a driver call per copy (ratio) | enqueue ms, DMA / per copy | DMA copies | auto picks |",
		"|---|---|---|---|---|---|---|---|---|---|---|", strings.Join(single, "\n"),
		"| layout | blocks | GB each way | CE both ways GB/s (x single CE) | SM path both ways (x) | DMA path both ways (x) |",
		"|---|---|---|---|---|---|", strings.Join(duplex, "\n"))
}

func envString(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// dmaLayout is a pool layout of the 8B model: pools pools of page-byte
// pages.
type dmaLayout struct {
	name  string
	pools int
	page  uint64
}

// dmaSource says where a bench side's memory comes from: host "alloc"
// (AllocHost) or "register" (a /dev/shm mapping, RegisterHost); pools
// "own" (Alloc) or "ipc" (another process's, ImportMem).
type dmaSource struct{ host, pools string }

// dmaSide is one set of pools and the objects of one transfer over them,
// with the pinned buffer they pack into.
type dmaSide struct {
	pools  []Mem
	objs   []Object
	hb     *driverHostBuf
	closer func() // ends the pools' holder process, if any
}

func (s *dmaSide) release() {
	for _, m := range s.pools {
		m.Release()
	}
	s.hb.Release()
	if s.closer != nil {
		s.closer()
	}
}

const dmaChunkBlocks = 16 // 256-token chunks of 16-token blocks

// newDMASide allocates the pools for total bytes of chunks (a quarter
// more blocks than they use), fills them, and lays out the chunks' objects
// back to back in a fresh pinned buffer.
func newDMASide(b *testing.B, d *driverDevice, src dmaSource, lay dmaLayout, shuffled bool, total uint64, seed uint64) *dmaSide {
	objBytes := uint64(lay.pools) * dmaChunkBlocks * lay.page
	nobj := max(total/objBytes, 1)
	blocks := int(nobj*dmaChunkBlocks*5/4 + 1)
	s := &dmaSide{}
	fill := make([]byte, uint64(blocks)*lay.page)
	fillRandom(fill, seed)
	var handles []MemHandle
	if src.pools == "ipc" {
		handles, s.closer = startDMAHolder(b, lay.pools, uint64(blocks)*lay.page)
	}
	for i := range lay.pools {
		var m Mem
		var err error
		if handles != nil {
			m, err = d.ImportMem(handles[i])
		} else {
			m, err = d.Alloc(uint64(blocks) * lay.page)
		}
		if err != nil {
			b.Fatal(err)
		}
		if err := d.Write(m, 0, fill); err != nil {
			b.Fatal(err)
		}
		s.pools = append(s.pools, m)
	}
	ids := make([]int, blocks)
	for i := range ids {
		ids[i] = i
	}
	if shuffled {
		r := rand.New(rand.NewPCG(seed, 25))
		r.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
	}
	var host uint64
	for c := range nobj {
		chunk := ids[c*dmaChunkBlocks : (c+1)*dmaChunkBlocks]
		var spans []Span
		for _, m := range s.pools {
			for _, id := range chunk {
				spans = append(spans, Span{Mem: m, Off: uint64(id) * lay.page, Len: lay.page})
			}
		}
		s.objs = append(s.objs, Object{HostOff: host, Spans: spans})
		host += objBytes
	}
	var hb HostBuf
	var err error
	if src.host == "register" {
		rw, _ := shmSegment(b, int(host))
		hb, err = d.RegisterHost(rw, false)
	} else {
		hb, err = d.AllocHost(host)
	}
	if err != nil {
		b.Fatal(err)
	}
	s.hb = hb.(*driverHostBuf)
	return s
}

// The pools' holder: this test binary run again with envDMAHolder set to
// "pools,bytes" allocates that many pools on device 0, prints their IPC
// handles as one JSON line and keeps them until its stdin closes.
const envDMAHolder = "KVTIER_BENCH_DMA_HOLDER"

func init() {
	if spec := os.Getenv(envDMAHolder); spec != "" {
		os.Exit(dmaHolder(spec))
	}
}

func dmaHolder(spec string) int {
	var n int
	var size uint64
	if _, err := fmt.Sscanf(spec, "%d,%d", &n, &size); err != nil {
		fmt.Fprintf(os.Stderr, "%s=%q: %v\n", envDMAHolder, spec, err)
		return 2
	}
	d, err := openDriver(0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer d.Close()
	var hs []MemHandle
	for range n {
		m, err := d.Alloc(size)
		if err == nil {
			var h MemHandle
			h, err = d.ExportMem(m, 0, size)
			hs = append(hs, h)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	line, _ := json.Marshal(hs)
	fmt.Printf("%s\n", line)
	_, _ = bufio.NewReader(os.Stdin).ReadString(0) // until the parent closes it
	return 0
}

// startDMAHolder starts a holder of n pools of size bytes and returns
// their handles and what ends it.
func startDMAHolder(b *testing.B, n int, size uint64) ([]MemHandle, func()) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d,%d", envDMAHolder, n, size))
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	end := func() { in.Close(); _ = cmd.Wait() }
	line, err := bufio.NewReader(out).ReadBytes('\n')
	var hs []MemHandle
	if err == nil {
		err = json.Unmarshal(line, &hs)
	}
	if err == nil && len(hs) != n {
		err = fmt.Errorf("%d handles, want %d", len(hs), n)
	}
	if err != nil {
		end()
		b.Fatalf("pools' holder: %v (%q)", err, line)
	}
	return hs, end
}

// runDMABench measures one layout, block order and size: the rows of the
// single-direction table (gather, scatter) and the row of the duplex one.
func runDMABench(b *testing.B, d *driverDevice, from dmaSource, lay dmaLayout, shuffled bool, total uint64, reps int) (single []string, duplex string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src := newDMASide(b, d, from, lay, shuffled, total, 1) // gathered
	defer src.release()
	dst := newDMASide(b, d, from, lay, shuffled, total, 2) // scattered into, from a host buffer of gathered bytes
	defer dst.release()
	bytes := src.hb.size
	var ss [3]*driverStream
	for i := range ss {
		st, err := d.NewStream()
		if err != nil {
			b.Fatal(err)
		}
		defer st.Close()
		ss[i] = st.(*driverStream)
	}
	gate, s1, s2 := ss[0], ss[1], ss[2]
	tm, err := d.newSpanTimer(2)
	if err != nil {
		b.Fatal(err)
	}
	defer tm.close()
	ce, err := d.rawAlloc(2 * bytes)
	if err != nil {
		b.Fatal(err)
	}
	defer d.rawFree(ce)

	gathers := func(st *driverStream, side *dmaSide, scatter bool) func() (*Op, error) {
		return func() (*Op, error) { return st.transfer(side.hb, side.objs, scatter, kFlagSum) }
	}
	// The scatter's host buffer holds what a gather of dst's pages packs.
	d.path = pathSM
	op, err := gathers(s1, dst, false)()
	if err != nil || op.Wait(ctx) != nil {
		b.Fatalf("filling the scatter's buffer: %v", err)
	}

	blocks := "consecutive"
	if shuffled {
		blocks = "shuffled"
	}
	gates := map[string]time.Duration{}
	hosts := map[string][]time.Duration{} // the enqueue's host time
	hasBatch := d.batch
	defer func() { d.batch = hasBatch }()
	// The DMA path with cuMemcpyBatchAsync (dma) and with a driver call
	// per copy (dma1), where the driver has the batch call.
	type variant struct {
		key   string
		p     copyPath
		batch bool
	}
	variants := []variant{{PathSM, pathSM, hasBatch}, {PathDMA, pathDMA, hasBatch}}
	if hasBatch {
		variants = append(variants, variant{"dma1", pathDMA, false})
	}
	measure := func(key string, ss []*driverStream, enqueue func() ([]*Op, error)) time.Duration {
		g, ok := gates[key]
		if !ok {
			g = 500 * time.Millisecond // the warm-up repetition's; then 1.5x the host's enqueue time
		}
		var ops []*Op
		dev, host, err := tm.run(gate, ss, g, func() error {
			var err error
			ops, err = enqueue()
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
		for _, op := range ops {
			if err := op.Wait(ctx); err != nil {
				b.Fatal(err)
			}
		}
		if host > g*9/10 {
			fmt.Printf("warning: %s: enqueuing took %v, the gate is %v: the time includes host work\n", key, host, g)
		}
		gates[key] = max(20*time.Millisecond, host*3/2+10*time.Millisecond)
		hosts[key] = append(hosts[key], host)
		return dev
	}
	one := func(f func() (*Op, error)) func() ([]*Op, error) {
		return func() ([]*Op, error) {
			op, err := f()
			return []*Op{op}, err
		}
	}
	both := func() ([]*Op, error) {
		g, err := gathers(s1, src, false)()
		if err != nil {
			return nil, err
		}
		s, err := gathers(s2, dst, true)()
		return []*Op{g, s}, err
	}
	// The ceiling's copies: into src's host buffer, out of dst's.
	ceCopy := func(scatter bool, st *driverStream, off uint64) func() error {
		h := src.hb.host
		if scatter {
			h = dst.hb.host
		}
		return func() error { return st.copyCE(h, ce+off, bytes, scatter) }
	}
	samples := map[string][]time.Duration{}
	var sums [3][]uint64 // gather sums of each variant
	autoPick := [2]string{}
	for rep := range reps + 1 {
		add := func(key string, t time.Duration) {
			if rep > 0 {
				samples[key] = append(samples[key], t)
			}
		}
		for k, scatter := range []bool{false, true} {
			dir := [2]string{"gather", "scatter"}[k]
			add("ce-"+dir, measure("ce-"+dir, []*driverStream{s1}, func() ([]*Op, error) { return nil, ceCopy(scatter, s1, 0)() }))
			side := src
			if scatter {
				side = dst
			}
			for vi, v := range variants {
				d.path, d.batch = v.p, v.batch
				key := v.key + "-" + dir
				var op *Op
				add(key, measure(key, []*driverStream{s1}, func() ([]*Op, error) {
					ops, err := one(gathers(s1, side, scatter))()
					op = ops[0]
					return ops, err
				}))
				if !scatter && rep == 0 {
					sums[vi] = slices.Clone(op.Sums())
				}
			}
			d.path, d.batch = pathAuto, hasBatch
			op, err := gathers(s1, side, scatter)()
			if err != nil || op.Wait(ctx) != nil {
				b.Fatalf("auto %s: %v", dir, err)
			}
			autoPick[k] = op.Path()
		}
		add("ce-both", measure("ce-both", []*driverStream{s1, s2}, func() ([]*Op, error) {
			if err := ceCopy(false, s1, 0)(); err != nil {
				return nil, err
			}
			return nil, ceCopy(true, s2, bytes)()
		}))
		for _, v := range variants[:2] {
			d.path, d.batch = v.p, v.batch
			add(v.key+"-both", measure(v.key+"-both", []*driverStream{s1, s2}, both))
		}
		d.path, d.batch = pathAuto, hasBatch
	}
	for vi := 1; vi < len(variants); vi++ {
		if !slices.Equal(sums[0], sums[vi]) {
			b.Fatalf("%s, %s blocks: gather sums of the SM path and %s differ", lay.name, blocks, variants[vi].key)
		}
	}
	med := map[string]time.Duration{}
	for k, v := range samples {
		med[k] = median(v)
	}
	gbps := func(key string, n uint64) float64 { return float64(n) / med[key].Seconds() / 1e9 }
	perCopy := lay.page
	if !shuffled {
		perCopy = lay.page * dmaChunkBlocks
	}
	enq := func(key string) string {
		if len(hosts[key]) < 2 {
			return "-"
		}
		return fmt.Sprintf("%.1f", float64(median(hosts[key][1:]).Microseconds())/1e3)
	}
	for k, dir := range []string{"gather", "scatter"} {
		ceG := gbps("ce-"+dir, bytes)
		one := "-"
		if hasBatch {
			one = fmt.Sprintf("%.1f (%.3f)", gbps("dma1-"+dir, bytes), gbps("dma1-"+dir, bytes)/ceG)
		}
		single = append(single, fmt.Sprintf("| %s | %s | %.2f | %s | %.1f | %.1f (%.3f) | %.1f (%.3f) | %s | %s / %s | %d of %d KiB | %s |",
			lay.name, blocks, float64(bytes)/1e9, dir, ceG,
			gbps(PathSM+"-"+dir, bytes), gbps(PathSM+"-"+dir, bytes)/ceG,
			gbps(PathDMA+"-"+dir, bytes), gbps(PathDMA+"-"+dir, bytes)/ceG, one,
			enq(PathDMA+"-"+dir), enq("dma1-"+dir), bytes/perCopy, perCopy>>10, autoPick[k]))
	}
	ceSingle := max(gbps("ce-gather", bytes), gbps("ce-scatter", bytes))
	x := func(key string) string {
		g := gbps(key, 2*bytes)
		return fmt.Sprintf("%.1f (%.2fx)", g, g/ceSingle)
	}
	duplex = fmt.Sprintf("| %s | %s | %.2f | %s | %s | %s |", lay.name, blocks, float64(bytes)/1e9,
		x("ce-both"), x(PathSM+"-both"), x(PathDMA+"-both"))
	fmt.Printf("%s\n%s\n", strings.Join(single, "\n"), duplex) // progress

	return single, duplex
}
