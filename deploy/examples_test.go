package deploy

import (
	"go/ast"
	"go/parser"
	"go/token"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/internal/flagfile"
)

// flagDefiners are the flag.FlagSet (and package flag) methods that define
// a flag, with the argument index of its name.
var flagDefiners = map[string]int{
	"Bool": 0, "Int": 0, "Int64": 0, "Uint": 0, "Uint64": 0, "String": 0, "Float64": 0, "Duration": 0, "Func": 0, "BoolFunc": 0,
	"BoolVar": 1, "IntVar": 1, "Int64Var": 1, "UintVar": 1, "Uint64Var": 1, "StringVar": 1, "Float64Var": 1, "DurationVar": 1,
	"Var": 1, "TextVar": 1,
}

// definedFlags returns the names of the flags the Go files (tests left
// out) of dir define with a literal name, read from their syntax: the
// deploy test needs no build of the commands.
func definedFlags(t *testing.T, dir string) map[string]bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(file, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			i, ok := flagDefiners[sel.Sel.Name]
			if !ok || len(call.Args) <= i {
				return true
			}
			lit, ok := call.Args[i].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			if name, err := strconv.Unquote(lit.Value); err == nil {
				names[name] = true
			}
			return true
		})
	}
	if len(names) < 10 {
		t.Fatalf("%s: found %d flags %v: the flag definitions are no longer read", dir, len(names), names)
	}
	return names
}

// commentedKey matches a commented-out setting: "# key = value".
var commentedKey = regexp.MustCompile(`^#\s*([a-z][a-z0-9]*(?:-[a-z0-9]+)*) = \S`)

// exampleKey is one key of an example config: its line and value.
type exampleKey struct {
	line  int
	value string
}

// exampleKeys returns the keys of an example config, set or commented
// out, each with its line and value.
func exampleKeys(t *testing.T, path string) map[string]exampleKey {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]exampleKey{}
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if m := commentedKey.FindStringSubmatch(line); m != nil {
			// Uncommented, the line must be one setting whose value is the
			// example value alone (a note goes after " # ").
			s, err := flagfile.ParseSettings([]byte(strings.TrimPrefix(line, "#")))
			if err != nil || len(s) != 1 || s[0].Key != m[1] || strings.ContainsAny(s[0].Value, " \t") {
				t.Errorf("%s:%d: uncommented, %q is not one %s setting with a one-word value: %+v, %v", path, i+1, line, m[1], s, err)
				keys[m[1]] = exampleKey{line: i + 1}
				continue
			}
			keys[m[1]] = exampleKey{line: i + 1, value: s[0].Value}
			continue
		}
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			keys[strings.TrimSpace(k)] = exampleKey{line: i + 1, value: strings.TrimSpace(v)}
		}
	}
	return keys
}

// undefinedKeys returns "file:line: key" for each key of the example that
// is not a flag of its command, sorted.
func undefinedKeys(path string, keys map[string]exampleKey, flags map[string]bool) []string {
	var bad []string
	for k, ek := range keys {
		if !flags[k] {
			bad = append(bad, path+":"+strconv.Itoa(ek.line)+": "+k)
		}
	}
	sort.Strings(bad)
	return bad
}

// TestExampleKeysAreFlags: every key of the example configs, commented
// out ones included (an operator uncomments them), names a flag of its
// command, and the keys of this session's features are all there.
func TestExampleKeysAreFlags(t *testing.T) {
	for _, tc := range []struct {
		example, cmd string
		want         []string
	}{
		{"examples/coordinator.conf", "../cmd/coordinator", []string{
			"nats-cluster", "nats-routes", "nats-cluster-name", "raft-id", "raft-bind", "raft-advertise", "raft-dir",
			"raft-peers", "raft-bootstrap", "raft-cert", "raft-cert-key", "raft-ca", "raft-heartbeat-timeout", "raft-election-timeout",
			"raft-lease-timeout", "raft-snapshot-threshold", "host-shared-l1", "rebuild-index"}},
		{"examples/rankd.conf", "../cmd/rankd", []string{
			"host-l1-dir", "l3-endpoint", "l3-bucket", "l3-prefix", "l3-credentials", "l3-ca", "l3-region", "l3-bytes"}},
	} {
		flags := definedFlags(t, tc.cmd)
		keys := exampleKeys(t, tc.example)
		for _, bad := range undefinedKeys(tc.example, keys, flags) {
			t.Errorf("%s is not a flag of %s", bad, tc.cmd)
		}
		for _, k := range tc.want {
			if _, ok := keys[k]; !ok {
				t.Errorf("%s: no key %s (set or commented out)", tc.example, k)
			}
		}
	}

	// A misspelled commented-out key is caught, with its line.
	keys := map[string]exampleKey{"raft-id": {line: 3}, "raft-bootsrap": {line: 7}}
	got := undefinedKeys("x.conf", keys, definedFlags(t, "../cmd/coordinator"))
	if want := []string{"x.conf:7: raft-bootsrap"}; strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("undefinedKeys = %q, want %q", got, want)
	}
}

// listenerKeys are the keys of the example configs that name a port a
// daemon listens on.
var listenerKeys = map[string][]string{
	"examples/coordinator.conf": {"nats-port", "nats-cluster", "bind", "raft-bind", "http"},
	"examples/rankd.conf":       {"bind", "http"},
}

// TestExampleListenersDoNotCollide: a coordinator and the rankds of its
// host run from these examples side by side, so no two listening keys of
// the examples may name the same port (the rankd example once put its
// HTTP port on the coordinator's default raft port).
func TestExampleListenersDoNotCollide(t *testing.T) {
	seen := map[string]string{} // port -> "file key"
	for file, names := range listenerKeys {
		keys := exampleKeys(t, file)
		for _, name := range names {
			k, ok := keys[name]
			if !ok || k.value == "" {
				t.Fatalf("%s: no example value for %s", file, name)
			}
			port := k.value
			if _, p, err := net.SplitHostPort(k.value); err == nil {
				port = p
			}
			if _, err := strconv.Atoi(port); err != nil {
				t.Fatalf("%s:%d: %s = %q has no port", file, k.line, name, k.value)
			}
			if prev, dup := seen[port]; dup {
				t.Errorf("port %s: %s and %s %s (line %d)", port, prev, file, name, k.line)
			}
			seen[port] = file + " " + name
		}
	}
}
