//go:build cgo && linux

package cuda

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
)

func openDriverT(t *testing.T) *driverDevice {
	t.Helper()
	d, err := openDriver(0)
	if errors.Is(err, ErrNoDriver) {
		t.Skipf("CUDA backend not testable here: %v", err)
	}
	if err != nil {
		t.Fatalf("OpenCUDA(0): %v", err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return d
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func (c *refcount) isFreed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.freed
}

// C1: releasing an event (an interprocess one, as an engine's producer
// event is) while a stream still waits on it neither destroys the driver
// event under the wait nor lets the waiting stream run early; the driver
// event is destroyed once the stream has passed the wait.
func TestDriverEventHeldWhileStreamWaits(t *testing.T) {
	d := openDriverT(t)
	const delay = 400 * time.Millisecond
	prod, cons := must(d.NewStream())(t), must(d.NewStream())(t)
	m := must(d.Alloc(4096))(t)
	old, fresh := bytes.Repeat([]byte{0x5a}, 4096), make([]byte, 4096)
	for i := range fresh {
		fresh[i] = byte(i*7 + 1)
	}
	if err := d.Write(m, 0, old); err != nil {
		t.Fatal(err)
	}
	ev := must(d.NewEvent(true))(t)
	if err := prod.Delay(delay); err != nil {
		t.Fatal(err)
	}
	if _, err := prod.Upload(m, 0, fresh); err != nil {
		t.Fatal(err)
	}
	if err := prod.Record(ev); err != nil {
		t.Fatal(err)
	}
	if err := cons.WaitEvent(ev); err != nil {
		t.Fatal(err)
	}
	core := ev.(*driverEvent).core
	if err := ev.Release(); err != nil {
		t.Fatal(err)
	}
	if core.refs.isFreed() {
		t.Fatal("the driver event was destroyed while a stream waits on it")
	}
	hb := must(d.AllocHost(4096))(t)
	op, err := cons.Gather(hb, []Object{{Spans: []Span{{Mem: m, Len: 4096}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := op.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(hb.Bytes(), fresh) {
		t.Fatal("the stream ran past the wait on the released event")
	}
	if op.Sums()[0] != checksum.Sum(fresh) {
		t.Fatal("sum differs")
	}
	if err := cons.Synchronize(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if !core.refs.isFreed() {
		t.Fatal("the driver event outlived the last wait on it")
	}
	if err := cons.WaitEvent(ev); !errors.Is(err, ErrReleased) {
		t.Fatalf("WaitEvent on the released event: %v, want ErrReleased", err)
	}
	for _, s := range []Stream{prod, cons} {
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

func must[T any](v T, err error) func(*testing.T) T {
	return func(t *testing.T) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// Staged transfers of many objects at odd host offsets through tiny staging
// halves, so objects split across batches at every alignment.
func TestDriverStagedBatches(t *testing.T) {
	d := openDriverT(t)
	d.mode, d.stageHalf = modeStaged, 3*minPiece+16*7
	s := must(d.NewStream())(t)
	r := rand.New(rand.NewPCG(3, 5))
	const stride, blocks = 561*64 + 37, 96
	src := must(d.Alloc(stride * blocks))(t)
	dst := must(d.Alloc(stride * blocks))(t)
	img := make([]byte, stride*blocks)
	for i := range img {
		img[i] = byte(r.Uint32())
	}
	pad := bytes.Repeat([]byte{0xee}, stride*blocks)
	if err := d.Write(src, 0, img); err != nil {
		t.Fatal(err)
	}
	if err := d.Write(dst, 0, pad); err != nil {
		t.Fatal(err)
	}
	perm := r.Perm(blocks)
	var gObjs, sObjs []Object
	var packed [][]byte
	host := uint64(3)
	for o := 0; o+3 <= blocks; o += 3 {
		var g, sc []Span
		var want []byte
		for _, b := range perm[o : o+3] {
			w := uint64(561 * (1 + r.IntN(64)))
			g = append(g, Span{Mem: src, Off: uint64(b) * stride, Len: w})
			sc = append(sc, Span{Mem: dst, Off: uint64(b) * stride, Len: w})
			want = append(want, img[uint64(b)*stride:uint64(b)*stride+w]...)
		}
		gObjs = append(gObjs, Object{HostOff: host, Spans: g})
		sObjs = append(sObjs, Object{HostOff: host, Spans: sc})
		packed = append(packed, want)
		host += uint64(len(want)) + uint64(r.IntN(3))*7
	}
	hb := must(d.AllocHost(host + 9))(t)
	gsums := gatherChecked(t, s, hb, gObjs, packed)
	sums := scatterChecked(t, d, s, hb, sObjs, dst, img, pad)
	for i := range sObjs {
		if sums[i] != gsums[i] {
			t.Fatalf("object %d: scatter sum differs", i)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

// gatherChecked gathers objs into hb and checks every object's packed
// bytes and its sum (kvsum64 of packed[i]); it returns the sums.
func gatherChecked(t *testing.T, s Stream, hb HostBuf, objs []Object, packed [][]byte) []uint64 {
	t.Helper()
	op := must(s.Gather(hb, objs))(t)
	if err := op.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for i, o := range objs {
		if !bytes.Equal(hb.Bytes()[o.HostOff:o.HostOff+uint64(len(packed[i]))], packed[i]) {
			t.Fatalf("object %d differs", i)
		}
		if op.Sums()[i] != checksum.Sum(packed[i]) {
			t.Fatalf("object %d: gather sum differs", i)
		}
	}
	return op.Sums()
}

// scatterChecked scatters objs from hb into dst, a pool that held pad and
// whose spans then hold img's bytes at the same offsets, checks the whole
// pool byte for byte (pages and padding) and returns the scatter's sums.
func scatterChecked(t *testing.T, d *driverDevice, s Stream, hb HostBuf, objs []Object, dst Mem, img, pad []byte) []uint64 {
	t.Helper()
	op := must(s.Scatter(hb, objs))(t)
	if err := op.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	want := append([]byte(nil), pad...)
	for _, o := range objs {
		for _, sp := range o.Spans {
			copy(want[sp.Off:sp.Off+sp.Len], img[sp.Off:sp.Off+sp.Len])
		}
	}
	got := make([]byte, len(want))
	if err := d.Read(dst, 0, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("destination pool differs (pages or padding)")
	}
	return op.Sums()
}

// A driver that exports cuMemcpyBatchAsync but refuses it: the DMA path
// enqueues the same copies a call each, byte-exact with the padding
// untouched, and the device stops batching, so auto picks the kernels. A
// failure that is not a refusal fails the transfer and leaves batching on.
func TestDriverBatchRefused(t *testing.T) {
	d := openDriverT(t)
	if !d.batch {
		t.Skip("the driver has no cuMemcpyBatchAsync")
	}
	t.Run("not a refusal", func(t *testing.T) {
		d := openDriverT(t)
		d.path = pathDMA
		d.refuseBatch = &DriverError{Op: "cuMemcpyBatchAsync", Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY"}
		s := must(d.NewStream())(t)
		src := must(d.Alloc(1 << 20))(t)
		hb := must(d.AllocHost(1 << 20))(t)
		op, err := s.Gather(hb, []Object{{Spans: []Span{{Mem: src, Len: 1 << 20}}}})
		if err == nil {
			err = op.Wait(ctxT(t))
		}
		var de *DriverError
		if !errors.As(err, &de) || de.Code != 2 {
			t.Fatalf("gather with the batch call out of memory: %v, want that error", err)
		}
		if !d.batching() {
			t.Fatal("an out-of-memory batch call turned batching off")
		}
	})
	refused := error(&DriverError{Op: "cuMemcpyBatchAsync", Code: cudaErrorNotSupported, Name: "CUDA_ERROR_NOT_SUPPORTED"})
	d.path, d.refuseBatch = pathDMA, refused
	s := must(d.NewStream())(t)
	const page, blocks, perObj = 512 << 10, 24, 3
	r := rand.New(rand.NewPCG(7, 9))
	img := make([]byte, page*blocks)
	for i := range img {
		img[i] = byte(r.Uint32())
	}
	pad := bytes.Repeat([]byte{0x5a}, page*blocks)
	src := must(d.Alloc(page * blocks))(t)
	dst := must(d.Alloc(page * blocks))(t)
	if err := d.Write(src, 0, img); err != nil {
		t.Fatal(err)
	}
	if err := d.Write(dst, 0, pad); err != nil {
		t.Fatal(err)
	}
	var gObjs, sObjs []Object
	perm := r.Perm(blocks)
	for o := 0; o+perObj <= blocks; o += perObj {
		var g, sc []Span
		for _, b := range perm[o : o+perObj] {
			g = append(g, Span{Mem: src, Off: uint64(b) * page, Len: page})
			sc = append(sc, Span{Mem: dst, Off: uint64(b) * page, Len: page - 4096})
		}
		gObjs = append(gObjs, Object{HostOff: uint64(o) * page, Spans: g})
		sObjs = append(sObjs, Object{HostOff: uint64(o) * page, Spans: sc})
	}
	hb := must(d.AllocHost(page * blocks))(t)
	op := must(s.Gather(hb, gObjs))(t)
	if err := op.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if op.Path() != PathDMA {
		t.Fatalf("path %q, want %q", op.Path(), PathDMA)
	}
	if p := d.batchRefused.Load(); p == nil || *p != refused {
		t.Fatalf("refusal not kept: %v", p)
	}
	for i, o := range gObjs {
		var want []byte
		for _, sp := range o.Spans {
			want = append(want, img[sp.Off:sp.Off+sp.Len]...)
		}
		if !bytes.Equal(hb.Bytes()[o.HostOff:o.HostOff+uint64(len(want))], want) || op.Sums()[i] != checksum.Sum(want) {
			t.Fatalf("object %d: bytes or sum differ", i)
		}
	}
	sop := must(s.Scatter(hb, sObjs))(t)
	if err := sop.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	want := append([]byte(nil), pad...)
	for i, o := range sObjs {
		host := hb.Bytes()[o.HostOff:]
		var packed []byte
		for _, sp := range o.Spans {
			copy(want[sp.Off:sp.Off+sp.Len], host[:sp.Len])
			packed = append(packed, host[:sp.Len]...)
			host = host[sp.Len:]
		}
		if sop.Sums()[i] != checksum.Sum(packed) {
			t.Fatalf("object %d: scatter sum differs", i)
		}
	}
	got := make([]byte, len(want))
	if err := d.Read(dst, 0, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("destination pool differs (pages or padding)")
	}
	d.path = pathAuto
	aop := must(s.Gather(hb, gObjs))(t)
	if err := aop.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if aop.Path() != PathSM {
		t.Fatalf("auto picked %q after the refusal, want %q", aop.Path(), PathSM)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

// A wait's sleeps grow to pollFine while the wait is short (a transfer's
// completion is noticed at most 100 us late) and to pollCoarse only
// after pollFineFor.
func TestPollSleepSchedule(t *testing.T) {
	short, long := 10*time.Microsecond, 10*time.Microsecond
	for range 20 {
		short = nextPollSleep(short, pollFineFor/2)
		long = nextPollSleep(long, pollFineFor+time.Millisecond)
		if short > pollFine || long > pollCoarse {
			t.Fatalf("sleeps %v (short wait), %v (long wait): over %v, %v", short, long, pollFine, pollCoarse)
		}
	}
	if short != pollFine || long != pollCoarse {
		t.Fatalf("sleeps settle at %v and %v, want %v and %v", short, long, pollFine, pollCoarse)
	}
	if pollFine > 100*time.Microsecond {
		t.Fatalf("pollFine %v: a short transfer's completion would be noticed later than 100 us", pollFine)
	}
}

// With DMATuning.UnitSums the DMA path verifies word-aligned spans with
// kv_sum_units: pages of 8 and 16-byte alignment, runs longer than a
// unit, objects ending mid-word, in checksum batches small enough that a
// transfer takes several; the gather's and the scatter's sums equal
// kvsum64 of the packed bytes, the pool byte-exact with its padding
// untouched. Without it, or with a span off a word, kv_checksum verifies
// the same transfers with the same sums.
func TestDriverUnitSums(t *testing.T) {
	d := openDriverT(t)
	d.path = pathDMA
	s := must(d.NewStream())(t)
	r := rand.New(rand.NewPCG(26, 7))
	const pool = 4 << 20
	src := must(d.Alloc(pool))(t)
	dst := must(d.Alloc(pool))(t)
	img := make([]byte, pool)
	for i := range img {
		img[i] = byte(r.Uint32())
	}
	pad := bytes.Repeat([]byte{0xee}, pool)
	if err := d.Write(src, 0, img); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		unit  bool
		align uint64 // span offsets are multiples of it, plus skew
		skew  uint64
		units bool
	}{
		{"16-aligned", true, 16, 0, true},
		{"8-aligned", true, 16, 8, true},
		{"default", false, 16, 0, false},
		{"off a word", true, 16, 4, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			d.dmaTune = DMATuning{SumBatch: 200 << 10, UnitSums: c.unit}
			if err := d.Write(dst, 0, pad); err != nil {
				t.Fatal(err)
			}
			// Disjoint slots of 256 KiB, one span each at most 200 KiB long.
			slots := r.Perm(pool / (256 << 10))
			var gObjs, sObjs []Object
			var packed [][]byte
			var host uint64
			for o := 0; o+2 <= len(slots); o += 2 {
				var g, sc []Span
				var want []byte
				for k, slot := range slots[o : o+2] {
					off := uint64(slot)*(256<<10) + c.align*uint64(r.IntN(64)) + c.skew
					n := uint64(8 * (1 + r.IntN(25<<10)))
					if k == 1 && r.IntN(2) == 0 {
						n += uint64(1 + r.IntN(7))
					}
					g = append(g, Span{Mem: src, Off: off, Len: n})
					sc = append(sc, Span{Mem: dst, Off: off, Len: n})
					want = append(want, img[off:off+n]...)
				}
				gObjs = append(gObjs, Object{HostOff: host, Spans: g})
				sObjs = append(sObjs, Object{HostOff: host, Spans: sc})
				packed = append(packed, want)
				host += uint64(len(want)+15) &^ 15
			}
			before := d.unitLaunches.Load()
			hb := must(d.AllocHost(host))(t)
			gatherChecked(t, s, hb, gObjs, packed)
			sums := scatterChecked(t, d, s, hb, sObjs, dst, img, pad)
			for i := range sObjs {
				if sums[i] != checksum.Sum(packed[i]) {
					t.Fatalf("scatter sum of object %d differs", i)
				}
			}
			if n := d.unitLaunches.Load() - before; (n > 0) != c.units {
				t.Fatalf("%d kv_sum_units launches, want them %v", n, c.units)
			}
			if err := hb.Release(); err != nil {
				t.Fatal(err)
			}
		})
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

// SMControlDuplex's choice: kv_move for a transfer enqueued while one of
// the other direction is in flight (enqueued, not yet seen finished), the
// copy engine's control copies otherwise; the count of transfers in flight
// goes back to zero once they are waited for (or dropped), whatever the
// order. No GPU needed: the device is not opened.
func TestSMControlDuplexChoice(t *testing.T) {
	d := &driverDevice{dmaTune: DMATuning{SMControlDuplex: true}}
	for _, scatter := range []bool{false, true} {
		if d.smControl(scatter) {
			t.Fatalf("scatter %v with nothing in flight: kv_move chosen", scatter)
		}
	}
	gather := &opState{busy: &d.busy[direction(false)]}
	gather.busy.Add(1)
	if !d.smControl(true) || d.smControl(false) {
		t.Fatalf("a gather in flight: scatter %v, gather %v; want kv_move for the scatter only", d.smControl(true), d.smControl(false))
	}
	scatter := &opState{busy: &d.busy[direction(true)]}
	scatter.busy.Add(1)
	if !d.smControl(false) {
		t.Fatal("a scatter in flight: a gather did not get kv_move")
	}
	gather.release()
	gather.release() // once only
	if d.smControl(true) || !d.smControl(false) || d.busy[0].Load() != 0 {
		t.Fatalf("gather finished: busy %d/%d", d.busy[0].Load(), d.busy[1].Load())
	}
	scatter.release()
	if d.busy[0].Load() != 0 || d.busy[1].Load() != 0 {
		t.Fatalf("busy %d/%d after every transfer finished", d.busy[0].Load(), d.busy[1].Load())
	}
	// SMControl: always; neither: never.
	d.dmaTune = DMATuning{SMControl: true}
	if !d.smControl(true) || !d.smControl(false) {
		t.Fatal("SMControl: kv_move not chosen")
	}
	d.dmaTune = DMATuning{}
	d.busy[0].Add(1)
	if d.smControl(true) {
		t.Fatal("neither SMControl nor SMControlDuplex: kv_move chosen")
	}
}

// TestSMSumsScatterChoice: DMATuning.SMSumsScatter gives every scatter,
// and only a scatter, kv_move for its sums, whatever is in flight; its
// tables stay as smControl chooses.
func TestSMSumsScatterChoice(t *testing.T) {
	d := &driverDevice{dmaTune: DMATuning{SMControlDuplex: true, SMSumsScatter: true}}
	if !d.smSums(true) || d.smSums(false) || d.smControl(true) {
		t.Fatalf("nothing in flight: sums by kv_move for a scatter %v, a gather %v; tables %v",
			d.smSums(true), d.smSums(false), d.smControl(true))
	}
	d.busy[direction(false)].Add(1) // a gather in flight
	if !d.smSums(true) || d.smSums(false) || !d.smControl(true) {
		t.Fatalf("a gather in flight: sums for a scatter %v, a gather %v; tables %v", d.smSums(true), d.smSums(false), d.smControl(true))
	}
	d.dmaTune = DMATuning{SMControlDuplex: true}
	if d.smSums(true) {
		t.Fatal("without SMSumsScatter a scatter's sums took kv_move by themselves")
	}
}

// On a GPU: a scatter enqueued while a gather is in flight moves its
// tables and sums with kv_move, a lone transfer does not, and both are
// byte-exact (padding included) with the right sums.
func TestDriverSMControlDuplex(t *testing.T) {
	d := openDriverT(t)
	d.path = pathDMA
	d.dmaTune = DMATuning{SumBatch: 4 << 10, SMControlDuplex: true}
	sg := must(d.NewStream())(t)
	ss := must(d.NewStream())(t)
	r := rand.New(rand.NewPCG(25, 3))
	const pool = 8 << 20
	src := must(d.Alloc(pool))(t)
	dst := must(d.Alloc(pool))(t)
	img := make([]byte, pool)
	for i := range img {
		img[i] = byte(r.Uint32())
	}
	pad := bytes.Repeat([]byte{0xee}, pool)
	if err := d.Write(src, 0, img); err != nil {
		t.Fatal(err)
	}
	if err := d.Write(dst, 0, pad); err != nil {
		t.Fatal(err)
	}
	// Objects of two 64 KiB pages each from shuffled slots: the gather's
	// from src, the scatter's into dst at the same offsets.
	slots := r.Perm(pool / (64 << 10))
	var gObjs, sObjs []Object
	var packed [][]byte
	var host uint64
	for o := 0; o+2 <= len(slots); o += 2 {
		var g, sc []Span
		var want []byte
		for _, slot := range slots[o : o+2] {
			off := uint64(slot) * (64 << 10)
			g = append(g, Span{Mem: src, Off: off, Len: 64 << 10})
			sc = append(sc, Span{Mem: dst, Off: off, Len: 64 << 10})
			want = append(want, img[off:off+64<<10]...)
		}
		gObjs = append(gObjs, Object{HostOff: host, Spans: g})
		sObjs = append(sObjs, Object{HostOff: host, Spans: sc})
		packed = append(packed, want)
		host += uint64(len(want))
	}
	hg := must(d.AllocHost(host))(t)
	hs := must(d.AllocHost(host))(t)
	for i, o := range sObjs {
		copy(hs.Bytes()[o.HostOff:], packed[i])
	}
	moved := d.moveTransfers.Load()
	gop := must(sg.Gather(hg, gObjs))(t) // not waited for yet: in flight
	if n := d.moveTransfers.Load() - moved; n != 0 {
		t.Fatalf("a lone gather: %d transfers by kv_move", n)
	}
	sums := scatterChecked(t, d, ss, hs, sObjs, dst, img, pad)
	if n := d.moveTransfers.Load() - moved; n != 1 {
		t.Fatalf("a scatter beside a gather in flight: %d transfers by kv_move, want 1", n)
	}
	if err := gop.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for i, o := range gObjs {
		if !bytes.Equal(hg.Bytes()[o.HostOff:o.HostOff+uint64(len(packed[i]))], packed[i]) {
			t.Fatalf("gathered object %d differs", i)
		}
		if gop.Sums()[i] != checksum.Sum(packed[i]) || sums[i] != checksum.Sum(packed[i]) {
			t.Fatalf("object %d: a sum differs", i)
		}
	}
	if d.busy[0].Load() != 0 || d.busy[1].Load() != 0 {
		t.Fatalf("busy %d/%d after both finished", d.busy[0].Load(), d.busy[1].Load())
	}
	// Alone again: the copy engine's control copies.
	moved = d.moveTransfers.Load()
	gatherChecked(t, sg, hg, gObjs, packed)
	if n := d.moveTransfers.Load() - moved; n != 0 {
		t.Fatalf("a lone gather after both finished: %d transfers by kv_move", n)
	}
	for _, c := range []interface{ Close() error }{sg, ss} {
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
	for _, hb := range []HostBuf{hg, hs} {
		if err := hb.Release(); err != nil {
			t.Fatal(err)
		}
	}
}
