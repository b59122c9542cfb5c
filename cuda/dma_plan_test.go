package cuda

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"sort"
	"testing"

	"github.com/kvtier/kvtier/checksum"
)

// xfer builds a checked transfer of objects given as (hostOff, spans with
// their Mem index); object offsets follow from the span order.
type tSpan struct {
	mem      uint32
	ptr, len uint64
}

func xfer(objs []uint64, spans [][]tSpan) *checkedTransfer[int] {
	t := &checkedTransfer[int]{}
	for i, h := range objs {
		o := checkedObject{hostOff: h, first: len(t.spans)}
		for _, sp := range spans[i] {
			t.spans = append(t.spans, kSpan{ptr: sp.ptr, objOff: o.len, len: sp.len})
			t.memOf = append(t.memOf, sp.mem)
			o.len += sp.len
			o.n++
		}
		t.objs = append(t.objs, o)
	}
	return t
}

func TestPlanDMA(t *testing.T) {
	const base = 1 << 40
	for _, c := range []struct {
		name  string
		objs  []uint64
		spans [][]tSpan
		want  []dmaCopy
	}{
		{"contiguous pages make one copy", []uint64{100}, [][]tSpan{{{0, base, 64}, {0, base + 64, 64}, {0, base + 128, 32}}},
			[]dmaCopy{{dev: base, pitch: 160, host: 100, width: 160, rows: 1}}},
		{"pages at a pitch make one 2D copy", []uint64{0}, [][]tSpan{{{0, base, 64}, {0, base + 100, 64}, {0, base + 200, 64}, {0, base + 300, 64}}},
			[]dmaCopy{{dev: base, pitch: 100, host: 0, width: 64, rows: 4}}},
		{"a row of another width or pitch ends a 2D copy", []uint64{0}, [][]tSpan{{{0, base, 64}, {0, base + 100, 64}, {0, base + 200, 32}, {0, base + 400, 64}, {0, base + 401, 64}}},
			[]dmaCopy{{dev: base, pitch: 100, width: 64, rows: 2}, {dev: base + 200, pitch: 32, host: 128, width: 32, rows: 1},
				{dev: base + 400, pitch: 64, host: 160, width: 64, rows: 1}, {dev: base + 401, pitch: 64, host: 224, width: 64, rows: 1}}},
		{"another Mem never continues a copy", []uint64{0}, [][]tSpan{{{0, base, 64}, {1, base + 64, 64}}},
			[]dmaCopy{{dev: base, pitch: 64, width: 64, rows: 1}, {dev: base + 64, pitch: 64, host: 64, width: 64, rows: 1, mem: 1}}},
		{"objects back to back share a copy", []uint64{8, 72}, [][]tSpan{{{0, base, 64}}, {{0, base + 64, 64}}},
			[]dmaCopy{{dev: base, pitch: 128, host: 8, width: 128, rows: 1}}},
		{"a host gap splits", []uint64{8, 73}, [][]tSpan{{{0, base, 64}}, {{0, base + 64, 64}}},
			[]dmaCopy{{dev: base, pitch: 64, host: 8, width: 64, rows: 1}, {dev: base + 64, pitch: 64, host: 73, width: 64, rows: 1, obj: 1}}},
		{"a page gathered twice is two copies", []uint64{0}, [][]tSpan{{{0, base, 64}, {0, base, 64}}},
			[]dmaCopy{{dev: base, pitch: 64, width: 64, rows: 1}, {dev: base, pitch: 64, host: 64, width: 64, rows: 1}}},
		{"overlapping rows are no 2D copy", []uint64{0}, [][]tSpan{{{0, base, 64}, {0, base + 32, 64}}},
			[]dmaCopy{{dev: base, pitch: 64, width: 64, rows: 1}, {dev: base + 32, pitch: 64, host: 64, width: 64, rows: 1}}},
		{"a pitch past the driver's limit splits", []uint64{0}, [][]tSpan{{{0, base, 64}, {0, base + dmaMaxPitch + 1, 64}}},
			[]dmaCopy{{dev: base, pitch: 64, width: 64, rows: 1}, {dev: base + dmaMaxPitch + 1, pitch: 64, host: 64, width: 64, rows: 1}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, ok := planDMA(xfer(c.objs, c.spans), -1)
			if !ok || !slices.Equal(got, c.want) {
				t.Fatalf("planDMA: %+v (%v), want %+v", got, ok, c.want)
			}
			if len(c.want) > 1 {
				if got, ok := planDMA(xfer(c.objs, c.spans), len(c.want)-1); ok || got != nil {
					t.Fatalf("planDMA with limit %d: %+v, %v; want nil, false", len(c.want)-1, got, ok)
				}
			}
		})
	}
}

