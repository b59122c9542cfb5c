package transfer

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/numa"
	"github.com/kvtier/kvtier/transfer/tier"
	"github.com/kvtier/kvtier/wire"
)

// L2Policy says when L1 objects are written to L2.
type L2Policy uint8

const (
	// WriteThrough writes every committed object to L2 asynchronously; an
	// object waiting for its write is pinned in L1. Nothing is lost when
	// rankd dies after the write, at the cost of writing everything.
	WriteThrough L2Policy = iota + 1
	// WriteBackOnEvict writes an object to L2 only when L1 evicts it (and
	// on Close): less L2 traffic, but objects only in L1 die with rankd.
	WriteBackOnEvict
)

func (p L2Policy) String() string {
	switch p {
	case WriteThrough:
		return "write-through"
	case WriteBackOnEvict:
		return "write-back-on-evict"
	}
	return fmt.Sprintf("policy(%d)", uint8(p))
}

// Config configures an Engine. Start from DefaultConfig: New validates
// exactly what it is given and fills in nothing, so a zero field means
// zero (and is refused where zero is invalid), never "the default".
type Config struct {
	// Rank is this rankd's identity (engine instance and TP rank). Required.
	Rank wire.Rank
	// TPSize is the engine's tensor-parallel size; a registration whose
	// layout has another TP size is rejected. Required (>= 1, > Rank.TPRank).
	TPSize int
	// Incarnation distinguishes this run of the rank from earlier ones in
	// every event and inventory (C7); a larger incarnation supersedes a
	// smaller one. Default 0: the wall clock in nanoseconds at New. rankd
	// passes the one it gossips (cluster.NewIncarnation).
	Incarnation uint64

	// Device is the GPU (or host simulator) the engine's pools live on.
	// Required. The engine does not close it.
	Device cuda.Device

	// L1Bytes is the pinned host memory of L1, allocated at New. Default
	// 1 GiB. Larger holds more hot objects; it is pinned (unswappable) RAM.
	L1Bytes uint64
	// L1SlabBytes is the allocation unit of L1: an object occupies a run of
	// contiguous slabs. Default 64 KiB (SlabFor of the default L1); a
	// multiple of 4096. Smaller wastes less on small objects (on average
	// half a slab per object) but makes placement scans longer (they are
	// linear in the slab count). SlabFor(L1Bytes) picks one for any L1.
	L1SlabBytes uint64
	// L1NUMA places L1's pages on a NUMA node (docs/gpu.md, "Multi-GPU
	// hosts: L1 near the GPU"): numa.Auto binds them to the Device's node
	// (sysfs numa_node of its PCI bus id) when it is known and the host
	// has more than one node; numa.Node(n) binds them to node n (refused
	// at New when the host has no node n); numa.Off (the zero value)
	// leaves them to the kernel, as cuMemHostAlloc does. Bound L1 is
	// mapped, bound with mbind (preferred: a full node spills elsewhere,
	// counted in L1Placement), faulted in and then registered with the
	// device. Default numa.Auto.
	L1NUMA numa.Spec
	// HighWatermark and LowWatermark are fractions of L1Bytes: when the
	// occupied bytes exceed High, the evictor evicts least-recently-used
	// unpinned objects until they are at or below Low. Defaults 0.90 and
	// 0.75. A wider gap evicts in fewer, larger rounds; a High close to 1
	// makes stores more likely to wait for eviction themselves.
	HighWatermark float64
	LowWatermark  float64

	// HostL1Dir, when not "", makes L1 host-shared (issue 15.1): L1 is the
	// data region of a shared-memory segment "<instance>.<tp>.l1" created
	// in this directory (a private 0700 directory of this uid, typically
	// under /dev/shm, created when missing; symlinks, foreign owners and a
	// parent others could replace it in are refused), whose
	// catalog lists every object L1 holds; the other TP ranks of the
	// instance on this host, given the same directory, restore those
	// objects straight from it (mapped read-only, registered with the
	// device) instead of reading L2, so an MLA object read by every TP
	// rank is held once per host. Default "": L1 is private pinned memory.
	// The segment is tmpfs memory the kernel accounts to the directory's
	// file system, not to the process; it is removed by Close, and a
	// crashed run's is replaced by the next start.
	HostL1Dir string
	// HostL1SharedWith names the other engine instances of this
	// instance's share group whose rankds on this host keep their
	// host-shared L1 in HostL1Dir (docs/sharing.md): a retrieve that finds
	// an object neither in its own L1 nor in another rank's of its
	// instance looks in their ranks' segments next (before L2), with the
	// same leases and checks (the expected size and recorded sum before
	// the scatter, the sum of what it placed after). Default nil: only
	// this instance's segments are read. Needs HostL1Dir. Name exactly
	// the coordinator's --share-group members (with --share-host-l1).
	HostL1SharedWith []string

	// L2Dir is the root of the L2 file tier, shared by the rankds of one
	// engine instance (objects of every rank live under it; each file
	// records its writer). Default "": no L2 unless L2 is set.
	L2Dir string
	// L2 replaces the file tier with another implementation (for example an
	// S3-compatible one). Default nil: a FileTier on L2Dir when set.
	L2 L2Tier
	// L2Policy is WriteThrough (default) or WriteBackOnEvict. Ignored
	// without an L2 tier. Under either, a failing L2 never blocks L1: after
	// 3 consecutive failed writes the tier is degraded (Warn log, gauge
	// kvtier_transfer_l2_degraded = 1): write-through skips new writes
	// (counted), objects only L1 holds become evictable and are dropped
	// when L1 needs room (counted in l2_dropped_dirty_total, logged at
	// Error), and one probe write is tried after 1 s, backing off to 30 s;
	// its success ends the degradation and write-through writes the dirty
	// objects L1 still holds. Flush and Close always try every write.
	L2Policy L2Policy
	// L2Writers is the number of goroutines writing objects to L2. Default
	// 4. Every object is fsynced on its own (C6), so writers are bound by
	// fsync latency, not CPU: more writers overlap fsyncs (on this
	// project's 2-core VM, 4 writers reached 2-3x the rate of one); each
	// holds its object in L1 until written.
	L2Writers int
	// L2VerifyOnScan makes the background rescan at New also read every
	// file this rank wrote and verify its payload checksum. Default false:
	// the rescan reads headers only (and file lengths), so a large tier is
	// rescanned quickly; Get verifies every read either way (C5), so a
	// corrupted payload is caught when it is restored, and quarantined.
	L2VerifyOnScan bool
	// L2Bytes bounds the bytes of the L2 files this rank wrote (header and
	// payload; other ranks sharing the directory keep their own bounds).
	// Default 0: unbounded. When a write would pass it, the least recently
	// used objects (by last write or read of this rank) are deleted first,
	// each announced as an L2 removal and counted in
	// kvtier_transfer_l2_evictions_total. An object L1 holds dirty or is
	// writing is never evicted, and a store never fails because of the
	// bound: an object larger than the bound is not written to L2
	// (counted in l2_writes_skipped_total). L2 writes wait for the start-
	// up rescan (headers only) to have counted this rank's files; objects
	// wait in L1 meanwhile. A tier already over the bound at start-up is
	// brought under it by the next writes. A smaller bound keeps the disk
	// in check at the cost of more misses that must be recomputed.
	L2Bytes uint64
	// L2FreeFloorBytes, when not 0, makes L2 writes of a FileTier evict
	// this rank's least recently used objects while the file system would
	// have less than this many bytes free after the write (statfs, so it
	// counts every writer of the file system). Default 0: no floor. A
	// floor keeps the file system from filling (ENOSPC fails writes and
	// degrades L2), at the cost of evicting when others use the space;
	// when this rank has nothing left to evict the write goes ahead.
	L2FreeFloorBytes uint64
	// L2CollectGrace is the age (last modification) after which the file
	// tier's garbage is removed: quarantined files, temporary files of
	// interrupted writes and orphaned files in namespace directories
	// (counted in l2_collected_files_total). Default 24 h. Longer keeps
	// quarantined files for an operator to inspect; it must stay well
	// above the longest L2 write, or a slow write's temporary file could
	// be taken for an interrupted one.
	L2CollectGrace time.Duration
	// L2CollectEvery is how often garbage is collected after the first
	// collection, which runs right after start-up in the background.
	// Default 10 min. Each collection lists every namespace directory.
	L2CollectEvery time.Duration
	// L2SharedWith names the other engine instances of this instance's
	// share group whose rankds write the same L2 directory (a shared file
	// system; docs/sharing.md). A store of an object this rank holds in
	// neither L1 nor its own L2, whose file a rank of one of them wrote
	// (header MAC verified, the namespace's layout fingerprint and the
	// object's size), is deduplicated against that file: no L1 copy, no
	// L2 or L3 write, nothing announced (the writer's placement serves the
	// group's restores), counted in kvtier_transfer_dedupe_shared_total.
	// An object a retrieve reads from such a file stays in L1 as a local
	// copy of the member's (as with KeepSharedInL1): a later store of it
	// writes nothing either. Default nil: a store writes its own copy,
	// replacing another instance's file of the same key (also of an object
	// a retrieve read from it). Costs one header read per stored
	// object this rank does not hold. Name exactly the coordinator's
	// --share-group members: a copy of an instance named here but not in
	// the group is one this rank's engine cannot restore (a miss,
	// recomputed).
	L2SharedWith []string
	// KeepSharedInL1 makes a store deduplicated onto a member's L2 file
	// (L2SharedWith) keep a local L1 copy all the same: the object is
	// gathered from the engine's pages into L1 and announced there, and
	// never written to L2 (the member's file holds it) or L3, nor again
	// to L2 by a later store of it; it leaves when L1 evicts it. Counted
	// in kvtier_transfer_dedupe_shared_l1_total as well as
	// dedupe_shared_total. For a rank whose restores should read DRAM,
	// not the shared file system, for what the group already holds.
	// Default false: no copy at all. Needs L2SharedWith.
	KeepSharedInL1 bool

	// L3 is an S3-compatible object store (objstore.Store) behind L2: every
	// object a store commits is written behind to it, and retrieves read it
	// when neither L1 nor L2 holds the object (issue 15.3). Default nil: no
	// L3.
	L3 ObjectStore
	// L3Writers is the number of goroutines writing to L3. Default 4. Each
	// pins the object it writes in L1 for the length of its PUT (or reads
	// it from L2 once L1 has evicted it), so more writers overlap more
	// round trips at the cost of more pinned L1.
	L3Writers int
	// L3QueueObjects bounds the write-behind queue. Default 4096. When it
	// is full, a store's object is not queued (counted in
	// kvtier_transfer_l3_queue_full_total): a slow bucket never blocks a
	// store; the object reaches L3 only if a later store queues it again.
	L3QueueObjects int
	// L3Bytes bounds the bytes (header and payload) of the L3 objects this
	// rank wrote: past it the least recently written or read are deleted,
	// each announced as an L3 removal. Default 0: unbounded (a bucket
	// lifecycle rule may expire objects instead; their reads then miss).
	L3Bytes uint64
	// L3Encrypt encrypts the payload of every L3 object written with
	// AES-256-GCM under a key derived from StorageKey, the instance and the
	// object's namespace (format 3, docs/storage-encryption.md); requires
	// StorageKey. Default false: payloads in clear, objects byte for byte
	// as before the option existed. Objects are read in either format
	// whatever the setting, so turning it on or off keeps the cache. Costs
	// one AES-GCM pass over each object written to or read from L3, and 29 B
	// per object.
	L3Encrypt bool
	// L3SharedWith names the other engine instances of this instance's
	// share group whose L3 objects this rank may read (docs/sharing.md):
	// their rankds write, under their own instance's prefix, the bucket
	// and prefix this rank's L3 reads. A retrieve whose plan names the L3
	// copy of one of them reads it there (verified as always: the storage
	// key's header MAC, C12, and the recorded sum, C5; an encrypted payload
	// opens under that instance's payload key); a plan naming the L3 copy
	// of an instance not listed here fails the item, counted in
	// kvtier_transfer_l3_shared_refused_total. Default nil: only this
	// instance's prefix is read. Name exactly the coordinator's
	// --share-group members (with --share-l3).
	L3SharedWith []string

	// StorageKey is the cluster's storage MAC key (C12; auth's storage.key,
	// at least 32 bytes): every L2 and L3 object header the engine writes
	// carries its MAC, and the start-up L2 rescan and L3 scan announce only
	// objects whose MAC verifies; the others (another cluster's, written
	// with a rotated key, format 1 without a MAC, or forged by whoever can
	// write the directory or the bucket) are counted in
	// kvtier_transfer_unverified_objects_total, quarantined (L2) or left
	// unannounced (L3), and never served. Default nil: no MAC is written
	// or checked, and the tiers' headers are trusted (rankd allows this
	// only with --insecure). Applies to the tiers New opens (L2Dir, L3); a
	// Config.L2 brings its own key.
	StorageKey []byte

	// StoreTimeout bounds a store from its request until its objects are
	// committed: the producer event, the device read and the commit.
	// Default 30 s. On timeout the store fails, but the engine keeps its
	// event and blocks until the device has really finished reading them
	// (StoreFuture.Released).
	StoreTimeout time.Duration
	// RetrieveTimeout bounds a retrieve: L2 reads, the scatter and its
	// verification. Default 30 s. When it expires with the scatter still
	// enqueued, the items fail with reason timeout but the answer waits
	// until the device has stopped writing their pages (C10), so the
	// engine may recompute them the moment it has the answer.
	RetrieveTimeout time.Duration
	// Streams is the number of device streams for stores and, separately,
	// for retrieves. A store holds its stream while it waits for the
	// producer event, so this bounds the stores whose events are being
	// waited on at once. Default 8.
	Streams int
	// L2Readers bounds the concurrent L2 reads of one retrieve. Default 4.
	L2Readers int
	// RetrieveBatchBytes bounds the L1 one retrieve pins at a time (slab
	// rounded): its items go through L1 in batches of whole chunks, each
	// scattered, verified and unpinned before the next is read, so a
	// prompt larger than L1 restores from L2. The bound used is
	// min(RetrieveBatchBytes, L1Bytes/4) (at least one slab); a retrieve's
	// first batches ramp up to it (RetrieveRamp), so its first copy starts
	// after little host work. Default 1 GiB.
	// Larger batches mean fewer, longer scatters, each with one checksum
	// kernel, which the GPU time-slices with the engine's context: on the
	// H200 at stop 47, 1 GiB against 256 MiB restored 1.3 GB at 0.859
	// of the copy engine against 0.846 (0.5 GB: 0.800 against 0.766; 4
	// rankds: 0.920 against 0.908) and slowed a decode-shaped loop beside
	// the restores 1.172x against 1.212x (BENCHMARKS.md); smaller ones
	// leave more of L1 to concurrent work.
	RetrieveBatchBytes uint64
	// RetrievePaceWindow bounds a paced retrieve's batches
	// (RetrieveRequest.Pace) to what its pace moves in this time (a whole
	// chunk at least, RetrieveBatchBytes at most): each batch goes at full
	// speed, then the retrieve waits until the pace allows the next. Each
	// batch is a transfer with its own checksum kernel, and on the H200 at
	// stop 48 every batch cost a decode-shaped loop beside it ~0.5 ms of
	// its time besides ~2.4 ms per GB moved (a fit of six paces, 0.5 GB/s
	// to full speed; docs/gpu.md): with 4 ms windows the batches alone
	// took up to 13 %, so paced restores slowed the loop as much as
	// unpaced ones. A longer window spends less on batches and comes in
	// longer bursts; as the last batch is not followed by a wait, a
	// retrieve of a few windows averages faster than its pace. Default
	// 64 ms; 1 ms to 1 s.
	RetrievePaceWindow time.Duration
	// RetrieveRamp is how many doublings a retrieve's batches take to
	// reach their bound: the first holds at most the bound >> RetrieveRamp
	// (a slab at least), each next twice the last. The device copies
	// nothing until the first batch is looked up, pinned and enqueued,
	// host work in proportion to its size (on the H200 ~0.6 ms for 256 MiB
	// of the 8B pages), so a small first batch starts a lone restore's
	// copies sooner; but every batch is a transfer with its own checksum
	// kernel, which cost a decode-shaped loop beside it ~0.5 ms each on
	// the H100 at stop 49 (docs/gpu.md), and 3 makes a 1.3 GB restore four
	// batches where 0 makes it two. Default 3; 0 to 8.
	RetrieveRamp int
	// RetrieveTailRamp is how many halvings an unpaced retrieve's last
	// batches take from the bound: the last holds at most the bound >>
	// RetrieveTailRamp (a slab at least), each before it twice the next,
	// the tail at most half the retrieve's bytes. A scatter's checksum of
	// its last batch follows every copy (each earlier batch's runs beside
	// the next batch's copies), and kv_checksum reads the 8B pages at
	// 0.6 TB/s with the whole GPU (the H100 at stop 51): a last batch of
	// 561 MiB, what a 1.3 GB restore ends with at the defaults, is ~1 ms
	// after its last copy. Default 0 (off): on an H100 at stop 52 (five
	// repetitions) 3 restored 1.3 GB at 0.861 of the copy engine against
	// 0.870, and its three more checksum kernels a restore slowed a
	// decode-shaped loop beside full-speed restores 1.217x against 1.172x
	// (BENCHMARKS.md; stop 51's one run had 0.858 against 0.839). 0 to 8.
	RetrieveTailRamp int
	// RetrieveSerialBatches makes a retrieve wait for and verify each
	// batch's scatter before it prepares the next, as before issue 12.6.
	// Default false: batch b+1 is prepared and enqueued while batch b is
	// on the device (two batches pinned at most). For A/B measurements.
	RetrieveSerialBatches bool

	// KeepEvents makes the engine hold its placement events until a
	// consumer pulls them (EventSource: NextEvents, then AckEvents once
	// they are durable elsewhere); rankd's publisher is that consumer.
	// Default false: events are sequenced and reflected in Inventory, but
	// nothing holds them.
	KeepEvents bool
	// EventBatch is the most events NextEvents hands out in one batch.
	// Default 1024, at most wire.MaxBatchEvents. Larger batches mean fewer
	// requests to the coordinator, each one longer to commit.
	EventBatch int
	// EventBuffer is the most events held for the consumer, those it took
	// and has not acknowledged included; beyond it new events are dropped
	// (counted in kvtier_transfer_events_dropped_total; the sequence gap
	// makes the coordinator resync from Inventory). Default 1<<20 (about
	// 100 MB of events). Larger rides out a longer coordinator outage
	// without a resync, at the cost of that memory.
	EventBuffer int

	// Logger receives structured logs. Required; DefaultConfig sets
	// zap.NewNop().
	Logger *zap.Logger
	// Registerer receives the engine's Prometheus metrics, labeled with
	// the rank. Default nil: metrics are kept (Stats) but not registered.
	Registerer prometheus.Registerer
	// Now is the clock (latency metrics, L2 headers). Required;
	// DefaultConfig sets time.Now.
	Now func() time.Time
}

