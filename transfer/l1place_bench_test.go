package transfer

import (
	"fmt"
	"testing"
	"time"
)

// steadyL1 drives a catalog of slabs slabs through placements of objects
// of n slabs each, as the engine does once L1 is full: past the high
// watermark (90 %) the least recently used objects are evicted down to
// the low one (75 %, evictToLowLocked), and each placement takes a free
// run (findFree) or, failing that, a window to evict (findWindow). It
// returns the time the placements after the first warm took, per
// placement.
func steadyL1(tb testing.TB, slabs, n, warm, measure int) time.Duration {
	c := &catalog{}
	c.init(slabs, 1<<20)
	high, low := slabs*9/10, slabs*3/4
	var took time.Duration
	for i := range warm + measure {
		if len(c.owner)-c.free > high {
			for o := c.head; o != nil && len(c.owner)-c.free > low; {
				next := o.next
				c.lruRemove(o)
				c.freeSlabs(o)
				o = next
			}
		}
		o := &l1Obj{state: stReady, nslab: n, slab: -1, pslot: -1}
		t0 := time.Now()
		s := c.findFree(n)
		if s < 0 {
			s, _ = c.findWindow(n, t0)
			if s < 0 {
				tb.Fatalf("placement %d: no window of %d slabs", i, n)
			}
			for j := s; j < s+n; j++ {
				if v := c.owner[j]; v != nil {
					c.lruRemove(v)
					c.freeSlabs(v)
				}
			}
		}
		c.assign(o, s)
		if i >= warm {
			took += time.Since(t0)
		}
		c.lruPush(o)
	}
	return took / time.Duration(measure)
}

// BenchmarkL1Placement: what placing one object costs under the engine's
// lock once L1 is full, for L1s of 16 GiB to 256 GiB in 1 MiB slabs
// (the default) and objects of 2 slabs (a 16-token chunk of an 8B model's
// pages on one rank). In process, the catalog alone.
func BenchmarkL1Placement(b *testing.B) {
	for _, gib := range []int{16, 64, 256} {
		b.Run(fmt.Sprintf("L1=%dGiB", gib), func(b *testing.B) {
			slabs := gib << 10
			b.ReportMetric(float64(steadyL1(b, slabs, 2, 2*slabs, slabs+b.N))/1e3, "us/placement")
		})
	}
}
