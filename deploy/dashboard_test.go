package deploy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/coordinator"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/objstore/objstoretest"
	"github.com/kvtier/kvtier/rankd"
	"github.com/kvtier/kvtier/wire"
)

func TestMain(m *testing.M) {
	// The dashboard test runs a replicated coordinator.
	testutil.Main(m, testutil.IgnoreRaftAwait)
}

const dashboardFile = "grafana/kvtier.json"

// dashboard is the part of a Grafana dashboard the tests read.
type dashboard struct {
	UID        string  `json:"uid"`
	Title      string  `json:"title"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name       string `json:"name"`
			Type       string `json:"type"`
			Definition string `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int     `json:"id"`
	Type       string  `json:"type"`
	Title      string  `json:"title"`
	Panels     []panel `json:"panels"` // a collapsed row's
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
}

// query is one PromQL expression of the dashboard and where it is.
type query struct {
	where, expr string
}

// queries returns every PromQL expression of d: each panel target's and
// each query variable's, with structural problems as errors.
func queries(d *dashboard) ([]query, []error) {
	var qs []query
	var errs []error
	ids := map[int]string{}
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
			if p.Title == "" {
				errs = append(errs, fmt.Errorf("%s: no title", where))
			}
			if prev, dup := ids[p.ID]; dup {
				errs = append(errs, fmt.Errorf("%s: id also used by %s", where, prev))
			}
			ids[p.ID] = where
			if p.Type == "row" {
				walk(p.Panels)
				continue
			}
			if len(p.Targets) == 0 {
				errs = append(errs, fmt.Errorf("%s: no queries", where))
			}
			if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
				errs = append(errs, fmt.Errorf("%s: datasource must be the ${datasource} variable", where))
			}
			for _, t := range p.Targets {
				if strings.TrimSpace(t.Expr) == "" {
					errs = append(errs, fmt.Errorf("%s target %s: empty expr", where, t.RefID))
					continue
				}
				qs = append(qs, query{where + " target " + t.RefID, t.Expr})
			}
		}
	}
	walk(d.Panels)
	labelValues := regexp.MustCompile(`^label_values\(\s*(.+?)\s*,\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)$`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			errs = append(errs, fmt.Errorf("variable %q: definition %q is not label_values(<selector>, <label>)", v.Name, v.Definition))
			continue
		}
		qs = append(qs, query{fmt.Sprintf("variable %q", v.Name), m[1]})
	}
	return qs, errs
}

// exported is what the daemons register: their real registries, and a
// metric's type where a gather shows one (a Vec without children shows in
// no gather; registered still finds it).
type exported struct {
	regs  map[string]*prometheus.Registry // by daemon
	types map[string]dto.MetricType
	// extra are names the check accepts although no daemon registers
	// them: Prometheus's own (up) and a rules file's recording rules.
	extra map[string]bool
	// fresh is what each daemon's registry gathered right after Start,
	// before any other daemon or engine talked to it: the series an
	// operator sees on a healthy, idle cluster.
	fresh map[string][]*dto.MetricFamily
}

// probe is a collector of one descriptor: registering it asks the registry
// whether the name is taken (its own uniqueness check, which covers
// collectors that export nothing yet).
type probe struct{ d *prometheus.Desc }

func (p probe) Describe(ch chan<- *prometheus.Desc) { ch <- p.d }
func (p probe) Collect(chan<- prometheus.Metric)    {}

// registered reports which daemons register a metric called name.
func (e *exported) registered(name string) ([]string, error) {
	var who []string
	for daemon, reg := range e.regs {
		p := probe{prometheus.NewDesc(name, "deploy dashboard test probe", nil, nil)}
		err := reg.Register(p)
		switch {
		case err == nil:
			reg.Unregister(p)
		case errors.As(err, new(prometheus.AlreadyRegisteredError)) || strings.Contains(err.Error(), "same fully-qualified name"):
			who = append(who, daemon)
		default:
			return nil, fmt.Errorf("probe %q in the %s registry: %w", name, daemon, err)
		}
	}
	sort.Strings(who)
	return who, nil
}

// check returns one error per query naming a metric no daemon registers.
// A histogram's _bucket, _sum and _count series count as the histogram.
func (e *exported) check(qs []query) []error {
	var errs []error
	for _, q := range qs {
		names, err := metricNames(q.expr)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", q.where, err))
			continue
		}
		if len(names) == 0 {
			errs = append(errs, fmt.Errorf("%s: %q names no metric", q.where, q.expr))
		}
		for _, name := range names {
			if e.extra[name] {
				continue
			}
			who, err := e.registered(name)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if len(who) > 0 {
				continue
			}
			base := ""
			for _, suf := range []string{"_bucket", "_sum", "_count"} {
				if strings.HasSuffix(name, suf) {
					base = strings.TrimSuffix(name, suf)
				}
			}
			if base != "" {
				who, err = e.registered(base)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				if t, ok := e.types[base]; len(who) > 0 && ok && t != dto.MetricType_HISTOGRAM && t != dto.MetricType_SUMMARY {
					errs = append(errs, fmt.Errorf("%s: %s: %s is a %v, not a histogram", q.where, name, base, t))
					continue
				}
			}
			if len(who) == 0 {
				errs = append(errs, fmt.Errorf("%s: metric %s is registered by neither the coordinator nor rankd", q.where, name))
			}
		}
	}
	return errs
}

