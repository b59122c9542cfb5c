package index

import (
	"github.com/kvtier/kvtier/wire"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// DropReason says why events (or an inventory) were not applied. Each is a
// label value of kvtier_index_dropped_total.
type DropReason string

const (
	// DropDuplicate: an event with a sequence <= the rank's last applied
	// one (at-least-once delivery; harmless).
	DropDuplicate DropReason = "duplicate"
	// DropGap: events after a missing sequence; the rank must resync.
	DropGap DropReason = "gap"
	// DropStaleIncarnation: a batch or inventory from an incarnation older
	// than the rank's current one.
	DropStaleIncarnation DropReason = "stale_incarnation"
	// DropFencedRank: a batch from the current incarnation of a rank that
	// was declared dead (FenceRank); it must resync with an inventory.
	DropFencedRank DropReason = "fenced_rank"
	// DropStaleInventory: an inventory of the current incarnation whose
	// sequence is below the rank's last applied event; applying it would
	// roll the rank back.
	DropStaleInventory DropReason = "stale_inventory"
	// DropPartialRank: a batch of a rank whose inventory a crash
	// interrupted (a sliced ApplyInventory); it must resync.
	DropPartialRank DropReason = "partial_rank"
	// DropFencedSince: an inventory requested under an older fence
	// generation of the rank than the index's (ApplyInventoryAt): the
	// rank was fenced after the inventory was taken, and applying it would
	// bring back the L1 placements the fence dropped and clear the fence.
	// Counts whole inventories.
	DropFencedSince DropReason = "fenced_since"
)

// FenceCause says why placements were fenced (kvtier_index_fenced_total).
type FenceCause string

const (
	// FenceNewIncarnation: a rank restarted; its old L1 is gone.
	FenceNewIncarnation FenceCause = "new_incarnation"
	// FenceRankDead: memberlist declared the rank dead (FenceRank).
	FenceRankDead FenceCause = "rank_dead"
)

// metrics are the index's counters (C8: every drop and fence counted).
type metrics struct {
	dropped     *prometheus.CounterVec // by reason; events, or inventories for stale_inventory
	fenced      *prometheus.CounterVec // placements, by cause
	resyncs     *prometheus.CounterVec // resync requests, by reason
	applied     prometheus.Counter
	removeNoop  prometheus.Counter
	inventories prometheus.Counter
	commits     prometheus.Counter
	commitSecs  prometheus.Histogram
	groupEvents prometheus.Histogram
	checkpoints prometheus.Counter
	foldSlices  prometheus.Counter
	ckptSecs    prometheus.Histogram
	objects     prometheus.Gauge
	placements  *prometheus.GaugeVec // by tier
	ranks       prometheus.Gauge
	logBytes    prometheus.Gauge
	raftSkipped prometheus.Counter
}

func newMetrics() *metrics {
	m := &metrics{
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_index_dropped_total",
			Help: "Events not applied, by reason (duplicate, gap, stale_incarnation, fenced_rank); " +
				"stale_inventory and fenced_since count whole inventories.",
		}, []string{"reason"}),
		fenced: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_index_fenced_placements_total",
			Help: "L1 placements fenced (removed from lookups), by cause (new_incarnation, rank_dead).",
		}, []string{"cause"}),
		resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_index_resyncs_requested_total",
			Help: "Batches whose outcome asked the rank for an inventory, by reason (gap, fenced_rank).",
		}, []string{"reason"}),
		applied: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_index_events_applied_total",
			Help: "Placement events applied and committed.",
		}),
		removeNoop: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_index_remove_unknown_total",
			Help: "Applied Removed events naming a placement the index did not hold.",
		}),
		inventories: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_index_inventories_applied_total",
			Help: "Rank inventories applied (each replaces all of the rank's placements).",
		}),
		commits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_index_commits_total",
			Help: "bbolt transactions committed by group commit.",
		}),
		commitSecs: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_index_commit_seconds",
			Help:    "Time to commit one group (bbolt write and fsync).",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
		}),
		groupEvents: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_index_group_events",
			Help:    "Events per group commit.",
			Buckets: prometheus.ExponentialBuckets(1, 4, 10),
		}),
		checkpoints: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_index_checkpoints_total",
			Help: "Change-log folds into the snapshot bucket.",
		}),
		foldSlices: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_index_fold_slices_total",
			Help: "Slices of automatic folds written (Config.FoldSliceChunks chunks each), with a group commit or alone.",
		}),
		ckptSecs: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_index_checkpoint_seconds",
			Help:    "Time to fold the change log into the snapshot bucket.",
			Buckets: prometheus.ExponentialBuckets(1e-3, 2, 14),
		}),
		objects: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvtier_index_objects",
			Help: "Distinct object keys with at least one placement.",
		}),
		placements: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvtier_index_placements",
			Help: "Placements held, by tier.",
		}, []string{"tier"}),
		ranks: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvtier_index_ranks",
			Help: "Ranks known to the index.",
		}),
		logBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvtier_index_log_bytes",
			Help: "Bytes in the change log, folded into the snapshot at the checkpoint threshold.",
		}),
		raftSkipped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_index_raft_skipped_total",
			Help: "Replicated requests skipped because their raft index was applied already (replay after a restart).",
		}),
	}
	// Every vector starts with its known series at 0, so an idle index
	// shows 0 rather than no data (deploy's TestVectorsInitialised).
	for _, r := range []DropReason{DropDuplicate, DropGap, DropStaleIncarnation, DropFencedRank, DropStaleInventory, DropPartialRank, DropFencedSince} {
		m.dropped.WithLabelValues(string(r))
	}
	for _, c := range []FenceCause{FenceNewIncarnation, FenceRankDead} {
		m.fenced.WithLabelValues(string(c))
	}
	for _, r := range []DropReason{DropGap, DropFencedRank, DropPartialRank} {
		m.resyncs.WithLabelValues(string(r))
	}
	return m
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.dropped, m.fenced, m.resyncs, m.applied, m.removeNoop, m.inventories,
		m.commits, m.commitSecs, m.groupEvents, m.checkpoints, m.foldSlices, m.ckptSecs, m.objects, m.placements, m.ranks, m.logBytes,
		m.raftSkipped}
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

