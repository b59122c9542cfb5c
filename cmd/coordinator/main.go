// Command coordinator makes a cluster's credentials (init, creds), runs the
// kvtier coordinator (serve) and queries a running one (members, ranks,
// object, namespaces, restores, verify).
//
//	coordinator init --dir D [--instance engine0 --tp-size 4 ...] [--tls-host IP,...] [--raft-ids c1,c2,c3] [--nats-conf FILE]
//	coordinator creds add --dir D --instance I --tp-size N
//	coordinator creds rotate --dir D --name IDENTITY
//	coordinator creds storage-key --dir D   (adds storage.key to a directory made without it)
//	coordinator creds tls --dir D --host IP,...   (adds the cluster CA and a NATS server certificate)
//	coordinator creds raft-cert --dir D --id ID [--id ID ...] [--replace]   (raft peer certificates)
//	coordinator serve --data-dir /var/lib/kvtier --creds-dir D [--nats URL | --nats-host H --nats-port P]
//	                  [--bind IP:PORT] [--advertise IP[:PORT]] [--join SEED,...] [--gossip-key-file F]
//	                  [--http ADDR] [--prefix P] [--log-level info] [--config FILE] [--insecure]
//	                  [--raft-id ID --raft-bind H:P --raft-dir D --raft-peers id=H:P,... [--raft-bootstrap]]
//	                  [--raft-cert F --raft-cert-key F --raft-ca F]
//	coordinator raft add-voter|remove-server --id ID [--addr H:P] [--nats URL] [--creds-dir D]
//	coordinator members|ranks|namespaces|restores|verify [--nats URL] [--creds-dir D] [--prefix P] [--json]
//	coordinator object [--nats URL] [--prefix P] [--json] --key KEY
//	coordinator object ... --spec-file SPEC.json [--model M] --tokens FILE [--instance I]
//	coordinator object ... --namespace NS --chunks HASH,HASH,... [--instance I]
//
// serve shuts down gracefully on SIGTERM or SIGINT (see
// coordinator.Coordinator.Shutdown for the order) and reloads the users
// file of --creds-dir on SIGHUP (new identities, rotated keys).
package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/coordinator"
	"github.com/kvtier/kvtier/coordinator/admin"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/cpuprof"
	"github.com/kvtier/kvtier/internal/flagfile"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// Exit codes.
const (
	exitOK    = 0
	exitFail  = 1 // an error, or verify found a mismatch
	exitUsage = 2
)

const usage = `usage: coordinator <command> [flags]

commands:
  init        make a new cluster's credentials directory (nkeys, users file, gossip key, storage MAC key, TLS)
  creds       add an instance's identities (creds add), rotate one key (creds rotate), add a
              storage MAC key (creds storage-key) or the CA and NATS certificate (creds tls) to a
              directory made without one, issue raft peer certificates (creds raft-cert)
  serve       run the coordinator
  members     memberlist members: name, role, state, address, incarnation; and in a
              replicated cluster every coordinator's raft role, term, commit and applied index
  ranks       ranks: incarnation, liveness, L1/L2 objects and bytes, last seq, fenced
  object      placements of one object (--key) or of a token chain's objects
  namespaces  registered namespaces and their usage
  restores    recent restore verdicts
  verify      re-derive the index from bbolt and compare (exit 1 on mismatch)
  raft add-voter --id ID --addr HOST:PORT | raft remove-server --id ID
              change a replicated cluster's voters (admin-write, answered by the leader)
  rank reset <instance>/<tp>
              forget a rank's incarnation and placements (undoes an implausible
              incarnation); the rank's real incarnation resyncs

run "coordinator <command> -h" for its flags.
`

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	cmd, args := args[0], args[1:]
	switch cmd {
	case "serve":
		return serve(ctx, args, stderr)
	case "init":
		return initCreds(args, stdout, stderr)
	case "creds":
		return creds(args, stdout, stderr)
	case wire.AdminMembers, wire.AdminRanks, wire.AdminNamespaces, wire.AdminRestores, wire.AdminVerify, wire.AdminObject:
		return adminQuery(ctx, cmd, args, stdout, stderr)
	case "raft":
		return raftChange(ctx, args, stdout, stderr)
	case "rank":
		if len(args) == 0 || args[0] != "reset" {
			fmt.Fprintf(stderr, "usage: coordinator rank reset [flags] <instance>/<tp>\n")
			return exitUsage
		}
		return rankReset(ctx, args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	}
	fmt.Fprintf(stderr, "unknown command %q\n\n%s", cmd, usage)
	return exitUsage
}

