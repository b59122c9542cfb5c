package deploy

import (
	"fmt"
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

const rulesFile = "prometheus/kvtier-alerts.yml"

// rules is the part of a Prometheus rules file the tests read.
type rules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Record      string            `yaml:"record"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// severities an alert may carry (docs/metrics.md says what each means).
var severities = map[string]bool{"critical": true, "warning": true}

var recordName = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)

// ruleQueries returns every expression of a rules file, the names its
// recording rules define, and one error per malformed rule: neither or
// both of alert and record, no expression, an unparsable for, an alert
// without a known severity or a summary, a name used twice.
func ruleQueries(data []byte) ([]query, map[string]bool, []error) {
	var f rules
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	dec.KnownFields(true) // a misspelled key (anotations) is an error, not an empty field
	if err := dec.Decode(&f); err != nil {
		return nil, nil, []error{fmt.Errorf("%s: %w", rulesFile, err)}
	}
	var qs []query
	var errs []error
	recorded := map[string]bool{}
	names := map[string]string{}
	for _, g := range f.Groups {
		if g.Name == "" || len(g.Rules) == 0 {
			errs = append(errs, fmt.Errorf("group %q: no name or no rules", g.Name))
		}
		for i, r := range g.Rules {
			where := fmt.Sprintf("group %s rule %d", g.Name, i)
			switch {
			case (r.Alert == "") == (r.Record == ""):
				errs = append(errs, fmt.Errorf("%s: want exactly one of alert and record", where))
				continue
			case r.Alert != "":
				where = fmt.Sprintf("group %s alert %s", g.Name, r.Alert)
				if !severities[r.Labels["severity"]] {
					errs = append(errs, fmt.Errorf("%s: severity %q, want critical or warning", where, r.Labels["severity"]))
				}
				if strings.TrimSpace(r.Annotations["summary"]) == "" {
					errs = append(errs, fmt.Errorf("%s: no summary annotation", where))
				}
				if r.For != "" {
					if _, err := time.ParseDuration(r.For); err != nil {
						errs = append(errs, fmt.Errorf("%s: for %q: %w", where, r.For, err))
					}
				}
			default:
				where = fmt.Sprintf("group %s record %s", g.Name, r.Record)
				if !recordName.MatchString(r.Record) {
					errs = append(errs, fmt.Errorf("%s: not a metric name", where))
				}
				recorded[r.Record] = true
			}
			name := r.Alert + r.Record
			if prev, dup := names[name]; dup {
				errs = append(errs, fmt.Errorf("%s: name also used by %s", where, prev))
			}
			names[name] = where
			if strings.TrimSpace(r.Expr) == "" {
				errs = append(errs, fmt.Errorf("%s: empty expr", where))
				continue
			}
			qs = append(qs, query{where, r.Expr})
		}
	}
	return qs, recorded, errs
}

// TestAlertRules: every rule of the alert rules file names only metrics
// a real coordinator or rankd registers (besides Prometheus's own up and
// the file's recording rules), and every alert has a severity and a
// summary. A misspelled metric, a histogram series of a gauge, a missing
// severity and a missing summary are each caught, naming the rule.
func TestAlertRules(t *testing.T) {
	data, err := os.ReadFile(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	qs, recorded, errs := ruleQueries(data)
	for _, err := range errs {
		t.Error(err)
	}
	if len(qs) < 20 {
		t.Fatalf("%d rules: the file lost its rules", len(qs))
	}
	e := daemonMetrics(t)
	e.extra = map[string]bool{"up": true}
	for name := range recorded {
		e.extra[name] = true
	}
	for _, err := range e.check(qs) {
		t.Error(err)
	}

	bad := strings.Replace(string(data), "kvtier_coord_restore_chunks_total{outcome=\"bytes_wrong\"}[15m])) > 0",
		"kvtier_coord_restore_chunk_total{outcome=\"bytes_wrong\"}[15m])) > 0", 1)
	bad = strings.Replace(bad, "max by (rank) (kvtier_transfer_l2_degraded)", "max by (rank) (kvtier_transfer_l2_degraded_bucket)", 1)
	bad = strings.Replace(bad, "          severity: critical\n        annotations:\n          summary: \"no kvtier", "          team: kvtier\n        annotations:\n          summary: \"no kvtier", 1)
	bad = strings.Replace(bad, "summary: \"index commits", "title: \"index commits", 1)
	if bad == string(data) {
		t.Fatal("the replacements changed nothing")
	}
	qs, _, errs = ruleQueries([]byte(bad))
	var got []string
	for _, err := range append(errs, e.check(qs)...) {
		got = append(got, err.Error())
	}
	want := []string{
		`group kvtier-coordinator alert KvtierNoRaftLeader: severity "", want critical or warning`,
		`group kvtier-coordinator alert KvtierIndexCommitSlow: no summary annotation`,
		`group kvtier-restores alert KvtierRestoreBytesWrong: metric kvtier_coord_restore_chunk_total is registered by neither the coordinator nor rankd`,
		`group kvtier-tiers alert KvtierL2Degraded: kvtier_transfer_l2_degraded_bucket: kvtier_transfer_l2_degraded is a GAUGE, not a histogram`,
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("errors for the bad rules:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
