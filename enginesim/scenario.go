package enginesim

import (
	"fmt"
	"sort"
	"strings"

	"github.com/kvtier/kvtier/dcp"
)

// Scenario is an engine configuration to simulate.
type Scenario struct {
	// Name is the --scenario value.
	Name string
	// Describe is a one-line description for progress output.
	Describe string
	// Spec is what the engine registers: model, layout, groups, chunk size.
	Spec dcp.Spec
	// Chunks is the number of full chunks in the simulated prompt.
	Chunks int
	// TailTokens is a trailing partial chunk: part of the prompt, never
	// stored (it has no chunk hash).
	TailTokens int
	// Tokens, when set, is the prompt itself (a replayed trace request)
	// instead of one drawn from the seed; it must hold exactly Chunks full
	// chunks and TailTokens more. Pages stay a function of position and
	// token (and, for opaque pages, of position under the seed), so two
	// prompts sharing a prefix under one seed share its chunk keys and
	// their bytes.
	Tokens []uint32
	// BlockBase is the first block id the block tables use in every
	// pool: the pools hold BlockBase more blocks below the ones the engine
	// uses, which must stay untouched (0: none). Block ids near 2^31 or
	// byte offsets past 2^32 are expressed with it without a table of
	// that many blocks.
	BlockBase int64
	// PoolBlocks is the number of blocks above BlockBase in every pool
	// that the block tables draw from; at least the blocks the prompt
	// uses (0: twice those, plus 3).
	PoolBlocks int64
	// Consecutive lays each phase's block table out as one run of
	// consecutive blocks (the store's from the bottom of the window, the
	// restore's from its top), as a fresh engine's free-block queue hands
	// them out; false shuffles them over the window (random pages).
	Consecutive bool
	// Source is the spec file the scenario was read from ("" for a
	// built-in one).
	Source string
}

// The seed geometries of the design brief. Block sizes and layer counts are
// small so that a whole scenario fits the host backend on a 2-core machine;
// page widths, tails and strides are the real ones.
func seedGroups() []dcp.Group {
	return []dcp.Group{
		// FP8 MLA row with an index tail: 528 B row + 33 B tail = 561 B per
		// token (byte-odd), block stride block_size*561 + 37.
		{Name: "mla_fp8_tail", Kind: dcp.Attention, MLA: true, BlockSize: 16, Layers: 2,
			SemanticBytes: 16 * 528, PageBytes: 16 * 561, StrideBytes: 16*561 + 37, KVFormat: "fp8"},
		// DeepSeek fp8_ds_mla: 512 FP8 + 16 scales + 128 RoPE = 656 B per token.
		{Name: "mla_fp8_ds", Kind: dcp.Attention, MLA: true, BlockSize: 16, Layers: 2,
			SemanticBytes: 16 * 656, PageBytes: 16 * 656, StrideBytes: 16 * 656, KVFormat: "fp8_ds_mla"},
		// Packed NVFP4 page: 512 x 304 B semantic, 177,408 B declared (346.5
		// B/token: one opaque slot), 200,000 B stride.
		{Name: "nvfp4", Kind: dcp.Attention, BlockSize: 512, Layers: 1,
			SemanticBytes: 512 * 304, PageBytes: 177408, StrideBytes: 200000, KVFormat: "nvfp4"},
		// Recurrent state page 4096 x 265 = 1,085,440 B: one opaque slot at
		// DCP1, tiled into W slots at DCP W.
		{Name: "mamba", Kind: dcp.Recurrent, BlockSize: 2048, Layers: 1,
			SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 265, KVFormat: "mamba_f32"},
	}
}

var scenarios = map[string]Scenario{
	"tp4dcp4": {
		Name:     "tp4dcp4",
		Describe: "TP4 x DCP4, MLA groups sharded by DCP (ranks 0-3 store shards 0-3), NVFP4 and recurrent per rank",
		Spec: dcp.Spec{Model: "enginesim/tp4dcp4", Layout: dcp.Layout{TP: 4, DCP: 4, Interleave: 1, PP: 1},
			Groups: seedGroups(), ChunkTokens: 2048},
		Chunks: 4, TailTokens: 100,
	},
	"tp1": {
		Name:     "tp1",
		Describe: "TP1 (one rank, one rankd), every group stored and restored by rank 0",
		Spec: dcp.Spec{Model: "enginesim/tp1", Layout: dcp.Layout{TP: 1, DCP: 1, Interleave: 1, PP: 1},
			Groups: seedGroups(), ChunkTokens: 2048},
		Chunks: 4, TailTokens: 100,
	},
	"tp4dcp1": {
		Name:     "tp4dcp1",
		Describe: "TP4 x DCP1, MLA groups stored by rank 0 and restored on all 4 ranks, NVFP4 and recurrent per rank",
		Spec: dcp.Spec{Model: "enginesim/tp4dcp1", Layout: dcp.Layout{TP: 4, DCP: 1, Interleave: 1, PP: 1},
			Groups: seedGroups(), ChunkTokens: 2048},
		Chunks: 4, TailTokens: 100,
	},
}

// ScenarioNames lists the scenarios, sorted.
func ScenarioNames() []string {
	out := make([]string, 0, len(scenarios))
	for n := range scenarios {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// LookupScenario returns a scenario by name.
func LookupScenario(name string) (Scenario, error) {
	s, ok := scenarios[name]
	if !ok {
		return Scenario{}, fmt.Errorf("unknown scenario %q (want one of %s)", name, strings.Join(ScenarioNames(), ", "))
	}
	s.Spec.Groups = append([]dcp.Group(nil), s.Spec.Groups...)
	return s, nil
}
