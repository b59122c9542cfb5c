//go:build cgo && linux

package cuda

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

// BenchmarkDriverSums times the DMA path's checksum kernels alone on CUDA
// device 0 (no copy: the benchmark's sumOnly hook), over the 8B model's
// pages as BenchmarkDriverDMA lays them out (block_major 64 KiB pages,
// kv_split 32 KiB, blocks of a chunk consecutive or shuffled):
// kv_checksum, the default, against kv_sum_units (DMATuning.UnitSums),
// each with one block per multiprocessor (a checksum beside copies) and
// with eight (a scatter's last, which nothing hides), KVTIER_BENCH_GBS
// (default 1.3) GB of pages in the default checksum batches, median of
// KVTIER_BENCH_REPS (default 5) device times between CUDA events. The
// time a checksum kernel runs is the time the engine's forward waits
// while the GPU serves the rankd's context (docs/gpu.md). Both kernels'
// sums must equal those of a gather by the copy kernels. Run it with
//
//	go test -run '^$' -bench DriverSums -benchtime 1x ./cuda
func BenchmarkDriverSums(b *testing.B) {
	d, err := openDriver(0)
	if err != nil {
		b.Skipf("CUDA backend not available: %v", err)
	}
	defer d.Close()
	defer func() { d.path, d.sumOnly, d.dmaTune = pathAuto, 0, DefaultDMATuning() }()
	reps := int(envFloat("KVTIER_BENCH_REPS", 5))
	gb := envFloat("KVTIER_BENCH_GBS", 1.3)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var gate, s1 *driverStream
	for _, p := range []**driverStream{&gate, &s1} {
		st, err := d.NewStream()
		if err != nil {
			b.Fatal(err)
		}
		defer st.Close()
		*p = st.(*driverStream)
	}
	tm, err := d.newSpanTimer(1)
	if err != nil {
		b.Fatal(err)
	}
	defer tm.close()
	var rows []string
	for _, lay := range []dmaLayout{{"block_major", 32, 64 << 10}, {"kv_split", 64, 32 << 10}} {
		for _, shuffled := range []bool{false, true} {
			side := newDMASide(b, d, dmaSource{host: "alloc", pools: "own"}, lay, shuffled, uint64(gb*1e9), 1)
			// The reference sums: a gather by the copy kernels.
			d.path, d.sumOnly, d.dmaTune = pathSM, 0, DefaultDMATuning()
			op, err := s1.transfer(side.hb, side.objs, false, kFlagSum)
			if err != nil || op.Wait(ctx) != nil {
				b.Fatalf("reference gather: %v", err)
			}
			want := slices.Clone(op.Sums())
			blocks := map[bool]string{false: "consecutive", true: "shuffled"}[shuffled]
			for _, perSM := range []int{sumBlocksPerSM, copyBlocksPerSM} {
				var gbps [2]float64
				for k, units := range []bool{false, true} {
					d.path, d.sumOnly = pathDMA, perSM
					d.dmaTune.UnitSums = units
					before := d.unitLaunches.Load()
					var times []time.Duration
					for rep := range reps + 1 {
						var op *Op
						dev, _, err := tm.run(gate, []*driverStream{s1}, 100*time.Millisecond, func() error {
							var err error
							op, err = s1.transfer(side.hb, side.objs, false, kFlagSum)
							return err
						})
						if err != nil || op.Wait(ctx) != nil {
							b.Fatalf("%s %s, %d blocks/SM, units %v: %v", lay.name, blocks, perSM, units, err)
						}
						if !slices.Equal(op.Sums(), want) {
							b.Fatalf("%s %s, %d blocks/SM, units %v: the sums differ from the copy kernels' gather", lay.name, blocks, perSM, units)
						}
						if rep > 0 {
							times = append(times, dev)
						}
					}
					if (d.unitLaunches.Load() > before) != units {
						b.Fatalf("%s %s: kv_sum_units launched %d times, want them %v", lay.name, blocks, d.unitLaunches.Load()-before, units)
					}
					sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
					gbps[k] = float64(side.hb.size) / times[len(times)/2].Seconds() / 1e9
				}
				rows = append(rows, fmt.Sprintf("| %s | %s | %.2f | %d | %.0f | %.0f | %.2fx |",
					lay.name, blocks, float64(side.hb.size)/1e9, perSM, gbps[0], gbps[1], gbps[1]/gbps[0]))
			}
			side.release()
		}
	}
	// Printed, not logged: benchmark logs are cut to ten lines.
	fmt.Printf("\ndevice: %s (%s), %d multiprocessors; median of %d; checksum batch %d B\n\n%s\n%s\n%s\n\n",
		d.info.Name, d.info.UUID, d.sms, reps, DefaultDMATuning().SumBatch,
		"| layout | blocks | GB | blocks/SM | kv_checksum GB/s | kv_sum_units GB/s | units x checksum |",
		"|---|---|---|---|---|---|---|", strings.Join(rows, "\n"))
}
