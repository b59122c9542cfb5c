//go:build cgo && linux

package cuda

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
)

// The host-shared L1 on the CUDA backend (issue 15.1, tiers4.5): a rank's
// L1 is a tmpfs segment it maps read-write and registers with
// cuMemHostRegister; a peer rank maps the same file read-only and registers
// it with CU_MEMHOSTREGISTER_READ_ONLY, then scatters MLA objects straight
// from it into its engine's pages. TestDriverRegisterHost checks one
// object; the test and benchmark here run the restore's shape (MLA objects
// of 32 pages of 64 x 656 B rows, 1,343,488 B, to random distinct pages)
// in every copy mode. Both skip without a driver: run them on the H200.

// shmSegment maps a new file of size bytes under /dev/shm (or tb's temp
// directory) twice: read-write (the holder's) and read-only (a peer's).
func shmSegment(tb testing.TB, size int) (rw, ro []byte) {
	tb.Helper()
	dir := tb.TempDir()
	if dd, err := os.MkdirTemp("/dev/shm", "kvtier-peerl1-"); err == nil {
		dir = dd
		tb.Cleanup(func() { os.RemoveAll(dd) })
	}
	f, err := os.OpenFile(filepath.Join(dir, "seg"), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		tb.Fatal(err)
	}
	if rw, err = syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = syscall.Munmap(rw) })
	if ro, err = syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ, syscall.MAP_SHARED); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = syscall.Munmap(ro) })
	return rw, ro
}

// mlaPage is one page of the MLA group the peer-L1 benchmarks restore:
// 64 tokens of 656 B (fp8_ds_mla); an object is mlaPagesPerObj pages.
const (
	mlaPage        = 64 * 656
	mlaPagesPerObj = 32
	mlaObject      = mlaPage * mlaPagesPerObj // 1,343,488 B
)

// mlaObjects lays out n objects back to back in a host buffer, each
// scattered to mlaPagesPerObj random distinct pages of pool (blocks pages).
func mlaObjects(pool Mem, n, blocks int, seed uint64) []Object {
	perm := rand.New(rand.NewPCG(seed, 5)).Perm(blocks)
	objs := make([]Object, n)
	for i := range objs {
		spans := make([]Span, mlaPagesPerObj)
		for k := range spans {
			spans[k] = Span{Mem: pool, Off: uint64(perm[i*mlaPagesPerObj+k]) * mlaPage, Len: mlaPage}
		}
		objs[i] = Object{HostOff: uint64(i) * mlaObject, Spans: spans}
	}
	return objs
}

// TestDriverPeerL1ScatterModes: MLA objects written into a holder's
// segment (through its read-write mapping) are scattered from the peer's
// read-only registration in each copy mode (the kernel reading the mapped
// segment; device staging behind a cuMemcpyHtoD of the segment; the mode
// the device picks; copy-engine copies of each page straight from the
// segment, the DMA path): every page holds exactly its object's bytes, the
// pages between are untouched, and each object's kvsum64 is the one of
// the segment's bytes.
func TestDriverPeerL1ScatterModes(t *testing.T) {
	d := openDriverT(t)
	const nobj = 6
	blocks := nobj*mlaPagesPerObj + 17
	rw, ro := shmSegment(t, nobj*mlaObject)
	fillRandom(rw, 11)
	own, err := d.RegisterHost(rw, false)
	if err != nil {
		t.Fatalf("register the holder's mapping: %v", err)
	}
	defer own.Release()
	peer, err := d.RegisterHost(ro, true)
	if err != nil {
		t.Fatalf("register the peer's read-only mapping: %v", err)
	}
	defer peer.Release()
	pool, err := d.Alloc(uint64(blocks) * mlaPage)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Release()
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	defer func() { d.mode, d.path = modeAuto, pathAuto }()
	for k, c := range []struct {
		mode copyMode
		path copyPath
	}{{modeDirect, pathSM}, {modeStaged, pathSM}, {modeAuto, pathAuto}, {modeAuto, pathDMA}} {
		mode := k // named in the messages: 0 direct, 1 staged, 2 auto, 3 DMA forced
		background := make([]byte, blocks*mlaPage)
		fillRandom(background, uint64(k)+100)
		if err := d.Write(pool, 0, background); err != nil {
			t.Fatal(err)
		}
		objs := mlaObjects(pool, nobj, blocks, uint64(k)+1)
		d.mode, d.path = c.mode, c.path
		op, err := s.Scatter(peer, objs)
		if err != nil {
			t.Fatalf("mode %d: scatter from the read-only peer mapping: %v", mode, err)
		}
		if err := op.Wait(ctxT(t)); err != nil {
			t.Fatalf("mode %d: %v", mode, err)
		}
		if c.path != pathAuto && op.Path() != c.path.name() {
			t.Fatalf("mode %d: copy path %s, want %s", mode, op.Path(), c.path.name())
		}
		want := background
		for i, o := range objs {
			if got, exp := op.Sums()[i], checksum.Sum(ro[o.HostOff:o.HostOff+mlaObject]); got != exp {
				t.Fatalf("mode %d object %d: kvsum64 %016x, the segment's bytes give %016x", mode, i, got, exp)
			}
			for k, sp := range o.Spans {
				copy(want[sp.Off:sp.Off+mlaPage], ro[o.HostOff+uint64(k)*mlaPage:])
			}
		}
		got := make([]byte, len(want))
		if err := d.Read(pool, 0, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("mode %d: the pool differs from the segment's objects over the untouched background", mode)
		}
	}
}