// daemonMetrics builds a real coordinator (started: the index and the
// cluster member register theirs in Start) and a real rankd (started too:
// New registers its own and the cluster member's, Start the transfer
// engine's, built after the duplicate-rank check) on the host backend, and
// returns their registries. Both are shut down at cleanup.
//
// Both run with this session's optional features on, so that their
// metrics exist: the coordinator in replicated mode (a single-node raft
// cluster that bootstraps itself; New registers kvtier_raft_*), the rankd
// with host-shared L1 and an L3 tier on the in-process S3 server (the
// engine registers kvtier_transfer_l3_* only when L3 is configured).
func daemonMetrics(t *testing.T) *exported {
	t.Helper()
	creg := prometheus.NewRegistry()
	creds := filepath.Join(t.TempDir(), "creds") // auth on, as deployed
	if err := auth.Init(creds, []auth.Instance{{Name: "dash", TPSize: 1}}); err != nil {
		t.Fatal(err)
	}
	// The raft port is mutual TLS: the cluster CA and the one peer's
	// certificate (NATS speaks TLS too, as deployed).
	if err := auth.InitTLS(creds, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	if err := auth.IssueRaftCert(creds, "dash1", false); err != nil {
		t.Fatal(err)
	}
	raftAddr := freeAddr(t)
	cc := coordinator.DefaultConfig()
	cc.CredsDir = creds
	cc.DataDir = t.TempDir()
	cc.Embedded.Port = 0
	cc.HTTPAddr = ""
	cc.Cluster.NodeName = "coord"
	cc.Cluster.BindAddr, cc.Cluster.BindPort = "127.0.0.1", 0
	cc.LeaveTimeout = 200 * time.Millisecond
	cc.Logger = zaptest.NewLogger(t)
	cc.Registry = creg
	cc.Raft.ID, cc.Raft.Bind, cc.Raft.Dir = "dash1", raftAddr, filepath.Join(t.TempDir(), "raft")
	cc.Raft.Peers = []coordinator.RaftPeer{{ID: "dash1", Addr: raftAddr}}
	cc.Raft.Bootstrap = true // its certificate comes from <creds>/raft-dash1.pem, as deployed
	cc.KVEvents = true       // every optional feature on, so that each of its metrics is registered
	c, err := coordinator.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Shutdown)
	freshCoord, err := creg.Gather()
	if err != nil {
		t.Fatal(err)
	}

	hostDir := t.TempDir()
	if err := os.Chmod(hostDir, 0o700); err != nil { // the host backend wants a private dir
		t.Fatal(err)
	}
	rc := rankd.DefaultConfig(wire.Rank{Instance: "dash", TPRank: 0})
	rc.TPSize = 1
	rc.Device, rc.Host = "host", cuda.HostConfig{Dir: hostDir, UUID: "HOST-deploy-test"}
	rc.L1Bytes = 8 << 20
	rc.L2Dir = t.TempDir()
	hostL1 := t.TempDir()
	if err := os.Chmod(hostL1, 0o700); err != nil {
		t.Fatal(err)
	}
	rc.HostL1Dir = hostL1
	rc.L3 = objstoretest.Start(t).Config("dash/")
	rc.NATSURL = c.NATSURL()
	rc.CredsDir = creds
	rc.BindAddr, rc.BindPort = "127.0.0.1", 0
	rc.HTTPAddr = ""
	rc.Logger = zaptest.NewLogger(t)
	d, err := rankd.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := d.Shutdown(ctx); err != nil {
			t.Errorf("rankd shutdown: %v", err)
		}
	})
	sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer scancel()
	if err := d.Start(sctx); err != nil {
		t.Fatalf("rankd start: %v", err)
	}
	freshRankd, err := d.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}

	e := &exported{regs: map[string]*prometheus.Registry{"coordinator": creg, "rankd": d.Registry()}, types: map[string]dto.MetricType{},
		fresh: map[string][]*dto.MetricFamily{"coordinator": freshCoord, "rankd": freshRankd}}
	for _, reg := range e.regs {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			e.types[mf.GetName()] = mf.GetType()
		}
	}
	return e
}