// The rule: forced paths are kept, a transfer of no bytes takes the copy
// kernels, and auto, on a device that batches its copies, picks the copy
// engine from an average copy of dmaMinCopy bytes; on one that does not,
// auto never does.
func TestUseDMA(t *testing.T) {
	const base = 1 << 40
	if _, dma := useDMA(xfer([]uint64{0}, [][]tSpan{{{0, base, 4 * dmaMinCopy}}}), pathAuto, false); dma {
		t.Fatal("auto picked DMA for one 1 MiB copy without batched copies: the H200 measured the copy kernels faster")
	}
	if _, dma := useDMA(xfer([]uint64{0}, [][]tSpan{{{0, base, 4 * dmaMinCopy}}}), pathDMA, false); !dma {
		t.Fatal("forced DMA not kept without batched copies")
	}
	// n pages of width at a stride; with scattered, each in another Mem
	// than the one before (no two make one copy).
	pages := func(n int, width, stride uint64, scattered bool) *checkedTransfer[int] {
		var sp []tSpan
		for i := range n {
			m := uint32(0)
			if scattered {
				m = uint32(i % 2)
			}
			sp = append(sp, tSpan{m, base + uint64(i)*stride, width})
		}
		return xfer([]uint64{0}, [][]tSpan{sp})
	}
	for _, c := range []struct {
		name string
		t    *checkedTransfer[int]
		path copyPath
		want int // copies, or -1: the copy kernels
	}{
		{"scattered 32 KiB pages", pages(16, 32<<10, 32<<10, true), pathAuto, -1},
		{"16 consecutive 32 KiB pages (one 512 KiB copy)", pages(16, 32<<10, 32<<10, false), pathAuto, 1},
		{"2D: 64 KiB pages at a pitch", pages(16, 64<<10, 100<<10, false), pathAuto, 1},
		{"copies of exactly dmaMinCopy", pages(4, dmaMinCopy, dmaMinCopy, true), pathAuto, 4},
		{"one byte short", xfer([]uint64{0}, [][]tSpan{{{0, base, dmaMinCopy - 1}}}), pathAuto, -1},
		{"forced sm", pages(16, 32<<10, 32<<10, false), pathSM, -1},
		{"forced dma, scattered 561 B rows", pages(5, 561, 561, true), pathDMA, 5},
		{"no bytes", xfer([]uint64{0}, [][]tSpan{nil}), pathDMA, -1},
	} {
		copies, ok := useDMA(c.t, c.path, true)
		got := len(copies)
		if !ok {
			got = -1
		}
		if got != c.want {
			t.Errorf("%s: %d copies (ok %v), want %d", c.name, len(copies), ok, c.want)
		}
	}
}

