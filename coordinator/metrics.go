package coordinator

import (
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvtier/kvtier/wire"
)

// metrics of one coordinator (C8: every drop, fence, timeout and failure is
// counted).
type metrics struct {
	batches        *prometheus.CounterVec // by outcome
	events         prometheus.Counter
	badRequests    *prometheus.CounterVec // by op
	gaps           prometheus.Counter
	heartbeatGaps  prometheus.Counter
	indexOffers    *prometheus.CounterVec // by outcome: resync | other_index
	resyncs        *prometheus.CounterVec // by outcome: ok | failed | fenced | abandoned
	resyncAttempts prometheus.Counter
	indexRebuilds  prometheus.Counter
	dropped        prometheus.Counter
	natsErrors     *prometheus.CounterVec // by kind: reply_permission | permission | slow_consumer | other
	applySeconds   prometheus.Histogram
	startupRefused prometheus.Counter // requests answered unavailable while starting

	fences       *prometheus.CounterVec // by cause: dead | left | incarnation | startup
	fenced       prometheus.Counter     // placements fenced
	fenceSeconds prometheus.Histogram   // death notification -> fence committed
	fenceSkips   prometheus.Counter     // deaths of superseded incarnations

	lookups        *prometheus.CounterVec // by outcome: hit | partial | miss
	lookupTokens   prometheus.Counter     // coord.lookup: chunks asked x the namespace's chunk_tokens
	lookupHits     prometheus.Counter     // coord.lookup: prefix chunks found x chunk_tokens
	lookupSeconds  prometheus.Histogram
	restoreChunks  *prometheus.CounterVec // chunks of decided restores, by outcome: verified | bytes_wrong | failed
	restores       *prometheus.CounterVec // by outcome: complete | failed | refused
	restoreBegins  prometheus.Counter
	verdictSeconds prometheus.Histogram   // last report -> verdict
	beginSeconds   prometheus.Histogram   // restore.begin received by its handler -> plan sent
	reports        *prometheus.CounterVec // by outcome: ok | duplicate | rejected
	notPlanned     *prometheus.CounterVec // begins refused, by cause: dead | left | fenced | absent
	rankFailures   *prometheus.CounterVec // restores failed early, by cause: dead | left | superseded | startup
	active         prometheus.Gauge
	internal       prometheus.Counter
	replies        *prometheus.CounterVec // by op and outcome: ok | error | too_large | send_failed | no_inbox
	refused        *prometheus.CounterVec // by rule (limits.go)
	duplicates     prometheus.Counter     // rankd members joining beside a live incarnation of their rank
}

