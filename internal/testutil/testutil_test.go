package testutil

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func TestMain(m *testing.M) { Main(m) }

// fakeTB records a failure instead of ending the test, so the tests can
// check that a helper fails.
type fakeTB struct {
	testing.TB
	mu     sync.Mutex
	failed string
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.failed = format
	f.mu.Unlock()
	panic(f)
}
func (f *fakeTB) Fatal(args ...any) { f.Fatalf("%v", args...) }

// fails reports whether fn failed its TB.
func fails(t *testing.T, fn func(tb testing.TB)) bool {
	t.Helper()
	f := &fakeTB{TB: t}
	func() {
		defer func() {
			if r := recover(); r != nil && r != any(f) {
				panic(r)
			}
		}()
		fn(f)
	}()
	return f.failed != ""
}

func registry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "t_total"}, []string{"kind", "tier"})
	c.WithLabelValues("a", "L1").Add(2)
	c.WithLabelValues("b", "L1").Add(3)
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "t_gauge"})
	g.Set(7)
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "t_seconds"})
	h.Observe(1)
	h.Observe(2)
	empty := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "t_unused_total"}, []string{"kind"})
	reg.MustRegister(c, g, h, empty)
	return reg
}

func TestMetric(t *testing.T) {
	reg := registry()
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"t_total", []string{"kind", "a"}, 2},
		{"t_total", []string{"kind", "b", "tier", "L1"}, 3},
		{"t_gauge", nil, 7},
		{"t_seconds", nil, 2},
	} {
		if got := Metric(t, reg, tc.name, tc.labels...); got != tc.want {
			t.Errorf("Metric(%s %v) = %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
	if got := MetricSum(t, reg, "t_total", "tier", "L1"); got != 5 {
		t.Errorf("MetricSum = %v, want 5", got)
	}
}

// TestMetricFailsWhenAbsent: an absent family, an unused vector, an
// unmatched series, an ambiguous match and odd labels fail; none reads 0.
func TestMetricFailsWhenAbsent(t *testing.T) {
	reg := registry()
	for _, tc := range []struct {
		what string
		fn   func(tb testing.TB)
	}{
		{"absent family", func(tb testing.TB) { Metric(tb, reg, "t_missing") }},
		{"unused vector", func(tb testing.TB) { Metric(tb, reg, "t_unused_total", "kind", "x") }},
		{"no such series", func(tb testing.TB) { Metric(tb, reg, "t_total", "kind", "c") }},
		{"two series", func(tb testing.TB) { Metric(tb, reg, "t_total", "tier", "L1") }},
		{"odd labels", func(tb testing.TB) { Metric(tb, reg, "t_total", "kind") }},
		{"sum of nothing", func(tb testing.TB) { MetricSum(tb, reg, "t_total", "tier", "L2") }},
	} {
		if !fails(t, tc.fn) {
			t.Errorf("%s: did not fail", tc.what)
		}
	}
}

func TestScrape(t *testing.T) {
	srv := httptest.NewServer(promhttp.HandlerFor(registry(), promhttp.HandlerOpts{}))
	defer srv.Close()
	g := Scrape(srv.URL)
	if got := Metric(t, g, "t_total", "kind", "b"); got != 3 {
		t.Errorf("scraped t_total{kind=b} = %v, want 3", got)
	}
	if got := MetricSum(t, g, "t_total"); got != 5 {
		t.Errorf("scraped sum = %v, want 5", got)
	}
	if !fails(t, func(tb testing.TB) { Metric(tb, g, "t_missing") }) {
		t.Error("scraped absent metric did not fail")
	}
	bad := httptest.NewServer(http.NotFoundHandler())
	defer bad.Close()
	if !fails(t, func(tb testing.TB) { Metric(tb, Scrape(bad.URL), "t_total") }) {
		t.Error("a 404 did not fail")
	}
}

func TestEventually(t *testing.T) {
	n := 0
	Eventually(t, time.Second, "three polls", func() bool { n++; return n == 3 })
	if !fails(t, func(tb testing.TB) { Eventually(tb, 20*time.Millisecond, "never", func() bool { return false }) }) {
		t.Error("a condition that never holds did not fail")
	}
}

func TestNATS(t *testing.T) {
	srv := NATS(t)
	if !strings.HasPrefix(srv.ClientURL(), "nats://127.0.0.1:") || strings.HasSuffix(srv.ClientURL(), ":-1") {
		t.Fatalf("client URL %s", srv.ClientURL())
	}
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	sub, err := nc.SubscribeSync("x")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Publish("x", []byte("hi")); err != nil {
		t.Fatal(err)
	}
	if m, err := sub.NextMsg(5 * time.Second); err != nil || string(m.Data) != "hi" {
		t.Fatalf("got %v, %v", m, err)
	}
}

func TestFreePort(t *testing.T) {
	seen := map[int]bool{}
	for range 20 {
		p := FreePort(t)
		if seen[p] || p < 20000 || p >= 32000 {
			t.Fatalf("port %d (seen before: %v)", p, seen[p])
		}
		seen[p] = true
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("port %d not free: %v", p, err)
		}
		l.Close()
	}
}
