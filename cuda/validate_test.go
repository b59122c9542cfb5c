package cuda

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
)

// fakeMem is a Mem for the pure checks: a view of size bytes at base of an
// address space.
type fakeMem struct {
	size  uint64
	space string
	base  uint64
}

func (m *fakeMem) Size() uint64   { return m.size }
func (m *fakeMem) Release() error { return nil }

func resolveFake(m Mem) (*fakeMem, memView, error) {
	fm, ok := m.(*fakeMem)
	if !ok || fm == nil {
		return nil, memView{}, fmt.Errorf("%w: span of a %T, not fake memory", ErrBadHandle, m)
	}
	return fm, memView{size: fm.size, space: fm.space, base: fm.base}, nil
}

func TestCheckTransfer(t *testing.T) {
	a := &fakeMem{size: 1000, space: "A"}
	a2 := &fakeMem{size: 100, space: "A", base: 500} // a view aliasing a[500, 600)
	b := &fakeMem{size: 1000, space: "B"}
	huge := &fakeMem{size: math.MaxUint64, space: "H"}
	dev1 := &fakeMem{size: 100, base: 0x1000} // unified addresses (space "")
	dev2 := &fakeMem{size: 100, base: 0x1040}
	obj := func(hostOff uint64, spans ...Span) Object { return Object{HostOff: hostOff, Spans: spans} }
	sp := func(m Mem, off, n uint64) Span { return Span{Mem: m, Off: off, Len: n} }
	const hostLen = 4096
	for _, c := range []struct {
		name    string
		scatter bool
		objs    []Object
		want    error    // nil: accepted
		msg     []string // substrings of the error: the rule and its numbers
	}{
		{"empty", true, nil, nil, nil},
		{"valid", true, []Object{obj(0, sp(a, 0, 10), sp(b, 0, 10)), obj(20, sp(a, 10, 5))}, nil, nil},
		{"span end past Mem", false, []Object{obj(0, sp(a, 900, 101))}, ErrOutOfRange,
			[]string{"object 0 span 0", "[900, +101 B) outside its Mem of 1000 B"}},
		{"span offset past Mem", false, []Object{obj(0, sp(a, 1001, 0))}, ErrOutOfRange, []string{"outside its Mem"}},
		{"span offset+length overflows", true, []Object{obj(0, sp(a, math.MaxUint64-10, 20))}, ErrOutOfRange, []string{"outside its Mem"}},
		{"packed length overflows", false, []Object{obj(0, sp(huge, 0, math.MaxUint64), sp(huge, 0, 1))}, ErrOutOfRange,
			[]string{"object 0: packed length overflows at span 1"}},
		{"host range past buffer", false, []Object{obj(hostLen-5, sp(a, 0, 6))}, ErrOutOfRange,
			[]string{"object 0: host range [4091, +6 B) outside the host buffer of 4096 B"}},
		{"host offset+length overflows", true, []Object{obj(math.MaxUint64-5, sp(a, 0, 10))}, ErrOutOfRange, []string{"host range"}},
		{"not our memory", false, []Object{obj(0, sp(a, 0, 1)), obj(1, sp(nil, 0, 1))}, ErrBadHandle,
			[]string{"object 1 span 0", "<nil>"}},
		{"gather: device ranges may repeat", false, []Object{obj(0, sp(a, 0, 10)), obj(10, sp(a, 0, 10))}, nil, nil},
		{"gather: objects overlap in the host buffer", false, []Object{obj(0, sp(a, 0, 10)), obj(9, sp(b, 0, 10))}, ErrOverlap,
			[]string{"objects 0 and 1 overlap in the host buffer: [0, 10) and [9, 19)"}},
		{"gather: touching host ranges", false, []Object{obj(10, sp(a, 0, 10)), obj(0, sp(b, 0, 10))}, nil, nil},
		{"gather: empty objects at one offset", false, []Object{obj(5), obj(5, sp(a, 0, 0))}, nil, nil},
		{"scatter: host ranges may repeat", true, []Object{obj(0, sp(a, 0, 10)), obj(0, sp(a, 10, 10))}, nil, nil},
		{"scatter: spans of one object overlap", true, []Object{obj(0, sp(a, 0, 100), sp(a, 99, 10))}, ErrOverlap,
			[]string{"object 0 span 0 and object 0 span 1 both write 1 B at [99, 100) of allocation A"}},
		{"scatter: views of one allocation overlap", true, []Object{obj(0, sp(a, 550, 20)), obj(100, sp(a2, 60, 10))}, ErrOverlap,
			[]string{"object 0 span 0 and object 1 span 0 both write 10 B at [560, 570) of allocation A"}},
		{"scatter: same offsets of different allocations", true, []Object{obj(0, sp(a, 0, 10)), obj(10, sp(b, 0, 10))}, nil, nil},
		{"scatter: unified addresses overlap", true, []Object{obj(0, sp(dev1, 0x30, 0x20)), obj(100, sp(dev2, 0, 4))}, ErrOverlap,
			[]string{"both write 4 B at [0x1040, 0x1044) of unified device memory"}},
		{"scatter: contained behind a short range", true, []Object{obj(0, sp(a, 0, 100), sp(a, 10, 1)), obj(200, sp(a, 50, 60))}, ErrOverlap, nil},
		{"scatter: empty spans write nothing", true, []Object{obj(0, sp(a, 5, 0), sp(a, 0, 10))}, nil, nil},
		// Rows of one page, one span each, merge into one range for the
		// overlap check; an overlap inside the run is still found and named
		// span by span.
		{"scatter: adjacent rows, across objects", true, []Object{obj(0, sp(a, 0, 10), sp(a, 10, 10)), obj(20, sp(a, 20, 10), sp(b, 30, 5))}, nil, nil},
		{"scatter: overlap inside a run of adjacent rows", true, []Object{obj(0, sp(a, 0, 10), sp(a, 10, 10), sp(a, 20, 10)), obj(40, sp(a, 15, 2))}, ErrOverlap,
			[]string{"object 0 span 1 and object 1 span 0 both write 2 B at [15, 17) of allocation A"}},
		{"scatter: a run of rows overlaps across spaces' views", true, []Object{obj(0, sp(a, 540, 10), sp(a, 550, 10)), obj(100, sp(a2, 55, 10))}, ErrOverlap,
			[]string{"object 0 span 1 and object 1 span 0 both write 5 B at [555, 560) of allocation A"}},
	} {
		got, err := checkTransfer(c.objs, hostLen, c.scatter, checkOptions{memOf: true}, resolveFake)
		if c.want == nil {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			continue
		}
		if !errors.Is(err, c.want) || got != nil {
			t.Errorf("%s: got %v, %v; want an error wrapping %q", c.name, got, err, c.want)
			continue
		}
		for _, m := range c.msg {
			if !strings.Contains(err.Error(), m) {
				t.Errorf("%s: %q does not say %q", c.name, err, m)
			}
		}
	}
}

