package transfer

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvtier/kvtier/cuda"
)

// reasons indexes the failure counters.
var reasons = []Reason{ReasonMissing, ReasonCorrupt, ReasonTimeout, ReasonDevice, ReasonNoSpace, ReasonIO, ReasonSibling, ReasonCanceled}

func reasonIndex(r Reason) int {
	for i, x := range reasons {
		if x == r {
			return i
		}
	}
	return len(reasons) - 1
}

// counters are the engine's monotonic counters and gauges. They are the one
// source of truth for Stats and for the Prometheus collector.
type counters struct {
	bytesStoredL1         atomic.Uint64 // device -> L1 (gather)
	bytesRetrievedL1      atomic.Uint64 // L1 -> device (scatter)
	bytesWrittenL2        atomic.Uint64 // L1 -> L2
	bytesReadL2           atomic.Uint64 // L2 -> L1
	storesInflight        atomic.Int64
	objectsStored         atomic.Uint64
	dedupeHits            atomic.Uint64
	dedupeShared          atomic.Uint64 // objects deduplicated against a share-group member's L2 file
	dedupeSharedL1        atomic.Uint64 // of those, with a local L1 copy kept (Config.KeepSharedInL1)
	objectsRestored       atomic.Uint64
	evictions             atomic.Uint64
	writeBacks            atomic.Uint64
	checksumL1            atomic.Uint64
	checksumL2            atomic.Uint64
	quarantined           atomic.Uint64
	l1Full                atomic.Uint64
	l2WriteErrors         atomic.Uint64
	eventsPublished       atomic.Uint64
	eventsDropped         atomic.Uint64
	pinnedEvictions       atomic.Uint64 // must stay 0: evicting a pinned object is a bug
	lostObjects           atomic.Uint64 // dirty objects dropped without reaching L2
	storeFailures         [8]atomic.Uint64
	retrieveFailures      [8]atomic.Uint64
	l1OccupiedBytes       atomic.Uint64
	l1Objects             atomic.Int64
	l2Objects             atomic.Int64
	lastSeq               atomic.Uint64
	publishedThrough      atomic.Uint64
	l1CapacityBytes       uint64
	storeLatency          prometheus.Histogram
	retrieveLatency       prometheus.Histogram
	retrievesInflight     atomic.Int64
	retrieveDrains        atomic.Uint64 // timed-out scatters drained before their reply (C10)
	sessionDrains         atomic.Uint64 // registrations answered after a retired session's retrieves drained
	sessionDrainsRefused  atomic.Uint64 // registrations refused: a retired session's retrieves did not drain in time
	l2DroppedDirty        atomic.Uint64 // objects only L1 held, dropped for room while L2 was failing
	l2Skipped             atomic.Uint64 // write-through writes skipped while L2 was degraded
	l2Degraded            atomic.Bool
	l2DegradedTotal       atomic.Uint64 // times the tier became degraded
	l2ScanSkipped         atomic.Uint64 // rescan entries skipped: not regular files, symlinked directories
	l2Evictions           atomic.Uint64 // L2 objects deleted to stay under L2Bytes or the free-space floor
	l2EvictErrors         atomic.Uint64 // evictions whose delete failed (the object is kept)
	l2Bytes               atomic.Uint64 // bytes of this rank's L2 files
	l2CollectedQuarantine atomic.Uint64 // quarantined files collected
	l2CollectedTemp       atomic.Uint64 // temp files of interrupted writes collected
	l2CollectedOrphan     atomic.Uint64 // orphaned files collected
	l2CollectedBytes      atomic.Uint64
	l2Rescanning          atomic.Bool   // the background rescan is running
	l2Rewrites            atomic.Uint64 // L1 objects written to L2 again after their copy was found gone, quarantined or evicted
	l2BoundSkipped        atomic.Uint64 // objects kept in L1 only: the L2 bound was full of the same prompt's earlier objects
	storesNotDurable      atomic.Uint64 // write-through stores answered NotDurable
	storeThrottled        atomic.Uint64 // stores that waited for L1 room
	// deviceOps counts the gathers [0] and scatters [1] enqueued, by the
	// copy path the device chose (opPaths).
	deviceOps         [2][len(opPaths)]atomic.Uint64
	l2Reads           atomic.Uint64 // objects read from L2 files into L1
	peerL1Reads       atomic.Uint64 // objects placed from a peer's L1 and verified
	peerL1Bytes       atomic.Uint64
	peerL1Failures    atomic.Uint64 // peer reads that failed (wrong size or sum, scatter failed or mismatched)
	peerL1Stale       atomic.Uint64 // objects found in a peer's catalog but evicted before the lease
	peerL1DeadHolders atomic.Uint64 // peer segments left by a holder that died (kill -9), not read
	hostL1Collected   atomic.Uint64 // files of an earlier run (its segment, temporary files) collected at start
	unverifiedL2      atomic.Uint64 // L2 objects a rescan found with a header MAC that does not verify (C12)
	unverifiedL3      atomic.Uint64 // the same in the L3 scan
}

