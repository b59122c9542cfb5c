package transfer

import (
	"math/rand/v2"
	"testing"
	"time"
)

// layout builds a catalog whose slabs are held as spec says: 0 a free
// slab, t > 0 a ready, clean one-slab object last used at tick t, -t the
// same object pinned (blocked).
func layout(spec []int) *catalog {
	c := &catalog{}
	c.init(len(spec), 4096)
	for i, t := range spec {
		if t == 0 {
			continue
		}
		o := &l1Obj{state: stReady, nslab: 1, slab: -1, pslot: -1}
		if t < 0 {
			o.pins, t = 1, -t
		}
		o.tick = uint64(t)
		c.assign(o, i)
	}
	return c
}

// TestFindWindowEvictsLeastRecent: a placement that needs room takes the
// window of the oldest objects, not the one object stored a moment ago
// beside free slabs (a sum of ages picked slabs 4-7 here, evicting the
// object of tick 1000: the chunk the engine had just stored vanished from
// the index, seen on the H200 as "index shows 424 of 519 chunks after the
// store" in the 4-rankd daemon benchmark).
func TestFindWindowEvictsLeastRecent(t *testing.T) {
	c := layout([]int{400, 401, 402, 403, 1000, 0, 0, 0, 1001})
	s, wait := c.findWindow(4, time.Now())
	if s != 0 || wait {
		t.Fatalf("window for 4 slabs starts at %d (wait %v), want 0: the four objects older than any other", s, wait)
	}
	// Among windows of the same newest occupant the one evicting least.
	c = layout([]int{2, 2, 2, 9, 0, 0, 2, 9})
	if s, _ := c.findWindow(3, time.Now()); s != 4 {
		t.Fatalf("window for 3 slabs starts at %d, want 4 (newest occupant 2 as at 0, one object instead of three)", s)
	}
	// A pinned object is never in the window.
	c = layout([]int{1, 1, -1, 1, 50, 60, 70})
	if s, _ := c.findWindow(2, time.Now()); s != 0 {
		t.Fatalf("window for 2 slabs starts at %d, want 0", s)
	}
	c = layout([]int{1, -1, 1, -1})
	if s, _ := c.findWindow(2, time.Now()); s != -1 {
		t.Fatalf("window for 2 slabs starts at %d, want -1 (every pair holds a pinned object)", s)
	}
}

// TestFindWindowMatchesBruteForce compares the sliding-window scan with a
// direct evaluation of every window on random layouts.
func TestFindWindowMatchesBruteForce(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 12))
	for iter := range 3000 {
		ns := 1 + rng.IntN(40)
		spec := make([]int, ns)
		for i := range spec {
			switch r := rng.IntN(10); {
			case r < 3:
				spec[i] = 0
			case r == 3:
				spec[i] = -(1 + rng.IntN(50))
			default:
				spec[i] = 1 + rng.IntN(50)
			}
		}
		n := 1 + rng.IntN(ns)
		c := layout(spec)
		got, _ := c.findWindow(n, time.Now())
		want := -1
		var wantNewest, wantCost int
		for s := 0; s+n <= ns; s++ {
			newest, cost, ok := 0, 0, true
			for _, v := range spec[s : s+n] {
				if v < 0 {
					ok = false
					break
				}
				newest = max(newest, v)
				cost += v
			}
			if ok && (want < 0 || newest < wantNewest || (newest == wantNewest && cost < wantCost)) {
				want, wantNewest, wantCost = s, newest, cost
			}
		}
		if got != want {
			t.Fatalf("iteration %d: layout %v, %d slabs: window at %d, brute force %d", iter, spec, n, got, want)
		}
	}
}

// TestFindFreeNextFit: findFree returns a run of free slabs whenever one
// exists, the first that starts at or after the cursor, else the first
// before it; checked against every start on random layouts and cursors.
func TestFindFreeNextFit(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 9))
	for trial := range 3000 {
		ns := 1 + rng.IntN(40)
		spec := make([]int, ns)
		for i := range spec {
			if rng.IntN(3) > 0 {
				spec[i] = 1 + rng.IntN(5)
			}
		}
		c := layout(spec)
		c.cursor = rng.IntN(ns + 2)
		n := 1 + rng.IntN(4)
		free := func(s int) bool {
			if s < 0 || s+n > ns {
				return false
			}
			for i := s; i < s+n; i++ {
				if spec[i] != 0 {
					return false
				}
			}
			return true
		}
		want := -1
		from := c.cursor
		if from >= ns {
			from = 0
		}
		for s := from; s < ns && want < 0; s++ {
			if free(s) {
				want = s
			}
		}
		for s := 0; s < from && want < 0; s++ {
			if free(s) {
				want = s
			}
		}
		if got := c.findFree(n); got != want {
			t.Fatalf("trial %d: layout %v, cursor %d, %d slabs: findFree = %d, want %d", trial, spec, c.cursor, n, got, want)
		}
	}
}