// The checked transfer keeps every non-empty span in order with its
// address in its Mem's space and its place in the packed object, says
// each span's Mem when asked, and lists each Mem once, with the span that
// first used it.
func TestCheckTransferResult(t *testing.T) {
	a, b := &fakeMem{size: 100, space: "A", base: 1000}, &fakeMem{size: 100, space: "B", base: 5000}
	objs := []Object{
		{HostOff: 64, Spans: []Span{{Mem: b, Off: 10, Len: 5}, {Mem: a, Off: 0, Len: 0}, {Mem: b, Off: 20, Len: 7}}},
		{HostOff: 0},
		{HostOff: 16, Spans: []Span{{Mem: a, Off: 50, Len: 3}}},
	}
	for _, memOf := range []bool{false, true} {
		got, err := checkTransfer(objs, 128, true, checkOptions{memOf: memOf}, resolveFake)
		if err != nil {
			t.Fatal(err)
		}
		wantObjs := []checkedObject{{hostOff: 64, len: 12, first: 0, n: 2}, {hostOff: 0, len: 0, first: 2, n: 0}, {hostOff: 16, len: 3, first: 2, n: 1}}
		if !slices.Equal(got.objs, wantObjs) {
			t.Errorf("objects %+v, want %+v", got.objs, wantObjs)
		}
		wantSpans := []kSpan{{5010, 0, 5}, {5020, 5, 7}, {1050, 0, 3}}
		if !slices.Equal(got.spans, wantSpans) {
			t.Errorf("spans %+v, want %+v", got.spans, wantSpans)
		}
		if got := got.objSpans(2); !slices.Equal(got, wantSpans[2:]) {
			t.Errorf("spans of object 2: %+v", got)
		}
		var wantOf []uint32
		if memOf {
			wantOf = []uint32{0, 0, 1}
		}
		if !slices.Equal(got.memOf, wantOf) {
			t.Errorf("memOf %v, want %v", got.memOf, wantOf)
		}
		wantUses := []memUse[*fakeMem]{{b, memView{100, "B", 5000}, 0, 0}, {a, memView{100, "A", 1000}, 0, 1}}
		if !slices.Equal(got.mems, wantUses) {
			t.Errorf("mems %+v, want %+v", got.mems, wantUses)
		}
	}
}