// BenchmarkDriverPeerL1 is the device side of a peer-L1 restore on CUDA
// device 0: MLA objects (1,343,488 B, 32 random distinct pages each,
// about KVTIER_BENCH_GB gigabytes, default 1) scattered, with the kvsum64
// checksum and in the mode the device picks (production), from
//
//   - peer: a peer's read-only cuMemHostRegister of a tmpfs segment (the
//     reader of the host-shared L1),
//   - own: the holder's read-write registration of the same segment (a
//     rank restoring from its own host-shared L1),
//   - pinned: a cuMemHostAlloc buffer (the L1 without --host-l1-dir),
//
// against the ceiling measured in the same run: one cuMemcpyHtoDAsync of
// the same number of bytes from the pinned buffer into one device buffer.
// Device times (CUDA events), median of KVTIER_BENCH_REPS (default 5)
// after a warm-up. The last peer scatter's sums are checked against the
// segment's bytes. Run it with
//
//	go test -run '^$' -bench DriverPeerL1 -benchtime 1x ./cuda
//
// (or the cuda.test of make gpu-build with -test.bench DriverPeerL1).
func BenchmarkDriverPeerL1(b *testing.B) {
	d, err := openDriver(0)
	if err != nil {
		b.Skipf("CUDA backend not available: %v", err)
	}
	defer d.Close()
	reps := int(envFloat("KVTIER_BENCH_REPS", 5))
	nobj := max(1, int(envFloat("KVTIER_BENCH_GB", 1)*(1<<30)/mlaObject))
	total := uint64(nobj) * mlaObject
	bx := newBenchEnv(b, d, total)
	defer bx.close()
	rw, ro := shmSegment(b, int(total))
	fillRandom(rw, 3)
	copy(bx.hb.buf, rw) // the pinned source holds the same objects
	own, err := d.RegisterHost(rw, false)
	if err != nil {
		b.Fatalf("register the holder's mapping: %v", err)
	}
	defer own.Release()
	peer, err := d.RegisterHost(ro, true)
	if err != nil {
		b.Fatalf("register the peer's read-only mapping: %v", err)
	}
	defer peer.Release()
	blocks := nobj*mlaPagesPerObj + nobj*mlaPagesPerObj/4 + 1
	pool, err := d.Alloc(uint64(blocks) * mlaPage)
	if err != nil {
		b.Fatalf("pool of %d pages: %v", blocks, err)
	}
	defer pool.Release()
	objs := mlaObjects(pool, nobj, blocks, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	d.mode = modeAuto
	srcs := []struct {
		name string
		hb   HostBuf
	}{{"peer", peer}, {"own", own}, {"pinned", bx.hb}}
	samples := map[string][]time.Duration{}
	gates := map[string]time.Duration{}
	var last *Op
	b.ResetTimer()
	for rep := range reps + 1 {
		c := bx.ceiling(b, total, true)
		for _, src := range srcs {
			gate, ok := gates[src.name]
			if !ok {
				gate = 2 * time.Second
			}
			var op *Op
			t, hostT := bx.timed(b, gate, func() error {
				var err error
				op, err = bx.s.transfer(src.hb, objs, true, kFlagSum)
				return err
			})
			if err := op.Wait(ctx); err != nil {
				b.Fatalf("%s scatter: %v", src.name, err)
			}
			gates[src.name] = max(20*time.Millisecond, hostT*3/2+10*time.Millisecond)
			if src.name == "peer" {
				last = op
			}
			if rep > 0 {
				samples[src.name] = append(samples[src.name], t)
			}
		}
		if rep > 0 {
			samples["ce"] = append(samples["ce"], c)
		}
	}
	b.StopTimer()
	for i, o := range objs {
		if got, want := last.Sums()[i], checksum.Sum(ro[o.HostOff:o.HostOff+mlaObject]); got != want {
			b.Fatalf("peer scatter object %d: kvsum64 %016x, the segment's bytes give %016x", i, got, want)
		}
	}
	ce := median(samples["ce"])
	fmt.Printf("\ndevice: %s (%s); %d MLA objects of %d B (%.2f GB), median of %d\n\n", d.info.Name, d.info.UUID, nobj, mlaObject, float64(total)/1e9, reps)
	fmt.Println("| source | GB/s | ratio to the H2D CE ceiling |")
	fmt.Println("|---|---|---|")
	fmt.Printf("| cuMemcpyHtoDAsync from pinned (ceiling) | %.1f | 1.000 |\n", gbps(total, ce))
	for _, src := range srcs {
		t := median(samples[src.name])
		fmt.Printf("| scatter from %s | %.1f | %.3f |\n", src.name, gbps(total, t), ce.Seconds()/t.Seconds())
		b.ReportMetric(gbps(total, t), src.name+"_GB/s")
		b.ReportMetric(ce.Seconds()/t.Seconds(), "x_ce_"+src.name)
	}
	b.ReportMetric(gbps(total, ce), "ce_GB/s")
	fmt.Println()
}
