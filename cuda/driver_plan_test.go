package cuda

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"testing"
)

// planWorld is a fake address space for plans: device memory at devBase,
// the host buffer at hostBase, staging halves at stage[0] and stage[1].
type planWorld struct {
	dev, host, staging []byte
}

const (
	devBase   = 1 << 40
	hostBase  = 1 << 44
	stageBase = 1 << 46
)

// randomObjects draws objects of random spans (widths from the seed
// geometries and odd ones) from a device pool, placed in the host buffer
// with random gaps or back to back.
func randomObjects(r *rand.Rand, w *planWorld) []xferObject {
	widths := []uint64{1, 15, 16, 17, 528, 561, 656, 4096, 65536, 177408}
	var objs []xferObject
	var hostOff, devOff uint64
	for range 1 + r.IntN(12) {
		var o xferObject
		if r.IntN(2) == 0 {
			hostOff += uint64(r.IntN(40))
		}
		o.hostOff = hostOff
		for range r.IntN(6) {
			n := widths[r.IntN(len(widths))]
			devOff += uint64(r.IntN(64))
			o.spans = append(o.spans, kSpan{ptr: devBase + devOff, objOff: o.len, len: n})
			devOff += n
			o.len += n
		}
		hostOff += o.len
		objs = append(objs, o)
	}
	w.dev = make([]byte, devOff)
	for i := range w.dev {
		w.dev[i] = byte(r.Uint32())
	}
	w.host = make([]byte, hostOff+16)
	return objs
}

// runPlanGather executes a plan the way the kernels and the copy engine
// would, byte by byte: every segment's packed bytes come from its object's
// spans (found through spanBase/nspans), staged batches then copy their runs
// to the host.
func runPlanGather(t *testing.T, p *xferPlan, w *planWorld, half uint64) {
	t.Helper()
	for bi, b := range p.batches {
		var chunks uint64
		for k, s := range b.segs {
			if s.chunkBase != chunks {
				t.Fatalf("batch %d seg %d: chunkBase %d, want %d", bi, k, s.chunkBase, chunks)
			}
			chunks += chunksOf(s.packed, s.len)
			if s.objOff%16 != 0 || s.len == 0 {
				t.Fatalf("batch %d seg %d: objOff %d len %d", bi, k, s.objOff, s.len)
			}
			sp := p.spans[s.spanBase : s.spanBase+s.nspans]
			if sp[0].objOff > s.objOff || sp[0].objOff+sp[0].len <= s.objOff {
				t.Fatalf("batch %d seg %d: first span [%d,+%d) does not hold object offset %d", bi, k, sp[0].objOff, sp[0].len, s.objOff)
			}
			for i := uint64(0); i < s.len; i++ {
				x := s.objOff + i
				var src uint64
				found := false
				for _, q := range sp {
					if x >= q.objOff && x < q.objOff+q.len {
						src, found = q.ptr+x-q.objOff, true
					}
				}
				if !found {
					t.Fatalf("batch %d seg %d: object offset %d in no span", bi, k, x)
				}
				v := w.dev[src-devBase]
				if p.staged {
					a := s.packed - stageBase
					if want := uint64(b.half) * half; a < want || a+s.len > want+half {
						t.Fatalf("batch %d seg %d: [%d,+%d) outside half %d", bi, k, a, s.len, b.half)
					}
					w.staging[a+i] = v
				} else {
					w.host[s.packed-hostBase+i] = v
				}
			}
		}
		if chunks != b.nchunks {
			t.Fatalf("batch %d: nchunks %d, want %d", bi, b.nchunks, chunks)
		}
		for _, r := range b.runs {
			from := uint64(b.half)*half + r.staging
			copy(w.host[r.host:r.host+r.len], w.staging[from:from+r.len])
		}
	}
}

func TestPlansCopyEveryByteOnce(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	for it := range 100 {
		w := &planWorld{}
		objs := randomObjects(r, w)
		want := make([]byte, len(w.host))
		for _, o := range objs {
			pos := o.hostOff
			for _, s := range o.spans {
				copy(want[pos:], w.dev[s.ptr-devBase:s.ptr-devBase+s.len])
				pos += s.len
			}
		}
		half := uint64(2*minPiece + 16*r.IntN(20000))
		for _, staged := range []bool{false, true} {
			var p *xferPlan
			var err error
			if staged {
				p, err = planStaged(objs, [2]uint64{stageBase, stageBase + half}, half)
				w.staging = make([]byte, 2*half)
			} else {
				p, err = planDirect(objs, hostBase)
			}
			if err != nil {
				t.Fatal(err)
			}
			clear(w.host)
			runPlanGather(t, p, w, half)
			if !bytes.Equal(w.host, want) {
				t.Fatalf("iteration %d staged=%v half=%d: host buffer differs", it, staged, half)
			}
			// The tables encode to the layout's size.
			l := p.layout()
			buf := make([]byte, l.size)
			p.encode(buf, l)
		}
	}
}

// Objects back to back in the host buffer make one copy per batch.
func TestPlanStagedMergesRuns(t *testing.T) {
	var objs []xferObject
	for i := range 64 {
		objs = append(objs, xferObject{
			hostOff: uint64(i) * 177408,
			len:     177408,
			spans:   []kSpan{{ptr: devBase + uint64(i)*200000, len: 177408}},
		})
	}
	const half = 1 << 20
	p, err := planStaged(objs, [2]uint64{stageBase, stageBase + half}, half)
	if err != nil {
		t.Fatal(err)
	}
	var total uint64
	for i, b := range p.batches {
		if len(b.runs) != 1 {
			t.Errorf("batch %d: %d copies, want 1", i, len(b.runs))
		}
		if b.half != i%2 {
			t.Errorf("batch %d uses half %d", i, b.half)
		}
		total += b.runs[0].len
	}
	if want := uint64(64 * 177408); total != want {
		t.Fatalf("copies move %d B, want %d", total, want)
	}
	if want := (64*177408 + half - 1) / half; len(p.batches) != want {
		t.Fatalf("%d batches, want %d", len(p.batches), want)
	}
}

