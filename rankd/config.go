package rankd

import (
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/internal/numa"
	"github.com/kvtier/kvtier/objstore"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// maxEventWindow bounds Config.EventWindow: the engine's default event
// buffer holds 1024 full batches (1<<20 events of 1024), so a larger window
// could never fill.
const maxEventWindow = 1024

// Config configures one rankd. Build it from DefaultConfig(rank), set
// TPSize and Join, then pass it to New, which validates exactly what it is
// given: a zero value means zero (STYLE 23), never "the default".
type Config struct {
	// wrapDevice, in tests only, wraps the device the transfer engine
	// uses (a fault seam: streams that stall or fail); nil in production.
	wrapDevice func(cuda.Device) cuda.Device

	// Rank is the engine instance and TP rank this daemon serves. Required;
	// the instance is 1..64 characters of [A-Za-z0-9_-].
	Rank wire.Rank
	// TPSize is the engine's tensor-parallel size. Required (>= 1).
	TPSize int
	// DCPSize is the engine's decode-context-parallel size, gossiped in the
	// member metadata (it must divide TPSize). Default 1. It does not change
	// what is stored: the registered spec decides that.
	DCPSize int

	// Device names the device: "auto" (CUDA device 0 if a driver and device
	// exist, else the host backend), "host", "cuda:N" or a "GPU-..." UUID.
	// Default "auto".
	Device string
	// Host configures the host backend when Device selects it. Its Dir must
	// be the one the engine's host backend uses. Default
	// cuda.DefaultHostConfig() (/dev/shm/kvtier-<uid>, private 0700).
	Host cuda.HostConfig
	// CopyPath is how the device moves a store's and a restore's bytes:
	// "auto" (default: the copy engine for page runs averaging 256 KiB or
	// more where the driver batches copies, the copy kernels otherwise),
	// "sm" (the kernels), "sm-direct" / "sm-staged" (the kernels in one
	// mode: on the mapped L1 buffer, or through device staging by the copy
	// engine; the CUDA backend only) or "dma" (copy-engine copies of the
	// page runs and a checksum kernel over the device pages, fewer
	// multiprocessors held from the model; docs/gpu.md). Verification is
	// the same on every path.
	CopyPath string
	// DMA shapes the copy engine path's work (cuda.DMATuning: the
	// checksum batch, the bytes of copies in flight). Default
	// cuda.DefaultDMATuning() (1 GiB batches: one checksum kernel per
	// restore batch; no bound).
	DMA cuda.DMATuning

	// L1Bytes is the pinned host memory of L1. Default 1 GiB. More holds
	// more hot objects; it is pinned (unswappable) RAM.
	L1Bytes uint64
	// L1SlabBytes is L1's allocation unit (transfer.Config.L1SlabBytes):
	// an object takes whole slabs, so one smaller than a slab wastes the
	// rest of it (64 KiB objects in the 128 KiB slabs of a 2 GiB L1: half
	// of L1; 256 KiB objects, a 16-token chunk of an 8B model on TP8, in
	// the 1 MiB slabs of a 64 GiB L1: three quarters). 0, the default:
	// transfer.SlabFor(L1Bytes) (about 16,384 slabs, 4 KiB..1 MiB). Set it
	// to the rank's object size or a divisor of it (docs/gpu.md, "L1
	// slabs").
	L1SlabBytes uint64
	// HostL1Dir makes L1 host-shared (transfer.Config.HostL1Dir): L1 lives
	// in a shared-memory segment in this private (0700) directory, and the
	// rankds of the same instance on this host given the same directory
	// restore each other's L1 objects straight from it (MLA is then held
	// once per host, and write-back serves TP readers). The coordinator
	// plans such reads with --host-shared-l1. Default "": private L1.
	HostL1Dir string
	// HostL1SharedWith names the other instances of this instance's share
	// group whose rankds on this host keep their L1 in the same HostL1Dir:
	// a retrieve reads their segments after those of its own instance,
	// before L2 (transfer.Config.HostL1SharedWith; the coordinator plans
	// them with --share-host-l1). Needs HostL1Dir. Default nil.
	HostL1SharedWith []string
	// L1NUMA places L1's pages on a NUMA node (transfer.Config.L1NUMA;
	// docs/gpu.md, "Multi-GPU hosts: L1 near the GPU"): "auto" binds them
	// to the GPU's node when sysfs knows it and the host has more than one
	// node, "off" leaves them where the kernel puts them, a node number
	// binds them to that node (refused at start when the host has none).
	// Default "auto"; "" is refused.
	L1NUMA string
	// L2Dir is the root of the L2 file tier, shared by the ranks of one
	// engine instance. Default "": no L2, and nothing survives a restart.
	L2Dir string
	// L2Policy is transfer.WriteThrough (default) or
	// transfer.WriteBackOnEvict.
	L2Policy transfer.L2Policy
	// L2Bytes bounds the bytes (header and payload) of the L2 files this
	// rank writes; least recently used objects are evicted to stay under
	// it, each announced to the coordinator as a removal
	// (transfer.Config.L2Bytes). Default 0: unbounded. Smaller keeps the
	// disk in check at the cost of more prompts recomputed.
	L2Bytes uint64
	// L2FreeFloorBytes and L2FreeFloorPercent make L2 writes evict this
	// rank's least recently used objects while the L2 file system would
	// have less free space than the larger of L2FreeFloorBytes and
	// L2FreeFloorPercent % of its size (taken at start:
	// transfer.Config.L2FreeFloorBytes; l2FreeFloor). Default 1 GiB and
	// 5 %: an unbounded L2 filled a 64 GiB disk, and the coordinator's
	// index on the same disk then failed every batch (BENCHMARKS.md, issue
	// 24). Both 0: no floor.
	L2FreeFloorBytes   uint64
	L2FreeFloorPercent float64
	// L2CollectGrace is the age after which quarantined, temporary and
	// orphaned L2 files are removed (transfer.Config.L2CollectGrace).
	// Default 24 h; longer keeps quarantined files for inspection.
	L2CollectGrace time.Duration
	// L2SharedWith names the other instances of this instance's share
	// group whose rankds write the same L2Dir (docs/sharing.md): a store
	// of an object one of their ranks already wrote there is deduplicated
	// against that file (transfer.Config.L2SharedWith). Default nil.
	L2SharedWith []string
	// KeepSharedInL1 makes a store deduplicated onto a member's L2 file
	// (L2SharedWith) still keep a local L1 copy: gathered, announced in L1
	// only, never written to L2 or L3 (transfer.Config.KeepSharedInL1).
	// Default false: no copy at all.
	KeepSharedInL1 bool
	// L2VerifyOnScan makes the background start-up rescan of L2 also
	// hash every payload this rank wrote (transfer.Config.L2VerifyOnScan).
	// Default false: headers only; every read is verified anyway (C5).
	L2VerifyOnScan bool
	// L3 is the S3-compatible object store behind L2 (issue 15.3;
	// transfer.Config.L3): objects are written behind to it and restored
	// from it when neither L1 nor L2 holds them. Default: Endpoint "", no
	// L3. Credentials come from L3.CredentialsFile only; HTTPS unless
	// L3.Insecure, which is refused off loopback unless L3.InsecureRemote.
	L3 objstore.Config
	// L3Bytes bounds the bytes of the L3 objects this rank wrote
	// (transfer.Config.L3Bytes). Default 0: unbounded (leave expiry to a
	// bucket lifecycle rule).
	L3Bytes uint64
	// L3Encrypt encrypts the payload of the L3 objects this rank writes
	// (AES-256-GCM, keys derived from the storage key per instance and
	// namespace; transfer.Config.L3Encrypt, docs/storage-encryption.md).
	// Needs L3 and the storage key. Default false: payloads in clear.
	// Either format is read whatever the setting.
	L3Encrypt bool
	// L3SharedWith names the other instances of this instance's share
	// group whose L3 objects this rank's retrieves may read, under their
	// prefixes of the same bucket and L3.Prefix (docs/sharing.md;
	// transfer.Config.L3SharedWith): the coordinator plans them with
	// --share-l3. Needs L3. Default nil: only this instance's objects.
	L3SharedWith []string
	// StoreTimeout bounds a store from its request to the commit
	// (transfer.Config.StoreTimeout) and, after a timeout, the further wait
	// for the device to release the engine's blocks before the reply; a
	// reply sent while they are still in use says blocks_in_use and a
	// wire.BlocksFreed message follows (C10). Default 30 s.
	StoreTimeout time.Duration
	// RetrieveSerialBatches: transfer.Config.RetrieveSerialBatches (an
	// ablation for benchmarks). Default false.
	RetrieveSerialBatches bool
	// RetrieveBatchBytes: transfer.Config.RetrieveBatchBytes, the L1 one
	// restore pins at a time, each batch a transfer of its own (at most a
	// quarter of L1 is used). Default 1 GiB; fewer, larger batches launch
	// fewer checksum kernels beside the engine's forward (docs/gpu.md).
	RetrieveBatchBytes uint64
	// RestorePace bounds the rate of every retrieve's copies that does not
	// carry its own (wire.HeaderPace), in bytes per second: 0 (the
	// default) is full speed, else at least transfer.MinPace
	// (transfer.RetrieveRequest.Pace).
	RestorePace uint64
	// RestorePaceWindow: transfer.Config.RetrievePaceWindow, the time a
	// paced restore's batch takes at its pace (each batch goes at full
	// speed, then the restore waits). Default 64 ms; 1 ms to 1 s.
	RestorePaceWindow time.Duration
	// RetrieveRamp: transfer.Config.RetrieveRamp, how many doublings a
	// restore's batches take to reach their bound (fewer: fewer checksum
	// kernels beside the engine, a later first copy). Default 3; 0 to 8.
	RetrieveRamp int
	// RetrieveTailRamp: transfer.Config.RetrieveTailRamp, how many
	// halvings an unpaced restore's last batches take from their bound
	// (more: a smaller checksum after the last copy, more checksum kernels
	// beside the engine). Default 0; 0 to 8.
	RetrieveTailRamp int
	// Streams: transfer.Config.Streams, the device streams for stores and,
	// separately, for restores (each two CUDA streams on a GPU: copies and
	// kernels). Default 8; 1 to 1024.
	Streams int
	// FlushTimeout bounds, at shutdown (SIGTERM), the engine's drain and
	// its flush to L2: under write-back every object only L1 holds is
	// written to L2 before the rankd leaves, with progress in the log;
	// whatever is still unwritten when it expires is counted
	// (kvtier_transfer_lost_objects_total) and logged at Error. It runs
	// apart from ShutdownTimeout, so a graceful shutdown takes at most
	// ShutdownTimeout + FlushTimeout. Default 120 s: about 12 GB at a
	// 100 MB/s disk; raise it for larger L1s on slow L2s.
	FlushTimeout time.Duration

	// Join lists the memberlist seeds (host:port), normally the
	// coordinator's gossip address. Required unless NATSURL is set.
	Join []string
	// NodeName is the memberlist node name. Required; DefaultConfig(rank)
	// sets DefaultNodeName(rank), "rankd-<instance>-<tp rank>".
	NodeName string
	// BindAddr and BindPort are the gossip address. Defaults "0.0.0.0" and
	// DefaultBindPort(rank), 7946 + 1 + TP rank (so the ranks of one host
	// do not collide with each other or with a coordinator on 7946). Port
	// 0 picks a free one.
	BindAddr string
	BindPort int
	// AdvertiseAddr and AdvertisePort are what peers dial, for NAT or
	// multi-homed hosts. Default "" (derived from BindAddr).
	AdvertiseAddr string
	AdvertisePort int
	// Detector tunes the failure detector; it must match the coordinator's.
	// Default cluster.DefaultDetector().
	Detector cluster.DetectorConfig
	// JoinTimeout bounds the initial join and the wait for the coordinator's
	// NATS URL in its member metadata. Default 30 s.
	JoinTimeout time.Duration
	// DuplicateWait is how long Start waits, after joining, for another
	// live member serving the same rank (another incarnation) to be
	// declared dead or to leave before refusing to start with
	// ErrDuplicateRank (issue 18.3). Default 5 s: a few failure-detector
	// rounds, so a replacement started right after its predecessor crashed
	// waits for the death instead of failing; a duplicate of a live rank
	// exits after it, non-zero, naming the live member.
	DuplicateWait time.Duration

	// NATSURL is an explicit NATS URL (comma-separated for a cluster:
	// the rank moves to another when its server dies). Default "": use
	// the URLs every alive coordinator gossips in its member metadata.
	NATSURL string
	// NATSSwitchAfter: with a discovered NATS URL, how long the connection
	// must be down before the daemon moves to other URLs the coordinator
	// gossips (it restarted elsewhere). Default 3 s. Shorter moves sooner;
	// a NATS restart at the old address within it is simply reconnected.
	NATSSwitchAfter time.Duration
	// Prefix is the first token of every NATS subject. Default "kvtier".
	Prefix string

	// CredsDir is the cluster's credentials directory (auth.Init), or a
	// copy holding this rank's seed (rankd-<instance>-<tp>.nk), users.json
	// and, with TLS, ca.pem. The seed authenticates the rank to NATS, where
	// it may publish only its own events, heartbeats and reports (C9);
	// users.json gives the coordinator's public key, which must have signed
	// a gossiped NATS URL before the rank follows it. Required unless
	// Insecure; no default.
	CredsDir string
	// SeedFile overrides the seed's path. Default "" (from CredsDir).
	SeedFile string
	// StorageKeyFile is the storage MAC key file (C12, issue 28.1): the
	// headers of the L2 and L3 objects this rank writes carry a MAC keyed
	// with it, and after a restart the rank announces only the objects
	// whose MAC verifies, so whoever can write the L2 directory or the
	// bucket cannot make a forged sum the recorded one. A regular 0600
	// file of this user (symlinks, group or other access refused), never
	// kept beside the objects. Default "" (CredsDir/storage.key, written
	// by 'coordinator init' or 'coordinator creds storage-key'). With an L2
	// directory or L3 and no key, New refuses to start unless Insecure.
	StorageKeyFile string
	// TLSCA is a PEM CA that verifies the NATS server. Default ""
	// (CredsDir/ca.pem if present).
	TLSCA string
	// CoordinatorKey is the coordinator's public nkey ("U..."). Default ""
	// (the coordinator entry of CredsDir/users.json).
	CoordinatorKey string
	// GossipKey encrypts and authenticates gossip (16, 24 or 32 bytes);
	// GossipSecondaryKeys are accepted during a rotation. Default none.
	// Without a key a rank refuses to gossip off loopback unless Insecure.
	GossipKey           []byte
	GossipSecondaryKeys [][]byte
	// Insecure connects to NATS without credentials, follows any NATS URL
	// a member claiming the coordinator role gossips, and allows plaintext
	// gossip off loopback: anyone on the network can then speak for this
	// rank or move it to their NATS server. Default false; development only.
	Insecure bool

	// HTTPAddr serves /metrics, /healthz and /readyz. Default
	// "127.0.0.1:0" (a free port; the address is logged). "" disables it.
	HTTPAddr string

	// EventAckTimeout bounds one event batch request; on timeout the same
	// batch is sent again (the coordinator ignores duplicates). Default 2 s.
	EventAckTimeout time.Duration
	// HeartbeatInterval is how often the daemon announces its last event
	// sequence to the coordinator (wire.Heartbeat), so events lost in
	// transit are noticed even when the rank is idle: within about two
	// intervals. Default 2 s; shorter notices sooner for a few bytes more.
	HeartbeatInterval time.Duration
	// EventWindow is the most event batches taken from the transfer
	// engine and sent to the coordinator without its acknowledgement yet.
	// Default 8, at most 1024. The engine's event buffer (1<<20 events,
	// transfer.Config.EventBuffer) is the only queue: its bound counts
	// these batches too, and beyond it events are dropped, leaving a
	// sequence gap that makes the coordinator resync from the inventory.
	// Acks come in order; on a timeout or a transient error every batch
	// from the first unacknowledged one is sent again (the coordinator
	// ignores duplicates). 1 sends one batch per round trip; a larger
	// window keeps the coordinator's group commit fed at the cost of more
	// resent batches after an error.
	EventWindow int
	// MaxInFlight bounds engine requests being served at once; beyond it a
	// request gets code unavailable. Default 1024. A store holds its slot
	// while it waits for the engine's producer event.
	MaxInFlight int
	// InventoryPageSize is the objects per inventory page when the
	// coordinator's request names no size (wire.InventoryRequest). Default
	// wire.DefaultInventoryPageSize (4096, about 0.5 MiB of JSON); at most
	// wire.MaxInventoryPageSize. Larger pages mean fewer round trips but
	// must stay under the NATS payload limit (8 MiB).
	InventoryPageSize int
	// InventorySnapshotTTL is how long an inventory snapshot stays
	// available for its later pages after it was taken. Default 30 s. A
	// resync that takes longer fails with code not_found and starts over.
	InventorySnapshotTTL time.Duration
	// MaxInventorySnapshots bounds the snapshots kept at once; taking one
	// more evicts the oldest. Default 4. Each holds a full copy of the
	// inventory.
	MaxInventorySnapshots int
	// ReportTimeout bounds sending one restore report to the coordinator.
	// Default 5 s.
	ReportTimeout time.Duration
	// ShutdownTimeout bounds the graceful part of Shutdown: draining
	// in-flight requests and stores, flushing events, leaving the cluster.
	// Default 30 s.
	ShutdownTimeout time.Duration

	// EngineIdentity returns the authenticated engine identity of the
	// sender of an engine API message; a session belongs to the identity
	// that registered it, and only that identity may store, retrieve or
	// release in it. Default nil: every sender is "engine/<instance>",
	// because only the instance's engine may publish on this rank's
	// engine subjects (NATS permissions, C9), so the subject is the
	// proof. The connection layer sets it when its identities are finer.
	EngineIdentity func(msg *nats.Msg) string

	// Logger receives logs. Required; default zap.NewNop() (no logs).
	Logger *zap.Logger
}

// DefaultConfig returns the Config of rank r with every default filled
// in, those derived from the rank included (NodeName, BindPort); set
// TPSize and Join (or NATSURL). A caller that changes Rank afterwards
// derives them again (DefaultNodeName, DefaultBindPort) or sets its own.
func DefaultConfig(r wire.Rank) Config {
	return Config{
		Rank:                  r,
		DCPSize:               1,
		Device:                cuda.SpecAuto,
		Host:                  cuda.DefaultHostConfig(),
		DMA:                   cuda.DefaultDMATuning(),
		L1Bytes:               1 << 30,
		L1NUMA:                "auto",
		RetrieveBatchBytes:    transfer.DefaultConfig().RetrieveBatchBytes,
		RestorePaceWindow:     transfer.DefaultConfig().RetrievePaceWindow,
		RetrieveRamp:          transfer.DefaultConfig().RetrieveRamp,
		RetrieveTailRamp:      transfer.DefaultConfig().RetrieveTailRamp,
		Streams:               transfer.DefaultConfig().Streams,
		L2Policy:              transfer.WriteThrough,
		L2FreeFloorBytes:      1 << 30,
		L2FreeFloorPercent:    5,
		L2CollectGrace:        24 * time.Hour,
		L3:                    objstore.DefaultConfig(),
		StoreTimeout:          30 * time.Second,
		FlushTimeout:          120 * time.Second,
		BindAddr:              "0.0.0.0",
		NodeName:              DefaultNodeName(r),
		BindPort:              DefaultBindPort(r),
		Detector:              cluster.DefaultDetector(),
		JoinTimeout:           30 * time.Second,
		DuplicateWait:         5 * time.Second,
		NATSSwitchAfter:       3 * time.Second,
		Prefix:                wire.DefaultPrefix,
		HTTPAddr:              "127.0.0.1:0",
		EventAckTimeout:       2 * time.Second,
		HeartbeatInterval:     2 * time.Second,
		EventWindow:           8,
		MaxInFlight:           1024,
		InventoryPageSize:     wire.DefaultInventoryPageSize,
		InventorySnapshotTTL:  30 * time.Second,
		MaxInventorySnapshots: 4,
		ReportTimeout:         5 * time.Second,
		ShutdownTimeout:       30 * time.Second,
		Logger:                zap.NewNop(),
	}
}

// DefaultNodeName is rank r's default memberlist node name,
// "rankd-<instance>-<tp rank>".
func DefaultNodeName(r wire.Rank) string { return fmt.Sprintf("rankd-%s-%d", r.Instance, r.TPRank) }

// DefaultBindPort is rank r's default gossip port, 7946 + 1 + TP rank: the
// ranks of one host collide neither with each other nor with a
// coordinator on 7946.
func DefaultBindPort(r wire.Rank) int { return 7946 + 1 + r.TPRank }

// Validate checks every rule of c; the error names the rule and the numbers.
func (c *Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf(format+": %w", append(args, ErrConfig)...)
	}
	if err := wire.ValidInstance(c.Rank.Instance); err != nil {
		return bad("instance: %v", err)
	}
	switch {
	case c.TPSize < 1 || c.TPSize > 4096:
		return bad("TP size %d: want 1..4096", c.TPSize)
	case c.Rank.TPRank < 0 || c.Rank.TPRank >= c.TPSize:
		return bad("TP rank %d outside 0..%d (TP size %d)", c.Rank.TPRank, c.TPSize-1, c.TPSize)
	case c.DCPSize < 1 || c.TPSize%c.DCPSize != 0:
		return bad("DCP size %d must be >= 1 and divide TP size %d", c.DCPSize, c.TPSize)
	case c.Device == "":
		return bad("device spec is empty (want auto, host, cuda:N or a GPU UUID)")
	case !slices.Contains([]string{"", "auto", "sm", "sm-direct", "sm-staged", "dma"}, c.CopyPath):
		return bad("copy path %q: want auto, sm, sm-direct, sm-staged or dma", c.CopyPath)
	case c.DMA.Validate() != nil:
		return bad("%v", c.DMA.Validate())
	case c.RetrieveBatchBytes == 0:
		return bad("retrieve batch of 0 bytes: a restore pins at least one slab of L1 at a time")
	case c.RestorePace != 0 && c.RestorePace < transfer.MinPace:
		return bad("restore pace of %d B/s: want 0 (full speed) or at least %d B/s", c.RestorePace, transfer.MinPace)
	case c.RestorePaceWindow < time.Millisecond || c.RestorePaceWindow > time.Second:
		return bad("restore pace window %v: want 1ms..1s", c.RestorePaceWindow)
	case c.RetrieveRamp < 0 || c.RetrieveRamp > 8:
		return bad("retrieve ramp of %d doublings: want 0..8", c.RetrieveRamp)
	case c.RetrieveTailRamp < 0 || c.RetrieveTailRamp > 8:
		return bad("retrieve tail ramp of %d halvings: want 0..8", c.RetrieveTailRamp)
	case c.Streams < 1 || c.Streams > 1024:
		return bad("%d streams: want 1..1024", c.Streams)
	case c.L1Bytes < 1<<20:
		return bad("L1 of %d B is below the 1 MiB minimum", c.L1Bytes)
	case c.L1SlabBytes != 0 && (c.L1SlabBytes%4096 != 0 || c.L1SlabBytes > 1<<30 || c.L1SlabBytes > c.L1Bytes):
		return bad("L1 slab of %d B: want 0 (auto) or a multiple of 4096 B up to 1 GiB and the L1's %d B", c.L1SlabBytes, c.L1Bytes)
	case c.L1SlabBytes != 0 && c.L1Bytes/c.L1SlabBytes > 1<<24:
		return bad("L1 of %d B in slabs of %d B is %d slabs, limit %d: use larger slabs", c.L1Bytes, c.L1SlabBytes, c.L1Bytes/c.L1SlabBytes, 1<<24)
	case !validL1NUMA(c.L1NUMA):
		return bad("L1 NUMA placement %q: want auto, off or a node number 0..%d", c.L1NUMA, numa.MaxNode)
	case c.L2Policy != transfer.WriteThrough && c.L2Policy != transfer.WriteBackOnEvict:
		return bad("L2 policy %d: want write-through or write-back", uint8(c.L2Policy))
	case c.L3.Endpoint != "" && c.L3.Validate() != nil:
		return fmt.Errorf("rankd: L3: %w", c.L3.Validate())
	case c.L3Encrypt && c.L3.Endpoint == "":
		return bad("L3 encryption without L3: give --l3-endpoint or drop --l3-encrypt")
	case len(c.HostL1SharedWith) > 0 && c.HostL1Dir == "":
		return bad("host L1 shared with %v without host-shared L1: give --host-l1-dir or drop --host-l1-shared-with", c.HostL1SharedWith)
	case len(c.L3SharedWith) > 0 && c.L3.Endpoint == "":
		return bad("L3 shared with %v without L3: give --l3-endpoint or drop --l3-shared-with", c.L3SharedWith)
	case !(c.L2FreeFloorPercent >= 0 && c.L2FreeFloorPercent < 100):
		return bad("L2 free-space floor of %v %% of the file system: want 0 <= percent < 100", c.L2FreeFloorPercent)
	case c.KeepSharedInL1 && len(c.L2SharedWith) == 0:
		return bad("--keep-shared-in-l1 without --l2-shared-with: no store is deduplicated onto a member's copy")
	case len(c.Join) == 0 && c.NATSURL == "":
		return bad("no memberlist seed to join and no NATS URL: set --join (the coordinator's gossip address)")
	case net.ParseIP(c.BindAddr) == nil:
		return bad("bind address %q must be an IP address", c.BindAddr)
	case c.NodeName == "":
		return bad("node name is empty (DefaultConfig sets rankd-<instance>-<tp rank>)")
	case c.BindPort < 0 || c.BindPort > 65535:
		return bad("bind port %d outside 0..65535", c.BindPort)
	case c.AdvertiseAddr != "" && net.ParseIP(c.AdvertiseAddr) == nil:
		return bad("advertise address %q must be an IP address", c.AdvertiseAddr)
	case c.AdvertisePort < 0 || c.AdvertisePort > 65535:
		return bad("advertise port %d outside 0..65535", c.AdvertisePort)
	case c.Prefix == "" || strings.ContainsAny(c.Prefix, ".*> \t\r\n"):
		return bad("subject prefix %q must be one non-empty NATS token", c.Prefix)
	case c.NATSSwitchAfter <= 0:
		return bad("NATS switch delay %v must be > 0", c.NATSSwitchAfter)
	case c.HeartbeatInterval <= 0:
		return bad("heartbeat interval %v must be > 0", c.HeartbeatInterval)
	case c.DuplicateWait < 0:
		return bad("duplicate wait %v must be >= 0", c.DuplicateWait)
	case c.JoinTimeout <= 0 || c.EventAckTimeout <= 0 || c.ReportTimeout <= 0 || c.ShutdownTimeout <= 0 || c.StoreTimeout <= 0 || c.FlushTimeout <= 0:
		return bad("timeouts must be > 0 (join %v, event ack %v, report %v, shutdown %v, store %v, flush %v)",
			c.JoinTimeout, c.EventAckTimeout, c.ReportTimeout, c.ShutdownTimeout, c.StoreTimeout, c.FlushTimeout)
	case c.EventWindow < 1 || c.EventWindow > maxEventWindow:
		return bad("event window of %d batches: want 1..%d", c.EventWindow, maxEventWindow)
	case c.MaxInFlight < 1:
		return bad("max in-flight requests %d must be >= 1", c.MaxInFlight)
	case c.InventoryPageSize < 1 || c.InventoryPageSize > wire.MaxInventoryPageSize:
		return bad("inventory page size %d outside 1..%d", c.InventoryPageSize, wire.MaxInventoryPageSize)
	case c.InventorySnapshotTTL <= 0:
		return bad("inventory snapshot TTL %v must be > 0", c.InventorySnapshotTTL)
	case c.MaxInventorySnapshots < 1:
		return bad("max inventory snapshots %d must be >= 1", c.MaxInventorySnapshots)
	case c.Logger == nil:
		return bad("no logger (zap.NewNop() for none)")
	}
	for i, s := range c.Join {
		if _, _, err := net.SplitHostPort(s); err != nil {
			return bad("seed %d %q must be host:port", i, s)
		}
	}
	if c.NATSURL != "" {
		for _, u := range strings.Split(c.NATSURL, ",") {
			p, err := url.Parse(strings.TrimSpace(u))
			if err != nil || p.Host == "" {
				return bad("NATS URL %q must be scheme://host:port", u)
			}
		}
	}
	if c.HTTPAddr != "" {
		if _, _, err := net.SplitHostPort(c.HTTPAddr); err != nil {
			return bad("HTTP address %q must be host:port", c.HTTPAddr)
		}
	}
	if !c.Insecure && c.CredsDir == "" && c.SeedFile == "" {
		return bad("no NATS credentials: authentication is on by default (C9); give --creds-dir (from 'coordinator init') or run insecure")
	}
	if !c.Insecure && c.NATSURL == "" && c.CredsDir == "" && c.CoordinatorKey == "" {
		return bad("no coordinator key to verify a gossiped NATS URL: give --creds-dir, the coordinator's public key, or --nats")
	}
	if err := c.Detector.Validate(); err != nil {
		return fmt.Errorf("detector: %w", err)
	}
	return nil
}

// validL1NUMA reports whether s is an L1 NUMA placement numa.ParseSpec
// reads.
func validL1NUMA(s string) bool {
	_, err := numa.ParseSpec(s)
	return err == nil
}

// ParseL2Policy parses "write-through" or "write-back".
func ParseL2Policy(s string) (transfer.L2Policy, error) {
	switch s {
	case "write-through":
		return transfer.WriteThrough, nil
	case "write-back", "write-back-on-evict":
		return transfer.WriteBackOnEvict, nil
	}
	return 0, fmt.Errorf("L2 policy %q: want write-through or write-back: %w", s, ErrConfig)
}