// DefaultConfig returns a Config with every default filled in; callers set
// Rank, TPSize and Device.
func DefaultConfig() Config {
	return Config{
		L1Bytes:            1 << 30,
		L1SlabBytes:        1 << 20,
		L1NUMA:             numa.Auto,
		HighWatermark:      0.90,
		LowWatermark:       0.75,
		L2Policy:           WriteThrough,
		L2Writers:          4,
		L2CollectGrace:     24 * time.Hour,
		L2CollectEvery:     10 * time.Minute,
		StoreTimeout:       30 * time.Second,
		RetrieveTimeout:    30 * time.Second,
		Streams:            8,
		L2Readers:          4,
		L3Writers:          4,
		L3QueueObjects:     4096,
		RetrieveBatchBytes: 1 << 30,
		RetrievePaceWindow: 64 * time.Millisecond,
		RetrieveRamp:       3,
		EventBatch:         1024,
		EventBuffer:        1 << 20,
		Logger:             zap.NewNop(),
		Now:                time.Now,
	}
}

// Validate checks every rule of c, exactly as given (New calls it).
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf(format+": %w", append(args, ErrConfig)...)
	}
	switch {
	case wire.ValidInstance(c.Rank.Instance) != nil:
		return bad("rank instance %q: want 1..64 characters of [A-Za-z0-9_-]", c.Rank.Instance)
	case c.TPSize < 1:
		return bad("TP size %d must be >= 1", c.TPSize)
	case c.Rank.TPRank < 0 || c.Rank.TPRank >= c.TPSize:
		return bad("TP rank %d outside 0..%d (TP size %d)", c.Rank.TPRank, c.TPSize-1, c.TPSize)
	case c.Device == nil:
		return bad("no device")
	case c.L1SlabBytes < 4096 || c.L1SlabBytes%4096 != 0:
		return bad("L1 slab %d B must be a positive multiple of 4096 B", c.L1SlabBytes)
	case c.L1Bytes < c.L1SlabBytes:
		return bad("L1 of %d B is smaller than one %d B slab", c.L1Bytes, c.L1SlabBytes)
	case c.L1Bytes/c.L1SlabBytes > 1<<24:
		return bad("L1 of %d B is %d slabs of %d B, limit %d: use larger slabs", c.L1Bytes, c.L1Bytes/c.L1SlabBytes, c.L1SlabBytes, 1<<24)
	case !(c.LowWatermark > 0 && c.LowWatermark < c.HighWatermark && c.HighWatermark <= 1):
		return bad("watermarks low %g high %g: want 0 < low < high <= 1", c.LowWatermark, c.HighWatermark)
	case c.L2Policy != WriteThrough && c.L2Policy != WriteBackOnEvict:
		return bad("L2 policy %d: want WriteThrough or WriteBackOnEvict", uint8(c.L2Policy))
	case c.L2Writers < 1 || c.L2Writers > 256:
		return bad("%d L2 writers: want 1..256", c.L2Writers)
	case c.L2CollectGrace <= 0 || c.L2CollectEvery <= 0:
		return bad("L2 collection grace %v and period %v must be > 0", c.L2CollectGrace, c.L2CollectEvery)
	case c.StoreTimeout <= 0 || c.RetrieveTimeout <= 0:
		return bad("store timeout %v and retrieve timeout %v must be > 0", c.StoreTimeout, c.RetrieveTimeout)
	case c.Streams < 1 || c.Streams > 1024:
		return bad("%d streams: want 1..1024", c.Streams)
	case c.L2Readers < 1 || c.L2Readers > 256:
		return bad("%d L2 readers per retrieve: want 1..256", c.L2Readers)
	case c.L3Writers < 1 || c.L3Writers > 256:
		return bad("%d L3 writers: want 1..256", c.L3Writers)
	case c.RetrieveBatchBytes == 0:
		return bad("retrieve batch of 0 B: want > 0 (a batch pins at least one slab)")
	case c.RetrievePaceWindow < time.Millisecond || c.RetrievePaceWindow > time.Second:
		return bad("retrieve pace window %v: want 1ms..1s", c.RetrievePaceWindow)
	case c.RetrieveRamp < 0 || c.RetrieveRamp > 8:
		return bad("retrieve ramp of %d doublings: want 0..8", c.RetrieveRamp)
	case c.RetrieveTailRamp < 0 || c.RetrieveTailRamp > 8:
		return bad("retrieve tail ramp of %d halvings: want 0..8", c.RetrieveTailRamp)
	case c.L3QueueObjects < 1:
		return bad("L3 queue of %d objects: want >= 1", c.L3QueueObjects)
	case c.L3Encrypt && c.StorageKey == nil:
		return bad("L3 encryption needs the storage key: its payload keys are derived from it")
	case c.StorageKey != nil && len(c.StorageKey) < tier.MinMACKeyBytes:
		return bad("storage key of %d B: want at least %d B", len(c.StorageKey), tier.MinMACKeyBytes)
	case c.EventBatch < 1 || c.EventBatch > wire.MaxBatchEvents:
		return bad("event batch %d: want 1..%d", c.EventBatch, wire.MaxBatchEvents)
	case c.EventBuffer < c.EventBatch:
		return bad("event buffer %d smaller than one batch of %d", c.EventBuffer, c.EventBatch)
	case len(c.L2SharedWith) > 0 && c.L2Dir == "" && c.L2 == nil:
		return bad("L2 shared with %v, but there is no L2", c.L2SharedWith)
	case len(c.HostL1SharedWith) > 0 && c.HostL1Dir == "":
		return bad("host L1 shared with %v, but L1 is not host-shared (no HostL1Dir)", c.HostL1SharedWith)
	case c.KeepSharedInL1 && len(c.L2SharedWith) == 0:
		return bad("a local L1 copy of shared objects without L2 shared with any instance")
	case len(c.L3SharedWith) > 0 && c.L3 == nil:
		return bad("L3 shared with %v, but there is no L3", c.L3SharedWith)
	case c.Logger == nil || c.Now == nil:
		return bad("logger and clock must be set (DefaultConfig sets zap.NewNop and time.Now)")
	}
	for _, inst := range c.L2SharedWith {
		if err := wire.ValidInstance(inst); err != nil || inst == c.Rank.Instance {
			return bad("L2 shared with instance %q: want another instance's name of 1..64 characters of [A-Za-z0-9_-]", inst)
		}
	}
	for _, inst := range c.HostL1SharedWith {
		if err := wire.ValidInstance(inst); err != nil || inst == c.Rank.Instance {
			return bad("host L1 shared with instance %q: want another instance's name of 1..64 characters of [A-Za-z0-9_-]", inst)
		}
	}
	for _, inst := range c.L3SharedWith {
		if err := wire.ValidInstance(inst); err != nil || inst == c.Rank.Instance {
			return bad("L3 shared with instance %q: want another instance's name of 1..64 characters of [A-Za-z0-9_-]", inst)
		}
	}
	return nil
}

// SlabFor returns a slab size for an L1 of l1Bytes that keeps the slab
// count near 16,384 (placement scans are linear in it) while wasting at
// most one slab per object: a power of two between 4 KiB and 1 MiB.
func SlabFor(l1Bytes uint64) uint64 {
	s := uint64(4096)
	for s < 1<<20 && l1Bytes/s > 16384 {
		s *= 2
	}
	return s
}