// freeAddr returns a loopback host:port that was free a moment ago (raft
// wants a fixed address in its peer list).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func loadDashboard(t *testing.T, data []byte) *dashboard {
	t.Helper()
	var d dashboard
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return &d
}

// TestDashboardMetricsExist: every query of the dashboard names only
// metrics that a real coordinator or rankd registers, and a misspelled
// metric is caught, naming the panel and the metric.
func TestDashboardMetricsExist(t *testing.T) {
	data, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	d := loadDashboard(t, data)
	if d.UID == "" || d.Title == "" {
		t.Fatalf("dashboard uid %q title %q", d.UID, d.Title)
	}
	qs, errs := queries(d)
	for _, err := range errs {
		t.Error(err)
	}
	if len(qs) < 30 {
		t.Fatalf("%d queries: the dashboard lost its panels", len(qs))
	}
	e := daemonMetrics(t)
	for _, err := range e.check(qs) {
		t.Error(err)
	}

	// The same check on the dashboard with one metric misspelled, one a
	// histogram series of a gauge, and one made up.
	bad := strings.Replace(string(data), "kvtier_coord_verdict_seconds_bucket", "kvtier_coord_verdict_second_bucket", 1)
	bad = strings.Replace(bad, "kvtier_transfer_l1_objects{", "kvtier_transfer_l1_objects_bucket{", 1)
	bad = strings.Replace(bad, "kvtier_index_log_bytes", "kvtier_index_log_bytes + kvtier_made_up_total", 1)
	// And in this session's rows: a misspelled raft metric, an L3 gauge
	// misspelled, a raft gauge as a histogram, a peer-L1 counter misspelled.
	bad = strings.Replace(bad, "kvtier_raft_apply_lag", "kvtier_raft_apply_lags", 1)
	bad = strings.Replace(bad, "kvtier_transfer_l3_queued{", "kvtier_transfer_l3_queue{", 1)
	bad = strings.Replace(bad, "kvtier_raft_is_leader)", "kvtier_raft_is_leader_bucket)", 1)
	bad = strings.Replace(bad, "kvtier_transfer_peer_l1_stale_total", "kvtier_transfer_peer_l1_stales_total", 1)
	if bad == string(data) {
		t.Fatal("the replacements changed nothing")
	}
	qs, errs = queries(loadDashboard(t, []byte(bad)))
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	var got []string
	for _, err := range e.check(qs) {
		got = append(got, err.Error())
	}
	want := []string{
		`panel 4 "Objects by tier (ranks)" target A: kvtier_transfer_l1_objects_bucket: kvtier_transfer_l1_objects is a GAUGE, not a histogram`,
		`panel 10 "Index size" target A: metric kvtier_made_up_total is registered by neither the coordinator nor rankd`,
		`panel 18 "Verdict latency" target A: metric kvtier_coord_verdict_second_bucket is registered by neither the coordinator nor rankd`,
		`panel 45 "Raft leader" target A: kvtier_raft_is_leader_bucket: kvtier_raft_is_leader is a GAUGE, not a histogram`,
		`panel 48 "Raft apply lag" target A: metric kvtier_raft_apply_lags is registered by neither the coordinator nor rankd`,
		`panel 52 "L3 write-behind queue" target A: metric kvtier_transfer_l3_queue is registered by neither the coordinator nor rankd`,
		`panel 61 "Peer L1 failures and stale entries" target B: metric kvtier_transfer_peer_l1_stales_total is registered by neither the coordinator nor rankd`,
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("errors for the bad dashboard:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestMetricNames(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want []string
	}{
		{`up`, []string{"up"}},
		{`sum by (rank, le) (rate(a_total{rank=~"$rank", x="}{(by"}[$__rate_interval]))`, []string{"a_total"}},
		{`histogram_quantile(0.99, sum without (le) (rate(h_bucket[5m]))) > 1e-3`, []string{"h_bucket"}},
		{`a / on (rank) group_left (tier) b or c offset 5m`, []string{"a", "b", "c"}},
		{`sum(x) / (sum(x) + sum(y{a='q\'s'})) and bool z`, []string{"x", "y", "z"}},
		{"max(`raw{`) + ns:recorded:rate5m", []string{"ns:recorded:rate5m"}},
		{`count (foo) by (sum)`, []string{"foo"}},
		{`rate(a[1m:10s]) * 2.5e+3 + ${x} + $y`, []string{"a"}},
		{`a * group_left b`, []string{"a", "b"}},
	} {
		got, err := metricNames(tc.expr)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: got %q, %v; want %q", tc.expr, got, err, tc.want)
		}
	}
	for _, expr := range []string{`rate(a[5m]`, `a{b="c"`, `a}`, `a{b="c}`, `sum(a))`} {
		if got, err := metricNames(expr); err == nil {
			t.Errorf("%s: got %q, want an error", expr, got)
		}
	}
}
