package cuda

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// The fast paths of checkTransfer (a Mem resolved once per run of spans,
// adjacent rows merged, destinations grouped by region of intersecting
// views, a region's ranges in address order checked without a sort, the
// radix sort above radixMin ranges) refuse what the rules refuse: table
// cases aimed at each shortcut, then random transfers against a reference
// that checks every span and every pair of destinations.

// shadowMem is a Mem of another type than fakeMem whose address is that
// of the fakeMem inside it.
type shadowMem struct{ fakeMem }

// rowsAt returns n spans of width w in m, from off, each starting step
// bytes after the one before (step w: adjacent rows).
func rowsAt(m Mem, off, w, step uint64, n int) []Span {
	out := make([]Span, n)
	for k := range out {
		out[k] = Span{Mem: m, Off: off + uint64(k)*step, Len: w}
	}
	return out
}

func TestCheckTransferFastPaths(t *testing.T) {
	a := &fakeMem{size: 4 << 20, space: "A"}
	b := &fakeMem{size: 4 << 20, space: "B"}
	// Views of allocation A: lo and hi touch at 1000 (no byte in common);
	// mid intersects both, so lo, mid and hi form one region although lo
	// and hi do not intersect.
	lo := &fakeMem{size: 1000, space: "A", base: 0}
	hi := &fakeMem{size: 1000, space: "A", base: 1000}
	mid := &fakeMem{size: 200, space: "A", base: 900}
	dev := &fakeMem{size: 1 << 20, base: 1 << 30} // unified addresses
	// shadow and &shadow.fakeMem are Mems of two types at one address.
	shadow := &shadowMem{fakeMem{size: 100, space: "S"}}
	obj := func(hostOff uint64, spans ...Span) Object { return Object{HostOff: hostOff, Spans: spans} }
	cat := func(s ...[]Span) []Span { return slices.Concat(s...) }
	sp := func(m Mem, off, n uint64) Span { return Span{Mem: m, Off: off, Len: n} }
	// big: 4,096 rows of 561 B, 600 B apart, in address order or reversed.
	big := rowsAt(a, 0, 561, 600, 4096)
	rev := slices.Clone(big)
	slices.Reverse(rev)
	const hostLen = 8 << 20
	for _, c := range []struct {
		name    string
		scatter bool
		objs    []Object
		want    error
		msg     []string
	}{
		{"sorted disjoint rows", true, []Object{obj(0, big...)}, nil, nil},
		{"reversed disjoint rows (sorted by radix)", true, []Object{obj(0, rev...)}, nil, nil},
		{"sorted rows, one overlapping the next", true,
			[]Object{obj(0, cat(big[:100], []Span{sp(a, 100*600-1, 561)}, big[100:])...)}, ErrOverlap,
			[]string{"object 0 span 100 and object 0 span 101 both write 560 B at [60000, 60560) of allocation A"}},
		{"sorted rows, one starting where another does", true,
			[]Object{obj(0, cat(big[:100], []Span{sp(a, 99*600, 1)}, big[100:])...)}, ErrOverlap,
			[]string{"both write 1 B at [59400, 59401) of allocation A"}},
		{"reversed rows, one overlapping (radix sort)", true,
			[]Object{obj(0, cat(rev[:2000], []Span{sp(a, 1234*600+560, 2)}, rev[2000:])...)}, ErrOverlap,
			[]string{"both write 1 B at [740960, 740961) of allocation A"}},
		{"unsorted below radixMin, overlapping", true, []Object{obj(0, sp(a, 500, 10), sp(a, 0, 10), sp(a, 505, 1))}, ErrOverlap,
			[]string{"object 0 span 0 and object 0 span 2 both write 1 B at [505, 506)"}},
		{"unsorted below radixMin, disjoint", true, []Object{obj(0, sp(a, 500, 10), sp(a, 0, 10), sp(a, 510, 1))}, nil, nil},
		{"a long range hiding a later one (sorted by start)", true,
			[]Object{obj(0, sp(a, 0, 1000), sp(a, 2000, 10), sp(a, 500, 1))}, ErrOverlap, []string{"[500, 501)"}},
		{"merged adjacent rows, then a row inside the run", true,
			[]Object{obj(0, rowsAt(a, 0, 10, 10, 50)...), obj(500, sp(a, 255, 3))}, ErrOverlap,
			[]string{"object 0 span 25 and object 1 span 0 both write 3 B at [255, 258)"}},
		{"merged rows of one Mem, the same rows through another Mem of the space", true,
			[]Object{obj(0, rowsAt(lo, 900, 10, 10, 10)...), obj(100, sp(mid, 50, 10))}, ErrOverlap,
			[]string{"object 0 span 5 and object 1 span 0 both write 10 B at [950, 960) of allocation A"}},
		{"views that touch: no shared byte", true,
			[]Object{obj(0, sp(lo, 990, 10), sp(hi, 0, 10))}, nil, nil},
		{"one region through a view intersecting two others", true,
			[]Object{obj(0, sp(lo, 0, 950)), obj(950, sp(hi, 50, 100)), obj(2000, sp(mid, 60, 1))}, nil, nil},
		{"one region through a view intersecting two others, overlapping", true,
			[]Object{obj(0, sp(lo, 0, 950)), obj(950, sp(hi, 50, 100)), obj(2000, sp(mid, 49, 2))}, ErrOverlap,
			[]string{"object 0 span 0 and object 2 span 0 both write 1 B at [949, 950)"}},
		{"same addresses in different spaces", true,
			[]Object{obj(0, sp(a, 0, 100)), obj(100, sp(b, 0, 100))}, nil, nil},
		{"unified addresses, alternating Mems", true,
			[]Object{obj(0, sp(dev, 0, 16), sp(a, 0, 16), sp(dev, 16, 16), sp(a, 16, 16), sp(dev, 8, 1))}, ErrOverlap,
			[]string{"object 0 span 0 and object 0 span 4 both write 1 B at [0x40000008, 0x40000009) of unified device memory"}},
		// The Mem of a run of spans is resolved once: every span is still
		// checked against its bounds, and a different Mem is resolved.
		{"out of bounds inside a run of one Mem", true,
			[]Object{obj(0, cat(rowsAt(lo, 0, 10, 10, 99), []Span{sp(lo, 990, 11)})...)}, ErrOutOfRange,
			[]string{"object 0 span 99: [990, +11 B) outside its Mem of 1000 B"}},
		{"out of bounds after returning to a Mem", true,
			[]Object{obj(0, sp(lo, 0, 10), sp(hi, 0, 10), sp(lo, 995, 6))}, ErrOutOfRange,
			[]string{"object 0 span 2: [995, +6 B) outside its Mem of 1000 B"}},
		{"out of bounds for the next Mem, in bounds for the last", true,
			[]Object{obj(0, sp(a, 0, 10), sp(mid, 195, 10))}, ErrOutOfRange,
			[]string{"object 0 span 1: [195, +10 B) outside its Mem of 200 B"}},
		{"another backend's Mem after a run", false,
			[]Object{obj(0, cat(rowsAt(a, 0, 10, 10, 20), []Span{sp(&planMem{size: 1 << 20}, 0, 10)})...)}, ErrBadHandle,
			[]string{"object 0 span 20", "*cuda.planMem"}},
		{"a Mem of another type at the run's Mem's address", true,
			[]Object{obj(0, sp(&shadow.fakeMem, 0, 10), sp(&shadow.fakeMem, 10, 10), sp(shadow, 20, 10))}, ErrBadHandle,
			[]string{"object 0 span 2", "*cuda.shadowMem"}},
		{"a nil Mem after a run, next object", true,
			[]Object{obj(0, rowsAt(a, 0, 10, 10, 20)...), obj(200, sp(nil, 0, 10))}, ErrBadHandle,
			[]string{"object 1 span 0"}},
		{"an empty span out of bounds", true, []Object{obj(0, sp(a, 0, 10), sp(lo, 1001, 0))}, ErrOutOfRange,
			[]string{"object 0 span 1"}},
		{"gather: host ranges in order, the last overlapping", false,
			[]Object{obj(0, sp(a, 0, 10)), obj(10, sp(a, 0, 10)), obj(19, sp(a, 0, 10))}, ErrOverlap,
			[]string{"objects 1 and 2 overlap in the host buffer: [10, 20) and [19, 29)"}},
		{"gather: host ranges out of order, overlapping", false,
			[]Object{obj(100, sp(a, 0, 10)), obj(0, sp(a, 0, 10)), obj(105, sp(a, 0, 1))}, ErrOverlap,
			[]string{"objects 0 and 2 overlap in the host buffer"}},
		{"gather: host ranges out of order, disjoint", false,
			[]Object{obj(100, sp(a, 0, 10)), obj(0, sp(a, 0, 10)), obj(110, sp(a, 0, 1))}, nil, nil},
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

// refCheck applies the rules of checkTransfer the plain way: every span
// resolved, then every pair of destinations compared. It returns the
// sentinel of the first rule broken (nil: accepted) and, for a rule of
// one span or object, where.
func refCheck(objs []Object, hostLen uint64, scatter bool) (error, string) {
	type dst struct {
		space      string
		start, end uint64
	}
	var ds []dst
	for i, o := range objs {
		var total uint64
		for j, sp := range o.Spans {
			fm, ok := sp.Mem.(*fakeMem)
			if !ok || fm == nil {
				return ErrBadHandle, fmt.Sprintf("object %d span %d", i, j)
			}
			if sp.Off > fm.size || sp.Off+sp.Len > fm.size || sp.Off+sp.Len < sp.Off {
				return ErrOutOfRange, fmt.Sprintf("object %d span %d", i, j)
			}
			if total+sp.Len < total {
				return ErrOutOfRange, fmt.Sprintf("object %d: packed", i)
			}
			total += sp.Len
			if scatter && sp.Len > 0 {
				ds = append(ds, dst{fm.space, fm.base + sp.Off, fm.base + sp.Off + sp.Len})
			}
		}
		if o.HostOff > hostLen || o.HostOff+total > hostLen {
			return ErrOutOfRange, fmt.Sprintf("object %d: host range", i)
		}
		if !scatter && total > 0 {
			ds = append(ds, dst{"", o.HostOff, o.HostOff + total})
		}
	}
	for x := range ds {
		for y := x + 1; y < len(ds); y++ {
			if ds[x].space == ds[y].space && ds[x].start < ds[y].end && ds[y].start < ds[x].end {
				return ErrOverlap, ""
			}
		}
	}
	return nil, ""
}

// randomTransfer draws objects of rows from a few Mems: views of two
// allocations that alias, touch or stand apart, unified-address Mems, now
// and then a foreign Mem or a span out of bounds; the rows in address
// order, reversed, shuffled or in runs; sometimes one row moved onto
// another's bytes.
func randomTransfer(r *rand.Rand, n int) []Object {
	mems := []*fakeMem{
		{size: 1 << 16, space: "A", base: 0},
		{size: 1 << 16, space: "A", base: 1 << 16}, // touches the first
		{size: 1 << 12, space: "A", base: 1<<16 - 1<<11},
		{size: 1 << 16, space: "B", base: 0},
		{size: 1 << 16, base: 1 << 32},
		{size: 1 << 16, base: 1<<32 + 1<<15}, // aliases the one before
	}
	pick := mems[:1+r.IntN(len(mems))]
	var spans []Span
	next := make([]uint64, len(pick))
	for range n {
		k := r.IntN(len(pick))
		if len(spans) > 0 && r.IntN(4) > 0 { // stay on the last Mem: runs
			k = slices.Index(pick, spans[len(spans)-1].Mem.(*fakeMem))
		}
		w := uint64(1 + r.IntN(600))
		if r.IntN(2) == 0 {
			next[k] += uint64(r.IntN(64)) // a gap
		}
		m := pick[k]
		if next[k]+w > m.size {
			next[k] = 0 // wrap: may overlap what came before
		}
		spans = append(spans, Span{Mem: m, Off: next[k], Len: w})
		next[k] += w
	}
	switch r.IntN(4) {
	case 1:
		slices.Reverse(spans)
	case 2:
		r.Shuffle(len(spans), func(i, j int) { spans[i], spans[j] = spans[j], spans[i] })
	}
	if len(spans) > 1 && r.IntN(2) == 0 { // one span onto another's bytes
		x, y := r.IntN(len(spans)), r.IntN(len(spans))
		s := spans[x]
		spans[y] = Span{Mem: s.Mem, Off: s.Off + uint64(r.IntN(int(s.Len))), Len: 1 + uint64(r.IntN(100))}
	}
	if len(spans) > 0 && r.IntN(10) == 0 { // a span out of bounds
		x := r.IntN(len(spans))
		spans[x].Off = spans[x].Mem.Size() - spans[x].Len + 1 + uint64(r.IntN(3))
	}
	if len(spans) > 0 && r.IntN(10) == 0 { // a foreign Mem
		spans[r.IntN(len(spans))].Mem = &planMem{size: 1 << 16}
	}
	if len(spans) > 0 && r.IntN(10) == 0 { // an empty span
		spans[r.IntN(len(spans))].Len = 0
	}
	var objs []Object
	var host uint64
	for len(spans) > 0 {
		k := min(len(spans), 1+r.IntN(40))
		o := Object{HostOff: host, Spans: spans[:k]}
		spans = spans[k:]
		host += o.Len()
		if r.IntN(8) == 0 {
			host -= min(host, uint64(r.IntN(16))) // the next object may overlap in the host buffer
		}
		objs = append(objs, o)
	}
	return objs
}

func TestCheckTransferMatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(12, 7))
	refused := map[string]int{}
	for trial := range 400 {
		n := 1 + r.IntN(100)
		if trial%10 == 0 {
			n = radixMin + r.IntN(2*radixMin) // the radix sort
		}
		objs := randomTransfer(r, n)
		var hostLen uint64
		for _, o := range objs {
			hostLen = max(hostLen, o.HostOff+o.Len())
		}
		if trial%7 == 0 && hostLen > 0 {
			hostLen-- // the last object no longer fits
		}
		for _, scatter := range []bool{false, true} {
			want, where := refCheck(objs, hostLen, scatter)
			got, err := checkTransfer(objs, hostLen, scatter, checkOptions{memOf: true}, resolveFake)
			if want == nil {
				if err != nil || got == nil {
					t.Fatalf("trial %d scatter=%v: refused %v; the reference accepts", trial, scatter, err)
				}
				checkSpanTable(t, objs, got)
				continue
			}
			refused[want.Error()]++
			if !errors.Is(err, want) || got != nil {
				t.Fatalf("trial %d scatter=%v: got %v; the reference refuses with %v (%s)", trial, scatter, err, want, where)
			}
			if !strings.Contains(err.Error(), where) {
				t.Fatalf("trial %d scatter=%v: %q does not name %q", trial, scatter, err, where)
			}
		}
	}
	// Every rule was broken some of the time.
	for _, e := range []error{ErrBadHandle, ErrOutOfRange, ErrOverlap} {
		if refused[e.Error()] < 20 {
			t.Errorf("only %d transfers refused with %v: the generator misses that rule", refused[e.Error()], e)
		}
	}
}

