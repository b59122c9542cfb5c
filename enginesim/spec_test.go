package enginesim

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/kvtier/kvtier/dcp"
)

// The built-in scenarios equal their shipped spec files: same spec (and so
// the same namespace), prompt shape and description.
func TestBuiltinScenariosEqualTheirFiles(t *testing.T) {
	for _, name := range ScenarioNames() {
		want, err := LookupScenario(name)
		if err != nil {
			t.Fatal(err)
		}
		got, err := LoadSpec(filepath.Join("specs", name+".json"))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got.Source = ""
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: the spec file and the built-in scenario differ:\nfile     %+v\nbuilt-in %+v", name, got, want)
		}
		rw, _ := want.Spec.Resolve()
		rg, err := got.Spec.Resolve()
		if err != nil || rg.Namespace != rw.Namespace {
			t.Errorf("%s: namespace %v, built-in %s (%v)", name, rg, rw.Namespace, err)
		}
	}
}

// Every shipped spec in the folder is the one built into the binary, loads
// by path and by name, and plans; the folder covers the rows of DESIGN's
// seed geometry table and everything issue 27's acceptance names.
func TestShippedSpecsCoverTheAcceptance(t *testing.T) {
	files, err := filepath.Glob("specs/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no spec files: %v", err)
	}
	if len(files) != len(ShippedSpecs()) {
		t.Fatalf("%d files in specs/, %d built in", len(files), len(ShippedSpecs()))
	}
	have := map[string]bool{}
	models := map[string]dcp.Namespace{}
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".json")
		disk, _ := os.ReadFile(f)
		built, err := ShippedSpec(name + ".json")
		if err != nil || !bytes.Equal(disk, built) {
			t.Fatalf("%s: built-in copy differs from the file (%v)", name, err)
		}
		sc, err := LoadSpec(f)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		byName, err := LoadSpec(name)
		if err != nil || !strings.Contains(byName.Source, "built in") {
			t.Fatalf("%s by name: %+v %v", name, byName.Source, err)
		}
		if sc.Name != name {
			t.Errorf("%s: scenario named %q", f, sc.Name)
		}
		p, err := NewPlan(sc, 1)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		l := sc.Spec.Layout
		have["TP8"] = have["TP8"] || l.TP == 8
		have["DCP2"] = have["DCP2"] || l.DCP == 2
		have["DCP8"] = have["DCP8"] || l.DCP == 8
		have["interleave 2"] = have["interleave 2"] || l.Interleave == 2
		have["interleave 4"] = have["interleave 4"] || l.Interleave == 4
		have["1-token tail"] = have["1-token tail"] || sc.TailTokens == 1
		for gi, g := range p.R.Geometry {
			if g.Tiled && g.Kind != dcp.Recurrent {
				have["rows of "+itoa(g.SlotBytes)] = true
				if g.PageBytes-g.SemanticBytes == uint64(g.Slots) {
					have["1-byte tails"] = true
				}
			}
			if g.PageBytes-g.SemanticBytes == 1 {
				have["1-byte tails"] = true
			}
			if g.StrideBytes >= 1000*g.PageBytes {
				have["stride >> declared"] = true
			}
			lo, hi := p.Tables[0][gi][0], p.Tables[0][gi][0]
			for _, tab := range p.Tables {
				for _, b := range tab[gi] {
					lo, hi = min(lo, b), max(hi, b)
				}
			}
			if lo < 1<<31 && hi >= 1<<31 {
				have["block ids across 2^31"] = true
			}
			if hi*int64(g.StrideBytes) > 1<<31 {
				have["offsets > 2^31"] = true
			}
		}
		if ns, ok := models[sc.Spec.Model]; ok && ns != p.R.Namespace {
			have["same model, another layout"] = true
		}
		models[sc.Spec.Model] = p.R.Namespace
		have[name] = true
	}
	for _, want := range []string{"TP8", "DCP2", "DCP8", "interleave 2", "interleave 4",
		"rows of 1", "rows of 3", "rows of 561", "rows of 4097", "rows of 65537", "1-byte tails", "1-token tail",
		"stride >> declared", "block ids across 2^31", "offsets > 2^31", "same model, another layout",
		// DESIGN's seed geometry table, row by row
		"seed-mla-fp8-index-tail", "seed-fp8-ds-mla", "seed-opaque-tail", "seed-nvfp4-packed",
		"seed-recurrent-dcp1", "seed-recurrent-dcp2", "seed-recurrent-dcp4", "seed-recurrent-dcp8",
		"seed-large-recurrent-pool"} {
		if !have[want] {
			t.Errorf("no shipped spec has %s", want)
		}
	}
	// The last seed row is refused, naming the rule and the numbers.
	_, err = LoadSpec("specs/rejected/seed-declared-over-stride.json")
	if err == nil || !strings.Contains(err.Error(), "declared page 177408 B exceeds block stride 160000 B") {
		t.Fatalf("declared page over stride: %v", err)
	}
}

