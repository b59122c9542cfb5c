package coordinator

import (
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/wire"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Config configures one coordinator. Build it from DefaultConfig, set
// DataDir, then pass it to New, which validates it.
type Config struct {
	// DataDir holds the bbolt index file (IndexFile inside it). Created with
	// mode 0700 if missing. Required; no default. Put it on a local disk with
	// working fsync: every acknowledged event is committed there first (C7).
	DataDir string
	// RebuildIndex recovers from a damaged index (issue 15.2): when the
	// index in DataDir fails to open or verify, Start renames it aside
	// (IndexFile + ".damaged-<UTC time>", never deleted), starts with an
	// empty index and asks every live rankd for its inventory (the resync
	// path), so the placements come back from the ranks; ranks that join
	// later resync on their first event or second heartbeat. Namespace
	// specs come back when engines register again. A healthy index is
	// kept as it is, so the flag is safe to leave set. Default false: a
	// damaged index refuses the start (ErrCorruptIndex). Refused together
	// with replicated mode (Raft.ID set): a replica rebuilt from the
	// inventories would diverge from the raft log.
	RebuildIndex bool

	// NATSURL, when set, is an external NATS cluster (comma-separated URLs);
	// no NATS server is embedded then. Default "" (embed one, configured by
	// Embedded). External NATS is for deployments that outgrow one machine
	// or want NATS to outlive a coordinator restart.
	NATSURL string
	// Embedded configures the embedded NATS server when NATSURL is empty.
	// Default bus.DefaultEmbeddedConfig(): 127.0.0.1:4222. Use host 0.0.0.0
	// when rankds run on other hosts; port 0 picks a free port (tests).
	Embedded bus.EmbeddedConfig
	// CredsDir is the cluster's credentials directory (auth.Init): the
	// embedded server accepts exactly the users of its users file, each
	// with its role's permissions (C9), and the coordinator connects as
	// the coordinator identity with its seed (also to an external NATS).
	// A server certificate there (auth.ServerCertFile, auth.ServerKeyFile)
	// turns on TLS. Required unless Insecure; no default.
	CredsDir string
	// Insecure runs without authentication: no users on the embedded
	// server, no credentials for the coordinator's connection, and the
	// unscoped coordinator subjects of clients from before C9 are served.
	// Anyone who reaches the NATS port can then read every plan and forge
	// any rank's events and reports. Default false; for development only
	// (logged as a warning at Start).
	Insecure bool
	// Prefix is the first token of every NATS subject (wire.Subjects), so
	// several kvtier clusters can share one NATS deployment. Default
	// "kvtier".
	Prefix string

	// Cluster configures the memberlist member: bind/advertise addresses,
	// seeds, gossip encryption key, failure detector. Default
	// cluster.DefaultConfig() with NodeName "coordinator-<host>". Meta is
	// filled in by New (role coordinator, the signed NATS client URLs, the
	// index id); whatever the caller sets there is ignored. Logger and
	// Registerer default to this Config's.
	Cluster cluster.Config
	// JoinTimeout bounds the initial join to Cluster.Seeds. Default 10 s.
	// A coordinator that reaches no seed in that time logs an error and
	// serves as a cluster of one (rankds rejoin their seeds, which include
	// it, whenever they see no live coordinator); with no seeds it is the
	// first member. Longer rides out a slow seed; shorter starts sooner.
	JoinTimeout time.Duration
	// LeaveTimeout bounds the graceful leave at Shutdown. Default 2 s.
	// Longer gives the leave more chances to reach the ranks; the ranks
	// declare the coordinator dead on their own if it never arrives.
	LeaveTimeout time.Duration

	// StartupFenceGrace is how long after Start the coordinator waits for
	// the ranks to (re)join before it fences the L1 placements of every
	// rank whose incarnation is not alive in the cluster: ranks that died
	// while the coordinator was down, which memberlist will never report.
	// Default 10 s; 0 disables. It must exceed the time live rankds take to
	// rejoin a restarted coordinator (rankd rejoins its seeds every 500 ms
	// once the old coordinator is declared dead: about 2 s); too short fences
	// live ranks, which then resync from their inventories (safe, costly);
	// too long serves dead ranks' L1 copies longer (restores from them fail
	// at their deadline and are recomputed: safe, slow). It also switches
	// on the same inference for restore.begin: once it has passed, a reader
	// rank the index knows but memberlist never showed counts as not alive
	// and nothing is planned; with 0, absence alone never refuses a
	// restore (see "Reader liveness" in restore.go).
	StartupFenceGrace time.Duration
	// Death says how a gossip death or leave of a rankd is confirmed over
	// the rank's own NATS channel before it is acted on (deaths.go):
	// gossip alone fences nothing. Default DefaultDeathConfig().
	Death DeathConfig

	// HTTPAddr serves /metrics (Prometheus) and /healthz. Default
	// "127.0.0.1:9470"; "" disables the listener; port 0 picks a free one.
	HTTPAddr string

	// RestoreDeadline is how long a restore waits for the reports of every
	// expected rank when RestoreBegin gives no deadline; at the deadline the
	// silent ranks' chunks fail. Default 5 s. Shorter fails slow ranks
	// sooner (the engine recomputes); longer lets a loaded rank finish
	// reading from L2.
	RestoreDeadline time.Duration
	// MaxRestoreDeadline caps a deadline asked for in RestoreBegin. Default
	// 60 s. It bounds how long a restore's state can be held.
	MaxRestoreDeadline time.Duration
	// MaxActiveRestores bounds restores begun and not yet decided; a begin
	// beyond it is refused with code unavailable. Default 65536. Each costs
	// its plan's size in memory until its verdict.
	MaxActiveRestores int
	// VerdictHistory is how many final verdicts are kept for admin queries
	// and, per engine instance, for late waits. Default 1024. Each costs a
	// few hundred bytes plus its failed chunk list.
	VerdictHistory int

	// ResyncTimeout bounds one inventory page request to a rank (the first
	// one also takes the rank's snapshot). Default 10 s; an inventory of
	// millions of objects takes a while to build.
	ResyncTimeout time.Duration
	// ResyncWindow is the inventory page requests a resync keeps in flight
	// to the rank (pages are still taken in order; the first failed one
	// fails the attempt). Default bus.DefaultInventoryWindow (8); 1 fetches
	// page after page. More hides more round trips and holds more pages
	// in memory at once (about 170 KiB each in binary).
	ResyncWindow int
	// ResyncBackoff is the pause after the first failed inventory request;
	// it doubles per failure up to ResyncMaxBackoff, each pause a random
	// point in the upper half of its step (bus.Backoff). Default 100 ms.
	ResyncBackoff time.Duration
	// ResyncMaxBackoff caps the pause between inventory requests. Default
	// 5 s.
	ResyncMaxBackoff time.Duration
	// ResyncAttempts bounds the inventory requests of one resync; after the
	// last failure the resync is counted as failed and logged, and the
	// rank's next batch starts a new one. Default 10.
	ResyncAttempts int

	// Limits for a hostile or broken sender (limits.go, C9). Each refusal
	// is counted in kvtier_coord_refused_total by rule.
	//
	// MaxIncarnationSkew is how far ahead of this coordinator's clock a
	// rank's incarnation (its start time in Unix nanoseconds) may be.
	// Default 10 min. Larger tolerates worse clocks; an incarnation far in
	// the future would supersede every real restart of the rank until it
	// is reset (`coordinator rank reset`).
	MaxIncarnationSkew time.Duration
	// RequireMemberIncarnation refuses (code unavailable, so the rankd
	// retries) a batch that introduces a new incarnation of a rank until
	// memberlist shows that incarnation alive. Default true. Off, anyone
	// who can publish a rank's events can supersede it; on, a coordinator
	// driven over NATS alone (tests, no memberlist) accepts no new rank.
	RequireMemberIncarnation bool
	// MaxRanks caps the ranks the index holds; a batch of a new rank beyond
	// it is refused. Default 4096 (512 TP8 engines). Each rank costs a few
	// hundred bytes plus its placements.
	MaxRanks int
	// MaxInstances caps the engine instances the index holds. Default 512.
	MaxInstances int
	// MaxNamespaces caps the namespaces: a registration or a Stored event
	// into a new namespace beyond it is refused. Default 1024 (models x
	// salts x layouts in one fleet).
	MaxNamespaces int
	// MaxInventoryPages and MaxInventoryObjects bound one rank's inventory
	// during a resync; a larger one fails the resync (counted). Defaults
	// 8192 pages and 16777216 objects (16 Mi objects of >= 1 KiB is more
	// than a rank's L1 and L2 together). Each object costs about 150 B in
	// memory while the inventory is applied.
	MaxInventoryPages   int
	MaxInventoryObjects int
	// MaxPlacementsPerRank caps the placements (copies in any tier) the
	// index holds for one rank (budget.go, issue 28.3): a batch that would
	// take its rank past it is refused whole (code bad_request, naming
	// the rank, the count and the budget), and so is an inventory larger
	// than it. A rank whose heartbeats declare its capacity
	// (wire.Capacity) is held to the lower of this and that capacity over
	// the smallest object of any registered namespace. Default 1048576 (1
	// Mi: 4 TiB of a TP8 rank's 4 MiB shards of 256-token chunks at 8B
	// geometry; a rank stored 2 M invented placements in the attack of
	// issue 28.3). Each placement costs the coordinator about 350 B of
	// memory and the index file about 30 B, so this is what one rankd
	// credential can make it hold (~350 MiB by default); MaxRanks times it
	// bounds the fleet. Raise it for ranks that hold more objects. Must
	// be >= 1.
	MaxPlacementsPerRank int
	// EventRatePerRank and EventBurstPerRank bound how fast one rank's
	// events are taken (a token bucket per rank, one token per event of
	// a batch): a batch over the rate is refused with code unavailable
	// and a retry hint, and the rank sends it again. Defaults 2,000,000
	// events/s and 2,000,000: above the fastest ingest measured of one
	// rank (the index's committer takes 0.7-1.9 M events/s in all), so
	// they bound a runaway or hostile rank's churn, not a healthy one.
	// The burst must be >= wire.MaxBatchEvents (65536): a full batch must
	// be able to pass.
	EventRatePerRank  float64
	EventBurstPerRank int
	// MaxConcurrentResyncs bounds the resyncs running at once; one more is
	// dropped and counted, and the rank's next batch or heartbeat asks
	// again. Default 64. Each holds one inventory in memory.
	MaxConcurrentResyncs int
	// ResyncRate and ResyncBurst bound how fast resyncs start (a token
	// bucket: ResyncRate per second, up to ResyncBurst at once); one more is
	// dropped and counted like one over MaxConcurrentResyncs. Defaults 50/s
	// and 64: a whole cluster restarting resyncs within seconds, while a
	// rank that keeps asking (gap after gap) costs at most that many
	// inventory fetches a second.
	ResyncRate  float64
	ResyncBurst int
	// MaxActiveRestoresPerInstance caps one engine instance's active
	// restores, so a flood from one leaves MaxActiveRestores minus this for
	// the others. Default 4096; with MaxInstances * this > MaxActiveRestores
	// many flooding instances together can still exhaust the global cap.
	MaxActiveRestoresPerInstance int
	// MaxWaitersPerRestore and MaxWaiters bound parked restore.wait
	// requests (per restore and in all); beyond them a wait is refused with
	// code unavailable. Defaults 64 and 262144. Each costs one message.
	MaxWaitersPerRestore int
	MaxWaiters           int
	// MaxWaitersPerInstance caps the waiters parked on one instance's
	// restores, so one instance cannot take all of MaxWaiters (its
	// MaxActiveRestoresPerInstance restores times MaxWaitersPerRestore
	// reach it by default) and leave every other instance's waits refused.
	// Default 65536: a worker parks one wait per rank, so a TP8 instance's
	// 4096 restores park 32768, twice over. At most MaxWaiters; four
	// instances at the cap still fill the default MaxWaiters.
	MaxWaitersPerInstance int

	// HostSharedL1 plans restores from another rank's L1 of the same
	// instance (index.Config.HostSharedL1): set it when every instance's
	// rankds share a host and run with --host-l1-dir. Default false.
	HostSharedL1 bool

	// ShareGroups puts engine instances that serve the same model with the
	// same layout into share groups (docs/sharing.md): a lookup or restore
	// of a member may read the L2 copies the group's other members stored,
	// so instance B restores what instance A computed. The members' rankds
	// must share one L2 directory (a shared file system): a plan names a
	// file by key, and a reader that cannot see it fails the chunk and the
	// engine recomputes it. Nothing else changes: each reader rank still
	// confirms the sum recorded at store time (C5), a different layout is
	// another namespace (C4), another instance's L1 copies are never
	// planned (nor its L3 copies without ShareL3), and an engine still
	// acts only for its own instance (C9). An
	// instance is in at most one group. Default none: every instance reads
	// only its own copies. The trade-off: the members trust each other's
	// bytes as their own (they are checked against the writer's recorded
	// sum, not recomputed), and each can tell from its hit rate what the
	// others' prompts were, within a cache_salt.
	ShareGroups []ShareGroup
	// ShareL3 also plans the L3 copies of a member's share group, last of
	// all (index.Config.SharedL3): set it when the members' rankds use one
	// bucket and --l3-prefix and each names the others in
	// --l3-shared-with (a rankd refuses to read an instance it was not
	// given, and the chunk is recomputed). Default false. Refused without
	// ShareGroups.
	ShareL3 bool
	// ShareHostL1 also plans the L1 copies of a member's share group,
	// after the L1 copies of the reader's own instance and before any L2
	// copy (index.Config.SharedL1), under the fence rule of HostSharedL1:
	// set it when every member's rankds run on one host with one
	// --host-l1-dir and each names the others in --host-l1-shared-with.
	// Default false. Refused without ShareGroups and HostSharedL1.
	ShareHostL1 bool

	// KVEvents publishes KV events for routers (docs/kvevents.md): per
	// engine instance, on wire.Subjects.KVEvents, which chunks a restore
	// by it could read whole from which medium, in vLLM's KV-events
	// shape. Only the serving coordinator publishes (the raft leader).
	// Default false. KVEventsQueue bounds the changes waiting for the
	// publisher (default 4096); past it the publisher sends a snapshot.
	KVEvents      bool
	KVEventsQueue int

	// IndexMaxFileBytes caps the bbolt index file, in bytes
	// (index.Config.MaxFileBytes): a commit that would grow it further
	// fails, the index refuses writes until the coordinator restarts with
	// more room, and /healthz reports 503. Default 0: no cap (the disk is
	// the cap). A cap turns a full disk into a clear, early failure.
	IndexMaxFileBytes int

	// Raft turns on replicated mode (replicated.go, package replica):
	// several coordinators keep one index through hashicorp/raft. Default
	// DefaultRaftConfig(), with ID "": off, one coordinator, no raft code
	// on any path.
	Raft RaftConfig

	// Logger receives lifecycle and fault logs. Default zap.NewNop().
	Logger *zap.Logger
	// indexOpenHook, when set (tests only), runs in Start just before the
	// index is opened: a test blocks it to hold the coordinator in its
	// opening phase, as a large index would.
	indexOpenHook func()
	// indexAfterCommit, when set (tests only), is the index's AfterCommit
	// seam: a test blocks it to hold commits back (a slow committer).
	indexAfterCommit func()
	// raftBeforeApply, when set (tests only), is the raft node's
	// BeforeApply seam: a test blocks it to hold raft's state machine.
	raftBeforeApply func()
	// heartbeatHook, when set (tests only), runs before each heartbeat
	// is handled: a test blocks it to make heartbeats queue unhandled.
	heartbeatHook func()
	// beginPrepareHook, when set (tests only), runs as a restore.begin
	// starts preparing its plan: a test blocks it to hold a begin there.
	beginPrepareHook func()

	// Registry gets every metric of this coordinator and its cluster member
	// and is what /metrics serves. Default: a new registry per coordinator
	// (so tests can run several in one process).
	Registry *prometheus.Registry
}

// IndexFile is the name of the bbolt file inside DataDir.
const IndexFile = "index.db"

// DefaultConfig returns a Config with every default filled in except
// DataDir.
func DefaultConfig() Config {
	cc := cluster.DefaultConfig()
	cc.NodeName = "coordinator-" + cc.NodeName
	return Config{
		Embedded:           bus.DefaultEmbeddedConfig(),
		Prefix:             "kvtier",
		Cluster:            cc,
		JoinTimeout:        10 * time.Second,
		LeaveTimeout:       2 * time.Second,
		StartupFenceGrace:  10 * time.Second,
		Death:              DefaultDeathConfig(),
		HTTPAddr:           "127.0.0.1:9470",
		RestoreDeadline:    5 * time.Second,
		MaxRestoreDeadline: 60 * time.Second,
		MaxActiveRestores:  65536,
		VerdictHistory:     1024,
		ResyncTimeout:      10 * time.Second,
		ResyncWindow:       bus.DefaultInventoryWindow,
		ResyncBackoff:      100 * time.Millisecond,
		ResyncMaxBackoff:   5 * time.Second,
		ResyncAttempts:     10,

		MaxIncarnationSkew:           10 * time.Minute,
		RequireMemberIncarnation:     true,
		MaxRanks:                     4096,
		MaxInstances:                 512,
		MaxNamespaces:                1024,
		MaxInventoryPages:            8192,
		MaxInventoryObjects:          16 << 20,
		MaxPlacementsPerRank:         1 << 20,
		EventRatePerRank:             2_000_000,
		EventBurstPerRank:            2_000_000,
		MaxConcurrentResyncs:         64,
		ResyncRate:                   50,
		ResyncBurst:                  64,
		MaxActiveRestoresPerInstance: 4096,
		MaxWaitersPerRestore:         64,
		MaxWaiters:                   262144,
		MaxWaitersPerInstance:        65536,
		KVEventsQueue:                4096,
		Raft:                         DefaultRaftConfig(),

		Logger: zap.NewNop(),
	}
}

// Validate checks every rule of the config; the error names the rule and the
// numbers. The cluster member's own rules are checked by cluster.New.
func (c *Config) Validate() error {
	if c.DataDir == "" {
		return fmt.Errorf("data dir must be set: %w", ErrConfig)
	}
	if c.NATSURL != "" {
		for _, u := range strings.Split(c.NATSURL, ",") {
			p, err := url.Parse(strings.TrimSpace(u))
			if err != nil || p.Host == "" {
				return fmt.Errorf("NATS URL %q must be scheme://host:port: %w", u, ErrConfig)
			}
		}
	} else {
		if net.ParseIP(c.Embedded.Host) == nil {
			return fmt.Errorf("embedded NATS host %q must be an IP address: %w", c.Embedded.Host, ErrConfig)
		}
		if c.Embedded.Port < 0 || c.Embedded.Port > 65535 {
			return fmt.Errorf("embedded NATS port %d must be in [0, 65535]: %w", c.Embedded.Port, ErrConfig)
		}
		if c.Embedded.MaxPayload <= 0 {
			return fmt.Errorf("embedded NATS max payload %d B must be > 0: %w", c.Embedded.MaxPayload, ErrConfig)
		}
		if c.Embedded.ReadyTimeout <= 0 {
			return fmt.Errorf("embedded NATS ready timeout %v must be > 0: %w", c.Embedded.ReadyTimeout, ErrConfig)
		}
		// The route credentials come from CredsDir at Start; here only
		// the shape.
		if err := c.Embedded.Cluster.Validate(true); err != nil {
			return fmt.Errorf("%w: %w", err, ErrConfig)
		}
	}
	if c.NATSURL != "" && (c.Embedded.Cluster.Enabled() || len(c.Embedded.Cluster.Routes) > 0) {
		return fmt.Errorf("an external NATS (%s) and an embedded NATS cluster (listen %q, %d routes) exclude each other: %w",
			c.NATSURL, c.Embedded.Cluster.Host, len(c.Embedded.Cluster.Routes), ErrConfig)
	}
	if !c.Insecure && c.CredsDir == "" {
		return fmt.Errorf("no credentials dir: NATS authentication is on by default (C9); make one with 'coordinator init' or run insecure: %w", ErrConfig)
	}
	if c.Prefix == "" || strings.ContainsAny(c.Prefix, ".*> \t\r\n") {
		return fmt.Errorf("subject prefix %q must be one non-empty NATS token (no '.', '*', '>' or spaces): %w", c.Prefix, ErrConfig)
	}
	if c.HTTPAddr != "" {
		if _, _, err := net.SplitHostPort(c.HTTPAddr); err != nil {
			return fmt.Errorf("HTTP address %q must be host:port: %w", c.HTTPAddr, ErrConfig)
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"join timeout", c.JoinTimeout}, {"leave timeout", c.LeaveTimeout},
		{"restore deadline", c.RestoreDeadline}, {"max restore deadline", c.MaxRestoreDeadline},
		{"resync timeout", c.ResyncTimeout}, {"resync backoff", c.ResyncBackoff},
		{"resync max backoff", c.ResyncMaxBackoff},
	} {
		if d.v <= 0 {
			return fmt.Errorf("%s %v must be > 0: %w", d.name, d.v, ErrConfig)
		}
	}
	if c.StartupFenceGrace < 0 {
		return fmt.Errorf("startup fence grace %v must be >= 0: %w", c.StartupFenceGrace, ErrConfig)
	}
	if err := c.Death.Validate(); err != nil {
		return err
	}
	if c.RestoreDeadline > c.MaxRestoreDeadline {
		return fmt.Errorf("restore deadline %v exceeds max restore deadline %v: %w", c.RestoreDeadline, c.MaxRestoreDeadline, ErrConfig)
	}
	if c.ResyncBackoff > c.ResyncMaxBackoff {
		return fmt.Errorf("resync backoff %v exceeds resync max backoff %v: %w", c.ResyncBackoff, c.ResyncMaxBackoff, ErrConfig)
	}
	if c.MaxActiveRestores < 1 {
		return fmt.Errorf("max active restores %d must be >= 1: %w", c.MaxActiveRestores, ErrConfig)
	}
	if c.VerdictHistory < 1 {
		return fmt.Errorf("verdict history %d must be >= 1: %w", c.VerdictHistory, ErrConfig)
	}
	if c.ResyncAttempts < 1 {
		return fmt.Errorf("resync attempts %d must be >= 1: %w", c.ResyncAttempts, ErrConfig)
	}
	if c.MaxIncarnationSkew < 0 {
		return fmt.Errorf("max incarnation skew %v must be >= 0: %w", c.MaxIncarnationSkew, ErrConfig)
	}
	for _, v := range []struct {
		name string
		v    int
	}{
		{"max ranks", c.MaxRanks}, {"max instances", c.MaxInstances}, {"max namespaces", c.MaxNamespaces},
		{"max inventory pages", c.MaxInventoryPages}, {"max inventory objects", c.MaxInventoryObjects},
		{"max placements per rank", c.MaxPlacementsPerRank},
		{"max concurrent resyncs", c.MaxConcurrentResyncs}, {"resync burst", c.ResyncBurst}, {"resync window", c.ResyncWindow},
		{"max active restores per instance", c.MaxActiveRestoresPerInstance},
		{"max waiters per restore", c.MaxWaitersPerRestore}, {"max waiters", c.MaxWaiters},
		{"max waiters per instance", c.MaxWaitersPerInstance},
	} {
		if v.v < 1 {
			return fmt.Errorf("%s %d must be >= 1: %w", v.name, v.v, ErrConfig)
		}
	}
	if !(c.ResyncRate > 0) {
		return fmt.Errorf("resync rate %v per second must be > 0: %w", c.ResyncRate, ErrConfig)
	}
	if !(c.EventRatePerRank > 0) {
		return fmt.Errorf("event rate per rank %v per second must be > 0: %w", c.EventRatePerRank, ErrConfig)
	}
	if c.EventBurstPerRank < wire.MaxBatchEvents {
		return fmt.Errorf("event burst per rank %d must be >= %d, the events of one batch (wire.MaxBatchEvents): %w",
			c.EventBurstPerRank, wire.MaxBatchEvents, ErrConfig)
	}
	if c.MaxActiveRestoresPerInstance > c.MaxActiveRestores {
		return fmt.Errorf("max active restores per instance %d exceeds max active restores %d: %w",
			c.MaxActiveRestoresPerInstance, c.MaxActiveRestores, ErrConfig)
	}
	if c.MaxWaitersPerInstance > c.MaxWaiters {
		return fmt.Errorf("max waiters per instance %d exceeds max waiters %d: %w", c.MaxWaitersPerInstance, c.MaxWaiters, ErrConfig)
	}
	if c.KVEvents && c.KVEventsQueue < 1 {
		return fmt.Errorf("KV events queue %d must be >= 1: %w", c.KVEventsQueue, ErrConfig)
	}
	if c.IndexMaxFileBytes < 0 {
		return fmt.Errorf("index max file bytes %d must be >= 0 (0: no cap): %w", c.IndexMaxFileBytes, ErrConfig)
	}
	if err := validateShareGroups(c.ShareGroups); err != nil {
		return err
	}
	if c.ShareL3 && len(c.ShareGroups) == 0 {
		return fmt.Errorf("share L3 without a share group: %w", ErrConfig)
	}
	if c.ShareHostL1 && (len(c.ShareGroups) == 0 || !c.HostSharedL1) {
		return fmt.Errorf("share host L1 needs a share group and host-shared L1: %w", ErrConfig)
	}
	if err := c.Raft.Validate(); err != nil {
		return err
	}
	if c.RebuildIndex && c.Raft.Enabled() {
		return fmt.Errorf("--rebuild-index is for a single coordinator: in replicated mode (raft id %q) a replica rebuilt from the ranks' inventories would diverge from the raft log: %w",
			c.Raft.ID, ErrConfig)
	}
	if c.Logger == nil {
		return fmt.Errorf("logger must be set (zap.NewNop() for none): %w", ErrConfig)
	}
	return nil
}