// serve parses the serve flags into a coordinator.Config (parseServe),
// runs the coordinator until ctx ends (a signal) and shuts it down
// (runServe): cmd/rankd's main has the same shape.
func serve(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg, opts, err := parseServe(fs, args)
	if err == nil {
		err = runServe(ctx, cfg, opts)
	}
	var ue usageError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errFlags):
		return exitUsage // the flag set printed why
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "serve: %v\n", err)
		return exitUsage
	}
	fmt.Fprintf(stderr, "serve: %v\n", err)
	return exitFail
}

// serveOptions are the serve command line's settings that are not the
// coordinator's.
type serveOptions struct {
	cpuProfile string // write a CPU profile of the whole run here
	cpuHz      int    // its sampling rate (0: the runtime's 100 Hz)
	waitProf   string // write where goroutines waited to this path + .block / .mutex
}

// errFlags: the flags did not parse; the flag set has said why.
var errFlags = errors.New("bad flags")

// usageError is a flag value or config that was refused (exit 2).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// parseServe parses args (a --config file first, the command line over
// it) on fs into a coordinator.Config with its logger.
func parseServe(fs *flag.FlagSet, args []string) (coordinator.Config, serveOptions, error) {
	cfg := coordinator.DefaultConfig()
	var opts serveOptions
	fs.StringVar(&opts.cpuProfile, "cpu-profile", "", "write a CPU profile of the whole run to this file (benchmarks)")
	fs.StringVar(&opts.waitProf, "wait-profile", "", "write where goroutines waited over the whole run (Go's block and mutex profiles) to this path + .block and .mutex (benchmarks)")
	fs.IntVar(&opts.cpuHz, "cpu-profile-hz", 0, "--cpu-profile's samples per second of CPU (0: the Go runtime's 100; up to 10000, for stages of a millisecond). The kernel's timer tick caps the real rate (250 Hz on some kernels): the log line at exit says how much of the CPU time the profile holds")
	fs.StringVar(&cfg.DataDir, "data-dir", "", "directory of the bbolt index (required)")
	fs.BoolVar(&cfg.RebuildIndex, "rebuild-index", false, "if the index fails to open or verify, rename it aside (index.db.damaged-<time>), start empty and refill it from every rank's inventory; a healthy index is kept")
	fs.StringVar(&cfg.NATSURL, "nats", "", "external NATS URL(s), comma-separated; empty embeds a NATS server")
	fs.StringVar(&cfg.Embedded.Host, "nats-host", cfg.Embedded.Host, "embedded NATS listen IP (0.0.0.0 for rankds on other hosts)")
	fs.IntVar(&cfg.Embedded.Port, "nats-port", cfg.Embedded.Port, "embedded NATS client port (0 picks one)")
	natsCluster := fs.String("nats-cluster", "", "embedded NATS route listen IP:PORT: join the embedded servers of several coordinators into one NATS cluster (empty: a single server)")
	natsRoutes := fs.String("nats-routes", "", "the other coordinators' NATS route URLs, comma-separated nats-route://IP:PORT (credentials come from <creds-dir>/route.secret)")
	fs.StringVar(&cfg.Embedded.Cluster.Name, "nats-cluster-name", cfg.Embedded.Cluster.Name, "NATS cluster name, the same on every coordinator")
	bind := fs.String("bind", net.JoinHostPort(cfg.Cluster.BindAddr, strconv.Itoa(cfg.Cluster.BindPort)), "memberlist gossip bind IP:PORT")
	advertise := fs.String("advertise", "", "memberlist address others reach this node at, IP[:PORT] (default: derived from --bind)")
	join := fs.String("join", "", "memberlist seeds, comma-separated host:port (empty: start a new cluster)")
	gossipKey := fs.String("gossip-key", "", "base64 AES key (16, 24 or 32 bytes) encrypting gossip; prefer --gossip-key-file (a flag shows in ps)")
	gossipKeyFile := fs.String("gossip-key-file", "", "gossip key file (0600; one base64 key per line, the first is sent with; default <creds-dir>/gossip.key if present)")
	fs.StringVar(&cfg.CredsDir, "creds-dir", "", "credentials directory from 'coordinator init' (required unless --insecure)")
	fs.BoolVar(&cfg.Insecure, "insecure", false, "DEVELOPMENT ONLY: NATS without authentication and gossip without a key off loopback; anyone on the network can forge COMPLETE verdicts")
	fs.StringVar(&cfg.Cluster.NodeName, "node-name", cfg.Cluster.NodeName, "memberlist node name")
	fs.StringVar(&cfg.HTTPAddr, "http", cfg.HTTPAddr, "HTTP address for /metrics and /healthz (empty disables)")
	fs.StringVar(&cfg.Prefix, "prefix", cfg.Prefix, "NATS subject prefix")
	fs.DurationVar(&cfg.RestoreDeadline, "restore-deadline", cfg.RestoreDeadline, "default restore deadline")
	fs.IntVar(&cfg.VerdictHistory, "verdict-history", cfg.VerdictHistory, "restore verdicts kept for admin queries (the newest), and per engine instance for late restore.wait requests")
	fs.DurationVar(&cfg.MaxIncarnationSkew, "max-incarnation-skew", cfg.MaxIncarnationSkew, "refuse rank incarnations further ahead of this clock")
	fs.BoolVar(&cfg.RequireMemberIncarnation, "require-member-incarnation", cfg.RequireMemberIncarnation, "accept a new rank incarnation only once memberlist shows it alive")
	fs.IntVar(&cfg.Death.ConfirmBeats, "death-confirm-beats", cfg.Death.ConfirmBeats, "a gossip death of a rank still connected to NATS is acted on only after this many of its heartbeat intervals without a heartbeat")
	fs.DurationVar(&cfg.Death.AssumedInterval, "death-assumed-interval", cfg.Death.AssumedInterval, "heartbeat interval assumed for a rank that announces none")
	fs.IntVar(&cfg.MaxRanks, "max-ranks", cfg.MaxRanks, "ranks the index may hold")
	fs.IntVar(&cfg.MaxPlacementsPerRank, "max-placements-per-rank", cfg.MaxPlacementsPerRank, "placements (copies in any tier) the index may hold for one rank; a rank's declared capacity can only lower it")
	fs.Float64Var(&cfg.EventRatePerRank, "event-rate-per-rank", cfg.EventRatePerRank, "events per second one rank may send (token bucket); over it a batch is refused for now and sent again")
	fs.IntVar(&cfg.EventBurstPerRank, "event-burst-per-rank", cfg.EventBurstPerRank, "events one rank may send at once (>= 65536, one full batch)")
	fs.IntVar(&cfg.MaxActiveRestoresPerInstance, "max-active-restores-per-instance", cfg.MaxActiveRestoresPerInstance, "active restores of one engine instance")
	fs.BoolVar(&cfg.HostSharedL1, "host-shared-l1", cfg.HostSharedL1, "every instance's rankds share a host with --host-l1-dir: plan reads of another rank's L1 (before L2)")
	fs.Var((*shareGroupsFlag)(&cfg.ShareGroups), "share-group", "NAME=INSTANCE,INSTANCE[,...]: a share group (repeatable, or several separated by ';'; docs/sharing.md): each member's restores may read the L2 copies the others stored; their rankds must share one --l2-dir")
	fs.BoolVar(&cfg.ShareHostL1, "share-host-l1", cfg.ShareHostL1, "with --share-group and --host-shared-l1: each member's restores may also read the host-shared L1 copies of the others (after its own instance's L1, before any L2); their rankds must share the host and --host-l1-dir, with --host-l1-shared-with")
	fs.BoolVar(&cfg.ShareL3, "share-l3", cfg.ShareL3, "with --share-group: each member's restores may also read the L3 copies the others stored, last of all; their rankds must use one bucket and --l3-prefix, with --l3-shared-with")
	fs.BoolVar(&cfg.KVEvents, "kv-events", cfg.KVEvents, "publish KV events for routers on <prefix>.kvevents.<instance> (vLLM's KV-events shape, JSON; docs/kvevents.md); the admin identity may subscribe")
	fs.IntVar(&cfg.KVEventsQueue, "kv-events-queue", cfg.KVEventsQueue, "index changes waiting for the KV event publisher; past it the publisher sends a snapshot")
	fs.IntVar(&cfg.IndexMaxFileBytes, "index-max-file-bytes", cfg.IndexMaxFileBytes, "cap on the bbolt index file in bytes (0: none); beyond it the index fails and /healthz is 503")
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn, error")
	// Replicated mode (issue 16): several coordinators, one index, hashicorp/raft.
	fs.StringVar(&cfg.Raft.ID, "raft-id", "", "raft server id of this coordinator; empty runs one coordinator without raft")
	fs.StringVar(&cfg.Raft.Bind, "raft-bind", cfg.Raft.Bind, "raft TCP listen host:port")
	fs.StringVar(&cfg.Raft.Advertise, "raft-advertise", "", "raft address peers reach this node at (default: --raft-bind)")
	fs.StringVar(&cfg.Raft.Dir, "raft-dir", "", "raft log, stable store and snapshots (0700; default <data-dir>/raft)")
	raftPeers := fs.String("raft-peers", "", "initial voters id=host:port,... including this node (with --raft-bootstrap)")
	fs.BoolVar(&cfg.Raft.Bootstrap, "raft-bootstrap", false, "bootstrap a new raft cluster from --raft-peers if this node has no raft state (safe on every node with the same peers)")
	fs.StringVar(&cfg.Raft.CertFile, "raft-cert", "", "this coordinator's raft peer certificate, naming its --raft-id (default <creds-dir>/raft-<raft-id>.pem, from 'creds raft-cert')")
	fs.StringVar(&cfg.Raft.CertKeyFile, "raft-cert-key", "", "the raft certificate's key, 0600 (default <creds-dir>/raft-<raft-id>-key.pem)")
	fs.StringVar(&cfg.Raft.CAFile, "raft-ca", "", "cluster CA that every raft peer's certificate must chain to (default <creds-dir>/ca.pem)")
	raftKeyFile := fs.String("raft-key-file", "", "REMOVED: the raft port is mutual TLS now (--raft-cert); raft.key is no longer read")
	fs.DurationVar(&cfg.Raft.HeartbeatTimeout, "raft-heartbeat-timeout", cfg.Raft.HeartbeatTimeout, "raft heartbeat timeout (failover detection)")
	fs.DurationVar(&cfg.Raft.ElectionTimeout, "raft-election-timeout", cfg.Raft.ElectionTimeout, "raft election timeout")
	fs.DurationVar(&cfg.Raft.LeaderLeaseTimeout, "raft-lease-timeout", cfg.Raft.LeaderLeaseTimeout, "a leader without a quorum this long steps down and stops acknowledging")
	fs.Uint64Var(&cfg.Raft.SnapshotThreshold, "raft-snapshot-threshold", cfg.Raft.SnapshotThreshold, "log entries between raft snapshots")
	if err := flagfile.Parse(fs, args, "gossip-key"); err != nil {
		return cfg, opts, errFlags
	}
	if *raftKeyFile != "" {
		return cfg, opts, usageError{errors.New("--raft-key-file: the raft port is mutual TLS since issue 28.4 and raft.key is no longer read; " +
			"remove the flag and issue each coordinator a raft certificate ('coordinator creds raft-cert --dir D --id ID'; docs/scale-out.md)")}
	}
	if cfg.Raft.ID != "" {
		peers, err := coordinator.ParseRaftPeers(*raftPeers)
		if err != nil {
			return cfg, opts, usageError{fmt.Errorf("--raft-peers: %w", err)}
		}
		cfg.Raft.Peers = peers
		if cfg.Raft.Dir == "" && cfg.DataDir != "" {
			cfg.Raft.Dir = filepath.Join(cfg.DataDir, "raft")
		}
	}
	if fs.NArg() > 0 {
		return cfg, opts, usageError{fmt.Errorf("unexpected arguments %q", fs.Args())}
	}
	host, port, err := splitHostPort(*bind, cfg.Cluster.BindPort)
	if err != nil {
		return cfg, opts, usageError{fmt.Errorf("--bind: %w", err)}
	}
	cfg.Cluster.BindAddr, cfg.Cluster.BindPort = host, port
	if *advertise != "" {
		host, port, err := splitHostPort(*advertise, 0)
		if err != nil {
			return cfg, opts, usageError{fmt.Errorf("--advertise: %w", err)}
		}
		cfg.Cluster.AdvertiseAddr, cfg.Cluster.AdvertisePort = host, port
	}
	if *natsCluster != "" {
		host, port, err := splitHostPort(*natsCluster, cfg.Embedded.Cluster.Port)
		if err != nil {
			return cfg, opts, usageError{fmt.Errorf("--nats-cluster: %w", err)}
		}
		cfg.Embedded.Cluster.Host, cfg.Embedded.Cluster.Port = host, port
	}
	cfg.Embedded.Cluster.Routes = splitList(*natsRoutes)
	if *join != "" {
		for _, s := range strings.Split(*join, ",") {
			if s = strings.TrimSpace(s); s != "" {
				cfg.Cluster.Seeds = append(cfg.Cluster.Seeds, s)
			}
		}
	}
	if *gossipKey != "" {
		key, err := base64.StdEncoding.DecodeString(*gossipKey)
		if err != nil {
			return cfg, opts, usageError{fmt.Errorf("--gossip-key is not base64: %w", err)}
		}
		cfg.Cluster.SecretKey = key
	}
	if err := gossipKeys(&cfg.Cluster, *gossipKeyFile, cfg.CredsDir, *gossipKey != ""); err != nil {
		return cfg, opts, usageError{err}
	}
	cfg.Cluster.Insecure = cfg.Insecure
	lvl, err := zapcore.ParseLevel(*logLevel)
	if err != nil {
		return cfg, opts, usageError{fmt.Errorf("--log-level: %w", err)}
	}
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(lvl)
	log, err := zc.Build()
	if err != nil {
		return cfg, opts, fmt.Errorf("logger: %w", err)
	}
	cfg.Logger = log
	return cfg, opts, nil
}

