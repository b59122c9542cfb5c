package cluster

import "github.com/prometheus/client_golang/prometheus"

// metrics are this member's view of the cluster (C8: every drop counted).
type metrics struct {
	members  *prometheus.GaugeVec // by state
	joins    prometheus.Counter
	deaths   prometheus.Counter
	leaves   prometheus.Counter
	updates  prometheus.Counter
	dropped  prometheus.Counter
	rejected prometheus.Counter
}

func newMetrics() *metrics {
	return &metrics{
		members: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvtier_cluster_members",
			Help: "Members known to this node, by state (alive, dead, left).",
		}, []string{"state"}),
		joins: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_cluster_joins_total",
			Help: "Members seen joining, including rejoins after death and new incarnations.",
		}),
		deaths: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_cluster_deaths_total",
			Help: "Members declared dead by the failure detector.",
		}),
		leaves: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_cluster_leaves_total",
			Help: "Members that left gracefully.",
		}),
		updates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_cluster_meta_updates_total",
			Help: "Meta updates received from members.",
		}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_cluster_events_dropped_total",
			Help: "Membership events dropped because a subscriber's buffer was full.",
		}),
		rejected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_cluster_alive_rejected_total",
			Help: "Alive messages ignored because the member's meta or name was invalid.",
		}),
	}
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.members, m.joins, m.deaths, m.leaves, m.updates, m.dropped, m.rejected}
}

// Describe and Collect make the metrics one prometheus.Collector, so they
// are registered all together or not at all, and unregistered in one call.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}
