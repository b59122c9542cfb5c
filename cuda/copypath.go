package cuda

import "fmt"

// pathSetter is a device whose Gather and Scatter copy path can be forced.
type pathSetter interface{ setPath(copyPath) }

func (d *hostDevice) setPath(p copyPath) { d.path = p }

// copyMode is how the CUDA backend's copy kernels move bytes across PCIe.
type copyMode int

const (
	modeAuto   copyMode = iota // staged when the objects make long host runs, else direct
	modeDirect                 // the kernel reads/writes the mapped host buffer
	modeStaged                 // kernel <-> device staging, copy engine <-> host buffer
)

// modeSetter is a device whose copy kernels' mode can be forced: the CUDA
// backend's, on the mapped host buffer (direct) or through device staging.
type modeSetter interface{ setMode(copyMode) }

// ForceCopyPath sets how a device's Gather and Scatter move bytes: "auto"
// (the rule of useDMA: the copy engine for page runs averaging at least
// 256 KiB where copies are enqueued in batches), "sm" (the copy kernels)
// or "dma" (copy-engine copies of the page runs, then a checksum kernel
// over the device pages); "sm-direct" and "sm-staged" are the copy
// kernels in one mode (ModeDirect, ModeStaged), on a device that has modes
// (the CUDA backend). rankd's --copy-path calls it after Open, before the
// device is shared; the verification is the same on every path.
func ForceCopyPath(dev Device, path string) error {
	p, ok := parseCopyPath(path)
	mode := modeAuto
	switch path {
	case PathSM + "-" + ModeDirect:
		p, mode, ok = pathSM, modeDirect, true
	case PathSM + "-" + ModeStaged:
		p, mode, ok = pathSM, modeStaged, true
	}
	if !ok {
		return fmt.Errorf("cuda: copy path %q: want auto, sm, sm-direct, sm-staged or dma", path)
	}
	ps, ok := dev.(pathSetter)
	if !ok {
		return fmt.Errorf("cuda: device %T has no copy path to set", dev)
	}
	if mode != modeAuto {
		ms, ok := dev.(modeSetter)
		if !ok {
			return fmt.Errorf("cuda: copy path %q: device %T has no copy modes", path, dev)
		}
		ms.setMode(mode)
	}
	ps.setPath(p)
	return nil
}

