package cudatest

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
)

// Widths of the round trips: byte-odd, around the 16-byte vector width, the
// seed geometries of DESIGN.md (528 and 561 B FP8 MLA rows, 656 B
// fp8_ds_mla, 177408 B packed NVFP4 page, 1085440 B recurrent page) and
// plain powers of two.
var widths = []uint64{1, 15, 16, 17, 528, 561, 656, 4096, 65536, 177408, 1085440}

// layer is one KV pool: page b is [base+b*stride, base+b*stride+width);
// the stride-width bytes after each page are padding.
type layer struct {
	width, stride, base uint64
}

// tailGuard bytes follow the last page of every pool, to catch overruns.
const tailGuard = 29

func (l layer) poolSize(blocks int) uint64 { return l.base + uint64(blocks)*l.stride + tailGuard }

func (l layer) page(b int) uint64 { return l.base + uint64(b)*l.stride }

// rtCase is a round trip: gather objects from source pools into a host
// buffer, scatter them into distinct pages of fresh destination pools.
type rtCase struct {
	layers []layer
	blocks int // pages per pool
	maxPer int // pages per object: 1..maxPer (random lists)
	// lists, if set, are the source pages of each object (duplicates
	// allowed); otherwise they are drawn at random, with replacement.
	lists [][]int
	// hostOffs give the first object's host offset and then the gaps
	// between objects, cyclically; default 1, 3, 7, 9 in random order.
	hostOffs []uint64
	// dests, if set, are the destination pages of the scatter, one per
	// gathered page in order; otherwise distinct pages at random.
	dests []int
	// path, if set, is the Op.Path every Gather and Scatter must report.
	path string
	seed uint64
}

// rtResult is what a round trip left: the host buffer after the Gather,
// the sums of both directions and every destination pool after the
// Scatter.
type rtResult struct {
	host         []byte
	gsums, ssums []uint64
	pools        [][]byte
}

