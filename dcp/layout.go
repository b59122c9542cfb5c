package dcp

import "fmt"

// Layout is the parallel layout of one engine instance.
//
// TP ranks are numbered 0..TP-1; the DCP rank of TP rank t is t % DCP, so the
// TP/DCP ranks t, t+DCP, t+2*DCP, ... hold the same tokens.
type Layout struct {
	// TP is the tensor-parallel size (>= 1).
	TP int `json:"tp"`
	// DCP is the decode-context-parallel size W (>= 1, divides TP).
	DCP int `json:"dcp"`
	// Interleave is the DCP interleave I: tokens are dealt to DCP ranks in
	// runs of I (>= 1; must divide every attention group's block size).
	Interleave int `json:"interleave"`
	// PP is the pipeline-parallel size P (>= 1).
	PP int `json:"pp"`
	// PPStage is the pipeline stage this layout describes (0..PP-1). Each
	// stage holds its own layers on its own GPUs, so kvtier treats a stage
	// as a world of its own: its own spec (its layers) and namespace, its
	// TP ranks a rank set of their own (the vLLM connector names them
	// instance "<instance>-pp<stage>"); an engine restores a chunk only
	// when every stage's namespace holds it COMPLETE. PP 1 encodes no
	// stage, so a PP-1 namespace is what it was before stages existed.
	PPStage int `json:"pp_stage,omitempty"`
}

// MaxTP bounds TP so shard numbers fit a Key's 16-bit shard field with room.
const MaxTP = 4096

// MaxPP bounds the pipeline-parallel size (vLLM's largest deployments run
// a few dozen stages at most; a bound keeps a forged spec small).
const MaxPP = 256

// Validate checks the rules of a layout.
func (l Layout) Validate() error {
	switch {
	case l.TP < 1:
		return fmt.Errorf("TP size %d must be >= 1: %w", l.TP, ErrLayout)
	case l.DCP < 1:
		return fmt.Errorf("DCP size %d must be >= 1: %w", l.DCP, ErrLayout)
	case l.Interleave < 1:
		return fmt.Errorf("DCP interleave %d must be >= 1: %w", l.Interleave, ErrLayout)
	case l.TP > MaxTP:
		return fmt.Errorf("TP size %d exceeds the supported %d: %w", l.TP, MaxTP, ErrLayout)
	case l.PP < 1 || l.PP > MaxPP:
		return fmt.Errorf("PP size %d: want 1..%d: %w", l.PP, MaxPP, ErrLayout)
	case l.PPStage < 0 || l.PPStage >= l.PP:
		return fmt.Errorf("PP stage %d of PP size %d: want 0..%d: %w", l.PPStage, l.PP, l.PP-1, ErrLayout)
	case l.TP%l.DCP != 0:
		return fmt.Errorf("TP size %d is not divisible by DCP size %d: %w", l.TP, l.DCP, ErrLayout)
	}
	return nil
}

// DCPRank returns the DCP rank of a TP rank.
func (l Layout) DCPRank(tpRank int) int { return tpRank % l.DCP }

// Owner returns the DCP rank that holds token position pos in an attention
// group whose blocks hold blockSize tokens on each rank:
// vbs = blockSize*W, vbo = pos % vbs, owner = (vbo / I) % W.
func (l Layout) Owner(pos int64, blockSize int) int {
	w, i := int64(l.DCP), int64(l.Interleave)
	vbo := pos % (int64(blockSize) * w)
	return int((vbo / i) % w)
}

// LocalSlot returns the DCP rank owning pos and its slot in that rank's KV
// pool: block_table[pos / vbs]*blockSize + (vbo / (W*I))*I + vbo % I, where
// blockTable maps virtual (scheduler) blocks of blockSize*W tokens to the
// block ids of this group.
func (l Layout) LocalSlot(pos int64, blockSize int, blockTable []int64) (rank int, slot int64, err error) {
	if pos < 0 {
		return 0, 0, fmt.Errorf("token position %d is negative: %w", pos, ErrBlock)
	}
	w, i, bs := int64(l.DCP), int64(l.Interleave), int64(blockSize)
	vbs := bs * w
	vb := pos / vbs
	if vb >= int64(len(blockTable)) {
		return 0, 0, fmt.Errorf("token position %d needs virtual block %d, block table has %d: %w",
			pos, vb, len(blockTable), ErrBlock)
	}
	vbo := pos % vbs
	rank = int((vbo / i) % w)
	slot = blockTable[vb]*bs + (vbo/(w*i))*i + vbo%i
	return rank, slot, nil
}