func itoa(n uint64) string { b, _ := json.Marshal(n); return string(b) }

// A spec in YAML is the same scenario as in JSON.
func TestSpecYAMLEqualsJSON(t *testing.T) {
	data, err := os.ReadFile("specs/tp4dcp2-interleave4.json")
	if err != nil {
		t.Fatal(err)
	}
	var v any
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatal(err)
	}
	y, err := yaml.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	fromJSON, err := ParseSpec(data, false, "x")
	if err != nil {
		t.Fatal(err)
	}
	fromYAML, err := ParseSpec(y, true, "x")
	if err != nil {
		t.Fatalf("%v\n%s", err, y)
	}
	if !reflect.DeepEqual(fromJSON, fromYAML) {
		t.Fatalf("YAML %+v, JSON %+v", fromYAML, fromJSON)
	}
	dir := t.TempDir()
	f := filepath.Join(dir, "m.yaml")
	if err := os.WriteFile(f, y, 0o600); err != nil {
		t.Fatal(err)
	}
	if sc, err := LoadSpec(f); err != nil || sc.Name != "m" || sc.Spec.Layout.Interleave != 4 {
		t.Fatalf("LoadSpec %s: %+v %v", f, sc, err)
	}
}

// Absent layout sizes and scenario fields take their documented defaults.
func TestSpecDefaults(t *testing.T) {
	sc, err := ParseSpec([]byte(`{"model": "m", "layout": {"tp": 2}, "chunk_tokens": 16,
		"groups": [{"kind": "attention", "block_size": 16, "layers": 1, "semantic_bytes": 32, "page_bytes": 32, "stride_bytes": 32, "kv_format": "bf16"}]}`), false, "mine")
	if err != nil {
		t.Fatal(err)
	}
	want := dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}
	if sc.Name != "mine" || sc.Spec.Layout != want || sc.Chunks != DefaultSpecChunks || sc.TailTokens != 0 || sc.BlockBase != 0 {
		t.Fatalf("%+v", sc)
	}
}

// block_order "consecutive" lays each phase's table out as one run, the
// store's at the bottom of the window and the restore's at its top (no
// block shared); absent or "shuffled" keeps the random tables.
func TestSpecBlockOrder(t *testing.T) {
	spec := func(order string) Scenario {
		t.Helper()
		extra := ""
		if order != "" {
			extra = `, "block_order": "` + order + `"`
		}
		sc, err := ParseSpec([]byte(`{"model": "m", "layout": {"tp": 1}, "chunk_tokens": 64,
			"groups": [{"kind": "attention", "block_size": 16, "layers": 2, "semantic_bytes": 32, "page_bytes": 32, "stride_bytes": 32, "kv_format": "bf16"}],
			"scenario": {"chunks": 3, "block_id_base": 5`+extra+`}}`), false, "x")
		if err != nil {
			t.Fatal(err)
		}
		return sc
	}
	p, err := NewPlan(spec("consecutive"), 1)
	if err != nil {
		t.Fatal(err)
	}
	used, window := int64(12), int64(27) // 3 chunks x 4 blocks; twice that plus 3
	for phase, first := range []int64{5, 5 + window - used} {
		tab := p.Tables[phase][0]
		if int64(len(tab)) != used {
			t.Fatalf("phase %d: %d blocks, want %d", phase, len(tab), used)
		}
		for v, b := range tab {
			if b != first+int64(v) {
				t.Fatalf("phase %d: table %v, want one run from %d", phase, tab, first)
			}
		}
	}
	if p.Tables[1][0][0] <= p.Tables[0][0][used-1] || p.Tables[1][0][used-1] >= 5+window {
		t.Fatalf("phases overlap or leave the window: %v %v", p.Tables[0][0], p.Tables[1][0])
	}
	for _, order := range []string{"", "shuffled"} {
		sc := spec(order)
		if sc.Consecutive {
			t.Fatalf("order %q: consecutive", order)
		}
		p, err := NewPlan(sc, 1)
		if err != nil {
			t.Fatal(err)
		}
		run := true
		for v, b := range p.Tables[0][0] {
			run = run && b == p.Tables[0][0][0]+int64(v)
		}
		if run {
			t.Fatalf("order %q: table %v is one run", order, p.Tables[0][0])
		}
	}
}