func (ix *Index) gauges() {
	ix.met.objects.Set(float64(ix.st.objects))
	ix.met.placements.WithLabelValues("L1").Set(float64(ix.st.placements[wire.L1]))
	ix.met.placements.WithLabelValues("L2").Set(float64(ix.st.placements[wire.L2]))
	ix.met.placements.WithLabelValues("L3").Set(float64(ix.st.placements[wire.L3]))
	ix.met.ranks.Set(float64(len(ix.st.ranks) - 1))
	lb := ix.logBytes
	if ix.folding != nil {
		lb += ix.folding.f.logBytes // not deleted until its last slice
	}
	ix.met.logBytes.Set(float64(lb))
}

// account counts and logs what a committed request did (C8).
func (ix *Index) account(r *request) {
	m := ix.met
	switch r.kind {
	case reqBatch:
		o, b := &r.out, r.batch
		m.applied.Add(float64(o.Applied))
		if o.RemovedUnknown > 0 {
			m.removeNoop.Add(float64(o.RemovedUnknown))
		}
		if o.Duplicates > 0 {
			m.dropped.WithLabelValues(string(DropDuplicate)).Add(float64(o.Duplicates))
			ix.log.Debug("duplicate events ignored", zap.Stringer("rank", b.Rank),
				zap.Uint64("incarnation", b.Incarnation), zap.Int("events", o.Duplicates), zap.Uint64("last_seq", o.LastSeq))
		}
		if o.NewIncarnation {
			m.fenced.WithLabelValues(string(FenceNewIncarnation)).Add(float64(o.Fenced))
			ix.log.Info("new rank incarnation; old L1 placements fenced", zap.Stringer("rank", b.Rank),
				zap.Uint64("incarnation", b.Incarnation), zap.Int("fenced", o.Fenced))
		}
		if o.Dropped > 0 {
			m.dropped.WithLabelValues(string(o.Reason)).Add(float64(o.Dropped))
			fields := []zap.Field{zap.Stringer("rank", b.Rank), zap.Uint64("incarnation", b.Incarnation),
				zap.String("reason", string(o.Reason)), zap.Int("events", o.Dropped),
				zap.Uint64("rank_incarnation", o.Incarnation), zap.Uint64("last_seq", o.LastSeq)}
			if o.Resync {
				fields = append(fields, zap.Uint64("resync_from", o.ResyncFrom))
			}
			ix.log.Warn("events dropped", fields...)
		}
		if o.Resync {
			m.resyncs.WithLabelValues(string(o.Reason)).Inc()
		}
	case reqInventory:
		o, inv := &r.invOut, r.inv
		if !o.Applied {
			m.dropped.WithLabelValues(string(o.Reason)).Inc()
			ix.log.Warn("inventory dropped", zap.Stringer("rank", inv.Rank), zap.Uint64("incarnation", inv.Incarnation),
				zap.Uint64("seq", inv.Seq), zap.String("reason", string(o.Reason)),
				zap.Uint64("rank_incarnation", o.Incarnation), zap.Uint64("last_seq", o.LastSeq))
			return
		}
		m.inventories.Inc()
		if o.Fenced > 0 {
			m.fenced.WithLabelValues(string(FenceNewIncarnation)).Add(float64(o.Fenced))
		}
		ix.log.Info("inventory applied", zap.Stringer("rank", inv.Rank), zap.Uint64("incarnation", inv.Incarnation),
			zap.Uint64("seq", inv.Seq), zap.Int("placements", o.Placements), zap.Int("replaced", o.Replaced),
			zap.Int("fenced", o.Fenced))
	case reqFence:
		if r.fenced == fenceUnknown {
			ix.log.Debug("fence of an unknown rank ignored", zap.Stringer("rank", r.rank))
			return
		}
		if r.fenced == fenceSuperseded {
			ix.log.Info("fence of a superseded incarnation ignored", zap.Stringer("rank", r.rank),
				zap.Uint64("up_to_incarnation", r.upTo))
			return
		}
		m.fenced.WithLabelValues(string(FenceRankDead)).Add(float64(r.fenced))
		ix.log.Warn("dead rank fenced", zap.Stringer("rank", r.rank), zap.Int("l1_placements", r.fenced))
	case reqInvStep:
		ix.accountStep(r)
	case reqReset:
		if r.fenced != fenceUnknown {
			ix.log.Warn("rank reset by an operator: placements dropped, incarnation forgotten", zap.Stringer("rank", r.rank),
				zap.Int("placements", r.fenced))
		}
	case reqRegister:
		ix.log.Info("namespace registered", zap.Stringer("namespace", r.spec.Namespace),
			zap.String("model", r.spec.Model), zap.Int("tp", r.spec.Layout.TP), zap.Int("dcp", r.spec.Layout.DCP))
	}
}