// On random transfers the copies move every packed byte exactly once,
// between the host offset and the device address its span gives it.
func TestPlanDMACoversEveryByte(t *testing.T) {
	r := rand.New(rand.NewPCG(25, 2))
	const base = 1 << 30
	for trial := range 300 {
		var objs []uint64
		var spans [][]tSpan
		host := uint64(r.IntN(5))
		for range 1 + r.IntN(4) {
			objs = append(objs, host)
			var sp []tSpan
			ptr := base + uint64(r.IntN(4))*1000
			width := uint64(1 + r.IntN(40))
			for range r.IntN(6) {
				if r.IntN(3) == 0 {
					width = uint64(1 + r.IntN(40))
				}
				sp = append(sp, tSpan{uint32(r.IntN(2)), ptr, width})
				host += width
				ptr += width + []uint64{0, 0, 7, 50}[r.IntN(4)]
			}
			spans = append(spans, sp)
			host += uint64(r.IntN(2))
		}
		tr := xfer(objs, spans)
		want := map[uint64][2]uint64{} // host byte -> Mem, device byte
		for _, o := range tr.objs {
			for k := o.first; k < o.first+o.n; k++ {
				sp := tr.spans[k]
				for b := range sp.len {
					want[o.hostOff+sp.objOff+b] = [2]uint64{uint64(tr.memOf[k]), sp.ptr + b}
				}
			}
		}
		copies, ok := planDMA(tr, -1)
		if !ok {
			t.Fatal("planDMA refused without a limit")
		}
		got := map[uint64][2]uint64{}
		for _, c := range copies {
			if c.rows > 1 && c.pitch < c.width {
				t.Fatalf("trial %d: copy %+v has a pitch under its width", trial, c)
			}
			for row := range c.rows {
				for b := range c.width {
					h := c.host + row*c.width + b
					if _, dup := got[h]; dup {
						t.Fatalf("trial %d: host byte %d copied twice", trial, h)
					}
					got[h] = [2]uint64{uint64(c.mem), c.dev + row*c.pitch + b}
				}
			}
		}
		if len(got) != len(want) {
			t.Fatalf("trial %d: %d bytes copied, want %d", trial, len(got), len(want))
		}
		for h, w := range want {
			if got[h] != w {
				t.Fatalf("trial %d: host byte %d from %v, want %v", trial, h, got[h], w)
			}
		}
	}
}