// DMATuning shapes the DMA path's work on the GPU (driver backend; the host
// backend has no copy engine to shape and ignores it). DefaultDMATuning
// gives the defaults.
type DMATuning struct {
	// SumBatch is the bytes of pages each checksum kernel reads, at least
	// 1: a scatter launches one after each batch's copies are placed, so
	// smaller batches expose less checksum time at the end and larger ones
	// launch fewer kernels beside the engine's own (each may cost the
	// engine's forward a context switch, see dmaSumBatch). Default 1 GiB.
	SumBatch uint64
	// Queue bounds the bytes of copies a transfer has enqueued and the
	// copy engine has not finished: the enqueue waits for older copies
	// (cuEventSynchronize, holding the stream's enqueue lock) once more
	// are queued. For measurements: 0, no bound (up to 1,024 copies a
	// call), is the default; a bound measured no better inside vLLM
	// (BENCHMARKS.md).
	Queue uint64
	// HostLaunch launches a scatter's checksum kernel from the host once
	// the copies it reads are done (the enqueue waits on an event), and a
	// gather's once the work already on its stream is, instead of queueing
	// the kernel on the device behind a wait for the copies. The GPU then
	// never holds work of this context that is blocked on another stream
	// while the engine's forward runs: the time-slice scheduler may switch
	// to a context whose only work is such a wait (the experiment of
	// BENCHMARKS.md, issue 24.4). The enqueue of a transfer returns only
	// after its copies, which serializes the transfers of one stream. For
	// measurements; off by default.
	HostLaunch bool
	// NoOverlapHint enqueues batched copies without the driver's
	// "prefer to overlap with compute" flag (on by default: copy engines,
	// not SMs). For measurements: whether that hint's choice of engines is
	// what a load costs the model's own copies and steps (docs/gpu.md);
	// off by default.
	NoOverlapHint bool
	// EachCopy enqueues the copies of the DMA path one cuMemcpy call per
	// contiguous piece (cuMemcpyHtoDAsync / cuMemcpyDtoHAsync, as vLLM's
	// own offload copies blocks; a 2D run is a call per row) instead of
	// cuMemcpyBatchAsync calls of up to 1,024:
	// more host calls, and no batched copy from this context beside the
	// engine's work. For measurements: whether the batch API is what a
	// load costs the model's steps (docs/gpu.md); off by default.
	EachCopy bool
	// OrderScatters chains the copies of every DMA scatter of the device
	// in this process: each scatter's copies wait on the device for the
	// previous scatter's copies (not its checksum), so the copy engine
	// moves one retrieve batch after the other instead of two at once, and
	// a batch ends, and is verified and replaced, as early as it can. Two
	// batches on two streams share the engine otherwise, each ending about
	// when the other does (BENCHMARKS.md, stop 46). A scatter's timer
	// marks are placed before its wait, so its device stage includes the
	// wait: with the chain, read a restore's device busy time, not its
	// batches' starts. Not with HostLaunch or Queue (Validate). For
	// measurements; off by default.
	OrderScatters bool
	// UnitSums verifies DMA transfers whose spans are all word-aligned
	// with kv_sum_units, which hashes such spans a warp per piece of at
	// most 64 KiB, instead of kv_checksum, which finds each 16-byte
	// chunk's span by a search and reduces every chunk over the warp
	// (kv_checksum remains for spans off a word). The same sums; what
	// differs is how long the kernel holds the GPU away from another
	// context's work. Off by default: on an H100 at stop 51 it passed the
	// driver tests, read 4-6x faster alone, and a decode-shaped loop
	// beside full-speed restores slowed 1.12x with it against 1.18x, but a
	// restore through rankd was no faster (0.78 of the copy engine against
	// 0.84 at 1.3 GB, one run; BENCHMARKS.md).
	UnitSums bool
	// SumBlocks bounds the blocks of every checksum kernel hidden under
	// copies (a gather's, every scatter batch's but the last) to this many
	// in all, so that it holds a few multiprocessors for longer instead of
	// a slot on every one (0: one block per multiprocessor, the default).
	// The last batch of a scatter, which nothing hides, keeps them all.
	// kv_sum_units reads ~12 GB/s per block on an H100 (stop 51), so 8
	// blocks outrun a copy engine's 55 GB/s; kv_checksum ~2 GB/s per
	// block, which needs 40. For measurements: whether a model beside
	// full-speed restores slows less with the checksums confined; off by
	// default.
	SumBlocks uint32
	// SMControl moves each transfer's tables to the device and its partial
	// sums back with kv_move, a small kernel reading and writing the mapped
	// pinned table block, instead of copy-engine copies: those queue behind
	// the bulk copies of another transfer going the same way, so a store
	// beside a restore started its copies only once the restore's were
	// nearly done (its first device mark 11-24 ms after its enqueue began,
	// BENCHMARKS.md issue 25.3), and a restore's sums waited behind a
	// store's pages. Off by default: on an H100 at stop 52 both directions
	// at once reached 0.90-0.92 of the card's duplex ceiling with it
	// against 0.82-0.84, but vLLM's decoders beside a load slowed 1.34x
	// against 1.19-1.21x (two more kernels of this context per transfer,
	// time-sliced with the engine's; BENCHMARKS.md).
	SMControl bool
	// SMControlDuplex uses kv_move for a transfer's tables and sums only
	// when a transfer of the other direction is in flight on the device
	// as it is enqueued (not yet seen finished): where the control copies
	// would queue behind the other direction's bulk copies. A device that
	// only restores (decoding beside a load) keeps the copy engine's
	// control copies and their lower cost to the model; one that stores
	// and restores at once gets SMControl's overlap. Implied by SMControl.
	// On by default: at stop 54 both directions at once reached
	// 1.37-1.51x one direction's copy engine with it against 1.26x
	// without, and a restore alone and the decode-shaped loop beside
	// restores moved within their spread; the runs with and without it
	// were on two H100s of the same kind, not in one call (BENCHMARKS.md,
	// "Stop 54").
	SMControlDuplex bool
	// SMSumsScatter brings every scatter's partial sums back with kv_move
	// (its tables still go as SMControl and SMControlDuplex choose). A
	// restore batch enqueued before a store began keeps the copy engine
	// under SMControlDuplex, so its sums, copied back at its end, queue
	// behind every byte of the store queued meanwhile: the candidate for
	// SMControlDuplex's shortfall against SMControl with both directions
	// at once (1.14-1.32x against 1.50x on one H100 at stop 61,
	// docs/gpu.md). It costs a restore alone one small kernel a batch.
	// On by default since stop 62: on two H100s, both directions at once
	// 1.54-1.58x one direction's copy engine in four runs (each run's
	// spread within 1.53-1.61x) against the duplex rule alone's 1.24x,
	// 1.53x and 1.53x, and the decode-shaped loop beside full-speed
	// restores 1.177x with it and without (BENCHMARKS.md, "Stop 62").
	SMSumsScatter bool
}