func TestChunksOf(t *testing.T) {
	for _, c := range []struct{ addr, n, want uint64 }{
		{0, 0, 0}, {0, 1, 1}, {0, 16, 1}, {0, 17, 2}, {15, 1, 1}, {15, 2, 2}, {1, 561, 36}, {16, 561, 36}, {7, 16, 2},
	} {
		if got := chunksOf(c.addr, c.n); got != c.want {
			t.Errorf("chunksOf(%d, %d) = %d, want %d", c.addr, c.n, got, c.want)
		}
	}
}

// newPlan takes the spans of objects made by deviceObjects (one shared
// array) without copying them, with the same tables as for objects whose
// spans are separate slices; empty objects and empty spans included.
func TestNewPlanSharedSpans(t *testing.T) {
	a := &planMem{size: 1 << 20}
	objs := []Object{
		{HostOff: 0, Spans: []Span{{Mem: a, Off: 100, Len: 561}, {Mem: a, Off: 0, Len: 0}, {Mem: a, Off: 5000, Len: 561}}},
		{HostOff: 2000},
		{HostOff: 4000, Spans: []Span{{Mem: a, Off: 9000, Len: 17}}},
		{HostOff: 8000, Spans: []Span{{Mem: a, Off: 20000, Len: 4096}, {Mem: a, Off: 30000, Len: 1}}},
	}
	ct, err := checkTransfer(objs, 1<<16, true, checkOptions{}, func(m Mem) (*planMem, memView, error) {
		return m.(*planMem), memView{size: m.Size(), base: devBase}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	shared := deviceObjects(ct)
	if sharedSpans(shared) == nil {
		t.Fatal("deviceObjects did not put the spans in one array")
	}
	separate := make([]xferObject, len(shared))
	for i, o := range shared {
		separate[i] = xferObject{hostOff: o.hostOff, len: o.len, spans: append([]kSpan(nil), o.spans...)}
	}
	if sharedSpans(separate) != nil && len(separate) > 1 {
		t.Fatal("separately allocated spans reported as one array")
	}
	p1, err := newPlan(shared)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := newPlan(separate)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(p1.spans, p2.spans) || !slices.Equal(p1.first, p2.first) || p1.nobj != p2.nobj {
		t.Fatalf("shared: spans %v first %v; separate: spans %v first %v", p1.spans, p1.first, p2.spans, p2.first)
	}
	want := []kSpan{{devBase + 100, 0, 561}, {devBase + 5000, 561, 561}, {devBase + 9000, 0, 17}, {devBase + 20000, 0, 4096}, {devBase + 30000, 4096, 1}}
	if !slices.Equal(p1.spans, want) || !slices.Equal(p1.first, []uint32{0, 2, 2, 3}) {
		t.Fatalf("spans %v first %v, want %v first [0 2 2 3]", p1.spans, p1.first, want)
	}
}

// The tables encode to the same bytes whether the checks wrote the span
// table into the block (checkOptions.table), into memory of their own
// (copied as bytes) or field by field as on a big-endian host.
func TestEncodeSpanTableInPlace(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 8))
	pool := &planMem{size: 1 << 24}
	resolve := func(m Mem) (*planMem, memView, error) {
		return m.(*planMem), memView{size: m.Size(), base: devBase}, nil
	}
	for trial := range 50 {
		var objs []Object
		var host, dev uint64
		for range 1 + r.IntN(40) {
			o := Object{HostOff: host}
			for range r.IntN(300) {
				n := uint64(r.IntN(700))
				o.Spans = append(o.Spans, Span{Mem: pool, Off: dev, Len: n})
				dev += n + uint64(r.IntN(50))
			}
			objs = append(objs, o)
			host += o.Len() + uint64(r.IntN(100))
		}
		encoded := func(inPlace, native bool) []byte {
			defer func(was bool) { littleEndian = was }(littleEndian)
			littleEndian = littleEndian && native
			nspans := 0
			for _, o := range objs {
				nspans += len(o.Spans)
			}
			block := tableBlock(jobCap(tableEstimate(nspans, len(objs)) + 1<<20))
			var opt checkOptions
			if inPlace {
				opt.table = spanTableOf(block)
			}
			ct, err := checkTransfer(objs, host, true, opt, resolve)
			if err != nil {
				t.Fatal(err)
			}
			if inPlace && len(ct.spans) > 0 && &ct.spans[0] != &spanTableOf(block)[0] {
				t.Fatal("the span table is not in the block")
			}
			p, err := planStaged(deviceObjects(ct), [2]uint64{stageBase, stageBase + 1<<20}, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			l := p.layout()
			p.encode(block, l)
			return block[:l.partials]
		}
		want := encoded(false, false)
		for _, c := range []struct{ inPlace, native bool }{{true, true}, {false, true}} {
			if got := encoded(c.inPlace, c.native); !bytes.Equal(got, want) {
				t.Fatalf("trial %d: in place %v, native %v: tables differ from the field-by-field encoding", trial, c.inPlace, c.native)
			}
		}
	}
}
