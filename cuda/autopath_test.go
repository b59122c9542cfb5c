package cuda_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/kvtier/kvtier/cuda"
)

// TestAutoPath: on the host backend, which models a driver with batched
// copies, auto moves page runs averaging 256 KiB or more with the copy
// engine (sixteen consecutive 32 KiB pages: one 512 KiB run) and scattered
// pages with the copy kernels, as the CUDA backend does on the H200; both
// place every byte and leave the pages between untouched, and a gather of
// the placed pages reads back what was scattered, with the same sums on
// both paths.
func TestAutoPath(t *testing.T) {
	const page, pages = 32 << 10, 16
	dev := openHost(t)
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	src, err := dev.AllocHost(page * pages)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Release()
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*131 + i>>13)
	}
	var sums [2][]uint64
	for k, c := range []struct {
		name, want string
		block      func(i int) uint64 // the pool block of page i
	}{
		{"consecutive", cuda.PathDMA, func(i int) uint64 { return uint64(i) }},
		{"scattered", cuda.PathSM, func(i int) uint64 { return uint64(2*((i*7)%pages) + 1) }},
	} {
		pool, err := dev.Alloc(2 * page * (pages + 1))
		if err != nil {
			t.Fatal(err)
		}
		const pad = 0xa5
		if err := dev.Write(pool, 0, bytes.Repeat([]byte{pad}, 2*page*(pages+1))); err != nil {
			t.Fatal(err)
		}
		var spans []cuda.Span
		for i := range pages {
			spans = append(spans, cuda.Span{Mem: pool, Off: c.block(i) * page, Len: page})
		}
		objs := []cuda.Object{{HostOff: 0, Spans: spans}}
		op, err := s.Scatter(src, objs)
		if err != nil {
			t.Fatal(err)
		}
		if err := op.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
		if op.Path() != c.want {
			t.Fatalf("%s pages: auto took %q, want %q", c.name, op.Path(), c.want)
		}
		got := make([]byte, 2*page*(pages+1))
		if err := dev.Read(pool, 0, got); err != nil {
			t.Fatal(err)
		}
		placed := map[uint64]int{}
		for i := range pages {
			placed[c.block(i)] = i
		}
		for b := range uint64(2 * (pages + 1)) {
			blk := got[b*page : (b+1)*page]
			if i, ok := placed[b]; ok {
				if !bytes.Equal(blk, src.Bytes()[i*page:(i+1)*page]) {
					t.Fatalf("%s pages: block %d holds other bytes than page %d", c.name, b, i)
				}
			} else if !bytes.Equal(blk, bytes.Repeat([]byte{pad}, page)) {
				t.Fatalf("%s pages: block %d, not a destination, was written", c.name, b)
			}
		}
		back, err := dev.AllocHost(page * pages)
		if err != nil {
			t.Fatal(err)
		}
		gop, err := s.Gather(back, objs)
		if err != nil {
			t.Fatal(err)
		}
		if err := gop.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
		if gop.Path() != c.want || !bytes.Equal(back.Bytes(), src.Bytes()) {
			t.Fatalf("%s pages: the gather (%s) read back other bytes", c.name, gop.Path())
		}
		sums[k] = gop.Sums()
		back.Release()
		pool.Release()
	}
	if len(sums[0]) != 1 || sums[0][0] != sums[1][0] {
		t.Fatalf("sums of the same bytes differ between the paths: %v, %v", sums[0], sums[1])
	}
}

// TestDMATuningValidate: scatters in order cannot be combined with the
// tunings that block the enqueuing thread on the device (the chain's lock
// would stall every other scatter's enqueue); each alone is valid.
func TestDMATuningValidate(t *testing.T) {
	def := cuda.DefaultDMATuning()
	ordered := def
	ordered.OrderScatters = true
	for _, c := range []struct {
		name string
		t    cuda.DMATuning
		ok   bool
	}{
		{"defaults", def, true},
		{"ordered", ordered, true},
		{"ordered, host launch", cuda.DMATuning{SumBatch: def.SumBatch, OrderScatters: true, HostLaunch: true}, false},
		{"ordered, queue", cuda.DMATuning{SumBatch: def.SumBatch, OrderScatters: true, Queue: 64 << 20}, false},
		{"host launch", cuda.DMATuning{SumBatch: def.SumBatch, HostLaunch: true}, true},
		{"no checksum batch", cuda.DMATuning{OrderScatters: true}, false},
	} {
		if err := c.t.Validate(); (err == nil) != c.ok {
			t.Errorf("%s: Validate() = %v, want ok %v", c.name, err, c.ok)
		}
	}
}
