package cluster

import (
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestSoakDetection measures the dead-member detection latency distribution:
// KVTIER_SOAK=1 (make soak) enables it; KVTIER_SOAK_RUNS (default 20) kills
// per cluster size, KVTIER_SOAK_SIZES (default "5,9") the cluster sizes
// (coordinator included). It prints p50/p90/max at the coordinator and at
// the last survivor and asserts nothing but detection within 5 s.
func TestSoakDetection(t *testing.T) {
	if os.Getenv("KVTIER_SOAK") != "1" {
		t.Skip("set KVTIER_SOAK=1 to measure the detection distribution")
	}
	runs := 20
	if v, err := strconv.Atoi(os.Getenv("KVTIER_SOAK_RUNS")); err == nil && v > 0 {
		runs = v
	}
	sizes := []int{5, 9}
	if v := os.Getenv("KVTIER_SOAK_SIZES"); v != "" {
		sizes = sizes[:0]
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 3 || n > 9 {
				t.Fatalf("KVTIER_SOAK_SIZES %q: sizes must be 3..9", v)
			}
			sizes = append(sizes, n)
		}
	}
	d := DefaultDetector()
	for _, n := range sizes {
		coord, all, lag := detectionRuns(t, n, runs, 5*time.Second)
		s := d.SuspicionFor(n)
		fmt.Printf("cluster: dead detection, n=%d members, %d kills, probe %v, suspicion %v..%v (k=%d), worst scheduling lag %v\n",
			n, runs, d.ProbeInterval, s.Min, s.Max, s.Confirmations, lag.Round(time.Millisecond))
		fmt.Printf("  at coordinator:     %s\n", summary(coord))
		fmt.Printf("  at every survivor:  %s\n", summary(all))
	}
}

// BenchmarkDeadDetection kills one member per iteration and reports the
// latency until every survivor declared it dead (p50/p90/max in ms; ns/op
// also counts the replacement's join and is not the figure of merit).
func BenchmarkDeadDetection(b *testing.B) {
	for _, n := range []int{5, 9} {
		b.Run(fmt.Sprintf("members=%d", n), func(b *testing.B) {
			_, all, lag := detectionRuns(b, n, b.N, 5*time.Second)
			s := slices.Clone(all)
			sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
			q := func(p float64) float64 {
				return float64(s[int(p*float64(len(s)-1)+0.5)]) / float64(time.Millisecond)
			}
			b.ReportMetric(q(0.5), "p50-ms")
			b.ReportMetric(q(0.9), "p90-ms")
			b.ReportMetric(q(1), "max-ms")
			b.ReportMetric(float64(lag)/float64(time.Millisecond), "lag-ms")
		})
	}
}
