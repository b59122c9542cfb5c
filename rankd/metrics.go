package rankd

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/transfer"
)

// metrics are the daemon's own Prometheus metrics; the transfer engine and
// the cluster member register theirs in the same registry.
type metrics struct {
	reg    *prometheus.Registry
	labels prometheus.Labels // the rank's

	requests          *prometheus.CounterVec // op, code ("ok" on success)
	requestSeconds    *prometheus.HistogramVec
	stageSeconds      *prometheus.HistogramVec // op, stage
	stages            *stageRecorder
	inFlight          prometheus.Gauge
	eventBatchesSent  prometheus.Counter
	eventBatchesAcked prometheus.Counter
	eventRetries      prometheus.Counter
	eventsRefused     prometheus.Counter
	eventsDropped     prometheus.Counter
	eventsFenced      prometheus.Counter
	eventQueue        prometheus.Gauge
	reports           *prometheus.CounterVec // result: ok | failed
	inventories       prometheus.Counter
	blocksFreed       *prometheus.CounterVec // result: sent | failed
	supersessions     prometheus.Counter
	// retrieveDeadline counts retrieves the engine's deadline
	// (wire.HeaderDeadline) refused on arrival or cut short.
	retrieveDeadline *prometheus.CounterVec // outcome: expired_on_arrival | cut
	// storeDeadline counts stores the engine's deadline refused on
	// arrival or cut short before their gather, and stores whose gather
	// ended after the engine stopped waiting (wire.HeaderGatherLimit),
	// committing nothing (issue 24).
	storeDeadline *prometheus.CounterVec // outcome: expired_on_arrival | cut | gather_late
	// storeCuts counts stores their engine cut (OpCut, a preempted
	// request): in flight when the cut came, or on arrival after it.
	storeCuts *prometheus.CounterVec // when: in_flight | on_arrival
	// incarnationSaveFailures counts failed writes of the incarnation file
	// (a failing L2 at start, then each retry).
	incarnationSaveFailures prometheus.Counter
	// l1NUMANode is the NUMA node L1 is bound to, -1 when not bound;
	// l1NUMAElsewhere the pages of a sample of bound L1 found on another
	// node at start (transfer.L1Placement).
	l1NUMANode, l1NUMAElsewhere prometheus.Gauge
}

