package deploy

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// vectorConstructors are the client_golang functions that make a metric
// vector: a family that shows in no scrape until a label value is used.
var vectorConstructors = map[string]bool{"NewCounterVec": true, "NewGaugeVec": true, "NewHistogramVec": true, "NewSummaryVec": true}

// vector is one metric vector the code defines.
type vector struct {
	name, where string
}

// definedVectors returns every metric vector the Go files (tests left out)
// under root define, read from their syntax: the fully qualified name
// (Namespace, Subsystem and Name of the options literal) and where. A
// vector whose name is not made of string literals is an error: the test
// would not know what to look for.
func definedVectors(root string, skip map[string]bool) ([]vector, error) {
	var out []vector
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && (strings.HasPrefix(d.Name(), ".") || skip[filepath.ToSlash(strings.TrimPrefix(path, root+string(filepath.Separator)))]) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		file, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		var ferr error
		ast.Inspect(file, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || ferr != nil {
				return ferr == nil
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || !vectorConstructors[sel.Sel.Name] || len(call.Args) == 0 {
				return true
			}
			where := fset.Position(call.Pos()).String()
			lit, ok := call.Args[0].(*ast.CompositeLit)
			if !ok {
				ferr = fmt.Errorf("%s: %s: the options are not a literal", where, sel.Sel.Name)
				return false
			}
			parts := map[string]string{}
			for _, el := range lit.Elts {
				kv, ok := el.(*ast.KeyValueExpr)
				if !ok {
					continue
				}
				key, _ := kv.Key.(*ast.Ident)
				if key == nil || (key.Name != "Namespace" && key.Name != "Subsystem" && key.Name != "Name") {
					continue
				}
				bl, ok := kv.Value.(*ast.BasicLit)
				if !ok || bl.Kind != token.STRING {
					ferr = fmt.Errorf("%s: %s: %s is not a string literal", where, sel.Sel.Name, key.Name)
					return false
				}
				parts[key.Name], _ = strconv.Unquote(bl.Value)
			}
			name := prometheus.BuildFQName(parts["Namespace"], parts["Subsystem"], parts["Name"])
			if parts["Name"] == "" {
				ferr = fmt.Errorf("%s: %s: no Name", where, sel.Sel.Name)
				return false
			}
			out = append(out, vector{name, where})
			return true
		})
		return ferr
	})
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out, err
}

// uninitialised returns one error per vector of vs that a daemon
// registers but that shows no series in the daemon's fresh gather, and one
// per vector no daemon registers (a vector of a package the daemons do not
// link belongs in skip).
func (e *exported) uninitialised(vs []vector) []error {
	var errs []error
	for _, v := range vs {
		who, err := e.registered(v.name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if len(who) == 0 {
			errs = append(errs, fmt.Errorf("%s (%s) is registered by neither the coordinator nor rankd", v.name, v.where))
		}
		for _, d := range who {
			n := 0
			for _, mf := range e.fresh[d] {
				if mf.GetName() == v.name {
					n = len(mf.GetMetric())
				}
			}
			if n == 0 {
				errs = append(errs, fmt.Errorf("%s (%s): no series on a fresh %s: initialise its known label values", v.name, v.where, d))
			}
		}
	}
	return errs
}

// notDaemon are the directories (from the repository root) whose metric
// vectors no daemon registers: the test tools.
var notDaemon = map[string]bool{"python": true, "enginesim": true, "campaign": true, "e2e": true, "cmd/enginesim": true, "cmd/campaign": true}

// TestVectorsInitialised: every metric vector the code defines shows at
// least one series on a freshly started coordinator or rankd, before any
// engine or rank has talked to it, so that a healthy, idle cluster's
// panels show 0 rather than "No data", and an alert on the first failure
// (increase() over a series that would otherwise appear at 1) can fire.
// A vector without its label values initialised is caught, with its file.
func TestVectorsInitialised(t *testing.T) {
	vs, err := definedVectors("..", notDaemon)
	if err != nil {
		t.Fatal(err)
	}
	if len(vs) < 20 {
		t.Fatalf("%d vectors found: the definitions are no longer read", len(vs))
	}
	e := daemonMetrics(t)
	for _, err := range e.uninitialised(vs) {
		t.Error(err)
	}

	// A vector nobody initialised is caught: the same check with a
	// fresh gather that lost the coordinator's restore outcomes.
	var lost []*dto.MetricFamily
	for _, mf := range e.fresh["coordinator"] {
		if mf.GetName() != "kvtier_coord_restores_total" {
			lost = append(lost, mf)
		}
	}
	e.fresh["coordinator"] = lost
	var got []string
	for _, err := range e.uninitialised(vs) {
		got = append(got, err.Error())
	}
	if len(got) != 1 || !strings.Contains(got[0], "kvtier_coord_restores_total (../coordinator/metrics.go:") ||
		!strings.HasSuffix(got[0], "no series on a fresh coordinator: initialise its known label values") {
		t.Fatalf("errors without the restore outcomes: %q", got)
	}
}