// Stats is a snapshot of the engine's counters (the same numbers the
// Prometheus collector exports).
type Stats struct {
	L1CapacityBytes uint64
	L1OccupiedBytes uint64 // bytes of the slabs objects occupy
	L1Objects       int64
	L2Objects       int64 // objects this rank wrote that L2 holds

	BytesStoredL1    uint64 // device -> L1 (gathers)
	BytesRetrievedL1 uint64 // L1 -> device (scatters)
	BytesWrittenL2   uint64
	BytesReadL2      uint64

	StoresInflight    int64
	RetrievesInflight int64
	ObjectsStored     uint64 // committed to L1 by stores
	DedupeHits        uint64 // objects a store found already held
	DedupeShared      uint64 // objects a store found in a share-group member's L2 file (Config.L2SharedWith)
	DedupeSharedL1    uint64 // of those, gathered into a local L1 copy (Config.KeepSharedInL1)
	ObjectsRestored   uint64 // placed and verified
	StoreFailures     map[Reason]uint64
	RetrieveFailures  map[Reason]uint64

	Evictions        uint64
	WriteBacks       uint64 // objects written to L2 to be evicted
	ChecksumFailures uint64 // L1 and L2
	ChecksumL1       uint64
	ChecksumL2       uint64
	Quarantined      uint64 // L2 files moved to quarantine
	L1Full           uint64 // placements that failed for lack of L1 room
	L2WriteErrors    uint64
	LostObjects      uint64        // objects only in L1 that could not be written back at Close
	PinnedEvictions  uint64        // always 0 unless there is a bug
	RetrieveDrains   uint64        // timed-out scatters drained before their reply (C10)
	L2Degraded       bool          // consecutive L2 writes failed: writes skipped, probes with backoff
	L2DroppedDirty   uint64        // objects only L1 held, dropped for room while L2 was degraded
	L2WritesSkipped  uint64        // write-through writes skipped while L2 was degraded
	L2ScanSkipped    uint64        // rescan entries skipped: not regular files, symlinked namespace directories
	L2Evictions      uint64        // L2 objects deleted to stay under L2Bytes or the free-space floor
	L2EvictErrors    uint64        // evictions whose delete failed (the object is kept)
	L2Bytes          uint64        // bytes (header and payload) of this rank's L2 files
	L2Collected      CollectResult // garbage files removed since New, by kind
	L2Rewrites       uint64        // L1 objects written to L2 again after their copy was found gone or quarantined
	StoresNotDurable uint64        // write-through stores answered NotDurable (L2 degraded or unavailable)
	StoresThrottled  uint64        // stores that waited for L1 room (full of pinned or filling objects)
	L2Reads          uint64        // objects read from L2 files
	PeerL1Reads      uint64        // objects restored from a peer's L1 (host-shared L1), verified
	PeerL1Bytes      uint64
	PeerL1Failures   uint64 // peer L1 reads that failed (the chunk failed, or it was read from L2)
	PeerL1Stale      uint64 // objects a peer's catalog listed but evicted before they were leased
	PeerL1DeadHolder uint64 // peer segments whose holder died without closing them (kill -9): never read
	HostL1Collected  uint64 // segment files of an earlier run of this rank collected at start
	// UnverifiedL2 and UnverifiedL3 count objects the start-up scans found
	// with a header MAC that does not verify (C12), never announced.
	UnverifiedL2, UnverifiedL3 uint64

	LastSeq          uint64 // last event sequence assigned
	EventsPublished  uint64
	EventsDropped    uint64
	PublishedThrough uint64 // highest sequence the consumer acknowledged (AckEvents)
}