func newMetrics(rank string) *metrics {
	labels := prometheus.Labels{"rank": rank}
	c := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd", Name: name, Help: help, ConstLabels: labels})
	}
	m := &metrics{
		reg: prometheus.NewRegistry(), labels: labels,
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "engine_requests_total", Help: "Engine API requests by operation and reply code (ok on success).", ConstLabels: labels},
			[]string{"op", "code"}),
		requestSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "engine_request_seconds", Help: "Engine API request latency, receipt to reply.", ConstLabels: labels,
			Buckets: prometheus.ExponentialBuckets(1e-4, 4, 10)}, []string{"op"}),
		stageSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "stage_seconds", Help: "Time of each stage of a store or retrieve, per request (a stage of several copy batches: their sum); see docs/metrics.md.",
			ConstLabels: labels, Buckets: prometheus.ExponentialBuckets(25e-6, 4, 9)}, []string{"op", "stage"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "engine_requests_in_flight", Help: "Engine API requests being served.", ConstLabels: labels}),
		eventBatchesSent:  c("event_batch_requests_total", "Event batch requests sent to the coordinator, retries included."),
		eventBatchesAcked: c("event_batches_acked_total", "Event batches the coordinator acknowledged as durable."),
		eventRetries:      c("event_batch_retries_total", "Event batches sent again after a timeout or transient error."),
		eventsRefused:     c("event_batches_refused_total", "Event batches left unacknowledged when the shutdown flush ended (the coordinator resyncs the next incarnation); events the engine's full buffer dropped are kvtier_transfer_events_dropped_total."),
		eventsDropped:     c("event_batches_dropped_total", "Event batches dropped: rejected by the coordinator or unencodable."),
		eventsFenced:      c("event_batches_fenced_total", "Event batches the coordinator fenced (superseded incarnation)."),
		eventQueue: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "event_queue_batches", Help: "Event batches held for the coordinator: taken from the engine's event buffer and not yet acknowledged, or waiting there.", ConstLabels: labels}),
		reports: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "restore_reports_total", Help: "Restore reports sent to the coordinator, by result.", ConstLabels: labels},
			[]string{"result"}),
		inventories: c("inventory_requests_total", "Inventory pages served."),
		blocksFreed: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "blocks_freed_total", Help: "Blocks-freed messages for stores answered with blocks_in_use (C10), by result.", ConstLabels: labels},
			[]string{"result"}),
		supersessions: c("engine_sessions_superseded_total",
			"Engine registrations that superseded a live session of their namespace (an engine restart, or a second engine process of the instance)."),
		retrieveDeadline: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "retrieve_deadline_total", Help: "Retrieves past the engine's deadline (the engine had taken the blocks back): refused on arrival, nothing placed (expired_on_arrival), or cut short, the items not yet placed failed (cut).", ConstLabels: labels},
			[]string{"outcome"}),
		storeDeadline: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "store_deadline_total", Help: "Stores past the engine's deadline (the engine holds the blocks until the answer): refused on arrival, nothing read (expired_on_arrival), or whose deadline passed while they waited for L1 room, the objects not yet gathered failed, not stored (cut), or whose gather ended after the engine stopped waiting (its deadline plus grace), nothing of it committed (gather_late).", ConstLabels: labels},
			[]string{"outcome"}),
		storeCuts: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "store_cuts_total", Help: "Stores cut by their engine (engine.cut: vLLM preempted the request), by when: in flight when the cut came, or on arrival after a cut bounded by their deadline.", ConstLabels: labels},
			[]string{"when"}),
		incarnationSaveFailures: c("incarnation_save_failures_total",
			"Failed writes of the rank's incarnation file in the L2 directory (a failing L2: the rank serves anyway and retries every heartbeat)."),
		l1NUMANode: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "l1_numa_node", Help: "NUMA node L1's pages are bound to (--l1-numa); -1: not bound.", ConstLabels: labels}),
		l1NUMAElsewhere: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "kvtier", Subsystem: "rankd",
			Name: "l1_numa_pages_elsewhere", Help: "Pages of a sample of bound L1 found on another NUMA node at start (the node was short of free memory).", ConstLabels: labels}),
	}
	m.l1NUMANode.Set(-1)
	m.stages = newStageRecorder(m.stageSeconds) // every series of stageSeconds
	m.reg.MustRegister(m.requests, m.requestSeconds, m.stageSeconds, m.inFlight, m.eventBatchesSent, m.eventBatchesAcked,
		m.eventRetries, m.eventsRefused, m.eventsDropped, m.eventsFenced, m.eventQueue, m.reports, m.inventories, m.blocksFreed, m.supersessions, m.incarnationSaveFailures,
		m.retrieveDeadline, m.storeDeadline, m.storeCuts,
		m.l1NUMANode, m.l1NUMAElsewhere,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// Every vector starts with its known series at 0, so an idle rank
	// shows 0 rather than no data (deploy's TestVectorsInitialised). An
	// error code appears when first answered.
	for _, op := range []string{OpRegister, OpStore, OpRetrieve, OpRelease, OpStatus, OpCut} {
		m.requests.WithLabelValues(op, "ok")
		m.requestSeconds.WithLabelValues(op)
	}
	for _, r := range []string{"ok", "failed"} {
		m.reports.WithLabelValues(r)
	}
	for _, r := range []string{"sent", "failed"} {
		m.blocksFreed.WithLabelValues(r)
	}
	for _, o := range []string{"expired_on_arrival", "cut"} {
		m.retrieveDeadline.WithLabelValues(o)
		m.storeDeadline.WithLabelValues(o)
	}
	m.storeDeadline.WithLabelValues("gather_late")
	m.storeCuts.WithLabelValues("in_flight")
	m.storeCuts.WithLabelValues("on_arrival")
	return m
}

// noteL1Placement shows where the engine put L1.
func (m *metrics) noteL1Placement(p transfer.L1Placement) {
	m.l1NUMANode.Set(float64(p.Node))
	m.l1NUMAElsewhere.Set(float64(p.Elsewhere))
}

// watchCopyEngine exports whether dev batches its copy-engine copies
// (cuda.CopyEngineBatching), read at each scrape: a driver that refuses
// the batch call at run time turns it to 0.
func (m *metrics) watchCopyEngine(dev cuda.Device) {
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "kvtier", Subsystem: "rankd",
		Name: "copy_engine_batching", ConstLabels: m.labels,
		Help: "1 while the device enqueues copy-engine copies in batches (cuMemcpyBatchAsync), which auto needs to pick the copy engine; 0 where the driver lacks it or refused it at run time (auto then keeps the copy kernels).",
	}, func() float64 {
		if batching(dev) {
			return 1
		}
		return 0
	}))
	m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd",
		Name: "sm_control_transfers_total", ConstLabels: m.labels,
		Help: "Transfers whose tables and partial sums the GPU moved with kv_move instead of copy-engine copies (--dma-sm-control, or --dma-sm-control-duplex beside a transfer of the other direction): how often this rank stores and restores at once.",
	}, func() float64 { return float64(cuda.SMControlTransfers(dev)) }))
}
