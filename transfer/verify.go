package transfer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/kvtier/kvtier/checksum"
)

// verifyBytes checks p against its recorded kvsum64.
func verifyBytes(p []byte, sum uint64) error {
	if got := checksum.Sum(p); got != sum {
		return fmt.Errorf("%d B hash to kvsum64 %016x, recorded %016x: %w", len(p), got, sum, ErrCorrupt)
	}
	return nil
}

func isCorrupt(err error) bool { return errors.Is(err, ErrCorrupt) }

// partialSumsParallelBytes is the object size from which partialSums
// hashes its layers on several cores.
const partialSumsParallelBytes = 8 << 20

// partialSums reads src, a whole object of layers x n pages of page bytes
// (layer-major, then block order), once, and returns its kvsum64 and, for
// each layer, the kvsum64 of that layer's pages skip..n-1 taken as an
// object of their own: what a scatter of that run (a cuda.Object of its
// own) computes of what it placed. Reading each word once for both sums is
// what makes the pair exact: the run sums describe the very bytes whose
// whole-object sum was compared with the recorded one, even if src
// changed meanwhile (a peer's L1 slot). page must be a multiple of 8, so
// every run starts at a word of the object. A large object's layers are
// hashed by several goroutines that spawn starts (the engine's group; a
// refusal hashes the rest here).
func partialSums(src []byte, page uint64, layers, n, skip int, spawn func(func()) bool) (whole uint64, runs []uint64) {
	if page%8 != 0 || uint64(len(src)) != uint64(layers)*uint64(n)*page || skip < 0 || skip > n {
		panic("transfer: partialSums of an object that does not match its geometry")
	}
	runs = make([]uint64, layers)
	totals := make([]uint64, layers)
	layer := func(li int) {
		base := uint64(li*n) * page
		cut := base + uint64(skip)*page
		end := base + uint64(n)*page
		tot := checksum.Partial(src[base:cut], base)
		run := src[cut:end]
		first := cut / 8
		var r0 uint64
		j := uint64(0)
		for ; len(run) >= 32; j += 4 {
			w0, w1 := binary.LittleEndian.Uint64(run), binary.LittleEndian.Uint64(run[8:])
			w2, w3 := binary.LittleEndian.Uint64(run[16:]), binary.LittleEndian.Uint64(run[24:])
			tot += checksum.Term(first+j, w0) + checksum.Term(first+j+1, w1) +
				checksum.Term(first+j+2, w2) + checksum.Term(first+j+3, w3)
			r0 += checksum.Term(j, w0) + checksum.Term(j+1, w1) + checksum.Term(j+2, w2) + checksum.Term(j+3, w3)
			run = run[32:]
		}
		for ; len(run) >= 8; j++ {
			w := binary.LittleEndian.Uint64(run)
			tot += checksum.Term(first+j, w)
			r0 += checksum.Term(j, w)
			run = run[8:]
		}
		totals[li] = tot
		runs[li] = checksum.Finish(r0, end-cut)
	}
	var next atomic.Int64
	work := func() {
		for li := int(next.Add(1)) - 1; li < layers; li = int(next.Add(1)) - 1 {
			layer(li)
		}
	}
	var wg sync.WaitGroup
	if len(src) >= partialSumsParallelBytes && spawn != nil {
		for range min(runtime.GOMAXPROCS(0), layers, 8) - 1 {
			wg.Add(1)
			if !spawn(func() { defer wg.Done(); work() }) {
				wg.Done()
				break
			}
		}
	}
	work()
	wg.Wait()
	var sum uint64
	for _, t := range totals {
		sum += t
	}
	return checksum.Finish(sum, uint64(len(src))), runs
}