// acquire takes the references in order of first use; when one fails it
// drops those it took and names the span that first used the failing Mem.
func TestCheckedTransferAcquire(t *testing.T) {
	a, b, c := &fakeMem{size: 10}, &fakeMem{size: 10, base: 10}, &fakeMem{size: 10, base: 20}
	objs := []Object{
		{HostOff: 0, Spans: []Span{{Mem: a, Off: 0, Len: 1}}},
		{HostOff: 1, Spans: []Span{{Mem: a, Off: 1, Len: 1}, {Mem: b, Off: 0, Len: 1}, {Mem: c, Off: 0, Len: 1}}},
	}
	ct, err := checkTransfer(objs, 10, true, checkOptions{}, resolveFake)
	if err != nil {
		t.Fatal(err)
	}
	refs := map[*fakeMem]int{}
	errGone := fmt.Errorf("%w: test", ErrReleased)
	err = ct.acquire(func(m *fakeMem) error {
		if m == b {
			return errGone
		}
		refs[m]++
		return nil
	}, func(m *fakeMem) { refs[m]-- })
	if !errors.Is(err, ErrReleased) || !strings.Contains(err.Error(), "object 1 span 1") {
		t.Errorf("acquire: %v; want ErrReleased naming object 1 span 1", err)
	}
	for m, n := range refs {
		if n != 0 {
			t.Errorf("%+v: %d references left after a failed acquire", m, n)
		}
	}
	if err := ct.acquire(func(m *fakeMem) error { refs[m]++; return nil }, nil); err != nil {
		t.Fatal(err)
	}
	if refs[a] != 1 || refs[b] != 1 || refs[c] != 1 {
		t.Errorf("references %v; want one on each Mem", refs)
	}
}

func TestResourceSet(t *testing.T) {
	r := &resourceSet{name: "test device"}
	m, s := &fakeMem{}, &hostStream{}
	for _, v := range []any{m, s} {
		if err := r.add(v); err != nil {
			t.Fatal(err)
		}
	}
	if got := liveOf[*fakeMem](r); len(got) != 1 || got[0] != m {
		t.Errorf("live memory %v", got)
	}
	r.remove(m)
	if got := liveOf[*fakeMem](r); len(got) != 0 {
		t.Errorf("live memory %v after remove", got)
	}
	if r.isClosed() || !r.close() || !r.isClosed() || r.close() {
		t.Error("close: want exactly the first call to close")
	}
	err := r.add(&fakeMem{})
	if !errors.Is(err, ErrReleased) || !strings.Contains(err.Error(), "test device is closed") {
		t.Errorf("add after close: %v", err)
	}
	if got := liveOf[*hostStream](r); len(got) != 1 || got[0] != s {
		t.Errorf("live streams %v after close", got)
	}
}