func newMetrics() *metrics {
	fine := prometheus.ExponentialBuckets(1e-6, 2, 24) // 1 us .. 8 s
	m := &metrics{
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_event_batches_total",
			Help: "Event batches received, by outcome (applied, resync, fenced, bad_request, failed).",
		}, []string{"outcome"}),
		events: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_events_applied_total",
			Help: "Placement events durably applied to the index.",
		}),
		badRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_bad_requests_total",
			Help: "Requests rejected as malformed or invalid, by operation.",
		}, []string{"op"}),
		gaps: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_event_gaps_total",
			Help: "Event batches that started past a sequence gap (each needs a resync).",
		}),
		heartbeatGaps: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_heartbeat_gaps_total",
			Help: "Heartbeats showing a rank's events lost in transit: the index stayed behind the sequence the rank announced one heartbeat earlier (each starts a resync).",
		}),
		indexOffers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_index_offers_total",
			Help: "Heartbeats in which a rank offered its inventory because it saw a new index id in the coordinator's signed gossip, by outcome (resync: the id is this index's, a resync is asked; other_index: another coordinator's or an older id, ignored).",
		}, []string{"outcome"}),
		resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_resyncs_total",
			Help: "Inventory resyncs finished, by outcome (ok, failed; fenced: dropped, the rank was fenced after the inventory was requested; abandoned: raft leadership lost).",
		}, []string{"outcome"}),
		resyncAttempts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_resync_attempts_total",
			Help: "Inventory requests sent to ranks.",
		}),
		indexRebuilds: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_index_rebuilds_total",
			Help: "Damaged index files set aside at start (--rebuild-index); the index was rebuilt from the ranks' inventories.",
		}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_nats_dropped_total",
			Help: "NATS asynchronous errors that may have lost a request (slow consumer drops included); a refused reply to an already answered request is not counted here (kvtier_coord_nats_errors_total{kind=\"reply_permission\"}).",
		}),
		natsErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_nats_errors_total",
			Help: "NATS asynchronous errors, by kind (reply_permission: a reply refused by allow_responses, a duplicated request's second answer or one past the response window; permission; slow_consumer; other).",
		}, []string{"kind"}),
		startupRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_startup_unavailable_total",
			Help: "Requests answered with code unavailable because the coordinator was still opening its index or joining the cluster.",
		}),
		applySeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_coord_apply_seconds",
			Help:    "Time to apply and commit one event batch.",
			Buckets: fine,
		}),
		fences: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_rank_fences_total",
			Help: "Ranks whose L1 placements were fenced, by cause (dead, left, startup; leader: a new raft leader's sweep).",
		}, []string{"cause"}),
		fenced: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_placements_fenced_total",
			Help: "L1 placements fenced.",
		}),
		fenceSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_coord_fence_seconds",
			Help:    "Time from a death or leave notification to the fence being committed.",
			Buckets: fine,
		}),
		fenceSkips: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_rank_fences_skipped_total",
			Help: "Deaths or leaves not fenced because a newer incarnation of the rank already reports.",
		}),
		lookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_lookups_total",
			Help: "Lookups answered, by outcome (hit: whole chain, partial, miss).",
		}, []string{"outcome"}),
		lookupTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_lookup_tokens_total",
			Help: "Tokens of the chunk chains engines looked up (coord.lookup; chunks x the namespace's chunk_tokens). With kvtier_coord_lookup_hit_tokens_total, the token-weighted hit ratio.",
		}),
		lookupHits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_lookup_hit_tokens_total",
			Help: "Tokens of the stored prefixes those lookups found (prefix chunks x chunk_tokens): the tokens an engine may restore instead of computing.",
		}),
		restoreChunks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_restore_chunks_total",
			Help: "Chunks of decided restores, by outcome (verified: every object of the chunk placed with its recorded checksum; bytes_wrong: a rank found the bytes failed verification, or placed bytes whose checksum was not the recorded one, so the engine recomputes the chunk; failed: any other failure, missing, timeout, device, deadline, rank gone).",
		}, []string{"outcome"}),
		lookupSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_coord_lookup_seconds",
			Help:    "Index lookup latency, lookups and restore begins.",
			Buckets: fine,
		}),
		restores: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_restores_total",
			Help: "Restores decided, by outcome (complete, failed, refused; cancelled: withdrawn by the engine before any rank read, cause engine) and cause (reports, deadline, empty, readers_not_alive, rank_dead, rank_left, rank_superseded, rank_startup).",
		}, []string{"outcome", "cause"}),
		notPlanned: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_restores_not_planned_total",
			Help: "Restore begins answered with prefix 0 although chunks are stored, because a reader rank is not alive, by the first such reader's cause (dead, left, fenced, absent).",
		}, []string{"cause"}),
		rankFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_restore_rank_failures_total",
			Help: "Active restores whose unreported results of a reader rank were failed at once because the rank was fenced, by cause (dead, left, superseded, startup).",
		}, []string{"cause"}),
		restoreBegins: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_restore_begins_total",
			Help: "Restore plans handed out.",
		}),
		verdictSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_coord_verdict_seconds",
			Help:    "Time from the last rank report to the verdict being sent to waiters.",
			Buckets: fine,
		}),
		beginSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_coord_restore_begin_seconds",
			Help:    "Time the coordinator spends on a restore.begin answered with a plan: from its handler taking the request (decode, lookup, plan, encoding) to the plan sent; the engine's begin time less this is the bus and the engine.",
			Buckets: fine,
		}),
		reports: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_restore_reports_total",
			Help: "Restore reports, by outcome (ok, duplicate, rejected).",
		}, []string{"outcome"}),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvtier_coord_restores_active",
			Help: "Restores begun and not yet decided.",
		}),
		internal: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_internal_errors_total",
			Help: "Requests that failed on an internal or I/O error.",
		}),
		replies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_replies_total",
			Help: "Replies, by operation and outcome (ok, error, too_large: the answer exceeded the NATS max payload and was refused, send_failed: the send failed and the requester got nothing, no_inbox: the request had no reply subject).",
		}, []string{"op", "outcome"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_refused_total",
			Help: "Messages refused by a limit for a hostile or broken sender, by rule (incarnation_skew, not_member, max_ranks, max_instances, max_namespaces, geometry, inventory_objects, inventory_pages, resync_cap, resync_rate, instance_restores, waiters, instance_waiters, unknown_rank_heartbeat; per-rank budgets: rank_budget, rank_budget_in_flight, rank_rate, rank_held, rank_resetting, inventory_budget).",
		}, []string{"rule"}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_duplicate_rank_members_total",
			Help: "Rankd members that joined while another incarnation of their rank was alive (a second rankd for a live rank, or a restart before its predecessor was declared dead).",
		}),
	}
	m.initialise()
	return m
}

