//go:build cgo && linux

package cuda_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/cuda/cudatest"
)

// openCUDA opens CUDA device 0, or skips the test where there is no driver
// or no device.
func openCUDA(t *testing.T) cuda.Device {
	t.Helper()
	dev, err := cuda.OpenCUDA(0)
	if errors.Is(err, cuda.ErrNoDriver) {
		t.Skipf("CUDA backend not testable here: %v", err)
	}
	if err != nil {
		t.Fatalf("OpenCUDA(0): %v", err)
	}
	return dev
}

// The conformance suite in each copy mode: the mode and path the device
// picks, the kernel on the mapped host buffer and the copy-engine pipeline
// with staging halves small enough that most transfers take many batches
// (both on the copy kernels' path), and every transfer forced onto the DMA
// path (copy-engine copies of the page runs, kv_sum_units over word-aligned
// pages with DMATuning.UnitSums, kv_checksum over the others),
// also with DMATuning small enough that transfers wait on their copy queue
// and checksum in many batches, with the checksums launched from the host,
// with the batched copies enqueued without the overlap hint, with the
// copies enqueued one call each, and with every scatter's copies chained
// after the previous scatter's (checksummed in many batches meanwhile), and
// with kv_sum_units verifying every word-aligned transfer (UnitSums), and
// with the hidden checksums confined to one or two blocks (SumBlocks), and
// with the tables and sums moved by kv_move on every path (SMControl), and
// with the staging copies enqueued one call each instead of batched.
var dmaSumBatchDefault = cuda.DefaultDMATuning().SumBatch

func TestDriverConformance(t *testing.T) {
	if err := openCUDA(t).Close(); err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct {
		name, mode, path string
		half             uint64
		tune             cuda.DMATuning
	}{
		{"auto", "auto", "auto", 0, cuda.DefaultDMATuning()}, {"direct", "direct", "sm", 0, cuda.DefaultDMATuning()},
		{"staged", "staged", "sm", 64 << 10, cuda.DefaultDMATuning()}, {"dma", "auto", "dma", 0, cuda.DefaultDMATuning()},
		{"dma-tuned", "auto", "dma", 0, cuda.DMATuning{SumBatch: 4 << 10, Queue: 16 << 10}},
		{"dma-host-launch", "auto", "dma", 0, cuda.DMATuning{SumBatch: 4 << 10, HostLaunch: true}},
		{"dma-no-overlap-hint", "auto", "dma", 0, cuda.DMATuning{SumBatch: dmaSumBatchDefault, NoOverlapHint: true}},
		{"dma-each-copy", "auto", "dma", 0, cuda.DMATuning{SumBatch: dmaSumBatchDefault, EachCopy: true}},
		{"dma-ordered", "auto", "dma", 0, cuda.DMATuning{SumBatch: 4 << 10, OrderScatters: true}},
		{"dma-unit-sums", "auto", "dma", 0, cuda.DMATuning{SumBatch: 4 << 10, UnitSums: true}},
		{"dma-sum-blocks", "auto", "dma", 0, cuda.DMATuning{SumBatch: 4 << 10, SumBlocks: 1}},
		{"dma-unit-sum-blocks", "auto", "dma", 0, cuda.DMATuning{SumBatch: 4 << 10, UnitSums: true, SumBlocks: 2}},
		{"dma-sm-control", "auto", "dma", 0, cuda.DMATuning{SumBatch: 4 << 10, SMControl: true}},
		{"direct-sm-control", "direct", "sm", 0, cuda.DMATuning{SumBatch: dmaSumBatchDefault, SMControl: true}},
		{"staged-sm-control", "staged", "sm", 64 << 10, cuda.DMATuning{SumBatch: dmaSumBatchDefault, SMControl: true}},
		{"dma-sm-sums", "auto", "dma", 0, cuda.DMATuning{SumBatch: 4 << 10, SMSumsScatter: true}},
		{"direct-sm-sums", "direct", "sm", 0, cuda.DMATuning{SumBatch: dmaSumBatchDefault, SMSumsScatter: true}},
		{"staged-sm-sums", "staged", "sm", 64 << 10, cuda.DMATuning{SumBatch: dmaSumBatchDefault, SMSumsScatter: true}},
		{"staged-each-copy", "staged", "sm", 64 << 10, cuda.DMATuning{SumBatch: dmaSumBatchDefault, EachCopy: true}},
	} {
		t.Run(m.name, func(t *testing.T) {
			cudatest.Run(t, func(t *testing.T) cuda.Device {
				dev := openCUDA(t)
				cuda.SetDriverCopyMode(dev, m.mode, m.half)
				cuda.SetCopyPath(dev, m.path)
				if err := cuda.TuneDMA(dev, m.tune); err != nil {
					t.Fatal(err)
				}
				return dev
			})
		})
	}
}