// Stats returns a snapshot of the counters.
func (e *Engine) Stats() Stats {
	c := &e.ctr
	s := Stats{
		L1CapacityBytes:   c.l1CapacityBytes,
		L1OccupiedBytes:   c.l1OccupiedBytes.Load(),
		L1Objects:         c.l1Objects.Load(),
		L2Objects:         c.l2Objects.Load(),
		BytesStoredL1:     c.bytesStoredL1.Load(),
		BytesRetrievedL1:  c.bytesRetrievedL1.Load(),
		BytesWrittenL2:    c.bytesWrittenL2.Load(),
		BytesReadL2:       c.bytesReadL2.Load(),
		StoresInflight:    c.storesInflight.Load(),
		RetrievesInflight: c.retrievesInflight.Load(),
		ObjectsStored:     c.objectsStored.Load(),
		DedupeHits:        c.dedupeHits.Load(),
		DedupeShared:      c.dedupeShared.Load(),
		DedupeSharedL1:    c.dedupeSharedL1.Load(),
		ObjectsRestored:   c.objectsRestored.Load(),
		StoreFailures:     map[Reason]uint64{},
		RetrieveFailures:  map[Reason]uint64{},
		Evictions:         c.evictions.Load(),
		WriteBacks:        c.writeBacks.Load(),
		ChecksumL1:        c.checksumL1.Load(),
		ChecksumL2:        c.checksumL2.Load(),
		Quarantined:       c.quarantined.Load(),
		L1Full:            c.l1Full.Load(),
		L2WriteErrors:     c.l2WriteErrors.Load(),
		LostObjects:       c.lostObjects.Load(),
		PinnedEvictions:   c.pinnedEvictions.Load(),
		RetrieveDrains:    c.retrieveDrains.Load(),
		L2Degraded:        c.l2Degraded.Load(),
		L2DroppedDirty:    c.l2DroppedDirty.Load(),
		L2WritesSkipped:   c.l2Skipped.Load(),
		L2ScanSkipped:     c.l2ScanSkipped.Load(),
		L2Evictions:       c.l2Evictions.Load(),
		L2EvictErrors:     c.l2EvictErrors.Load(),
		L2Bytes:           c.l2Bytes.Load(),
		L2Collected: CollectResult{Quarantined: int(c.l2CollectedQuarantine.Load()), Temp: int(c.l2CollectedTemp.Load()),
			Orphans: int(c.l2CollectedOrphan.Load()), Bytes: c.l2CollectedBytes.Load()},
		L2Rewrites:       c.l2Rewrites.Load(),
		StoresNotDurable: c.storesNotDurable.Load(),
		StoresThrottled:  c.storeThrottled.Load(),
		L2Reads:          c.l2Reads.Load(),
		PeerL1Reads:      c.peerL1Reads.Load(),
		PeerL1Bytes:      c.peerL1Bytes.Load(),
		PeerL1Failures:   c.peerL1Failures.Load(),
		PeerL1Stale:      c.peerL1Stale.Load(),
		PeerL1DeadHolder: c.peerL1DeadHolders.Load(),
		HostL1Collected:  c.hostL1Collected.Load(),
		UnverifiedL2:     c.unverifiedL2.Load(),
		UnverifiedL3:     c.unverifiedL3.Load(),
		LastSeq:          c.lastSeq.Load(),
		EventsPublished:  c.eventsPublished.Load(),
		EventsDropped:    c.eventsDropped.Load(),
		PublishedThrough: c.publishedThrough.Load(),
	}
	s.ChecksumFailures = s.ChecksumL1 + s.ChecksumL2
	for i, r := range reasons {
		if v := c.storeFailures[i].Load(); v != 0 {
			s.StoreFailures[r] = v
		}
		if v := c.retrieveFailures[i].Load(); v != 0 {
			s.RetrieveFailures[r] = v
		}
	}
	return s
}

// collector exports counters to Prometheus.
type collector struct {
	c     *counters
	descs map[string]*prometheus.Desc
	order []string
}

