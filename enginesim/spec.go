package enginesim

import (
	"bytes"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/kvtier/kvtier/dcp"
)

// SpecDir is where the shipped spec files live in the source tree; the
// same files are built into the binary (ShippedSpecs, LoadSpec by name).
const SpecDir = "enginesim/specs"

// shipped holds the spec files of SpecDir. Those under rejected/ break a
// rule of dcp.Resolve on purpose (a row of the seed geometry table that
// must be refused); they are not runnable.
//
//go:embed specs/*.json specs/rejected/*.json
var shipped embed.FS

// MaxSpecBytes bounds a spec file.
const MaxSpecBytes = 1 << 20

// ErrSpec is wrapped by every error about a spec file's content.
var ErrSpec = errors.New("invalid enginesim spec")

// SpecFile is the on-disk form of a model spec (JSON or YAML, same field
// names). Model, cache salt, layout, chunk tokens and groups map onto
// dcp.Spec and decide the namespace; Scenario only shapes the simulated
// prompt and pools. See docs/enginesim.md.
type SpecFile struct {
	// Name is the scenario name in progress output and results (default:
	// the file name without its extension).
	Name string `json:"name,omitempty" yaml:"name,omitempty"`
	// Describe is a one-line description.
	Describe    string      `json:"describe,omitempty" yaml:"describe,omitempty"`
	Model       string      `json:"model" yaml:"model"`
	CacheSalt   string      `json:"cache_salt,omitempty" yaml:"cache_salt,omitempty"`
	Layout      SpecLayout  `json:"layout" yaml:"layout"`
	ChunkTokens int         `json:"chunk_tokens" yaml:"chunk_tokens"`
	Groups      []SpecGroup `json:"groups" yaml:"groups"`
	// Scenario is optional; absent fields take the defaults documented on
	// SpecScenario.
	Scenario *SpecScenario `json:"scenario,omitempty" yaml:"scenario,omitempty"`
}

// SpecLayout is dcp.Layout with DCP, interleave and PP optional (absent:
// 1). An explicit 0 is an error, not a default.
type SpecLayout struct {
	TP         int  `json:"tp" yaml:"tp"`
	DCP        *int `json:"dcp,omitempty" yaml:"dcp,omitempty"`
	Interleave *int `json:"interleave,omitempty" yaml:"interleave,omitempty"`
	PP         *int `json:"pp,omitempty" yaml:"pp,omitempty"`
	// PPStage is the pipeline stage the spec describes (default 0): under
	// PP > 1 each stage is a world of its own (dcp.Layout.PPStage), so a
	// spec file describes one stage, run by that stage's rankds.
	PPStage int `json:"pp_stage,omitempty" yaml:"pp_stage,omitempty"`
}

// SpecGroup is dcp.Group with the kind spelled out ("attention",
// "sliding_window", "recurrent").
type SpecGroup struct {
	Name          string `json:"name,omitempty" yaml:"name,omitempty"`
	Kind          string `json:"kind" yaml:"kind"`
	MLA           bool   `json:"mla,omitempty" yaml:"mla,omitempty"`
	BlockSize     int    `json:"block_size" yaml:"block_size"`
	Layers        int    `json:"layers" yaml:"layers"`
	SemanticBytes uint64 `json:"semantic_bytes" yaml:"semantic_bytes"`
	PageBytes     uint64 `json:"page_bytes" yaml:"page_bytes"`
	StrideBytes   uint64 `json:"stride_bytes" yaml:"stride_bytes"`
	KVFormat      string `json:"kv_format" yaml:"kv_format"`
}