// maxSumBlocks bounds DMATuning.SumBlocks (a grid's blocks; more than a
// GPU's multiprocessors hold at once is no confinement).
const maxSumBlocks = 1 << 16

// dmaSumBatch is the default size of the checksum batches of a DMA
// transfer (DefaultDMATuning; DMATuning.SumBatch sets it). A scatter's checksum of one batch
// runs once its copies are placed, while the copy engine places the next,
// so only the last batch's checksum follows the copies; but each is a
// kernel on the compute engine, which the GPU time-slices between this
// context and the engine's, and fewer of them slowed vLLM's decoding less:
// inside vLLM on the H200, 64 MiB batches (about
// four kernels per 256 MiB restore batch) slowed the decoding requests'
// steps 1.61x while a 32k prompt loaded, one kernel per transfer 1.28x at
// the same TTFT (BENCHMARKS.md). A transfer of rankd's (at most
// RetrieveBatchBytes, 1 GiB by default) is therefore one batch: its
// exposed checksum reads at most 1 GiB of HBM, about 0.3 ms.
const dmaSumBatch = 1 << 30

// DefaultDMATuning returns the DMA path's defaults, which a device starts
// with.
func DefaultDMATuning() DMATuning {
	return DMATuning{SumBatch: dmaSumBatch, SMControlDuplex: true, SMSumsScatter: true}
}

// Validate checks t.
func (t DMATuning) Validate() error {
	switch {
	case t.SumBatch == 0:
		return fmt.Errorf("cuda: DMA checksum batch of 0 bytes: a checksum kernel reads at least 1 byte")
	case t.SumBlocks > maxSumBlocks:
		return fmt.Errorf("cuda: DMA checksum kernels of %d blocks: at most %d", t.SumBlocks, maxSumBlocks)
	case t.OrderScatters && (t.HostLaunch || t.Queue > 0):
		// Both block the enqueuing thread on the device, which with the
		// chain's lock held would stall every other scatter's enqueue.
		return fmt.Errorf("cuda: DMA scatters in order cannot be combined with checksums launched from the host or a copy queue bound")
	}
	return nil
}

type dmaTuner interface{ tuneDMA(DMATuning) }

func (d *hostDevice) tuneDMA(DMATuning) {}

// TuneDMA sets dev's DMATuning; rankd's --dma-sum-batch and --dma-queue
// call it after Open, before the device is shared.
func TuneDMA(dev Device, t DMATuning) error {
	if err := t.Validate(); err != nil {
		return err
	}
	dt, ok := dev.(dmaTuner)
	if !ok {
		return fmt.Errorf("cuda: device %T has no DMA path to tune", dev)
	}
	dt.tuneDMA(t)
	return nil
}

type batchReporter interface{ copyBatching() (bool, error) }

func (d *hostDevice) copyBatching() (bool, error) { return hostBatched, nil }

type moveCounter interface{ smControlTransfers() uint64 }

func (d *hostDevice) smControlTransfers() uint64 { return 0 }

// SMControlTransfers is how many transfers dev has enqueued with their
// tables and sums moved by kv_move (DMATuning.SMControl, or
// SMControlDuplex beside a transfer of the other direction); 0 for a
// device without a DMA path. rankd exports it as
// kvtier_rankd_sm_control_transfers_total.
func SMControlTransfers(dev Device) uint64 {
	if mc, ok := dev.(moveCounter); ok {
		return mc.smControlTransfers()
	}
	return 0
}

// CopyEngineBatching reports whether dev's DMA path enqueues its copies in
// batches (cuMemcpyBatchAsync), which auto's rule needs before it picks
// the copy engine, and the driver's refusal if it refused a batch at run
// time (the device then enqueues a call per copy and auto keeps the
// kernels). rankd exports it as kvtier_rankd_copy_engine_batching.
func CopyEngineBatching(dev Device) (bool, error) {
	br, ok := dev.(batchReporter)
	if !ok {
		return false, nil
	}
	return br.copyBatching()
}
