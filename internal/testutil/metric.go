package testutil

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metric returns the value of the one series of metric family name in g
// whose labels include labels, given as name, value pairs (labels the
// series has beyond those are not compared). A counter, gauge or untyped
// series gives its value, a histogram or summary its sample count.
//
// It fails tb when the family is absent, when no series matches (a vector
// whose label values were never used has no series: that is not 0), when
// more than one series matches (name more labels, or use MetricSum), or
// when labels is not a list of pairs.
func Metric(tb testing.TB, g prometheus.Gatherer, name string, labels ...string) float64 {
	tb.Helper()
	vals := matching(tb, g, name, labels)
	if len(vals) > 1 {
		tb.Fatalf("metric %s%s: %d series match, want 1 (name more labels or use MetricSum)", name, fmtLabels(labels), len(vals))
	}
	return vals[0]
}

// MetricSum returns the sum over every series of metric family name in g
// whose labels include labels (name, value pairs), as Metric reads each.
// It fails tb when the family is absent or no series matches.
func MetricSum(tb testing.TB, g prometheus.Gatherer, name string, labels ...string) float64 {
	tb.Helper()
	var sum float64
	for _, v := range matching(tb, g, name, labels) {
		sum += v
	}
	return sum
}

// Scrape is a Gatherer that reads the Prometheus text exposition at url
// (a daemon's /metrics) each time it is gathered, for Metric and
// MetricSum.
func Scrape(url string) prometheus.Gatherer {
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		cl := http.Client{Timeout: 10 * time.Second}
		resp, err := cl.Get(url)
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
			return nil, fmt.Errorf("GET %s: %s: %s", url, resp.Status, b)
		}
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := p.TextToMetricFamilies(resp.Body)
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", url, err)
		}
		out := make([]*dto.MetricFamily, 0, len(fams))
		for _, f := range fams {
			out = append(out, f)
		}
		return out, nil
	})
}

// matching returns the values of the series of name in g whose labels
// include labels; it fails tb when there are none.
func matching(tb testing.TB, g prometheus.Gatherer, name string, labels []string) []float64 {
	tb.Helper()
	if len(labels)%2 != 0 {
		tb.Fatalf("metric %s: labels %q are not name, value pairs", name, labels)
	}
	mfs, err := g.Gather()
	if err != nil {
		tb.Fatalf("gather metrics for %s: %v", name, err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var vals []float64
		for _, m := range mf.GetMetric() {
			if hasLabels(m, labels) {
				vals = append(vals, value(m))
			}
		}
		if len(vals) == 0 {
			tb.Fatalf("metric %s has no series with labels %s (%d series)", name, fmtLabels(labels), len(mf.GetMetric()))
		}
		return vals
	}
	tb.Fatalf("metric %s is not registered (or has no series)", name)
	return nil
}

func hasLabels(m *dto.Metric, labels []string) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		found := false
		for _, lp := range m.GetLabel() {
			if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

func value(m *dto.Metric) float64 {
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetHistogram() != nil:
		return float64(m.GetHistogram().GetSampleCount())
	case m.GetSummary() != nil:
		return float64(m.GetSummary().GetSampleCount())
	default:
		return m.GetUntyped().GetValue()
	}
}

func fmtLabels(labels []string) string {
	var b strings.Builder
	b.WriteByte('{')
	for i := 0; i+1 < len(labels); i += 2 {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s=%q", labels[i], labels[i+1])
	}
	b.WriteByte('}')
	return b.String()
}