// roundTrip runs c and checks every byte of the host buffer and of every
// pool, the padding included, and the checksums.
func roundTrip(t *testing.T, dev cuda.Device, c rtCase) rtResult {
	t.Helper()
	rng := rand.New(rand.NewPCG(c.seed, 0x6b7674696572))
	s := newStream(t, dev)
	nl := len(c.layers)
	src, dst := make([]cuda.Mem, nl), make([]cuda.Mem, nl)
	srcImg, dstImg, wantDst := make([][]byte, nl), make([][]byte, nl), make([][]byte, nl)
	for l, ly := range c.layers {
		if ly.stride < ly.width {
			t.Fatalf("bad case: layer %d stride %d < width %d", l, ly.stride, ly.width)
		}
		size := ly.poolSize(c.blocks)
		src[l], dst[l] = alloc(t, dev, size), alloc(t, dev, size)
		srcImg[l] = randomBytes(size, c.seed*31+uint64(l))
		dstImg[l] = sentinelBytes(size, byte(l))
		wantDst[l] = append([]byte(nil), dstImg[l]...)
		write(t, dev, src[l], 0, srcImg[l])
		write(t, dev, dst[l], 0, dstImg[l])
	}

	lists := c.lists
	if lists == nil {
		picks := max(1, c.blocks*3/4)
		for picks > 0 {
			k := min(1+rng.IntN(c.maxPer), picks)
			list := make([]int, k)
			for i := range list {
				list[i] = rng.IntN(c.blocks)
			}
			lists = append(lists, list)
			picks -= k
		}
	}
	total := 0
	for _, l := range lists {
		total += len(l)
	}
	if total > c.blocks {
		t.Fatalf("bad case: %d pages gathered, only %d distinct destinations", total, c.blocks)
	}
	dests := rng.Perm(c.blocks)[:total]
	if c.dests != nil {
		if len(c.dests) != total {
			t.Fatalf("bad case: %d destinations for %d pages", len(c.dests), total)
		}
		dests = c.dests
	}
	offs := c.hostOffs
	if offs == nil {
		offs = []uint64{1, 3, 7, 9}
		rng.Shuffle(len(offs), func(i, j int) { offs[i], offs[j] = offs[j], offs[i] })
	}

	var gObjs, sObjs []cuda.Object
	var packed [][]byte
	pos := offs[0]
	k := 0
	for i, list := range lists {
		var gs, ss []cuda.Span
		var want []byte
		for _, b := range list {
			d := dests[k]
			k++
			for l, ly := range c.layers {
				from, to := ly.page(b), ly.page(d)
				gs = append(gs, cuda.Span{Mem: src[l], Off: from, Len: ly.width})
				ss = append(ss, cuda.Span{Mem: dst[l], Off: to, Len: ly.width})
				want = append(want, srcImg[l][from:from+ly.width]...)
				copy(wantDst[l][to:to+ly.width], srcImg[l][from:from+ly.width])
			}
		}
		gObjs = append(gObjs, cuda.Object{HostOff: pos, Spans: gs})
		sObjs = append(sObjs, cuda.Object{HostOff: pos, Spans: ss})
		packed = append(packed, want)
		pos += uint64(len(want)) + offs[(i+1)%len(offs)]
	}

	hb := allocHost(t, dev, pos+5)
	hostImg := sentinelBytes(pos+5, 0x5c)
	copy(hb.Bytes(), hostImg)
	wantHost := append([]byte(nil), hostImg...)
	for i, o := range gObjs {
		copy(wantHost[o.HostOff:], packed[i])
	}

	gsums := transferPath(t, s, hb, gObjs, false, c.path)
	equalBytes(t, "host buffer after Gather (objects and the bytes between them)", hb.Bytes(), wantHost)
	for i, p := range packed {
		if want := checksum.Sum(p); gsums[i] != want {
			t.Fatalf("Gather: object %d (%d B): sum %#016x, want checksum.Sum %#016x", i, len(p), gsums[i], want)
		}
	}
	for l := range c.layers {
		equalBytes(t, fmt.Sprintf("source pool %d after Gather", l), readAll(t, dev, src[l]), srcImg[l])
	}

	ssums := transferPath(t, s, hb, sObjs, true, c.path)
	for i := range ssums {
		if ssums[i] != gsums[i] {
			t.Fatalf("Scatter: object %d: sum %#016x, Gather said %#016x", i, ssums[i], gsums[i])
		}
	}
	for l := range c.layers {
		equalBytes(t, fmt.Sprintf("destination pool %d after Scatter (pages and padding)", l), readAll(t, dev, dst[l]), wantDst[l])
	}
	equalBytes(t, "host buffer after Scatter", hb.Bytes(), wantHost)
	res := rtResult{host: append([]byte(nil), hb.Bytes()...), gsums: gsums, ssums: ssums}
	for l := range c.layers {
		res.pools = append(res.pools, readAll(t, dev, dst[l]))
	}
	return res
}

func testRoundTrips(t *testing.T, open Opener) {
	const budget = 2 << 20 // bytes of pages per pool
	for wi, w := range widths {
		for si, sc := range []struct {
			name         string
			stride, base uint64
		}{
			{"stride=width", w, 0},
			{"stride=width+37", w + 37, 0},
			{"stride=aligned+16,base=7", (w+15)&^15 + 16, 7},
		} {
			t.Run(fmt.Sprintf("width=%d/%s", w, sc.name), func(t *testing.T) {
				dev := openDev(t, open)
				blocks := min(max(int(budget/sc.stride), 3), 24)
				roundTrip(t, dev, rtCase{
					layers: []layer{{w, sc.stride, sc.base}},
					blocks: blocks,
					maxPer: 3,
					seed:   uint64(wi*10 + si + 1),
				})
			})
		}
	}
}

// Objects that span several pools (layers, K and V), each with its own
// width, stride and alignment, including the opaque-tail geometry.
func testMultiMem(t *testing.T, dev cuda.Device) {
	roundTrip(t, dev, rtCase{
		layers: []layer{
			{561 * 16, 561*16 + 37, 0}, // FP8 MLA rows with index tail
			{656 * 16, 656 * 16, 3},    // fp8_ds_mla, unaligned base
			{40, 80, 0},                // opaque tail: declared 40 of stride 80
			{177408, 200000, 1},        // packed NVFP4 page
			{1, 1, 0},
		},
		blocks: 8,
		maxPer: 3,
		seed:   1001,
	})
}

