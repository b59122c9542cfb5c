package cuda

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/kvtier/kvtier/checksum"
)

// The checksum kernels' own source, run on the CPU by
// kernels/testdata/kvemu.cc (a coroutine per lane, a warp's shuffles
// taken in turn), over the tables planUnits and planSums encode: every object's
// partials, summed over its batches, finish to the kvsum64 of its packed
// bytes, for kv_sum_units on word-aligned spans (8- and 16-aligned, runs
// longer than a unit, objects ending mid-word) and for kv_checksum on
// spans of any alignment and length, each with grids of one and of three
// blocks. This is the kernels' arithmetic and indexing without a GPU;
// the driver tests (TestDriverUnitSums, TestDriverConformance) run them
// on one.
func TestKernelsEmulated(t *testing.T) {
	bin := buildKernelEmulation(t)
	r := rand.New(rand.NewPCG(49, 2))
	var err error
	const base = 0 // the image's offsets are the tables' addresses
	img := make([]byte, 192<<10)
	for i := range img {
		img[i] = byte(r.Uint32())
	}
	for trial := range 10 {
		for _, units := range []bool{true, false} {
			objs, want := randomWordObjects(r, img, base, 4, 3, 512, units)
			batch := uint64(1 + r.IntN(96<<10))
			var p *xferPlan
			kernel := "units"
			if units {
				var ok bool
				p, _, ok, err = planUnits(objs, batch)
				if !ok {
					t.Fatalf("trial %d: planUnits refused word-aligned spans", trial)
				}
			} else {
				kernel = "checksum"
				p, _, err = planSums(objs, batch)
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, blocks := range []int{1, 3} {
				parts := emulateKernel(t, bin, kernel, blocks, p, img, nil, kFlagSum)
				for i, pk := range want {
					if got := checksum.Finish(parts[i], objs[i].len); got != checksum.Sum(pk) {
						t.Fatalf("trial %d, kv_%s on %d blocks: object %d (%d B, %d spans, %d batches): sum %#x, want %#x",
							trial, kernel, blocks, i, len(pk), len(objs[i].spans), len(p.batches), got, checksum.Sum(pk))
					}
				}
			}
		}
	}
}

// buildKernelEmulation compiles kernels/testdata/kvemu.cc with kvcopy.cu.
func buildKernelEmulation(t *testing.T) string {
	t.Helper()
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Fatalf("the kernel emulation needs g++ (Debian: apt-get install g++): %v", err)
	}
	bin := filepath.Join(t.TempDir(), "kvemu")
	if out, err := exec.Command(cxx, "-std=c++20", "-O1", "-w", "-o", bin, "kernels/testdata/kvemu.cc").CombinedOutput(); err != nil {
		t.Fatalf("building the emulation: %v\n%s", err, out)
	}
	return bin
}

// emulateKernel runs kernel over each batch of p on the emulation, with
// flags, and returns every object's partials, summed over the batches;
// img (the device memory the spans address) and host (the packed side of
// gather and scatter, nil for the checksum kernels) end as the kernel
// left them.
func emulateKernel(t *testing.T, bin, kernel string, blocks int, p *xferPlan, img, host []byte, flags uint32) []uint64 {
	t.Helper()
	partials := make([]uint64, p.nobj)
	for bi := range p.batches {
		for i, v := range emulateBatch(t, bin, kernel, blocks, p, bi, img, host, flags) {
			partials[i] += v
		}
	}
	return partials
}

// emulateBatch runs kernel over batch bi of p: emulateKernel for one
// batch, the packed side (host) being whatever the batch's segments
// address (a staging buffer for planStaged's).
func emulateBatch(t *testing.T, bin, kernel string, blocks int, p *xferPlan, bi int, img, host []byte, flags uint32) []uint64 {
	t.Helper()
	l := p.layout()
	buf := make([]byte, l.size)
	p.encode(buf, l)
	b := p.batches[bi]
	var w bytes.Buffer
	for _, v := range []uint64{uint64(len(b.segs)), uint64(len(p.spans)), b.nchunks, uint64(p.nobj), uint64(len(img)), uint64(flags), uint64(len(host))} {
		_ = binary.Write(&w, binary.LittleEndian, v)
	}
	w.Write(buf[l.segs[bi] : l.segs[bi]+uint64(len(b.segs))*kSegSize])
	w.Write(buf[:len(p.spans)*kSpanSize])
	head := w.Len()
	w.Write(img)
	w.Write(host)
	file := filepath.Join(t.TempDir(), "tables")
	if err := os.WriteFile(file, w.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin, kernel, strconv.Itoa(blocks), file).Output()
	if err != nil {
		t.Fatalf("kvemu %s, batch %d: %v", kernel, bi, err)
	}
	back, err := os.ReadFile(file)
	if err != nil || len(back) != head+len(img)+len(host) {
		t.Fatalf("kvemu %s, batch %d: %d bytes back, want %d (%v)", kernel, bi, len(back), head+len(img)+len(host), err)
	}
	copy(img, back[head:])
	copy(host, back[head+len(img):])
	partials := make([]uint64, p.nobj)
	sc := bufio.NewScanner(bytes.NewReader(out))
	for i := range partials {
		if !sc.Scan() {
			t.Fatalf("kvemu %s, batch %d: %d partials, want %d", kernel, bi, i, len(partials))
		}
		v, err := strconv.ParseUint(sc.Text(), 16, 64)
		if err != nil {
			t.Fatal(fmt.Errorf("kvemu %s: %w", kernel, err))
		}
		partials[i] = v
	}
	return partials
}