const metricPrefix = "kvtier_transfer_"

func newCollector(c *counters, rank string) *collector {
	cl := &collector{c: c, descs: map[string]*prometheus.Desc{}}
	labels := prometheus.Labels{"rank": rank}
	add := func(name, help string, varLabels ...string) {
		cl.descs[name] = prometheus.NewDesc(metricPrefix+name, help, varLabels, labels)
		cl.order = append(cl.order, name)
	}
	add("bytes_total", "Bytes moved, by direction (store: toward the tier, retrieve: out of it) and tier.", "direction", "tier")
	add("stores_inflight", "Store futures not yet finished.")
	add("retrieves_inflight", "Retrieve calls in progress.")
	add("l1_capacity_bytes", "Pinned host memory of L1.")
	add("l1_occupancy_bytes", "Bytes of L1 slabs held by objects.")
	add("l1_objects", "Objects in L1.")
	add("l2_objects", "Objects this rank wrote that L2 holds.")
	add("objects_stored_total", "Objects committed to L1 by stores.")
	add("dedupe_hits_total", "Objects a store found already held (no copy).")
	add("dedupe_shared_total", "Objects a store found in the shared L2 directory, written by a rank of another instance of the share group (--l2-shared-with): no second copy.")
	add("dedupe_shared_l1_total", "Of dedupe_shared_total, the objects kept in a local L1 copy all the same (--keep-shared-in-l1): gathered and announced in L1 only, never written to L2 or L3.")
	add("objects_restored_total", "Objects placed into engine pages and verified.")
	add("store_failures_total", "Objects a store failed to commit, by reason.", "reason")
	add("retrieve_failures_total", "Objects a retrieve failed to place, by reason.", "reason")
	add("evictions_total", "Objects evicted from L1.")
	add("write_backs_total", "Objects written to L2 to be evicted from L1.")
	add("checksum_failures_total", "Objects whose bytes failed their kvsum64, by tier.", "tier")
	add("quarantined_files_total", "L2 files moved to quarantine.")
	add("unverified_objects_total", "Objects a start-up scan found whose header MAC does not verify with the cluster's storage key (C12: another cluster's or a rotated key, format 1, or replaced by whoever can write the tier): never announced nor served; quarantined (L2) or left in the bucket (L3).", "tier")
	add("device_transfers_total", "Gathers (stores into L1) and scatters (restores from it) enqueued on the device, by the copy path it chose: dma (copy-engine copies, then a checksum kernel), sm-direct (the copy kernels on the mapped host buffer), sm-staged (the copy kernels through a device staging buffer the copy engine fills or drains), sm (the host backend's kernels).", "op", "path")
	add("l1_full_total", "Placements that failed for lack of L1 room after eviction.")
	add("l2_write_errors_total", "Failed L2 writes.")
	add("lost_objects_total", "Objects only in L1 that could not be written to L2 before shutdown.")
	add("retrieve_drains_total", "Timed-out scatters the engine waited for before answering (C10: a failure reply means hands off).")
	add("session_drains_total", "Registrations that waited for a retired session's retrieves to stop writing its pools (drained: answered after; refused: they did not stop within the retrieve timeout).", "outcome")
	add("l2_degraded", "1 while L2 writes keep failing: writes are skipped, objects only L1 holds are dropped for room, a probe write runs with backoff. Alert on it.")
	add("l2_degraded_total", "Times L2 became degraded.")
	add("l2_dropped_dirty_total", "Objects only L1 held, dropped to make room while L2 was degraded (lost from the tiers).")
	add("l2_writes_skipped_total", "Write-through writes skipped while L2 was degraded.")
	add("l2_scan_skipped_total", "L2 rescan entries skipped as unsafe: not regular files (FIFOs, devices, symlinks) or symlinked namespace directories.")
	add("l2_rewrites_total", "Objects L1 holds written to L2 again because their L2 copy was found gone or quarantined, or was evicted (a store of the object again).")
	add("l2_bound_skipped_total", "Objects not written to L2 because the bound was full of the same prompt's objects at the same or earlier chunk positions, which a prompt's writes never evict (its prefix stays restorable from L2); kept in L1 only.")
	add("l2_evictions_total", "L2 objects of this rank deleted to stay under --l2-bytes or the free-space floor (each announced as a removal).")
	add("l2_evict_errors_total", "L2 evictions whose delete failed; the object is kept and announced again.")
	add("l2_bytes", "Bytes (header and payload) of the L2 files this rank wrote.")
	add("l2_collected_files_total", "L2 garbage files removed once older than the grace period, by kind (quarantine, temp: interrupted writes, orphan: stray files).", "kind")
	add("l2_rescanning", "1 while the start-up rescan of L2 (headers only, in the background) runs; objects it has not reached are still served.")
	add("l2_collected_bytes_total", "Bytes of the L2 garbage files removed.")
	add("stores_not_durable_total", "Write-through stores committed to L1 only because L2 was degraded or unavailable (said so in the reply).")
	add("stores_throttled_total", "Stores that waited for L1 room because L1 was full of pinned or filling objects.")
	add("l2_reads_total", "Objects read from L2 files into L1 by retrieves.")
	add("peer_l1_reads_total", "Objects restored straight from the L1 of another rank of this host and instance (host-shared L1), verified.")
	add("peer_l1_bytes_total", "Bytes restored from the L1 of another rank of this host (host-shared L1).")
	add("peer_l1_failures_total", "Reads from another rank's L1 that failed: size or checksum not the expected ones, or the bytes changed during the read (an eviction raced it); the chunk failed or came from L2.")
	add("peer_l1_dead_holder_total", "Peer host L1 segments found left by a rankd that died without closing them (kill -9): never read; its next start replaces them.")
	add("host_l1_collected_total", "Host L1 segment files of an earlier run of this rank (its segment, temporary files) collected at start.")
	add("peer_l1_stale_total", "Objects another rank's L1 catalog listed but that were evicted or replaced before this rank's lease (read from L2 or failed).")
	add("events_published_total", "Events the consumer acknowledged (published and durable at the coordinator).")
	add("events_dropped_total", "Events dropped because the event buffer was full; the gap forces a resync.")
	add("event_seq", "Last event sequence number assigned.")
	return cl
}

