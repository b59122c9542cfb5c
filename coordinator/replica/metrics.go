package replica

import "github.com/prometheus/client_golang/prometheus"

// metrics are replicated mode's metrics, in the registry of Options.Registerer.
type metrics struct {
	isLeader      prometheus.Gauge
	leaderChanges prometheus.Counter
	elections     prometheus.Counter
	commitSecs    prometheus.Histogram
	refused       prometheus.Counter
	notLeader     prometheus.Counter
	withheld      prometheus.Counter
	restores      prometheus.Counter
	abandoned     prometheus.Counter
}

func newMetrics() *metrics {
	return &metrics{
		isLeader: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvtier_raft_is_leader",
			Help: "1 while this coordinator is the raft leader."}),
		leaderChanges: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_leader_changes_total",
			Help: "Leader changes this coordinator observed (including to no leader)."}),
		elections: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_elections_total",
			Help: "Elections this coordinator started (became candidate)."}),
		commitSecs: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvtier_raft_commit_seconds",
			Help:    "Leader: entry proposed to committed on a quorum and handed to the index.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 18)}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_refused_connections_total",
			Help: "Connections to the raft port refused: the peer failed the key handshake, or too many handshakes."}),
		notLeader: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_not_leader_total",
			Help: "Requests answered unavailable because leadership was lost before their entry committed."}),
		withheld: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_verdicts_withheld_total",
			Help: "COMPLETE verdicts not sent because leadership could not be verified (the waiter got unavailable)."}),
		restores: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_snapshots_installed_total",
			Help: "Raft snapshots installed into the index (a follower catching up)."}),
		abandoned: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvtier_raft_restores_abandoned_total",
			Help: "Active restores abandoned when this coordinator lost leadership."}),
	}
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.isLeader, m.leaderChanges, m.elections, m.commitSecs, m.refused, m.notLeader,
		m.withheld, m.restores, m.abandoned}
}