// The same page gathered several times, within one object and across
// objects.
func testDuplicates(t *testing.T, dev cuda.Device) {
	roundTrip(t, dev, rtCase{
		layers: []layer{{561, 598, 0}, {17, 17, 5}},
		blocks: 8,
		lists:  [][]int{{2, 2, 2}, {0}, {2}, {5, 0, 5}},
		seed:   1002,
	})
}

// Every host offset is odd; the device side is 16-byte aligned, so only the
// host misalignment varies.
func testUnalignedHost(t *testing.T, dev cuda.Device) {
	for _, off := range []uint64{1, 3, 7, 9} {
		for _, w := range []uint64{16, 17, 656, 4096} {
			t.Run(fmt.Sprintf("hostoff=%d/width=%d", off, w), func(t *testing.T) {
				roundTrip(t, dev, rtCase{
					layers:   []layer{{w, (w + 15) &^ 15, 0}},
					blocks:   6,
					maxPer:   2,
					hostOffs: []uint64{off},
					seed:     2000 + off*100 + w,
				})
			})
		}
	}
}

// Empty lists, objects without spans and spans of length 0: nothing is
// written and every object's sum is that of zero bytes.
func testEmpty(t *testing.T, dev cuda.Device) {
	s := newStream(t, dev)
	m := alloc(t, dev, 256)
	pool := sentinelBytes(256, 1)
	write(t, dev, m, 0, pool)
	hb := allocHost(t, dev, 64)
	host := sentinelBytes(64, 2)
	copy(hb.Bytes(), host)
	empty := checksum.Sum(nil)

	if got := gather(t, s, hb, nil); len(got) != 0 {
		t.Fatalf("Gather(nil): %d sums", len(got))
	}
	if got := scatter(t, s, hb, []cuda.Object{}); len(got) != 0 {
		t.Fatalf("Scatter(empty): %d sums", len(got))
	}
	objs := []cuda.Object{
		{HostOff: 0},
		{HostOff: 64, Spans: []cuda.Span{{Mem: m, Off: 256, Len: 0}}},
		{HostOff: 3, Spans: []cuda.Span{{Mem: m, Off: 5, Len: 0}, {Mem: m, Off: 0, Len: 0}}},
	}
	for _, sums := range [][]uint64{gather(t, s, hb, objs), scatter(t, s, hb, objs)} {
		for i, got := range sums {
			if got != empty {
				t.Fatalf("object %d of 0 B: sum %#016x, want %#016x", i, got, empty)
			}
		}
	}
	equalBytes(t, "host buffer", hb.Bytes(), host)
	equalBytes(t, "pool", readAll(t, dev, m), pool)
}