// rankd's --copy-path sm-direct and sm-staged force the copy kernels'
// mode: every gather and scatter reports the forced one (Op.Mode), for
// objects that auto would stage (back to back) and ones it would not.
func TestDriverForcedModes(t *testing.T) {
	dev := openCUDA(t)
	defer dev.Close()
	ctx := context.Background()
	pool := must(dev.Alloc(64 << 20))(t)
	defer pool.Release()
	hb := must(dev.AllocHost(64 << 20))(t)
	defer hb.Release()
	st := must(dev.NewStream())(t)
	defer st.Close()
	layouts := map[string][]cuda.Object{}
	for _, step := range []uint64{64 << 10, 1 << 20} { // back to back; one per 1 MiB
		var objs []cuda.Object
		for i := range uint64(16) {
			objs = append(objs, cuda.Object{HostOff: i * step, Spans: []cuda.Span{{Mem: pool, Off: i * (64 << 10), Len: 64 << 10}}})
		}
		layouts[fmt.Sprintf("an object per %d KiB", step>>10)] = objs
	}
	for _, path := range []string{"sm-direct", "sm-staged"} {
		if err := cuda.ForceCopyPath(dev, path); err != nil {
			t.Fatal(err)
		}
		for name, objs := range layouts {
			for _, scatter := range []bool{false, true} {
				op, err := st.Gather(hb, objs)
				if scatter {
					op, err = st.Scatter(hb, objs)
				}
				if err != nil {
					t.Fatalf("%s, %s: %v", path, name, err)
				}
				if err := op.Wait(ctx); err != nil {
					t.Fatalf("%s, %s: %v", path, name, err)
				}
				if got := "sm-" + op.Mode(); op.Path() != cuda.PathSM || got != path {
					t.Errorf("%s, %s, scatter %v: path %s mode %s", path, name, scatter, op.Path(), op.Mode())
				}
			}
		}
	}
}

// The copy kernels' path and the DMA path give the same bytes and sums.
func TestDriverPaths(t *testing.T) {
	if err := openCUDA(t).Close(); err != nil {
		t.Fatal(err)
	}
	cudatest.RunPaths(t, func(t *testing.T, path string) cuda.Device {
		dev := openCUDA(t)
		cuda.SetCopyPath(dev, path)
		return dev
	})
}

func openCUDAShared(t *testing.T, _ string) cuda.Device { return openCUDA(t) }

func TestDriverCrossProcess(t *testing.T) {
	if err := openCUDA(t).Close(); err != nil {
		t.Fatal(err)
	}
	cudatest.RunCrossProcess(t, cudatest.CrossProcessConfig{
		HelperTest: "TestHelperDriverEngine",
		Open:       openCUDAShared,
	})
}

// TestHelperDriverEngine is the engine process of TestDriverCrossProcess.
func TestHelperDriverEngine(t *testing.T) { cudatest.EngineMain(t, openCUDAShared) }

// Without libcuda.so.1 (or without a device) OpenCUDA fails cleanly with
// ErrNoDriver, and Open("auto") falls back to the host backend.
func TestOpenCUDAWithoutDriver(t *testing.T) {
	dev, err := cuda.OpenCUDA(0)
	if err == nil {
		dev.Close()
		t.Skip("a CUDA driver and device are present")
	}
	if !errors.Is(err, cuda.ErrNoDriver) {
		t.Fatalf("OpenCUDA(0) without a driver: %v, want an error wrapping ErrNoDriver", err)
	}
	t.Logf("OpenCUDA(0): %v", err)
}