// The checksum batches of a DMA transfer: whole objects in order, batches
// of at least the batch size but the last, every segment at a 16-aligned
// virtual address (two whole object words per chunk), empty objects left
// out, every object's spans named.
func TestPlanSums(t *testing.T) {
	lens := []uint64{100, 0, 4096, 17, 5000, 3, 0}
	var objs []xferObject
	for i, n := range lens {
		o := xferObject{hostOff: uint64(i) * 10000, len: n}
		if n > 0 {
			o.spans = []kSpan{{ptr: 1 << 40, len: n}}
		}
		objs = append(objs, o)
	}
	p, ends, err := planSums(objs, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int{3, 5, 7}; !slices.Equal(ends, want) {
		t.Fatalf("ends %v, want %v", ends, want)
	}
	var got []uint32
	for _, b := range p.batches {
		var chunks uint64
		for _, s := range b.segs {
			if s.packed != 16*s.chunkBase || s.chunkBase != chunks || s.objOff != 0 || s.len != lens[s.sum] {
				t.Fatalf("segment %+v: want packed = 16*chunkBase = 16*%d, object offset 0, length %d", s, chunks, lens[s.sum])
			}
			if s.nspans != 1 || p.spans[s.spanBase].len != s.len {
				t.Fatalf("segment %+v does not name its object's span", s)
			}
			chunks += (s.len + 15) / 16
			got = append(got, s.sum)
		}
		if b.nchunks != chunks {
			t.Fatalf("batch of %d chunks, segments make %d", b.nchunks, chunks)
		}
	}
	if want := []uint32{0, 2, 3, 4, 5}; !slices.Equal(got, want) {
		t.Fatalf("objects %v, want %v", got, want)
	}
}

// A scatter's checksum batch runs only after every copy into its objects,
// and as soon as that is so.
func TestSumsAfter(t *testing.T) {
	r := rand.New(rand.NewPCG(25, 3))
	for trial := range 500 {
		nobj := 1 + r.IntN(8)
		// Copies in object order; a copy may run on into later objects.
		var copies []dmaCopy
		var last []int // the object of each copy's last byte
		for o := 0; o < nobj; {
			end := min(nobj-1, o+r.IntN(3)-1)
			end = max(end, o)
			for range r.IntN(3) { // copies within object o
				copies, last = append(copies, dmaCopy{obj: o}), append(last, o)
			}
			copies, last = append(copies, dmaCopy{obj: o}), append(last, end)
			o = end
			if r.IntN(2) == 0 || end == nobj-1 {
				o = end + 1
			}
		}
		var ends []int
		for e := 1; e <= nobj; e++ {
			if r.IntN(2) == 0 || e == nobj {
				ends = append(ends, e)
			}
		}
		after := sumsAfter(copies, ends)
		for b, end := range ends {
			// The first copy after which batch b may run: every copy
			// touching an object < end has landed.
			want := 0
			for ci := range copies {
				if copies[ci].obj < end {
					want = ci
				}
			}
			first := -1
			for ci, n := range after {
				if n > b {
					first = ci
					break
				}
			}
			if first != want {
				t.Fatalf("trial %d: batch %d (objects < %d) runs after copy %d, want %d (copies %+v, last %v, after %v)",
					trial, b, end, first, want, copies, last, after)
			}
		}
		if after[len(after)-1] != len(ends) {
			t.Fatalf("trial %d: %d of %d batches after the last copy", trial, after[len(after)-1], len(ends))
		}
	}
}

// emulateChecksum computes, on the CPU, what kv_checksum (kvcopy.cu:
// copy<false> with FLAG_SUM|FLAG_NOSTORE) adds to each object's partial
// for the batches of p: chunk by chunk, the chunk's segment bytes read
// from the spans through read, hashed as the two object words the chunk
// holds. It follows the kernel's arithmetic for segments whose packed side
// is 8-aligned (planSums makes them 16-aligned), where no word crosses
// into the next lane's chunk.
func emulateChecksum(t *testing.T, p *xferPlan, nobj int, read func(ptr, n uint64) []byte) []uint64 {
	partials := make([]uint64, nobj)
	for _, b := range p.batches {
		for g := uint64(0); g < b.nchunks; g++ {
			si := sort.Search(len(b.segs), func(i int) bool { return b.segs[i].chunkBase > g }) - 1
			s := b.segs[si]
			if s.packed&7 != 0 {
				t.Fatalf("segment %+v: packed side not 8-aligned", s)
			}
			c := s.packed&^15 + 16*(g-s.chunkBase)
			a := int64(c - s.packed)
			from := uint64(max(a, 0))
			to := min(uint64(a+16), s.len)
			var v [16]byte
			for x := from; x < to; {
				// findSpan: the last span of the object with objOff <= x.
				spans := p.spans[s.spanBase : s.spanBase+s.nspans]
				k := sort.Search(len(spans), func(i int) bool { return spans[i].objOff > s.objOff+x }) - 1
				sp := spans[k]
				in := s.objOff + x - sp.objOff
				n := min(sp.len-in, to-x)
				copy(v[int64(x)-a:], read(sp.ptr+in, n))
				x += n
			}
			lo, hi := binary.LittleEndian.Uint64(v[:8]), binary.LittleEndian.Uint64(v[8:])
			var term uint64
			if a >= 0 && a < int64(s.len) {
				term += checksum.Term((s.objOff+uint64(a))>>3, lo)
			}
			if a+8 < int64(s.len) {
				term += checksum.Term((s.objOff+uint64(a+8))>>3, hi)
			}
			partials[s.sum] += term
		}
	}
	return partials
}

// planSums' tables, read as kv_checksum reads them, give every object's
// kvsum64: objects of random sizes made of random spans of a device image,
// in batches small enough that most transfers take several.
func TestPlanSumsGivesTheSums(t *testing.T) {
	r := rand.New(rand.NewPCG(25, 4))
	const base = 1 << 36
	img := make([]byte, 1<<16)
	for i := range img {
		img[i] = byte(r.Uint32())
	}
	read := func(ptr, n uint64) []byte { return img[ptr-base : ptr-base+n] }
	for trial := range 200 {
		var objs []xferObject
		var want [][]byte
		for range 1 + r.IntN(6) {
			var o xferObject
			var packed []byte
			for range r.IntN(5) {
				off, n := uint64(r.IntN(len(img)-600)), uint64(1+r.IntN(600))
				o.spans = append(o.spans, kSpan{ptr: base + off, objOff: o.len, len: n})
				o.len += n
				packed = append(packed, img[off:off+n]...)
			}
			objs = append(objs, o)
			want = append(want, packed)
		}
		p, _, err := planSums(objs, uint64(1+r.IntN(2000)))
		if err != nil {
			t.Fatal(err)
		}
		parts := emulateChecksum(t, p, len(objs), read)
		for i, pk := range want {
			if got := checksum.Finish(parts[i], objs[i].len); got != checksum.Sum(pk) {
				t.Fatalf("trial %d object %d (%d B, %d spans): sum %#x, want %#x", trial, i, len(pk), len(objs[i].spans), got, checksum.Sum(pk))
			}
		}
	}
}

// emulateUnits computes, on the CPU, what kv_sum_units (kvcopy.cu) adds to
// each object's partial for the batches of p, lane by lane as the kernel
// walks a unit: the 16-byte loop in rounds of four loads a lane where the
// unit is 16-aligned, the word loop after it, lane 0's zero-padded last
// word.
func emulateUnits(t *testing.T, p *xferPlan, nobj int, read func(ptr, n uint64) []byte) []uint64 {
	if !p.units {
		t.Fatal("not a units plan")
	}
	partials := make([]uint64, nobj)
	word := func(ptr uint64) uint64 { return binary.LittleEndian.Uint64(read(ptr, 8)) }
	for _, b := range p.batches {
		if uint64(len(b.segs)) != b.nchunks {
			t.Fatalf("batch of %d units counts %d", len(b.segs), b.nchunks)
		}
		for _, s := range b.segs {
			i0, words := s.objOff>>3, s.len>>3
			var sum uint64
			for lane := uint64(0); lane < 32; lane++ {
				var tl uint64
				k := uint64(0)
				if s.packed%16 == 0 {
					pairs := words >> 1
					j := lane
					for ; j+96 < pairs; j += 128 {
						for _, d := range []uint64{0, 32, 64, 96} {
							q := s.packed + 16*(j+d)
							tl += checksum.Term(i0+2*(j+d), word(q)) + checksum.Term(i0+2*(j+d)+1, word(q+8))
						}
					}
					for ; j < pairs; j += 32 {
						q := s.packed + 16*j
						tl += checksum.Term(i0+2*j, word(q)) + checksum.Term(i0+2*j+1, word(q+8))
					}
					k = 2 * pairs
				}
				for j := k + lane; j < words; j += 32 {
					tl += checksum.Term(i0+j, word(s.packed+8*j))
				}
				if rem := s.len & 7; rem != 0 && lane == 0 {
					var w [8]byte
					copy(w[:], read(s.packed+8*words, rem))
					tl += checksum.Term(i0+words, binary.LittleEndian.Uint64(w[:]))
				}
				sum += tl
			}
			partials[s.sum] += sum
		}
	}
	return partials
}

// planUnits' tables, read as kv_sum_units reads them, give every object's
// kvsum64: word-aligned spans of random lengths (runs longer than a unit
// among them, cut into units), 16-aligned and only 8-aligned, the last
// span of an object ending mid-word; batches of random sizes end at the
// same objects as planSums' do.
func TestPlanUnitsGivesTheSums(t *testing.T) {
	r := rand.New(rand.NewPCG(26, 1))
	const base = 1 << 36
	img := make([]byte, 3*kUnitBytes)
	for i := range img {
		img[i] = byte(r.Uint32())
	}
	read := func(ptr, n uint64) []byte { return img[ptr-base : ptr-base+n] }
	units := 0
	for trial := range 300 {
		objs, want := randomWordObjects(r, img, base, 6, 5, 64, true)
		batch := uint64(1 + r.IntN(4*kUnitBytes))
		p, ends, ok, err := planUnits(objs, batch)
		if err != nil || !ok {
			t.Fatalf("trial %d: planUnits: ok %v, %v", trial, ok, err)
		}
		_, sumEnds, err := planSums(objs, batch)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(ends, sumEnds) {
			t.Fatalf("trial %d: batches end at objects %v, planSums' at %v", trial, ends, sumEnds)
		}
		for _, b := range p.batches {
			for _, s := range b.segs {
				if s.len == 0 || s.len > kUnitBytes || s.objOff%8 != 0 || s.packed%8 != 0 {
					t.Fatalf("trial %d: unit %+v", trial, s)
				}
				units++
			}
		}
		parts := emulateUnits(t, p, len(objs), read)
		for i, pk := range want {
			if got := checksum.Finish(parts[i], objs[i].len); got != checksum.Sum(pk) {
				t.Fatalf("trial %d object %d (%d B, %d spans): sum %#x, want %#x", trial, i, len(pk), len(objs[i].spans), got, checksum.Sum(pk))
			}
		}
	}
	if units == 0 {
		t.Fatal("no units planned")
	}
}

// A span that would make kv_sum_units read a word across two spans, or a
// word at an unaligned address, leaves the transfer to kv_checksum.
func TestPlanUnitsRefusesUnalignedSpans(t *testing.T) {
	const base = 1 << 36
	span := func(ptr, objOff, n uint64) kSpan { return kSpan{ptr: base + ptr, objOff: objOff, len: n} }
	for _, c := range []struct {
		name  string
		spans []kSpan
		ok    bool
	}{
		{"aligned", []kSpan{span(0, 0, 64), span(4096, 64, 24)}, true},
		{"last span ends mid-word", []kSpan{span(0, 0, 64), span(4096, 64, 21)}, true},
		{"8-aligned, not 16", []kSpan{span(8, 0, 40)}, true},
		{"device address off a word", []kSpan{span(4, 0, 64)}, false},
		{"inner span ends mid-word", []kSpan{span(0, 0, 60), span(4096, 60, 4)}, false},
		{"561-byte rows", []kSpan{span(0, 0, 561), span(1024, 561, 561)}, false},
	} {
		o := xferObject{spans: c.spans}
		for _, sp := range c.spans {
			o.len += sp.len
		}
		p, _, ok, err := planUnits([]xferObject{{}, o}, 1<<30)
		if err != nil || ok != c.ok {
			t.Errorf("%s: ok %v, err %v; want ok %v", c.name, ok, err, c.ok)
		}
		if ok && (len(p.batches) != 1 || p.batches[0].segs[0].sum != 1) {
			t.Errorf("%s: batches %+v", c.name, p.batches)
		}
	}
}

// randomWordObjects makes up to maxObjs objects of up to maxSpans spans each
// over img (at device address base), and their packed bytes: spans of up
// to short words, one in seven longer (up to the image less 8 KiB);
// aligned: at 8-aligned offsets, half of them 16-aligned, an object's
// last span ending mid-word half the time; else at any offset and of any
// length.
func randomWordObjects(r *rand.Rand, img []byte, base uint64, maxObjs, maxSpans, short int, aligned bool) ([]xferObject, [][]byte) {
	var objs []xferObject
	var want [][]byte
	for range 1 + r.IntN(maxObjs) {
		var o xferObject
		var packed []byte
		nsp := r.IntN(maxSpans + 1)
		for k := range nsp {
			n := uint64(8 * (1 + r.IntN(short)))
			if r.IntN(7) == 0 {
				n = uint64(8 * (1 + r.IntN(len(img)/8-1024)))
			}
			off := uint64(8 * r.IntN((len(img)-int(n))/8))
			switch {
			case !aligned:
				n, off = n-uint64(r.IntN(8)), off+uint64(r.IntN(8))
			case r.IntN(2) == 0:
				off &^= 15
			}
			if aligned && k == nsp-1 && r.IntN(2) == 0 {
				n -= uint64(1 + r.IntN(7)) // the object ends mid-word
			}
			o.spans = append(o.spans, kSpan{ptr: base + off, objOff: o.len, len: n})
			o.len += n
			packed = append(packed, img[off:off+n]...)
		}
		objs = append(objs, o)
		want = append(want, packed)
	}
	return objs, want
}
