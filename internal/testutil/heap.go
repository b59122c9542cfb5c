package testutil

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// PeakHeap runs f and returns the peak HeapInuse sampled every
// millisecond while it ran, above HeapInuse right before it (after a GC),
// and what it left (HeapInuse after a GC once it returned, above the same
// baseline; negative when it freed more than it kept). For benchmarks of
// memory spikes (a reset, an inventory); a sample can miss a spike shorter
// than a millisecond.
func PeakHeap(f func()) (peak uint64, kept int64) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse
	var top atomic.Uint64
	top.Store(base)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(time.Millisecond)
		defer t.Stop()
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			if m.HeapInuse > top.Load() {
				top.Store(m.HeapInuse)
			}
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	})
	f()
	close(stop)
	wg.Wait()
	runtime.ReadMemStats(&ms)
	peak = max(top.Load(), ms.HeapInuse) - base
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return peak, int64(ms.HeapInuse) - int64(base)
}