// checkSpanTable: an accepted transfer's span table is every non-empty
// span in order, at its Mem's base plus its offset, with its place in the
// packed object, and memOf names its Mem.
func checkSpanTable(t *testing.T, objs []Object, got *checkedTransfer[*fakeMem]) {
	t.Helper()
	k := 0
	for i, o := range objs {
		var pos uint64
		for j, sp := range o.Spans {
			if sp.Len == 0 {
				continue
			}
			fm := sp.Mem.(*fakeMem)
			want := kSpan{ptr: fm.base + sp.Off, objOff: pos, len: sp.Len}
			if k >= len(got.spans) || got.spans[k] != want || got.mems[got.memOf[k]].mem != fm {
				t.Fatalf("object %d span %d: table entry %d is not %+v of %p", i, j, k, want, fm)
			}
			pos += sp.Len
			k++
		}
		if got.objs[i].len != pos || got.objs[i].hostOff != o.HostOff {
			t.Fatalf("object %d: %+v, want len %d at %d", i, got.objs[i], pos, o.HostOff)
		}
	}
	if k != len(got.spans) {
		t.Fatalf("%d table entries, want %d", len(got.spans), k)
	}
}

// overlapIn on ranges in address order, reversed and shuffled, above and
// below radixMin, with starts far apart (every digit of the radix sort),
// agrees with a pairwise check.
func TestOverlapInMatchesBruteForce(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 5))
	for trial := range 200 {
		n := 2 + r.IntN(3*radixMin)
		if trial%2 == 0 {
			n = 2 + r.IntN(64)
		}
		ds := make([]destSpan, n)
		pos := r.Uint64() >> uint(r.IntN(64))
		for i := range ds {
			pos += uint64(r.IntN(1 << uint(r.IntN(40))))
			w := 1 + uint64(r.IntN(1000))
			if pos > ^uint64(0)-w-1<<41 {
				pos = 0
			}
			ds[i] = destSpan{pos, pos + w}
			pos += w
		}
		switch trial % 3 {
		case 1:
			slices.Reverse(ds)
		case 2:
			r.Shuffle(n, func(i, j int) { ds[i], ds[j] = ds[j], ds[i] })
		}
		if trial%4 >= 2 {
			a, b := r.IntN(n), r.IntN(n)
			ds[b] = destSpan{ds[a].start + uint64(r.IntN(int(ds[a].end-ds[a].start))), 0}
			ds[b].end = ds[b].start + 1 + uint64(r.IntN(50))
		}
		want := false
		for x := range ds {
			for y := x + 1; y < n && !want; y++ {
				want = ds[x].start < ds[y].end && ds[y].start < ds[x].end
			}
		}
		if got := overlapIn(slices.Clone(ds)); got != want {
			t.Fatalf("trial %d (n %d, order %d): overlap %v, want %v", trial, n, trial%3, got, want)
		}
	}
}

