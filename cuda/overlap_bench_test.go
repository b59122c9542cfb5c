package cuda

import (
	"errors"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// checkOverlap rejects destinations that share a byte, ranges of one
// address space (for a scatter) or host ranges (for a gather), the way
// checkTransfer does with its ranges: overlapIn on each space's ranges,
// then nameOverlap names two that share a byte. ds is not modified.
func checkOverlap(ds []destRange, scatter bool) error {
	ids := map[string]int{}
	var per [][]destSpan
	for _, d := range ds {
		id, ok := ids[d.space]
		if !ok {
			id = len(per)
			ids[d.space] = id
			per = append(per, nil)
		}
		if d.end > d.start {
			per[id] = append(per[id], destSpan{d.start, d.end})
		}
	}
	for _, p := range per {
		if overlapIn(p) {
			return nameOverlap(ds, scatter)
		}
	}
	return nil
}

// BenchmarkCheckOverlap: the overlap check of a scatter of n page spans at
// random pages of one allocation (a restore into a block table), per
// range, as checkTransfer runs it on the ranges of one Mem (overlapIn).
func BenchmarkCheckOverlap(b *testing.B) {
	const n, page = 160_000, 8192
	r := rand.New(rand.NewPCG(1, 2))
	perm := r.Perm(n)
	src := make([]destSpan, n)
	for i, p := range perm {
		src[i] = destSpan{devBase + uint64(p)*page, devBase + uint64(p)*page + page}
	}
	benchOverlapIn(b, src)
}

// benchOverlapIn times overlapIn on copies of src and reports per range
// the medians of wall and thread CPU time.
func benchOverlapIn(b *testing.B, src []destSpan) {
	ds := make([]destSpan, len(src))
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var wall, cpu []time.Duration
	for b.Loop() {
		copy(ds, src)
		t0, c0 := time.Now(), threadCPU()
		if overlapIn(ds) {
			b.Fatal("overlap")
		}
		wall, cpu = append(wall, time.Since(t0)), append(cpu, threadCPU()-c0)
	}
	per := func(v []time.Duration) float64 { return float64(median(v).Nanoseconds()) / float64(len(src)) }
	b.ReportMetric(per(wall), "ns/range")
	b.ReportMetric(per(cpu), "thread-cpu-ns/range")
}

// overlapsBrute reports whether two ranges of one space share a byte, by
// comparing every pair of the same space (small inputs only).
func overlapsBrute(ds []destRange) bool {
	for i := range ds {
		for j := i + 1; j < len(ds); j++ {
			a, b := ds[i], ds[j]
			if a.space == b.space && a.start < b.end && b.start < a.end && a.end > a.start && b.end > b.start {
				return true
			}
		}
	}
	return false
}

// TestCheckOverlapMatchesBruteForce: on random destinations in several
// address spaces, above and below the radix-sort threshold, with start
// digits shared by neighbours and spaces interleaved, the check finds an overlap
// exactly when one exists, and leaves ds as it was.
func TestCheckOverlapMatchesBruteForce(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	spaces := []string{"", "alloc-a", "alloc-b", "alloc-c"}
	for trial := range 300 {
		n := 2 + r.IntN(2*radixMin)
		// Each space's ranges packed densely from one base with random
		// gaps and lengths (so the ranges of the spaces interleave and
		// neighbours share high digits), then shuffled.
		base := r.Uint64() >> 8
		next := map[string]uint64{}
		ds := make([]destRange, n)
		for i := range ds {
			sp := spaces[r.IntN(len(spaces))]
			start := base + next[sp] + uint64(r.IntN(300))
			end := start + 1 + uint64(r.IntN(5000))
			next[sp] = end - base
			ds[i] = destRange{space: sp, start: start, end: end, obj: i}
		}
		r.Shuffle(n, func(i, j int) { ds[i], ds[j] = ds[j], ds[i] })
		if trial%2 == 1 { // one range moved onto another's, in the same space
			a, b := r.IntN(n), r.IntN(n)
			for b == a {
				b = r.IntN(n)
			}
			ds[b].space = ds[a].space
			ds[b].start = ds[a].start + uint64(r.IntN(int(ds[a].end-ds[a].start)))
			ds[b].end = ds[b].start + 1 + uint64(r.IntN(5000))
		}
		before := slices.Clone(ds)
		want := overlapsBrute(ds)
		err := checkOverlap(ds, true)
		if got := err != nil; got != want {
			t.Fatalf("trial %d (n %d): overlap found %v (%v), want %v", trial, n, got, err, want)
		}
		if err != nil && (!errors.Is(err, ErrOverlap) || !strings.Contains(err.Error(), "both write")) {
			t.Fatalf("trial %d: %v is not ErrOverlap naming two spans", trial, err)
		}
		if !slices.Equal(ds, before) {
			t.Fatalf("trial %d: checkOverlap changed its input", trial)
		}
	}
}

// BenchmarkOverlapInShuffled: the overlap check of 3.8 M rows of 561 B at
// random places of a 2.4 GB pool (BenchmarkPlanShuffledRows' scatter), per
// range: the radix sort and the scan.
func BenchmarkOverlapInShuffled(b *testing.B) {
	objs, _ := shuffledRowObjects(14848)
	var src []destSpan
	for _, o := range objs {
		for _, sp := range o.Spans {
			src = append(src, destSpan{devBase + sp.Off, devBase + sp.Off + sp.Len})
		}
	}
	benchOverlapIn(b, src)
}