// The copy kernels' own source on the CPU (kernels/testdata/kvemu.cc), in
// direct mode (planDirect: the packed side is the host buffer) and staged
// (planStaged: each batch packed into or unpacked from a half of a
// staging buffer of a few pages, the half's runs copied to or from the
// host buffer, objects cut across batches): a gather packs every object's
// spans (any alignment and length, 561-byte rows among them) at its host
// offset, each object's sum its kvsum64, and writes no other byte of the
// host buffer; the read-back pass (FLAG_NOSTORE) gives the same sums and
// writes nothing; a scatter places every object's packed bytes in its
// spans, sums them, and writes no byte outside them (C3), with grids of
// one and of three blocks.
func TestCopyKernelsEmulated(t *testing.T) {
	bin := buildKernelEmulation(t)
	r := rand.New(rand.NewPCG(49, 3))
	const slot = 4096 // a scatter's spans each in a slot of their own: disjoint
	const half = 3*minPiece + 16*7
	img := make([]byte, 48*slot)
	fill := func(n uint64) []byte { return bytes.Repeat([]byte{0xee}, int(n)) }
	for trial := range 8 {
		for i := range img {
			img[i] = byte(r.Uint32())
		}
		slots := r.Perm(len(img) / slot)
		var objs []xferObject
		var want [][]byte
		var host uint64
		for o := 0; o+4 <= len(slots) && len(objs) < 8; o += 4 {
			x := xferObject{hostOff: host + uint64(r.IntN(40))}
			var packed []byte
			for _, s := range slots[o : o+1+r.IntN(4)] {
				n := uint64(1 + r.IntN(slot-64))
				if r.IntN(3) == 0 {
					n = 561
				}
				off := uint64(s*slot) + uint64(r.IntN(slot-int(n)))
				x.spans = append(x.spans, kSpan{ptr: off, objOff: x.len, len: n})
				x.len += n
				packed = append(packed, img[off:off+n]...)
			}
			objs = append(objs, x)
			want = append(want, packed)
			host = x.hostOff + x.len
		}
		hostLen := host + uint64(r.IntN(40))
		wantHost := fill(hostLen)
		for i, x := range objs {
			copy(wantHost[x.hostOff:], want[i])
		}
		pad := make([]byte, len(img))
		for i := range pad {
			pad[i] = byte(i*7 + 3)
		}
		wantImg := slices.Clone(pad)
		for _, x := range objs {
			for _, sp := range x.spans {
				copy(wantImg[sp.ptr:sp.ptr+sp.len], img[sp.ptr:sp.ptr+sp.len])
			}
		}
		direct, err := planDirect(objs, 0)
		if err != nil {
			t.Fatal(err)
		}
		staged, err := planStaged(objs, [2]uint64{0, half}, half)
		if err != nil {
			t.Fatal(err)
		}
		if len(staged.batches) < 2 {
			t.Fatalf("trial %d: %d staged batches, want several", trial, len(staged.batches))
		}
		// run moves the packed side through kernel: direct, on the host
		// buffer hb; staged, batch by batch through the staging halves.
		run := func(mode, kernel string, blocks int, im, hb []byte, flags uint32) []uint64 {
			if mode == "direct" {
				return emulateKernel(t, bin, kernel, blocks, direct, im, hb, flags)
			}
			parts := make([]uint64, len(objs))
			stage := make([]byte, 2*half)
			for bi, b := range staged.batches {
				if kernel == "scatter" {
					for _, rn := range b.runs {
						off := uint64(b.half)*half + rn.staging
						copy(stage[off:off+rn.len], hb[rn.host:rn.host+rn.len])
					}
				}
				for i, v := range emulateBatch(t, bin, kernel, blocks, staged, bi, im, stage, flags) {
					parts[i] += v
				}
				if kernel == "gather" && flags&kFlagNoStore == 0 {
					for _, rn := range b.runs {
						off := uint64(b.half)*half + rn.staging
						copy(hb[rn.host:rn.host+rn.len], stage[off:off+rn.len])
					}
				}
			}
			return parts
		}
		for _, mode := range []string{"direct", "staged"} {
			for _, blocks := range []int{1, 3} {
				what := fmt.Sprintf("trial %d, %s on %d blocks", trial, mode, blocks)
				checkSums := func(kernel string, parts []uint64) {
					t.Helper()
					for i, pk := range want {
						if got := checksum.Finish(parts[i], objs[i].len); got != checksum.Sum(pk) {
							t.Fatalf("%s, %s: object %d (%d B, %d spans): sum %#x, want %#x", what, kernel, i, len(pk), len(objs[i].spans), got, checksum.Sum(pk))
						}
					}
				}
				// Gather: packed at each host offset, nothing else written.
				hb, im := fill(hostLen), slices.Clone(img)
				checkSums("gather", run(mode, "gather", blocks, im, hb, kFlagSum))
				if !bytes.Equal(hb, wantHost) || !bytes.Equal(im, img) {
					t.Fatalf("%s, gather: the host buffer (or the pages) differ from the packed objects", what)
				}
				// The read-back pass: the same sums, nothing written.
				hb = fill(hostLen)
				checkSums("read-back", run(mode, "gather", blocks, im, hb, kFlagSum|kFlagNoStore))
				if !bytes.Equal(hb, fill(hostLen)) {
					t.Fatalf("%s, read-back: wrote the host buffer", what)
				}
				// Scatter: the packed objects into pages that held other bytes.
				im, hb = slices.Clone(pad), slices.Clone(wantHost)
				checkSums("scatter", run(mode, "scatter", blocks, im, hb, kFlagSum))
				for i := range im {
					if im[i] != wantImg[i] {
						t.Fatalf("%s, scatter: page byte %d is %#x, want %#x", what, i, im[i], wantImg[i])
					}
				}
			}
		}
	}
}