// The device reproduces the kvsum64 vectors whole and split at odd piece
// boundaries across two pools, in both directions.
func testChecksumVectors(t *testing.T, dev cuda.Device) {
	s := newStream(t, dev)
	a, b := alloc(t, dev, 4096+64), alloc(t, dev, 4096+64)
	whole, back := alloc(t, dev, 4096+64), alloc(t, dev, 4096+64)
	hb := allocHost(t, dev, 4096+64)
	for _, cv := range checksum.Vectors {
		v := struct{ n, want uint64 }{uint64(cv.N), cv.Sum}
		in := checksum.VectorInput(cv.N)
		if got := checksum.Sum(in); got != v.want {
			t.Fatalf("checksum.Sum(VectorInput(%d)) = %#016x, want %#016x: package checksum changed", v.n, got, v.want)
		}
		cut := v.n / 3
		write(t, dev, a, 5, in[:cut])
		write(t, dev, b, 11, in[cut:])
		write(t, dev, whole, 7, in)
		for _, o := range []cuda.Object{
			{HostOff: 3, Spans: []cuda.Span{{Mem: a, Off: 5, Len: cut}, {Mem: b, Off: 11, Len: v.n - cut}}},
			{HostOff: 0, Spans: []cuda.Span{{Mem: whole, Off: 7, Len: v.n}}},
		} {
			if got := gather(t, s, hb, []cuda.Object{o})[0]; got != v.want {
				t.Fatalf("n=%d, %d spans: Gather sum %#016x, want %#016x", v.n, len(o.Spans), got, v.want)
			}
			equalBytes(t, fmt.Sprintf("n=%d gathered", v.n), hb.Bytes()[o.HostOff:o.HostOff+v.n], in)
			so := cuda.Object{HostOff: o.HostOff, Spans: []cuda.Span{{Mem: back, Off: 9, Len: v.n}}}
			if got := scatter(t, s, hb, []cuda.Object{so})[0]; got != v.want {
				t.Fatalf("n=%d: Scatter sum %#016x, want %#016x", v.n, got, v.want)
			}
			got := make([]byte, v.n)
			if err := dev.Read(back, 9, got); err != nil {
				t.Fatal(err)
			}
			equalBytes(t, fmt.Sprintf("n=%d scattered", v.n), got, in)
		}
	}
}

// Offsets above 2^31 and a page straddling 2^31 (large recurrent pool of
// DESIGN.md: 1,007,616 B pages, block id 2198).
func testLargeOffsets(t *testing.T, dev cuda.Device) {
	if testing.Short() {
		t.Skip("needs a 2.2 GB allocation")
	}
	const width = 1536 * 656
	ly := layer{width, width, 0}
	const blocks = 2199
	m := alloc(t, dev, uint64(blocks)*width)
	if ly.page(2131) >= 1<<31 || ly.page(2132) <= 1<<31 || ly.page(2198) <= 1<<31 {
		t.Fatal("bad case: pages do not straddle 2^31")
	}
	s := newStream(t, dev)
	srcPages := []int{2198, 2131}
	dstPages := []int{0, 2197}
	checked := []int{0, 1, 2130, 2131, 2132, 2196, 2197, 2198}
	want := map[int][]byte{}
	for _, b := range checked {
		want[b] = sentinelBytes(width, byte(b))
	}
	for i, b := range srcPages {
		want[b] = randomBytes(width, uint64(7000+i))
	}
	for _, b := range checked {
		write(t, dev, m, ly.page(b), want[b])
	}
	hb := allocHost(t, dev, 2*width+8)
	var gObjs, sObjs []cuda.Object
	for i := range srcPages {
		off := uint64(1 + i*(width+3))
		gObjs = append(gObjs, cuda.Object{HostOff: off, Spans: []cuda.Span{{Mem: m, Off: ly.page(srcPages[i]), Len: width}}})
		sObjs = append(sObjs, cuda.Object{HostOff: off, Spans: []cuda.Span{{Mem: m, Off: ly.page(dstPages[i]), Len: width}}})
	}
	gs := gather(t, s, hb, gObjs)
	for i, b := range srcPages {
		equalBytes(t, fmt.Sprintf("gathered page %d", b), hb.Bytes()[gObjs[i].HostOff:gObjs[i].HostOff+width], want[b])
		if sum := checksum.Sum(want[b]); gs[i] != sum {
			t.Fatalf("page %d: Gather sum %#016x, want %#016x", b, gs[i], sum)
		}
	}
	ss := scatter(t, s, hb, sObjs)
	for i, b := range dstPages {
		want[b] = want[srcPages[i]]
		if ss[i] != gs[i] {
			t.Fatalf("Scatter sum %d: %#016x, Gather said %#016x", i, ss[i], gs[i])
		}
	}
	got := make([]byte, width)
	for _, b := range checked {
		if err := dev.Read(m, ly.page(b), got); err != nil {
			t.Fatalf("Read page %d: %v", b, err)
		}
		equalBytes(t, fmt.Sprintf("page %d (offset %d)", b, ly.page(b)), got, want[b])
	}
}