// Label values every vector starts with, at 0, so that a healthy, idle
// cluster shows 0 rather than no data: a vector exports a series only once
// one of its label values is used, and increase() or rate() over a series
// that appears at 1 sees nothing (an alert on the first failure would never
// fire). A value not listed here still appears when it is first used.
// deploy's TestVectorsInitialised fails when a vector has no series on a
// fresh coordinator.
var (
	batchOutcomes  = []string{"applied", "resync", "fenced", "bad_request", "unauthorized", "refused", "failed"}
	replyOps       = []string{wire.CoordRegister, wire.CoordLookup, wire.CoordRestoreBegin, wire.CoordRestoreReport, wire.CoordRestoreWait, wire.CoordRestoreCancel, opEvents}
	requestOps     = append(slices.Clone(replyOps), "heartbeat") // heartbeats get no reply
	replyOutcomes  = []string{replyOK, replyError, replyTooLarge, replySendFailed, replyNoInbox}
	resyncOutcomes = []string{"ok", "failed", "fenced", "abandoned"}
	natsErrorKinds = []string{natsErrReplyPermission, natsErrPermission, natsErrSlowConsumer, natsErrOther}
	fenceCauses    = []string{"dead", "left", "incarnation", "startup", "leader"}
	lookupOutcomes = []string{"hit", "partial", "miss"}
	// rankCauses are failRank's causes; a restore failed by one has cause
	// "rank_<cause>".
	rankCauses        = []string{"dead", "left", "superseded", "startup", "leader", "reset"}
	notPlannedCauses  = []string{causeDead, causeLeft, causeFenced, causeAbsent}
	reportOutcomes    = []string{"ok", "duplicate", "late", "rejected"}
	restoreChunkKinds = []string{"verified", "bytes_wrong", "failed"}
	refusalRules      = []string{"incarnation_skew", "not_member", "max_ranks", "max_instances", "max_namespaces", "geometry",
		"inventory_objects", "inventory_pages", "resync_cap", "resync_rate", "instance_restores", "waiters", "instance_waiters", "unknown_rank_heartbeat",
		"rank_budget", "rank_budget_in_flight", "rank_rate", "rank_held", "rank_resetting", "inventory_budget"}
	unauthorizedKinds = []string{"events", "heartbeat", "report", "lookup", "restore_begin", "restore_wait", "restore_cancel"}
)

// restoreOutcomes are the (outcome, cause) pairs of kvtier_coord_restores_total.
func restoreOutcomes() [][2]string {
	out := [][2]string{
		{wire.VerdictComplete, "reports"}, {wire.VerdictComplete, "empty"},
		{wire.VerdictFailed, "reports"}, {wire.VerdictFailed, "deadline"},
		{wire.VerdictRefused, "readers_not_alive"}, {"cancelled", "engine"},
	}
	for _, c := range rankCauses {
		out = append(out, [2]string{wire.VerdictFailed, "rank_" + c})
	}
	return out
}

// initLabels creates the series of v for each label value.
func initLabels(v *prometheus.CounterVec, values ...string) {
	for _, x := range values {
		v.WithLabelValues(x)
	}
}

// initialise creates the known series of every vector (see above).
func (m *metrics) initialise() {
	initLabels(m.batches, batchOutcomes...)
	initLabels(m.badRequests, requestOps...)
	initLabels(m.resyncs, resyncOutcomes...)
	initLabels(m.indexOffers, "resync", "other_index")
	initLabels(m.natsErrors, natsErrorKinds...)
	initLabels(m.fences, fenceCauses...)
	initLabels(m.lookups, lookupOutcomes...)
	for _, oc := range restoreOutcomes() {
		m.restores.WithLabelValues(oc[0], oc[1])
	}
	initLabels(m.notPlanned, notPlannedCauses...)
	initLabels(m.rankFailures, rankCauses...)
	initLabels(m.reports, reportOutcomes...)
	initLabels(m.restoreChunks, restoreChunkKinds...)
	for _, op := range replyOps {
		for _, oc := range replyOutcomes {
			m.replies.WithLabelValues(op, oc)
		}
	}
	initLabels(m.refused, refusalRules...)
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{
		m.batches, m.events, m.badRequests, m.gaps, m.heartbeatGaps, m.indexOffers, m.resyncs, m.resyncAttempts, m.indexRebuilds, m.dropped, m.natsErrors, m.applySeconds, m.startupRefused,
		m.fences, m.fenced, m.fenceSeconds, m.fenceSkips,
		m.lookups, m.lookupTokens, m.lookupHits, m.lookupSeconds, m.restoreChunks, m.restores, m.restoreBegins, m.verdictSeconds, m.beginSeconds, m.reports, m.notPlanned, m.rankFailures,
		m.active, m.internal, m.replies, m.refused, m.duplicates,
	}
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