func (cl *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, n := range cl.order {
		ch <- cl.descs[n]
	}
	cl.c.storeLatency.Describe(ch)
	cl.c.retrieveLatency.Describe(ch)
}

func (cl *collector) Collect(ch chan<- prometheus.Metric) {
	c := cl.c
	counter := func(name string, v uint64, lv ...string) {
		ch <- prometheus.MustNewConstMetric(cl.descs[name], prometheus.CounterValue, float64(v), lv...)
	}
	gauge := func(name string, v float64, lv ...string) {
		ch <- prometheus.MustNewConstMetric(cl.descs[name], prometheus.GaugeValue, v, lv...)
	}
	counter("bytes_total", c.bytesStoredL1.Load(), "store", "L1")
	counter("bytes_total", c.bytesRetrievedL1.Load(), "retrieve", "L1")
	counter("bytes_total", c.bytesWrittenL2.Load(), "store", "L2")
	counter("bytes_total", c.bytesReadL2.Load(), "retrieve", "L2")
	gauge("stores_inflight", float64(c.storesInflight.Load()))
	gauge("retrieves_inflight", float64(c.retrievesInflight.Load()))
	gauge("l1_capacity_bytes", float64(c.l1CapacityBytes))
	gauge("l1_occupancy_bytes", float64(c.l1OccupiedBytes.Load()))
	gauge("l1_objects", float64(c.l1Objects.Load()))
	gauge("l2_objects", float64(c.l2Objects.Load()))
	counter("objects_stored_total", c.objectsStored.Load())
	counter("dedupe_hits_total", c.dedupeHits.Load())
	counter("dedupe_shared_total", c.dedupeShared.Load())
	counter("dedupe_shared_l1_total", c.dedupeSharedL1.Load())
	counter("objects_restored_total", c.objectsRestored.Load())
	for i, r := range reasons {
		counter("store_failures_total", c.storeFailures[i].Load(), string(r))
		counter("retrieve_failures_total", c.retrieveFailures[i].Load(), string(r))
	}
	counter("evictions_total", c.evictions.Load())
	counter("write_backs_total", c.writeBacks.Load())
	counter("checksum_failures_total", c.checksumL1.Load(), "L1")
	counter("checksum_failures_total", c.checksumL2.Load(), "L2")
	counter("quarantined_files_total", c.quarantined.Load())
	counter("unverified_objects_total", c.unverifiedL2.Load(), "L2")
	counter("unverified_objects_total", c.unverifiedL3.Load(), "L3")
	counter("l1_full_total", c.l1Full.Load())
	counter("l2_write_errors_total", c.l2WriteErrors.Load())
	counter("lost_objects_total", c.lostObjects.Load())
	counter("retrieve_drains_total", c.retrieveDrains.Load())
	counter("session_drains_total", c.sessionDrains.Load(), "drained")
	counter("session_drains_total", c.sessionDrainsRefused.Load(), "refused")
	deg := 0.0
	if c.l2Degraded.Load() {
		deg = 1
	}
	gauge("l2_degraded", deg)
	counter("l2_degraded_total", c.l2DegradedTotal.Load())
	counter("l2_dropped_dirty_total", c.l2DroppedDirty.Load())
	counter("l2_writes_skipped_total", c.l2Skipped.Load())
	counter("l2_scan_skipped_total", c.l2ScanSkipped.Load())
	counter("l2_rewrites_total", c.l2Rewrites.Load())
	counter("l2_bound_skipped_total", c.l2BoundSkipped.Load())
	counter("l2_evictions_total", c.l2Evictions.Load())
	counter("l2_evict_errors_total", c.l2EvictErrors.Load())
	gauge("l2_bytes", float64(c.l2Bytes.Load()))
	counter("l2_collected_files_total", c.l2CollectedQuarantine.Load(), "quarantine")
	counter("l2_collected_files_total", c.l2CollectedTemp.Load(), "temp")
	counter("l2_collected_files_total", c.l2CollectedOrphan.Load(), "orphan")
	counter("l2_collected_bytes_total", c.l2CollectedBytes.Load())
	resc := 0.0
	if c.l2Rescanning.Load() {
		resc = 1
	}
	gauge("l2_rescanning", resc)
	counter("stores_not_durable_total", c.storesNotDurable.Load())
	counter("stores_throttled_total", c.storeThrottled.Load())
	for d, op := range [2]string{"gather", "scatter"} {
		for p, path := range opPaths {
			counter("device_transfers_total", c.deviceOps[d][p].Load(), op, path)
		}
	}
	counter("l2_reads_total", c.l2Reads.Load())
	counter("peer_l1_reads_total", c.peerL1Reads.Load())
	counter("peer_l1_bytes_total", c.peerL1Bytes.Load())
	counter("peer_l1_failures_total", c.peerL1Failures.Load())
	counter("peer_l1_stale_total", c.peerL1Stale.Load())
	counter("peer_l1_dead_holder_total", c.peerL1DeadHolders.Load())
	counter("host_l1_collected_total", c.hostL1Collected.Load())
	counter("events_published_total", c.eventsPublished.Load())
	counter("events_dropped_total", c.eventsDropped.Load())
	gauge("event_seq", float64(c.lastSeq.Load()))
	c.storeLatency.Collect(ch)
	c.retrieveLatency.Collect(ch)
}

func newLatency(name, help, rank string) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:        metricPrefix + name,
		Help:        help,
		ConstLabels: prometheus.Labels{"rank": rank},
		// 100 us .. ~100 s
		Buckets: prometheus.ExponentialBuckets(100e-6, 2.5, 16),
	})
}

// opPaths are the device_transfers_total paths, in deviceOps' order.
var opPaths = [...]string{"dma", "sm-direct", "sm-staged", "sm"}

// countOp counts a gather (scatter false) or scatter the device enqueued,
// by its copy path and mode (cuda.Op.Path, cuda.Op.Mode): an index into
// opPaths, with no string built per transfer.
func (c *counters) countOp(scatter bool, op *cuda.Op) {
	p := 3 // sm: the host backend's copies
	switch {
	case op.Path() == cuda.PathDMA:
		p = 0
	case op.Mode() == cuda.ModeDirect:
		p = 1
	case op.Mode() == cuda.ModeStaged:
		p = 2
	}
	d := 0
	if scatter {
		d = 1
	}
	c.deviceOps[d][p].Add(1)
}
