package coordinator

import (
	"context"
	"encoding/json"
	"slices"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// KV events for routers (issue 26.4, docs/kvevents.md). With
// Config.KVEvents the coordinator that serves (standalone: itself; raft:
// the leader) publishes on wire.Subjects.KVEvents(instance), in vLLM's
// KV-events shape, which chunks a restore by the instance could read whole
// from which medium: BlockStored when that becomes true, BlockRemoved
// when it stops being true, AllBlocksCleared and a snapshot of
// BlockStored when the publisher (re)starts, gains leadership or lost
// track (its queue overflowed).
//
// The rule, per instance I, chunk c and tier T: every expectation
// (reader rank t, shard, group) of c's namespace has a copy of its object
// in T that I/t may read: in L1 its own copy (with HostSharedL1, any rank
// of I; with Config.ShareHostL1, also of another member), in L2 a copy of any rank of I or of another member of I's share
// group (as index.LookupSharedInto), in L3 a copy of any rank of I (with
// Config.ShareL3, or of another member).
//
// Nothing here runs on the ingest path beyond handing a job to a bounded
// queue: one worker (kvWorker, started through c.goroutines) owns the
// announced state without a lock, rechecks what each job touches by
// reading the index (index.Get), and publishes with no lock held. A full
// queue sets a flag instead of waiting: the worker then publishes
// AllBlocksCleared and a fresh snapshot rather than leave a router with
// a stale view.

// kvMaxHashes bounds the chunk hashes of one event and kvMaxMsgHashes
// those of one message (about 35 bytes each in JSON), so a snapshot of a
// large instance goes in messages far below the NATS payload limit.
const (
	kvMaxHashes    = 512
	kvMaxMsgHashes = 8192
)

// kvChunk is one chunk of one namespace.
type kvChunk struct {
	ns    dcp.Namespace
	chunk dcp.ChunkHash
}

// kvJob is what the worker rechecks: the chunks of holder instance inst
// (for inst and the other members of its group), and with all set every
// chunk announced for inst and its group.
type kvJob struct {
	inst   string
	chunks []kvChunk
	all    bool
}

// kvEvents is the publisher's state. queue, wake and overflow are shared
// with the producers; everything else belongs to the worker.
type kvEvents struct {
	queue    chan kvJob
	wake     chan struct{} // cap 1: a leadership change or an overflow
	overflow atomic.Bool

	met *kvMetrics

	// Worker-owned.
	term      context.Context                 // the term the announced state was published in
	announced map[string]map[kvChunk]uint8    // instance -> chunk -> tiers announced (bit 1<<tier)
	specs     map[dcp.Namespace]*dcp.Resolved // registered specs (they never change)
}

func newKVEvents(queue int) *kvEvents {
	return &kvEvents{queue: make(chan kvJob, queue), wake: make(chan struct{}, 1), met: newKVMetrics(),
		specs: make(map[dcp.Namespace]*dcp.Resolved)}
}

// kvEnqueue hands a job to the worker without waiting; a full queue
// marks an overflow (the worker resnapshots) and is counted.
func (c *Coordinator) kvEnqueue(j kvJob) {
	select {
	case c.kv.queue <- j:
	default:
		c.kv.met.overflows.Inc()
		c.kv.overflow.Store(true)
		c.kvWake()
	}
}

// kvWake asks the worker to look at its term and overflow flag.
func (c *Coordinator) kvWake() {
	if c.kv == nil {
		return
	}
	select {
	case c.kv.wake <- struct{}{}:
	default:
	}
}

// kvBatchApplied hands the chunks an applied batch touched to the worker,
// and the whole instance when the batch fenced an older incarnation's L1
// copies.
func (c *Coordinator) kvBatchApplied(b *wire.Batch, out index.Outcome) {
	if c.kv == nil {
		return
	}
	if out.NewIncarnation && out.Fenced > 0 {
		c.kvEnqueue(kvJob{inst: b.Rank.Instance, all: true})
	}
	if len(b.Events) == 0 {
		return
	}
	j := kvJob{inst: b.Rank.Instance, chunks: make([]kvChunk, 0, 1)}
	for i := range b.Events {
		k := kvChunk{b.Events[i].Key.NS, b.Events[i].Key.Chunk}
		if n := len(j.chunks); n == 0 || j.chunks[n-1] != k {
			j.chunks = append(j.chunks, k) // the worker deduplicates the rest
		}
	}
	c.kvEnqueue(j)
}

// kvRankChanged asks for a recheck of everything announced for r's
// instance and its group (a fence, a reset), plus the chunks of an
// applied inventory (inv, or nil), which may hold copies the index did
// not know.
func (c *Coordinator) kvRankChanged(r wire.Rank, inv *wire.Inventory) {
	if c.kv == nil {
		return
	}
	j := kvJob{inst: r.Instance, all: true}
	if inv != nil {
		for i := range inv.Objects {
			k := kvChunk{inv.Objects[i].Key.NS, inv.Objects[i].Key.Chunk}
			if n := len(j.chunks); n == 0 || j.chunks[n-1] != k {
				j.chunks = append(j.chunks, k)
			}
		}
	}
	c.kvEnqueue(j)
}

// kvWorker runs until the coordinator stops: a term change or an
// overflow first (a snapshot), then the queued jobs, gathered into one
// round per wake-up.
func (c *Coordinator) kvWorker() {
	kv := c.kv
	for {
		var jobs []kvJob
		select {
		case <-c.ctx.Done():
			return
		case j := <-kv.queue:
			jobs = append(jobs, j)
		case <-kv.wake:
		}
	more:
		for len(jobs) < cap(kv.queue) {
			select {
			case j := <-kv.queue:
				jobs = append(jobs, j)
			default:
				break more
			}
		}
		term := c.repl.term()
		if term.Err() != nil {
			// Not serving (a follower, or stopping): the new leader
			// announces from scratch; so will this one if it leads again.
			kv.term, kv.announced = nil, nil
			continue
		}
		if overflowed := kv.overflow.Swap(false); term != kv.term || overflowed {
			c.kvSnapshot(term)
			continue // the snapshot read the index after the jobs' changes
		}
		c.kvRound(jobs)
	}
}

// kvRound rechecks the chunks the jobs name and publishes the changes.
func (c *Coordinator) kvRound(jobs []kvJob) {
	kv := c.kv
	check := make(map[string]map[kvChunk]struct{})
	add := func(inst string, k kvChunk) {
		m := check[inst]
		if m == nil {
			m = make(map[kvChunk]struct{})
			check[inst] = m
		}
		m[k] = struct{}{}
	}
	for _, j := range jobs {
		readers := append([]string{j.inst}, c.share.shared(j.inst)...)
		for _, inst := range readers {
			for _, k := range j.chunks {
				add(inst, k)
			}
			if j.all {
				for k := range kv.announced[inst] {
					add(inst, k)
				}
			}
		}
	}
	insts := make([]string, 0, len(check))
	for inst := range check {
		insts = append(insts, inst)
	}
	slices.Sort(insts)
	for _, inst := range insts {
		var pub kvPublication
		ann := kv.announced[inst]
		for k := range check[inst] {
			now := c.kvTiers(inst, k)
			was := ann[k]
			if now == was {
				continue
			}
			pub.diff(k, c.kvBlockSize(k.ns), was, now)
			if now == 0 {
				delete(ann, k)
				continue
			}
			if ann == nil {
				ann = make(map[kvChunk]uint8)
				if kv.announced == nil {
					kv.announced = make(map[string]map[kvChunk]uint8)
				}
				kv.announced[inst] = ann
			}
			ann[k] = now
		}
		c.kvPublish(inst, &pub, false)
	}
}

// kvSnapshot forgets what was announced and announces, for every instance
// the index knows (and every configured share group member), everything a
// restore could read now: AllBlocksCleared first, then BlockStored.
func (c *Coordinator) kvSnapshot(term context.Context) {
	kv := c.kv
	kv.term, kv.announced = term, make(map[string]map[kvChunk]uint8)
	kv.met.snapshots.Inc()
	cand := make(map[string]map[kvChunk]struct{})
	for _, inst := range c.idx.Instances() {
		cand[inst] = make(map[kvChunk]struct{})
	}
	for inst := range c.share.groupOf {
		if cand[inst] == nil {
			cand[inst] = make(map[kvChunk]struct{})
		}
	}
	for _, ri := range c.idx.Ranks() {
		info, err := c.idx.ListRank(ri.Rank)
		if err != nil {
			continue // reset meanwhile: nothing of it to announce
		}
		readers := append([]string{ri.Rank.Instance}, c.share.shared(ri.Rank.Instance)...)
		for _, p := range info.Placements {
			k := kvChunk{p.Key.NS, p.Key.Chunk}
			for _, inst := range readers {
				cand[inst][k] = struct{}{}
			}
		}
	}
	insts := make([]string, 0, len(cand))
	for inst := range cand {
		insts = append(insts, inst)
	}
	slices.Sort(insts)
	for _, inst := range insts {
		var pub kvPublication
		ann := make(map[kvChunk]uint8)
		keys := make([]kvChunk, 0, len(cand[inst]))
		for k := range cand[inst] {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, compareKVChunk) // a stable snapshot order
		for _, k := range keys {
			if now := c.kvTiers(inst, k); now != 0 {
				ann[k] = now
				pub.diff(k, c.kvBlockSize(k.ns), 0, now)
			}
		}
		if len(ann) > 0 {
			kv.announced[inst] = ann
		}
		c.kvPublish(inst, &pub, true)
	}
}

func compareKVChunk(a, b kvChunk) int {
	if x := slices.Compare(a.ns[:], b.ns[:]); x != 0 {
		return x
	}
	return slices.Compare(a.chunk[:], b.chunk[:])
}

// kvTiers returns the tiers (bit 1<<tier) from which a restore by inst
// could read chunk k whole, by the rule in the comment at the top.
func (c *Coordinator) kvTiers(inst string, k kvChunk) uint8 {
	spec := c.kvSpec(k.ns)
	if spec == nil {
		return 0 // not registered: no reader layout to check against
	}
	shared := c.share.shared(inst)
	all := uint8(1<<wire.L1 | 1<<wire.L2 | 1<<wire.L3)
	holders := make(map[dcp.Key][]index.Holder)
	for _, e := range spec.Expectations() {
		key := dcp.Key{NS: k.ns, Chunk: k.chunk, Shard: uint16(e.Shard), Group: uint16(e.Group)}
		hs, ok := holders[key]
		if !ok {
			hs = c.idx.Get(key)
			holders[key] = hs
		}
		var have uint8
		for _, h := range hs {
			switch {
			case h.Tier == wire.L1 && h.Rank.Instance == inst && (h.Rank.TPRank == e.Rank || c.cfg.HostSharedL1):
			case h.Tier == wire.L1 && c.cfg.ShareHostL1 && slices.Contains(shared, h.Rank.Instance):
			case h.Tier == wire.L2 && (h.Rank.Instance == inst || slices.Contains(shared, h.Rank.Instance)):
			case h.Tier == wire.L3 && (h.Rank.Instance == inst || c.cfg.ShareL3 && slices.Contains(shared, h.Rank.Instance)):
			default:
				continue
			}
			have |= 1 << h.Tier
		}
		if all &= have; all == 0 {
			return 0
		}
	}
	return all
}

// kvSpec returns ns's registered spec, nil while it has none.
func (c *Coordinator) kvSpec(ns dcp.Namespace) *dcp.Resolved {
	if s, ok := c.kv.specs[ns]; ok {
		return s
	}
	ni, err := c.idx.ListNamespace(ns)
	if err != nil || ni.Spec == nil {
		return nil
	}
	c.kv.specs[ns] = ni.Spec
	return ni.Spec
}

func (c *Coordinator) kvBlockSize(ns dcp.Namespace) int {
	if s := c.kvSpec(ns); s != nil {
		return s.ChunkTokens
	}
	return 0
}

// kvMedia are the tiers in the order their events go out.
var kvMedia = []wire.Tier{wire.L1, wire.L2, wire.L3}

// kvPublication collects one instance's changes of a round: per tier and
// block size, the chunks removed and stored.
type kvPublication struct {
	removed, stored map[kvGroupKey][]dcp.ChunkHash
}

type kvGroupKey struct {
	tier      wire.Tier
	blockSize int
}

// diff records the changes between the tiers was and now of chunk k.
func (p *kvPublication) diff(k kvChunk, blockSize int, was, now uint8) {
	for _, t := range kvMedia {
		bit := uint8(1) << t
		g := kvGroupKey{t, blockSize}
		switch {
		case was&bit != 0 && now&bit == 0:
			if p.removed == nil {
				p.removed = make(map[kvGroupKey][]dcp.ChunkHash)
			}
			p.removed[g] = append(p.removed[g], k.chunk)
		case was&bit == 0 && now&bit != 0:
			if p.stored == nil {
				p.stored = make(map[kvGroupKey][]dcp.ChunkHash)
			}
			p.stored[g] = append(p.stored[g], k.chunk)
		}
	}
}

// sortedGroups returns m's keys by tier, then block size.
func sortedGroups(m map[kvGroupKey][]dcp.ChunkHash) []kvGroupKey {
	out := make([]kvGroupKey, 0, len(m))
	for g := range m {
		out = append(out, g)
	}
	slices.SortFunc(out, func(a, b kvGroupKey) int {
		if a.tier != b.tier {
			return int(a.tier) - int(b.tier)
		}
		return a.blockSize - b.blockSize
	})
	return out
}

// kvPublish sends one instance's changes: AllBlocksCleared first when
// cleared, then the removals, then the stores, in messages of at most
// kvMaxMsgHashes hashes. It runs on the worker with no lock held.
func (c *Coordinator) kvPublish(inst string, p *kvPublication, cleared bool) {
	var evs []wire.KVEvent
	hashes := 0
	flush := func() {
		if len(evs) == 0 {
			return
		}
		c.kvSend(inst, evs)
		evs, hashes = nil, 0
	}
	if cleared {
		evs = append(evs, &wire.AllBlocksCleared{})
	}
	emit := func(m map[kvGroupKey][]dcp.ChunkHash, stored bool) {
		for _, g := range sortedGroups(m) {
			hs := m[g]
			slices.SortFunc(hs, func(a, b dcp.ChunkHash) int { return slices.Compare(a[:], b[:]) })
			medium, owner := wire.KVMedium(g.tier)
			for len(hs) > 0 {
				n := min(len(hs), kvMaxHashes)
				if stored {
					evs = append(evs, &wire.BlockStored{BlockHashes: hs[:n:n], TokenIDs: []int{}, BlockSize: g.blockSize,
						Medium: medium, Ownership: owner})
				} else {
					evs = append(evs, &wire.BlockRemoved{BlockHashes: hs[:n:n], Medium: medium, Ownership: owner})
				}
				hs = hs[n:]
				if hashes += n; hashes >= kvMaxMsgHashes {
					flush()
				}
			}
		}
	}
	emit(p.removed, false)
	emit(p.stored, true)
	flush()
}

// kvSend publishes one message of events for inst and counts them.
func (c *Coordinator) kvSend(inst string, evs []wire.KVEvent) {
	data, err := json.Marshal(&wire.KVEventBatch{Ts: float64(time.Now().UnixNano()) / 1e9, Events: evs})
	if err == nil {
		err = c.nc.Publish(c.subj.KVEvents(inst), data)
	}
	if err != nil {
		c.kv.met.failed.Inc()
		c.log.Warn("KV events not published; routers resynchronise at the next snapshot", zap.String("instance", inst),
			zap.Int("events", len(evs)), zap.Error(err))
		c.kv.overflow.Store(true) // a router missed these: start over
		c.kvWake()
		return
	}
	for _, e := range evs {
		c.kv.met.events.WithLabelValues(wire.KVEventType(e)).Inc()
	}
}

// kvMetrics count what the publisher sent and what it lost track of.
type kvMetrics struct {
	events    *prometheus.CounterVec // by type
	snapshots prometheus.Counter
	overflows prometheus.Counter
	failed    prometheus.Counter
}

func newKVMetrics() *kvMetrics {
	m := &kvMetrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_kvevents_published_total",
			Help: "KV events published for routers (--kv-events), by type (BlockStored, BlockRemoved, AllBlocksCleared).",
		}, []string{"type"}),
		snapshots: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_kvevents_snapshots_total",
			Help: "KV event snapshots published (AllBlocksCleared, then everything available): at start, on gaining raft leadership, after an overflow or a failed publish.",
		}),
		overflows: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_kvevents_queue_overflows_total",
			Help: "Index changes not handed to the KV event publisher because its queue was full; each leads to a snapshot.",
		}),
		failed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_kvevents_publish_failures_total",
			Help: "KV event messages that could not be published; each leads to a snapshot.",
		}),
	}
	initLabels(m.events, wire.KVBlockStored, wire.KVBlockRemoved, wire.KVAllBlocksCleared)
	return m
}

func (m *kvMetrics) Describe(ch chan<- *prometheus.Desc) {
	m.events.Describe(ch)
	m.snapshots.Describe(ch)
	m.overflows.Describe(ch)
	m.failed.Describe(ch)
}

func (m *kvMetrics) Collect(ch chan<- prometheus.Metric) {
	m.events.Collect(ch)
	m.snapshots.Collect(ch)
	m.overflows.Collect(ch)
	m.failed.Collect(ch)
}