// runServe builds the coordinator from cfg, starts it and serves until
// ctx ends, then shuts it down. SIGHUP reloads the credentials.
func runServe(ctx context.Context, cfg coordinator.Config, opts serveOptions) error {
	log := cfg.Logger
	defer func() { _ = log.Sync() }()

	if cfg.Insecure {
		log.Warn("INSECURE MODE (--insecure): no NATS authentication, no gossip key required; anyone who reaches these ports can read restore plans, forge events and reports and take over the cluster. Development only.")
	}
	c, err := coordinator.New(cfg)
	if err != nil {
		return usageError{err}
	}
	stopProf, err := cpuprof.Start(opts.cpuProfile, opts.cpuHz)
	if err != nil {
		return usageError{err}
	}
	defer func() { cpuprof.Report(log, stopProf) }()
	stopWaits, err := cpuprof.StartWaits(opts.waitProf)
	if err != nil {
		return usageError{err}
	}
	defer func() { _ = stopWaits() }()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	hupDone := make(chan struct{})
	defer func() { <-hupDone }()
	hctx, hcancel := context.WithCancel(ctx)
	defer hcancel()
	go func() {
		defer close(hupDone)
		for {
			select {
			case <-hctx.Done():
				return
			case <-hup:
				if err := c.ReloadAuth(); err != nil {
					log.Error("SIGHUP: credentials not reloaded", zap.Error(err))
				}
			}
		}
	}()
	if err := c.Start(); err != nil {
		log.Error("coordinator failed to start", zap.Error(err))
		return err
	}
	log.Info("serving; SIGTERM or SIGINT to stop", zap.String("nats", c.NATSURL()), zap.String("gossip", c.GossipAddr()),
		zap.String("http", c.HTTPAddr()))
	return c.Run(ctx)
}

