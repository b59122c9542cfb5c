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
	"strconv"
	"testing"

	"github.com/kvtier/kvtier/checksum"
)

// The checksum kernels' own source, run on the CPU by
// kernels/testdata/kvemu.cc (a thread per lane, the shuffles at a
// barrier), over the tables planUnits and planSums encode: every object's
// partials, summed over its batches, finish to the kvsum64 of its packed
// bytes, for kv_sum_units on word-aligned spans (8- and 16-aligned, runs
// longer than a unit, objects ending mid-word) and for kv_checksum on
// spans of any alignment and length, each with grids of one and of three
// blocks. This is the kernels' arithmetic and indexing without a GPU;
// the driver tests (TestDriverUnitSums, TestDriverConformance) run them
// on one.
func TestKernelsEmulated(t *testing.T) {
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Fatalf("the kernel emulation needs g++ (Debian: apt-get install g++): %v", err)
	}
	bin := filepath.Join(t.TempDir(), "kvemu")
	if out, err := exec.Command(cxx, "-std=c++20", "-O1", "-pthread", "-w", "-o", bin, "kernels/testdata/kvemu.cc").CombinedOutput(); err != nil {
		t.Fatalf("building the emulation: %v\n%s", err, out)
	}
	r := rand.New(rand.NewPCG(49, 2))
	const base = 0 // the image's offsets are the tables' addresses
	img := make([]byte, 192<<10)
	for i := range img {
		img[i] = byte(r.Uint32())
	}
	for trial := range 10 {
		for _, units := range []bool{true, false} {
			var objs []xferObject
			var want [][]byte
			for range 1 + r.IntN(4) {
				var o xferObject
				var packed []byte
				nsp := r.IntN(4)
				for k := range nsp {
					n := uint64(8 * (1 + r.IntN(512)))
					if r.IntN(6) == 0 {
						n = uint64(8 * (1 + r.IntN(len(img)/8-1024))) // beyond a unit
					}
					off := uint64(8 * r.IntN((len(img)-int(n))/8))
					if units && r.IntN(2) == 0 {
						off &^= 15 // 16-aligned pieces take the vector loop
					}
					if !units {
						n, off = n-uint64(r.IntN(8)), off+uint64(r.IntN(8)) // any alignment, any length
					}
					if units && k == nsp-1 && r.IntN(2) == 0 {
						n -= uint64(1 + r.IntN(7)) // the object ends mid-word
					}
					o.spans = append(o.spans, kSpan{ptr: base + off, objOff: o.len, len: n})
					o.len += n
					packed = append(packed, img[off:off+n]...)
				}
				objs = append(objs, o)
				want = append(want, packed)
			}
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
				parts := emulateKernel(t, bin, kernel, blocks, p, img)
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

// emulateKernel runs kernel over each batch of p on the emulation and
// returns every object's partials, summed over the batches.
func emulateKernel(t *testing.T, bin, kernel string, blocks int, p *xferPlan, img []byte) []uint64 {
	t.Helper()
	l := p.layout()
	buf := make([]byte, l.size)
	p.encode(buf, l)
	spans := buf[:len(p.spans)*kSpanSize]
	partials := make([]uint64, p.nobj)
	file := filepath.Join(t.TempDir(), "tables")
	for bi, b := range p.batches {
		var w bytes.Buffer
		for _, v := range []uint64{uint64(len(b.segs)), uint64(len(p.spans)), b.nchunks, uint64(p.nobj), uint64(len(img)), kFlagSum} {
			_ = binary.Write(&w, binary.LittleEndian, v)
		}
		w.Write(buf[l.segs[bi] : l.segs[bi]+uint64(len(b.segs))*kSegSize])
		w.Write(spans)
		w.Write(img)
		if err := os.WriteFile(file, w.Bytes(), 0o600); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(bin, kernel, strconv.Itoa(blocks), file).Output()
		if err != nil {
			t.Fatalf("kvemu %s, batch %d: %v", kernel, bi, err)
		}
		sc := bufio.NewScanner(bytes.NewReader(out))
		for i := range partials {
			if !sc.Scan() {
				t.Fatalf("kvemu %s, batch %d: %d partials, want %d", kernel, bi, i, len(partials))
			}
			v, err := strconv.ParseUint(sc.Text(), 16, 64)
			if err != nil {
				t.Fatal(fmt.Errorf("kvemu %s: %w", kernel, err))
			}
			partials[i] += v
		}
	}
	return partials
}