// overlapIn on pages: ranges of one length at whole-page offsets (a pool's
// blocks, in any order, some taken twice), with now and then one range
// shifted or of another length, agrees with a pairwise check; and
// overlapPages decides exactly the uniform sets.
func TestOverlapInPages(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	for trial := range 400 {
		n := 2 + r.IntN(2*radixMin)
		page := uint64(1 + r.IntN(1<<uint(1+r.IntN(16))))
		base := r.Uint64() >> uint(1+r.IntN(63))
		slots := n + r.IntN(4*n)
		if trial%5 == 0 {
			slots = 100 * n // too sparse for the bitmap: the sort decides
		}
		if base > ^uint64(0)-uint64(slots+2)*page {
			base = 0
		}
		ds := make([]destSpan, n)
		for i, k := range r.Perm(slots)[:n] {
			ds[i] = destSpan{base + uint64(k)*page, base + uint64(k+1)*page}
		}
		if trial%3 == 1 { // a block taken twice
			ds[r.IntN(n)] = ds[r.IntN(n)]
		}
		uniform := true
		if trial%7 == 3 && page > 1 { // one range off the page grid, or longer
			i := r.IntN(n)
			if r.IntN(2) == 0 {
				ds[i].start++
				ds[i].end++
			} else {
				ds[i].end++
			}
			uniform = false
		}
		want := false
		for x := range ds {
			for y := x + 1; y < n && !want; y++ {
				want = ds[x].start < ds[y].end && ds[y].start < ds[x].end
			}
		}
		got, ok := overlapPages(slices.Clone(ds))
		if ok && got != want {
			t.Fatalf("trial %d (n %d, page %d): overlapPages %v, want %v", trial, n, page, got, want)
		}
		lo, hi := ds[0].start, ds[0].start
		for _, d := range ds {
			lo, hi = min(lo, d.start), max(hi, d.start)
		}
		switch sparse := (hi-lo)/page+1 > 64*uint64(n); {
		case !uniform:
			// Undecided, unless a block taken twice came first.
			if ok && !(got && want) {
				t.Fatalf("trial %d (n %d, page %d): decided %v for ranges off the page grid", trial, n, page, got)
			}
		case sparse && ok:
			t.Fatalf("trial %d (n %d, page %d): decided with a bitmap of %d slots", trial, n, page, (hi-lo)/page)
		case !sparse && !ok:
			t.Fatalf("trial %d (n %d, page %d): pages left undecided", trial, n, page)
		}
		if got := overlapIn(slices.Clone(ds)); got != want {
			t.Fatalf("trial %d (n %d, page %d): overlapIn %v, want %v", trial, n, page, got, want)
		}
	}
}