// kv_move (DMATuning.SMControl's tables and sums) on the CPU: every byte
// of the range copied, at every alignment of either side, on grids of one
// to three blocks and in moveGrid's, and not a byte outside the
// destination range written.
func TestKernelMoveEmulated(t *testing.T) {
	bin := buildKernelEmulation(t)
	r := rand.New(rand.NewPCG(51, 3))
	mem := make([]byte, 96<<10)
	for trial := range 24 {
		for i := range mem {
			mem[i] = byte(r.Uint32())
		}
		n := uint64([]int{0, 1, 15, 16, 17, 4096, 4101, 40 << 10}[trial%8])
		half := uint64(len(mem) / 2)
		src := uint64(r.IntN(int(half - n)))
		dst := half + uint64(r.IntN(int(half-n)))
		if trial%3 == 0 { // both 16-aligned: the vector loop
			src, dst = src&^15, dst&^15
		}
		blocks := []int{1, 2, 3, int(moveGrid(n))}[trial%4]
		file := filepath.Join(t.TempDir(), "mem")
		if err := os.WriteFile(file, mem, 0o600); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(bin, "move", strconv.Itoa(blocks), file, strconv.FormatUint(dst, 10),
			strconv.FormatUint(src, 10), strconv.FormatUint(n, 10)).CombinedOutput()
		if err != nil {
			t.Fatalf("kvemu move: %v\n%s", err, out)
		}
		got, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		want := slices.Clone(mem)
		copy(want[dst:dst+n], mem[src:src+n])
		if i := firstDiff(got, want); i >= 0 {
			t.Fatalf("trial %d: move of %d B from %d to %d on %d blocks: byte %d is %#x, want %#x",
				trial, n, src, dst, blocks, i, got[i], want[i])
		}
	}
}

// firstDiff is the first index where a and b differ (or where the shorter
// ends), -1 when they are equal.
func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

func TestMoveGrid(t *testing.T) {
	for _, tc := range []struct {
		n    uint64
		want uint32
	}{{0, 1}, {1, 1}, {4096, 1}, {4097, 2}, {32 * 4096, 32}, {1 << 30, 32}} {
		if got := moveGrid(tc.n); got != tc.want {
			t.Errorf("moveGrid(%d) = %d, want %d", tc.n, got, tc.want)
		}
	}
}