// Bad input is refused with the field, the rule and the numbers.
func TestSpecErrors(t *testing.T) {
	good := func() map[string]any {
		return map[string]any{
			"model": "m", "layout": map[string]any{"tp": 4, "dcp": 2, "interleave": 1, "pp": 1}, "chunk_tokens": 64,
			"groups": []any{map[string]any{"name": "g0", "kind": "attention", "mla": true, "block_size": 16, "layers": 1,
				"semantic_bytes": 16 * 528, "page_bytes": 16 * 561, "stride_bytes": 16*561 + 37, "kv_format": "fp8"}},
			"scenario": map[string]any{"chunks": 2, "tail_tokens": 1},
		}
	}
	group := func(m map[string]any) map[string]any { return m["groups"].([]any)[0].(map[string]any) }
	cases := []struct {
		name string
		edit func(m map[string]any)
		want []string
	}{
		{"unknown top-level field", func(m map[string]any) { m["modle"] = "x" }, []string{`unknown field "modle"`}},
		{"unknown group field", func(m map[string]any) { group(m)["page_size"] = 1 }, []string{`unknown field "page_size"`}},
		{"unknown scenario field", func(m map[string]any) { m["scenario"].(map[string]any)["chunk"] = 1 }, []string{`unknown field "chunk"`}},
		{"kind not understood", func(m map[string]any) { group(m)["kind"] = "mamba2" }, []string{"groups[0].kind", `"mamba2"`}},
		{"declared over stride", func(m map[string]any) { group(m)["stride_bytes"] = 16*561 - 1 },
			[]string{"groups[0]", "declared page 8976 B exceeds block stride 8975 B"}},
		{"semantic over declared", func(m map[string]any) { group(m)["semantic_bytes"] = 16*561 + 1 },
			[]string{"groups[0]", "semantic page 8977 B exceeds declared page 8976 B"}},
		{"TP not divisible by DCP", func(m map[string]any) { m["layout"].(map[string]any)["dcp"] = 3 },
			[]string{"layout", "TP size 4 is not divisible by DCP size 3"}},
		{"explicit DCP 0", func(m map[string]any) { m["layout"].(map[string]any)["dcp"] = 0 }, []string{"layout", "DCP size 0"}},
		{"PP stage past PP", func(m map[string]any) {
			m["layout"].(map[string]any)["pp"] = 2
			m["layout"].(map[string]any)["pp_stage"] = 2
		},
			[]string{"layout", "PP stage 2 of PP size 2"}},
		{"explicit PP 0", func(m map[string]any) { m["layout"].(map[string]any)["pp"] = 0 }, []string{"layout", "PP size 0"}},
		{"interleave not dividing the block", func(m map[string]any) { m["layout"].(map[string]any)["interleave"] = 3 },
			[]string{"groups[0]", "DCP interleave 3 does not divide block size 16"}},
		{"chunk not a multiple of the scheduler block", func(m map[string]any) { m["chunk_tokens"] = 48 },
			[]string{"chunk_tokens", "chunk size 48 tokens is not a multiple of the scheduler block 32"}},
		{"no chunk size", func(m map[string]any) { delete(m, "chunk_tokens") }, []string{"chunk_tokens", "0, want >= 1"}},
		{"no model", func(m map[string]any) { delete(m, "model") }, []string{"model", "empty"}},
		{"no groups", func(m map[string]any) { m["groups"] = []any{} }, []string{"groups", "no KV cache group"}},
		{"MLA recurrent", func(m map[string]any) { group(m)["kind"] = "recurrent" }, []string{"groups[0]", "MLA applies to attention groups"}},
		{"zero layers", func(m map[string]any) { group(m)["layers"] = 0 }, []string{"groups[0]", "layer count 0"}},
		{"zero chunks", func(m map[string]any) { m["scenario"].(map[string]any)["chunks"] = 0 }, []string{"scenario.chunks", "0, want >= 1"}},
		{"tail of a whole chunk", func(m map[string]any) { m["scenario"].(map[string]any)["tail_tokens"] = 64 },
			[]string{"scenario.tail_tokens", "64, want 0..63"}},
		{"pool smaller than the prompt", func(m map[string]any) { m["scenario"].(map[string]any)["pool_blocks"] = 3 },
			[]string{"scenario", `group "g0": 3 pool blocks, the prompt uses 4`}},
		{"negative block id base", func(m map[string]any) { m["scenario"].(map[string]any)["block_id_base"] = -1 },
			[]string{"scenario", "block id base -1"}},
		{"pool over the limit", func(m map[string]any) { m["scenario"].(map[string]any)["block_id_base"] = 1 << 40 },
			[]string{"scenario", "exceeds 1099511627776 B"}},
		{"block order not understood", func(m map[string]any) { m["scenario"].(map[string]any)["block_order"] = "sorted" },
			[]string{"scenario.block_order", `"sorted", want "shuffled" or "consecutive"`}},
		{"negative bytes", func(m map[string]any) { group(m)["page_bytes"] = -1 }, []string{"cannot unmarshal number -1", "page_bytes"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := good()
			tc.edit(m)
			data, _ := json.Marshal(m)
			_, err := ParseSpec(data, false, "x")
			if err == nil {
				t.Fatalf("accepted %s", data)
			}
			if !errors.Is(err, ErrSpec) {
				t.Errorf("%v does not wrap ErrSpec", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			// The same in YAML.
			y, _ := yaml.Marshal(m)
			if _, err := ParseSpec(y, true, "x"); err == nil {
				t.Errorf("YAML accepted:\n%s", y)
			}
		})
	}
	base, _ := json.Marshal(good())
	if _, err := ParseSpec(base, false, "x"); err != nil {
		t.Fatalf("the good spec: %v", err)
	}
	for name, data := range map[string]string{
		"trailing data": string(base) + "{}",
		"syntax":        "{\n\"model\": \"m\",\n\"layout\": {\"tp\": 1,}\n}",
		"too large":     strings.Repeat(" ", MaxSpecBytes+1),
	} {
		if _, err := ParseSpec([]byte(data), false, "x"); err == nil || !errors.Is(err, ErrSpec) {
			t.Errorf("%s: %v", name, err)
		} else if name == "syntax" && !strings.Contains(err.Error(), "line 3") {
			t.Errorf("syntax error without its line: %v", err)
		}
	}
	if _, err := LoadSpec("no-such-spec"); err == nil || !strings.Contains(err.Error(), "tp8dcp2") {
		t.Errorf("a missing spec does not list the shipped ones: %v", err)
	}
}

// A spec file never panics the parser, whatever its bytes.
func FuzzParseSpec(f *testing.F) {
	for _, n := range ShippedSpecs() {
		b, _ := ShippedSpec(n + ".json")
		f.Add(b, false)
	}
	f.Add([]byte("model: m\nlayout: {tp: 1}\nchunk_tokens: 1\n"), true)
	f.Fuzz(func(t *testing.T, data []byte, yamlFormat bool) {
		sc, err := ParseSpec(data, yamlFormat, "fuzz")
		if err != nil {
			return
		}
		if _, err := NewPlan(sc, 1); err != nil {
			t.Fatalf("ParseSpec accepted a scenario NewPlan refuses: %v", err)
		}
	})
}