// SpecScenario shapes the simulated prompt and pools; none of it is part
// of the namespace.
type SpecScenario struct {
	// Chunks is the number of full chunks in the prompt (absent: 4).
	Chunks *int `json:"chunks,omitempty" yaml:"chunks,omitempty"`
	// TailTokens is a trailing partial chunk, never stored (absent: 0).
	TailTokens int `json:"tail_tokens,omitempty" yaml:"tail_tokens,omitempty"`
	// BlockIDBase is the first block id the block tables use; the pools
	// hold that many untouched blocks below (Scenario.BlockBase).
	BlockIDBase int64 `json:"block_id_base,omitempty" yaml:"block_id_base,omitempty"`
	// PoolBlocks is the blocks above the base the tables draw from
	// (absent or 0: twice the blocks the prompt uses, plus 3).
	PoolBlocks int64 `json:"pool_blocks,omitempty" yaml:"pool_blocks,omitempty"`
	// BlockOrder is how the block tables draw from the window: "shuffled"
	// (absent: blocks in random order) or "consecutive" (one run each).
	BlockOrder string `json:"block_order,omitempty" yaml:"block_order,omitempty"`
}

// DefaultSpecChunks is the prompt's chunk count when a spec file gives none.
const DefaultSpecChunks = 4

// ParseSpec decodes a spec file's bytes (JSON, or YAML when yamlFormat) and
// checks it: unknown fields, a kind not understood, and every rule of
// dcp.Spec.Resolve and of the scenario are errors naming the field and the
// numbers. name is the scenario name when the file gives none.
func ParseSpec(data []byte, yamlFormat bool, name string) (Scenario, error) {
	var f SpecFile
	if len(data) > MaxSpecBytes {
		return Scenario{}, fmt.Errorf("spec is %d B, limit %d: %w", len(data), MaxSpecBytes, ErrSpec)
	}
	if yamlFormat {
		dec := yaml.NewDecoder(bytes.NewReader(data))
		dec.KnownFields(true)
		if err := dec.Decode(&f); err != nil {
			return Scenario{}, fmt.Errorf("%w: %w", ErrSpec, err)
		}
	} else {
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&f); err != nil {
			return Scenario{}, fmt.Errorf("%w: %w", ErrSpec, jsonErr(data, err))
		}
		if _, err := dec.Token(); err != io.EOF {
			return Scenario{}, fmt.Errorf("%w: data after the spec object", ErrSpec)
		}
	}
	if f.Name != "" {
		name = f.Name
	}
	return f.ToScenario(name)
}

// jsonErr adds the line of a syntax or type error.
func jsonErr(data []byte, err error) error {
	var off int64 = -1
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	switch {
	case errors.As(err, &se):
		off = se.Offset
	case errors.As(err, &te):
		off = te.Offset
	}
	if off < 0 || off > int64(len(data)) {
		return err
	}
	return fmt.Errorf("line %d: %w", bytes.Count(data[:off], []byte("\n"))+1, err)
}

