package deploy

import (
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// chartFlag matches a daemon flag in a template's args: "- --name=..." or
// "- --name".
var chartFlag = regexp.MustCompile(`(?m)^\s*- --([a-z0-9-]+)`)

// templateFlags returns the flags named in text, sorted, without repeats.
func templateFlags(text string) []string {
	seen := map[string]bool{}
	for _, m := range chartFlag.FindAllStringSubmatch(text, -1) {
		seen[m[1]] = true
	}
	var out []string
	for f := range seen {
		out = append(out, f)
	}
	sort.Strings(out)
	return out
}

// undefinedFlags returns the flags of text that flags lacks.
func undefinedFlags(text string, flags map[string]bool) []string {
	var bad []string
	for _, f := range templateFlags(text) {
		if !flags[f] {
			bad = append(bad, f)
		}
	}
	return bad
}

// TestChartFlags: the Helm chart starts the daemons with their real flags
// (the coordinator's StatefulSet, the rankd containers of an instance)
// and gives vLLM the connector keys the connector reads, with
// kv_load_failure_policy "recompute" (the connector refuses vLLM's
// default, "fail"). A misspelled flag is caught.
func TestChartFlags(t *testing.T) {
	coord, err := os.ReadFile("helm/kvtier/templates/coordinator.yaml")
	if err != nil {
		t.Fatal(err)
	}
	inst, err := os.ReadFile("helm/kvtier/templates/instance.yaml")
	if err != nil {
		t.Fatal(err)
	}
	coordFlags, rankdFlags := definedFlags(t, "../cmd/coordinator"), definedFlags(t, "../cmd/rankd")
	if bad := undefinedFlags(string(coord), coordFlags); len(bad) > 0 {
		t.Errorf("coordinator.yaml: not flags of coordinator serve: %q", bad)
	}
	_, rankdPart, ok := strings.Cut(string(inst), "- name: rankd-")
	vllmPart, _, _ := strings.Cut(string(inst), "- name: rankd-")
	if !ok {
		t.Fatal("instance.yaml: no rankd container")
	}
	if bad := undefinedFlags(rankdPart, rankdFlags); len(bad) > 0 {
		t.Errorf("instance.yaml: not flags of rankd: %q", bad)
	}
	for _, want := range []string{"raft-peers", "raft-bootstrap", "nats-routes", "data-dir", "creds-dir"} {
		if !strings.Contains(string(coord), "--"+want) {
			t.Errorf("coordinator.yaml: no --%s", want)
		}
	}
	if got := undefinedFlags("        - --tp-rank=0\n        - --l1-byte=1GiB\n", rankdFlags); strings.Join(got, ",") != "l1-byte" {
		t.Fatalf("a misspelled flag: got %q", got)
	}

	// The connector's keys: every kvtier_* key the template sets is one
	// the connector reads (python/src/kvtier/vllm/connector.py).
	src, err := os.ReadFile("../python/src/kvtier/vllm/connector.py")
	if err != nil {
		t.Fatal(err)
	}
	keys := regexp.MustCompile(`"(kvtier_[a-z_]+)"`).FindAllStringSubmatch(vllmPart, -1)
	if len(keys) < 5 {
		t.Fatalf("instance.yaml: %d connector keys", len(keys))
	}
	for _, k := range keys {
		if !strings.Contains(string(src), `extra.get("`+k[1]+`"`) {
			t.Errorf("instance.yaml: connector key %s is not read by the connector", k[1])
		}
	}
	// Every connector value of values.yaml reaches vLLM: a value the
	// template does not pass would be a setting that does nothing.
	vals, err := os.ReadFile("helm/kvtier/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	_, block, _ := strings.Cut(string(vals), "\n  connector:\n")
	var names []string
	for _, line := range strings.Split(block, "\n") {
		m := regexp.MustCompile(`^    ([A-Za-z]+):`).FindStringSubmatch(line)
		if m == nil {
			if strings.HasPrefix(line, "    #") {
				continue
			}
			break
		}
		names = append(names, m[1])
	}
	if len(names) < 4 {
		t.Fatalf("values.yaml: connector values %q", names)
	}
	for _, n := range names {
		if !strings.Contains(vllmPart, "$v.connector."+n) {
			t.Errorf("values.yaml: vllm.connector.%s is not passed to vLLM by instance.yaml", n)
		}
	}
	for _, want := range []string{`"kv_load_failure_policy" "recompute"`, `"kv_connector" "KvtierConnector"`, `"kv_connector_module_path" "kvtier.vllm"`} {
		if !strings.Contains(vllmPart, want) {
			t.Errorf("instance.yaml: the kv-transfer-config lacks %s", want)
		}
	}
}