// splitHostPort parses IP[:PORT]; a missing port is defPort.
func splitHostPort(s string, defPort int) (string, int, error) {
	host, ps, err := net.SplitHostPort(s)
	if err != nil {
		host, ps = s, strconv.Itoa(defPort)
	}
	if net.ParseIP(host) == nil {
		return "", 0, fmt.Errorf("%q: want an IP address", host)
	}
	p, err := strconv.Atoi(ps)
	if err != nil || p < 0 || p > 65535 {
		return "", 0, fmt.Errorf("port %q: want 0..65535", ps)
	}
	return host, p, nil
}

// adminQuery runs one admin query and prints a table or JSON.
func adminQuery(ctx context.Context, op string, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet(op, flag.ContinueOnError)
	fs.SetOutput(stderr)
	natsURL := fs.String("nats", "nats://127.0.0.1:4222", "NATS URL of the coordinator")
	var cl auth.Client
	fs.StringVar(&cl.Dir, "creds-dir", "", "credentials directory (connects as the admin identity)")
	fs.StringVar(&cl.SeedFile, "creds", "", "seed file of the admin identity (instead of --creds-dir)")
	fs.StringVar(&cl.CAFile, "tls-ca", "", "CA certificate that verifies the NATS server (default <creds-dir>/ca.pem if present)")
	fs.BoolVar(&cl.Insecure, "insecure", false, "connect without credentials (only an --insecure coordinator accepts that)")
	writeOp := fs.Bool("admin-write", false, "connect as admin-write (mutating admin operations)")
	prefix := fs.String("prefix", wire.DefaultPrefix, "NATS subject prefix")
	asJSON := fs.Bool("json", false, "print JSON instead of a table")
	timeout := fs.Duration("timeout", 10*time.Second, "request timeout (verify of a large index takes a while)")
	raftWindow := new(time.Duration)
	replicas := new(bool)
	if op == wire.AdminVerify {
		fs.BoolVar(replicas, "replicas", false, "replicated cluster: every coordinator verifies its own index and digests its state; exit 1 unless all verify and agree")
		fs.DurationVar(raftWindow, "raft-window", 2*time.Second, "how long to collect the replicas' answers (with --replicas)")
	}
	if op == wire.AdminMembers {
		fs.DurationVar(raftWindow, "raft-window", 500*time.Millisecond, "how long to collect the coordinators' raft states (replicated mode)")
	}
	var req wire.AdminObjectRequest
	var specFile, model, tokensFile, nsText, chunksText string
	if op == wire.AdminObject {
		fs.StringVar(&req.Key, "key", "", "object key text: <namespace>.<chunk>.<shard>.<group>")
		fs.StringVar(&specFile, "spec-file", "", "JSON dcp.Spec of the engine (with --tokens)")
		fs.StringVar(&model, "model", "", "model name, overriding the spec file's")
		fs.StringVar(&tokensFile, "tokens", "", "file of token ids (JSON array, or whitespace/comma separated)")
		fs.StringVar(&nsText, "namespace", "", "namespace hex (with --chunks)")
		fs.StringVar(&chunksText, "chunks", "", "chunk hashes hex, comma-separated (with --namespace)")
		fs.StringVar(&req.Instance, "instance", "", "engine instance whose ranks would restore (default: the best one)")
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected arguments %q\n", op, fs.Args())
		return exitUsage
	}
	var body any = struct{}{}
	if op == wire.AdminObject {
		if err := objectRequest(&req, specFile, model, tokensFile, nsText, chunksText); err != nil {
			fmt.Fprintf(stderr, "object: %v\n", err)
			return exitUsage
		}
		body = &req
	}
	cl.Identity = auth.Identity{Role: auth.RoleAdmin}
	if *writeOp {
		cl.Identity.Role = auth.RoleAdminWrite
	}
	copts, err := cl.Options()
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", op, err)
		return exitUsage
	}
	nc, err := bus.Connect(*natsURL, "kvtier-coordinator-cli", copts...)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", op, err)
		return exitFail
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	subject := wire.Subjects{Prefix: *prefix}.Admin(op)

	var rep any
	var write func() error
	switch op {
	case wire.AdminMembers:
		r, e := bus.Call[wire.AdminMembersReply](ctx, nc, subject, body)
		if e == nil {
			// A replicated cluster: every coordinator's raft role and
			// indexes (none answer in a cluster of one without raft).
			r.Raft, _ = admin.CollectRaft(ctx, nc, wire.Subjects{Prefix: *prefix}, *raftWindow)
		}
		rep, err, write = r, e, func() error { return admin.WriteMembersTable(stdout, r) }
	case wire.AdminRanks:
		r, e := bus.Call[wire.AdminRanksReply](ctx, nc, subject, body)
		rep, err, write = r, e, func() error { return admin.WriteRanksTable(stdout, r) }
	case wire.AdminObject:
		r, e := bus.Call[wire.AdminObjectReply](ctx, nc, subject, body)
		rep, err, write = r, e, func() error { return admin.WriteObjectTable(stdout, r) }
	case wire.AdminNamespaces:
		r, e := bus.Call[wire.AdminNamespacesReply](ctx, nc, subject, body)
		rep, err, write = r, e, func() error { return admin.WriteNamespacesTable(stdout, r) }
	case wire.AdminRestores:
		r, e := bus.Call[wire.AdminRestoresReply](ctx, nc, subject, body)
		rep, err, write = r, e, func() error { return admin.WriteRestoresTable(stdout, r) }
	case wire.AdminVerify:
		if *replicas {
			reps, err := admin.CollectRaftVerify(ctx, nc, wire.Subjects{Prefix: *prefix}, *raftWindow)
			if err == nil && len(reps) == 0 {
				err = errors.New("no coordinator answered admin.raft.verify (not a replicated cluster?)")
			}
			if err != nil {
				fmt.Fprintf(stderr, "verify: %v\n", err)
				return exitFail
			}
			if *asJSON {
				err = admin.WriteJSON(stdout, reps)
			} else {
				err = admin.WriteRaftVerifyTable(stdout, reps)
			}
			if err != nil {
				fmt.Fprintf(stderr, "verify: write output: %v\n", err)
				return exitFail
			}
			if err := admin.ReplicasAgree(reps); err != nil {
				fmt.Fprintf(stderr, "verify: %v\n", err)
				return exitFail
			}
			return exitOK
		}
		r, e := bus.Call[wire.AdminVerifyReply](ctx, nc, subject, body)
		rep, err, write = r, e, func() error { return admin.WriteVerifyTable(stdout, r) }
		if e == nil && !r.OK {
			defer func() { fmt.Fprintln(stderr, "verify: the index is inconsistent") }()
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", op, err)
		return exitFail
	}
	if *asJSON {
		err = admin.WriteJSON(stdout, rep)
	} else {
		err = write()
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: write output: %v\n", op, err)
		return exitFail
	}
	if v, ok := rep.(*wire.AdminVerifyReply); ok && !v.OK {
		return exitFail
	}
	return exitOK
}