// ToScenario checks f and turns it into a scenario named name.
func (f *SpecFile) ToScenario(name string) (Scenario, error) {
	bad := func(field, format string, args ...any) (Scenario, error) {
		return Scenario{}, fmt.Errorf("%s: "+format+": %w", append(append([]any{field}, args...), ErrSpec)...)
	}
	one := func(p *int) int {
		if p == nil {
			return 1
		}
		return *p
	}
	sc := Scenario{Name: name, Describe: f.Describe, Chunks: DefaultSpecChunks}
	if sc.Describe == "" {
		sc.Describe = "model spec " + name
	}
	sp := &sc.Spec
	sp.Model, sp.CacheSalt, sp.ChunkTokens = f.Model, f.CacheSalt, f.ChunkTokens
	sp.Layout = dcp.Layout{TP: f.Layout.TP, DCP: one(f.Layout.DCP), Interleave: one(f.Layout.Interleave), PP: one(f.Layout.PP),
		PPStage: f.Layout.PPStage}
	if err := sp.Layout.Validate(); err != nil {
		return bad("layout", "%w", err)
	}
	if len(f.Groups) == 0 {
		return bad("groups", "no KV cache group")
	}
	for i, g := range f.Groups {
		field := fmt.Sprintf("groups[%d]", i)
		kind, err := dcp.ParseKind(g.Kind)
		if err != nil {
			return bad(field+".kind", "%w", err)
		}
		dg := dcp.Group{Name: g.Name, Kind: kind, MLA: g.MLA, BlockSize: g.BlockSize, Layers: g.Layers,
			SemanticBytes: g.SemanticBytes, PageBytes: g.PageBytes, StrideBytes: g.StrideBytes, KVFormat: g.KVFormat}
		if _, err := dg.Resolve(sp.Layout); err != nil {
			return bad(field, "%w", err)
		}
		sp.Groups = append(sp.Groups, dg)
	}
	if sp.Model == "" {
		return bad("model", "empty")
	}
	if sp.ChunkTokens < 1 {
		return bad("chunk_tokens", "%d, want >= 1", sp.ChunkTokens)
	}
	if _, err := sp.Resolve(); err != nil {
		field := "spec"
		if strings.Contains(err.Error(), "chunk size") {
			field = "chunk_tokens"
		}
		return bad(field, "%w", err)
	}
	if s := f.Scenario; s != nil {
		if s.Chunks != nil {
			if *s.Chunks < 1 {
				return bad("scenario.chunks", "%d, want >= 1", *s.Chunks)
			}
			sc.Chunks = *s.Chunks
		}
		if s.TailTokens < 0 || s.TailTokens >= sp.ChunkTokens {
			return bad("scenario.tail_tokens", "%d, want 0..%d (less than one chunk of %d tokens)",
				s.TailTokens, sp.ChunkTokens-1, sp.ChunkTokens)
		}
		sc.TailTokens, sc.BlockBase, sc.PoolBlocks = s.TailTokens, s.BlockIDBase, s.PoolBlocks
		switch s.BlockOrder {
		case "", "shuffled":
		case "consecutive":
			sc.Consecutive = true
		default:
			return bad("scenario.block_order", "%q, want \"shuffled\" or \"consecutive\"", s.BlockOrder)
		}
	}
	// The pools and tables: what NewPlan refuses (block id base and pool
	// blocks out of range, a pool too large) is refused here.
	if _, err := NewPlan(sc, 1); err != nil {
		return bad("scenario", "%w", err)
	}
	return sc, nil
}

// isYAML reports whether a file name says YAML.
func isYAML(name string) bool {
	ext := strings.ToLower(path.Ext(name))
	return ext == ".yaml" || ext == ".yml"
}

func baseName(name string) string {
	b := path.Base(filepath.ToSlash(name))
	return strings.TrimSuffix(b, path.Ext(b))
}

// LoadSpec reads a spec file. A name that is not an existing file but
// the name of a shipped spec (ShippedSpecs, e.g. "tp8dcp8") loads the
// copy built into the binary.
func LoadSpec(file string) (Scenario, error) {
	data, err := os.ReadFile(file)
	src := file
	if errors.Is(err, fs.ErrNotExist) && !strings.ContainsAny(file, `/\.`) {
		if b, serr := shipped.ReadFile("specs/" + file + ".json"); serr == nil {
			data, err, src = b, nil, SpecDir+"/"+file+".json (built in)"
		}
	}
	if err != nil {
		return Scenario{}, fmt.Errorf("spec %s: %w (shipped specs, by name: %s)", file, err, strings.Join(ShippedSpecs(), ", "))
	}
	sc, err := ParseSpec(data, isYAML(file), baseName(file))
	if err != nil {
		return Scenario{}, fmt.Errorf("spec %s: %w", src, err)
	}
	sc.Source = src
	return sc, nil
}

// ShippedSpecs lists the runnable shipped specs by name, sorted.
func ShippedSpecs() []string {
	ents, _ := shipped.ReadDir("specs")
	var out []string
	for _, e := range ents {
		if !e.IsDir() && strings.HasSuffix(e.Name(), ".json") {
			out = append(out, strings.TrimSuffix(e.Name(), ".json"))
		}
	}
	sort.Strings(out)
	return out
}

// ShippedSpec returns the bytes of a shipped spec file by its path under
// SpecDir ("tp1.json", "rejected/seed-declared-over-stride.json").
func ShippedSpec(rel string) ([]byte, error) { return shipped.ReadFile("specs/" + rel) }