// raftChange runs "coordinator raft add-voter|remove-server".
func raftChange(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "add-voter" && args[0] != "remove-server") {
		fmt.Fprintln(stderr, "usage: coordinator raft add-voter --id ID --addr HOST:PORT | remove-server --id ID [flags]")
		return exitUsage
	}
	op := wire.AdminRaftAddVoter
	if args[0] == "remove-server" {
		op = wire.AdminRaftRemove
	}
	fs := flag.NewFlagSet("raft "+args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	natsURL := fs.String("nats", "nats://127.0.0.1:4222", "NATS URL of the coordinators")
	prefix := fs.String("prefix", wire.DefaultPrefix, "NATS subject prefix")
	timeout := fs.Duration("timeout", 30*time.Second, "request timeout")
	var req wire.AdminRaftChangeRequest
	fs.StringVar(&req.ID, "id", "", "raft id of the server (required)")
	if op == wire.AdminRaftAddVoter {
		fs.StringVar(&req.Addr, "addr", "", "raft host:port of the server to add (required)")
	}
	cl := auth.Client{Identity: auth.Identity{Role: auth.RoleAdminWrite}}
	fs.StringVar(&cl.Dir, "creds-dir", "", "credentials directory (connects as the admin-write identity)")
	fs.StringVar(&cl.SeedFile, "creds", "", "seed file of the admin-write identity (instead of --creds-dir)")
	fs.StringVar(&cl.CAFile, "tls-ca", "", "CA certificate that verifies the NATS server (default <creds-dir>/ca.pem if present)")
	fs.BoolVar(&cl.Insecure, "insecure", false, "connect without credentials (only an --insecure coordinator accepts that)")
	if err := fs.Parse(args[1:]); err != nil {
		return exitUsage
	}
	if req.ID == "" || (op == wire.AdminRaftAddVoter && req.Addr == "") || fs.NArg() > 0 {
		fmt.Fprintf(stderr, "raft %s: --id is required (and --addr to add a voter); no positional arguments\n", args[0])
		return exitUsage
	}
	copts, err := cl.Options()
	if err != nil {
		fmt.Fprintf(stderr, "raft %s: %v\n", args[0], err)
		return exitUsage
	}
	nc, err := bus.Connect(*natsURL, "kvtier-coordinator-cli", copts...)
	if err != nil {
		fmt.Fprintf(stderr, "raft %s: %v\n", args[0], err)
		return exitFail
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	rep, err := bus.Call[wire.AdminRaftChangeReply](ctx, nc, wire.Subjects{Prefix: *prefix}.Admin(op), req)
	if err != nil {
		fmt.Fprintf(stderr, "raft %s: %v\n", args[0], err)
		return exitFail
	}
	fmt.Fprintf(stdout, "raft configuration at index %d:\n", rep.Index)
	for _, s := range rep.Servers {
		fmt.Fprintf(stdout, "  %s %s %s\n", s.ID, s.Addr, s.Suffrage)
	}
	return exitOK
}

// rankReset runs "coordinator rank reset <instance>/<tp>".
func rankReset(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("rank reset", flag.ContinueOnError)
	fs.SetOutput(stderr)
	natsURL := fs.String("nats", "nats://127.0.0.1:4222", "NATS URL of the coordinator")
	prefix := fs.String("prefix", wire.DefaultPrefix, "NATS subject prefix")
	timeout := fs.Duration("timeout", 10*time.Second, "request timeout")
	cl := auth.Client{Identity: auth.Identity{Role: auth.RoleAdminWrite}}
	fs.StringVar(&cl.Dir, "creds-dir", "", "credentials directory (connects as the admin-write identity)")
	fs.StringVar(&cl.SeedFile, "creds", "", "seed file of the admin-write identity (instead of --creds-dir)")
	fs.StringVar(&cl.CAFile, "tls-ca", "", "CA certificate that verifies the NATS server (default <creds-dir>/ca.pem if present)")
	fs.BoolVar(&cl.Insecure, "insecure", false, "connect without credentials (only an --insecure coordinator accepts that)")
	// The rank may come before or after the flags.
	var rank []string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		rank, args = args[:1], args[1:]
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	rank = append(rank, fs.Args()...)
	if len(rank) != 1 {
		fmt.Fprintf(stderr, "rank reset: want one rank as <instance>/<tp>, got %q\n", rank)
		return exitUsage
	}
	if _, err := wire.ParseRank(rank[0]); err != nil {
		fmt.Fprintf(stderr, "rank reset: %v\n", err)
		return exitUsage
	}
	copts, err := cl.Options()
	if err != nil {
		fmt.Fprintf(stderr, "rank reset: %v\n", err)
		return exitUsage
	}
	nc, err := bus.Connect(*natsURL, "kvtier-coordinator-cli", copts...)
	if err != nil {
		fmt.Fprintf(stderr, "rank reset: %v\n", err)
		return exitFail
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	rep, err := bus.Call[wire.AdminRankResetReply](ctx, nc, wire.Subjects{Prefix: *prefix}.Admin(wire.AdminRankReset),
		wire.AdminRankResetRequest{Rank: rank[0]})
	if err != nil {
		fmt.Fprintf(stderr, "rank reset: %v\n", err)
		return exitFail
	}
	fmt.Fprintf(stdout, "rank %s reset: incarnation %d forgotten, %d placements dropped, %d active restores failed\n",
		rep.Rank, rep.PreviousIncarnation, rep.Placements, rep.Restores)
	return exitOK
}

// objectRequest fills req from the object flags: a key, a spec and tokens,
// or a namespace and chunk hashes.
func objectRequest(req *wire.AdminObjectRequest, specFile, model, tokensFile, nsText, chunksText string) error {
	modes := 0
	for _, set := range []bool{req.Key != "", specFile != "" || tokensFile != "", nsText != "" || chunksText != ""} {
		if set {
			modes++
		}
	}
	if modes != 1 {
		return errors.New("give exactly one of --key, --spec-file with --tokens, or --namespace with --chunks")
	}
	switch {
	case req.Key != "":
		if _, err := dcp.ParseKey(req.Key); err != nil {
			return err
		}
	case specFile != "":
		if tokensFile == "" {
			return errors.New("--spec-file needs --tokens")
		}
		data, err := os.ReadFile(specFile)
		if err != nil {
			return err
		}
		var spec dcp.Spec
		if err := json.Unmarshal(data, &spec); err != nil {
			return fmt.Errorf("spec file %s: %w", specFile, err)
		}
		if model != "" {
			spec.Model = model
		}
		res, err := spec.Resolve()
		if err != nil {
			return fmt.Errorf("spec file %s: %w", specFile, err)
		}
		toks, err := readTokens(tokensFile)
		if err != nil {
			return err
		}
		req.Namespace = res.Namespace
		req.Chunks = dcp.ChunkHashes(res.Namespace, toks, spec.ChunkTokens)
		if len(req.Chunks) == 0 {
			return fmt.Errorf("%d tokens make no full chunk of %d tokens", len(toks), spec.ChunkTokens)
		}
	case tokensFile != "":
		return errors.New("--tokens needs --spec-file")
	default:
		if nsText == "" || chunksText == "" {
			return errors.New("--namespace and --chunks go together")
		}
		ns, err := dcp.ParseNamespace(nsText)
		if err != nil {
			return err
		}
		req.Namespace = ns
		for _, s := range strings.Split(chunksText, ",") {
			ch, err := dcp.ParseChunkHash(strings.TrimSpace(s))
			if err != nil {
				return err
			}
			req.Chunks = append(req.Chunks, ch)
		}
	}
	return nil
}

// readTokens reads token ids: a JSON array, or numbers separated by
// whitespace or commas.
func readTokens(path string) ([]uint32, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	s := strings.TrimSpace(string(data))
	var toks []uint32
	if strings.HasPrefix(s, "[") {
		if err := json.Unmarshal([]byte(s), &toks); err != nil {
			return nil, fmt.Errorf("tokens file %s: %w", path, err)
		}
		return toks, nil
	}
	for i, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' || r == '\t' || r == '\r' }) {
		v, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("tokens file %s: token %d %q: want a uint32", path, i, f)
		}
		toks = append(toks, uint32(v))
	}
	return toks, nil
}
