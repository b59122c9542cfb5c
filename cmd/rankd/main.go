// Command rankd is kvtier's per-GPU daemon: one per rank of an engine
// instance. It opens its device, serves the engine API and its inventory
// over NATS, publishes placement events to the coordinator and joins the
// memberlist cluster.
//
//	rankd --instance engine0 --tp-rank 0 --tp-size 4 --device host \
//	      --l2-dir /var/lib/kvtier/l2/engine0 --join 10.0.0.1:7946 --creds-dir /etc/kvtier/creds
//	rankd --config /etc/kvtier/rankd-engine0-0.conf [flags that override it]
//
// --creds-dir holds this rank's seed (rankd-<instance>-<tp>.nk), the
// public users.json (the coordinator's key, which must sign a gossiped
// NATS URL), gossip.key and storage.key (the MAC key of L2 and L3 object
// headers); --insecure runs without them (development).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/internal/cpuprof"
	"github.com/kvtier/kvtier/internal/flagfile"
	"github.com/kvtier/kvtier/rankd"
	"github.com/kvtier/kvtier/wire"
)

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// main parses the flags into a rankd.Config and runs the daemon until
// SIGTERM or SIGINT: exit 2 on a bad flag or config (printed), 1 when the
// daemon fails to start or to shut down cleanly (logged).
func main() {
	cudaConnections()
	cfg, opts, err := parseFlags(flag.NewFlagSet(os.Args[0], flag.ExitOnError), os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "rankd:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// The first signal starts the shutdown; a second one kills.
	context.AfterFunc(ctx, stop)
	err = run(ctx, cfg, opts)
	stop()
	var ce configError
	switch {
	case errors.As(err, &ce):
		fmt.Fprintln(os.Stderr, "rankd:", ce.err)
		os.Exit(2)
	case err != nil:
		os.Exit(1)
	}
}

// maxConnections is the CUDA_DEVICE_MAX_CONNECTIONS rankd runs with unless
// its environment names one: the driver's limit (32).
const maxConnections = "32"

// cudaConnections sets CUDA_DEVICE_MAX_CONNECTIONS to maxConnections,
// before the driver is initialized, unless the environment already names
// it (an empty value counts as none: the driver would take its default),
// and returns the value in effect. The driver maps a context's streams
// onto that many hardware work queues (8 by default), and work on streams
// that share a queue runs in order: rankd's stores and retrieves use a
// stream pool each, up to two CUDA streams a stream (copies and
// checksums), 32 with the defaults, so a store's gather could queue behind
// a retrieve's copies. That is what the H100's timelines of both
// directions at once suggest (the store's first device mark reached 24 ms
// after its enqueue began, when the retrieve's copies ended, on both copy paths;
// BENCHMARKS.md, stop 46). Measured on the H100 at stop 47: both
// directions at once 1.12x the single-direction ceiling with 32, 1.03x
// with 8, the store's first mark 11 ms after its enqueue began.
func cudaConnections() string {
	const env = "CUDA_DEVICE_MAX_CONNECTIONS"
	if v := os.Getenv(env); v != "" {
		return v
	}
	_ = os.Setenv(env, maxConnections)
	return maxConnections
}

// options are the command line's settings that are not the daemon's.
type options struct {
	cpuProfile string // write a CPU profile of the whole run here
	cpuHz      int    // its sampling rate (0: the runtime's 100 Hz)
	waitProf   string // write where goroutines waited to this path + .block / .mutex
}

// configError is a config the daemon refused (exit 2).
type configError struct{ err error }

func (e configError) Error() string { return e.err.Error() }
func (e configError) Unwrap() error { return e.err }

// parseFlags parses args (the --config file first, the command line over
// it) on fs into a rankd.Config with its logger. With fs's ExitOnError, -h
// and a bad flag or file exit (0 and 2); the error names a flag value
// that parsed but is not valid.
func parseFlags(fs *flag.FlagSet, args []string) (rankd.Config, options, error) {
	cfg := rankd.DefaultConfig(wire.Rank{}) // the rank comes from the flags; what it derives is set below
	var opts options
	var (
		join, bind, advertise, hostDir, hostUUID, l2Policy, logLevel string
		l1Bytes, l1Slab, l2Bytes, l2FreeFloor, l3Bytes               string
		dmaSumBatch, dmaQueue, retrieveBatch                         string
	)
	fs.StringVar(&cfg.Rank.Instance, "instance", "", "engine instance this rank belongs to (required; [A-Za-z0-9_-], 1..64)")
	fs.IntVar(&cfg.Rank.TPRank, "tp-rank", 0, "TP rank")
	fs.IntVar(&cfg.TPSize, "tp-size", 1, "TP size of the engine")
	fs.IntVar(&cfg.DCPSize, "dcp-size", 1, "DCP size of the engine (gossiped metadata)")
	fs.StringVar(&cfg.Device, "device", "auto", "device: auto | host | cuda:N | GPU UUID")
	fs.StringVar(&cfg.CopyPath, "copy-path", "auto", "how bytes move between the GPU and L1: auto (the copy engine, then a checksum kernel, for page runs averaging >= 256 KiB on a driver with cuMemcpyBatchAsync; else the copy kernels) | sm (always the kernels) | sm-direct, sm-staged (the kernels in one mode, CUDA only) | dma (always the copy engine): docs/gpu.md")
	fs.StringVar(&dmaSumBatch, "dma-sum-batch", "1GiB", "the copy engine path's checksum batch (bytes, or with KiB/MiB/GiB; >= 1): smaller batches expose less of the last checksum and launch more checksum kernels beside the engine's forward")
	fs.BoolVar(&cfg.DMA.NoOverlapHint, "dma-no-overlap-hint", false, "for measurements: the copy engine path enqueues its batched copies without the driver's hint to overlap them with compute (cuMemcpyBatchAsync flags 0)")
	fs.BoolVar(&cfg.DMA.OrderScatters, "dma-order-scatters", false, "for measurements: each restore transfer's copy-engine copies wait on the device for those of the previous restore transfer on this GPU, so the copy engine moves one batch after the other instead of two at once (not with --dma-sum-host-launch or --dma-queue)")
	fs.BoolVar(&cfg.DMA.EachCopy, "dma-each-copy", false, "for measurements: the copy engine path enqueues its copies one cuMemcpyHtoDAsync/DtoHAsync call each (as vLLM's own offload does) instead of batched cuMemcpyBatchAsync calls")
	fs.BoolVar(&cfg.DMA.UnitSums, "dma-unit-sums", false, "the copy engine path verifies transfers whose spans are all word-aligned with kv_sum_units (a warp per piece of a span, no search per 16 bytes): the same sums in less of the GPU's time, so decoding beside full-speed restores slows less (1.12x against 1.18x on an H100), though a restore itself is no faster (docs/gpu.md)")
	fs.Func("dma-sum-blocks", "for measurements: the copy engine path's checksum kernels hidden under copies take at most this many blocks in all, a few multiprocessors for longer instead of a slot on every one (0: one block per multiprocessor, the default; 1..65536; kv_sum_units needs ~8 to outrun the copy engine, kv_checksum ~40)", func(v string) error {
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil {
			return fmt.Errorf("not a count of blocks: %w", err)
		}
		cfg.DMA.SumBlocks = uint32(n)
		return nil
	})
	fs.BoolVar(&cfg.DMA.SMControl, "dma-sm-control", false, "a transfer's tables go to the GPU and its checksums come back by a small kernel reading and writing pinned host memory instead of copy-engine copies, which queue behind another transfer's bulk copies going the same way: stores and restores at once move faster (0.90-0.92 of the duplex ceiling against 0.82-0.84 on an H100), but decoding beside a load slows more (vLLM 1.34x against 1.2x), so off by default (docs/gpu.md)")
	fs.BoolVar(&cfg.DMA.SMControlDuplex, "dma-sm-control-duplex", cfg.DMA.SMControlDuplex, "--dma-sm-control only for a transfer enqueued while one of the other direction is in flight on the GPU (a store beside a restore): both directions at once 1.37-1.51x one direction's copy engine with it against 1.26x without (two H100s whose plain copies both reach 1.80-1.84x, not one run), while a GPU that only restores keeps the copy engine's control copies, cheaper for the model (docs/gpu.md); =false: never")
	fs.BoolVar(&cfg.DMA.SMSumsScatter, "dma-sm-sums-scatter", cfg.DMA.SMSumsScatter, "every restore batch's checksums come back by kv_move whatever --dma-sm-control-duplex chose for its tables, so a batch enqueued before a store began does not wait behind the store's copies for them: both directions at once 1.54-1.58x one direction's copy engine with it, 1.24-1.53x without, on two H100s (docs/gpu.md); =false: the duplex rule alone")
	fs.BoolVar(&cfg.DMA.HostLaunch, "dma-sum-host-launch", false, "for measurements: the copy engine path launches a transfer's checksum kernel from the host once its copies are done, so no kernel of the rankd waits on the GPU behind the copies (the enqueue waits instead)")
	fs.StringVar(&dmaQueue, "dma-queue", "0", "for measurements: bound of the copy engine path's bytes in flight per transfer, the enqueue waiting on the device while its stream lock is held (bytes, or with KiB/MiB/GiB; 0: unbounded, the default; inside vLLM a bound slowed loads and did not help decoding)")
	fs.StringVar(&hostDir, "host-dir", "", "host backend shared-memory directory (private 0700 dir; default /dev/shm/kvtier-<uid>; must match the engine's)")
	fs.StringVar(&hostUUID, "host-uuid", "", "host backend device UUID (default derived from the host name)")
	fs.StringVar(&l1Bytes, "l1-bytes", "1GiB", "L1 pinned host memory (bytes, or with KiB/MiB/GiB)")
	fs.StringVar(&l1Slab, "l1-slab-bytes", "auto", "L1's allocation unit: an object takes whole slabs and wastes the rest of its last one, so give the rank's object size (a chunk's bytes on this rank) or a divisor of it when objects are smaller than auto's slab (docs/gpu.md, \"L1 slabs\"); auto: about 16,384 slabs of 4 KiB..1 MiB (bytes, or with KiB/MiB/GiB)")
	fs.StringVar(&cfg.L1NUMA, "l1-numa", cfg.L1NUMA, "NUMA node of L1's pages: auto (the GPU's node, from sysfs, on hosts of several nodes) | off (where the kernel puts them) | a node number (docs/gpu.md)")
	fs.StringVar(&cfg.HostL1Dir, "host-l1-dir", "", "host-shared L1: keep L1 in a shared-memory segment in this private 0700 dir (created when missing; e.g. /dev/shm/kvtier-l1) so the instance's other rankds on this host restore from it; empty: private L1")
	fs.StringVar(&cfg.L2Dir, "l2-dir", "", "L2 directory, shared by the ranks of the instance (empty: no L2)")
	fs.StringVar(&l2Policy, "l2-policy", "write-through", "write-through | write-back")
	fs.StringVar(&l2Bytes, "l2-bytes", "0", "bound of the L2 files this rank writes (bytes, or with KiB/MiB/GiB/TiB; 0: unbounded); least recently used objects are evicted")
	l2Shared := fs.String("l2-shared-with", "", "the other instances of this instance's share group whose rankds write this --l2-dir, comma-separated (docs/sharing.md): a store of an object one of them already wrote there keeps no second copy")
	fs.BoolVar(&cfg.L2VerifyOnScan, "l2-verify-on-scan", false, "also hash every payload in the start-up rescan of L2 (default: headers only; every read is verified anyway)")
	fs.DurationVar(&cfg.L2CollectGrace, "l2-collect-grace", cfg.L2CollectGrace, "age after which quarantined, temporary and orphaned L2 files are removed (at start-up and every 10 min)")
	fs.StringVar(&l2FreeFloor, "l2-free-floor", formatFloor(cfg.L2FreeFloorBytes, cfg.L2FreeFloorPercent),
		"evict this rank's least recently used L2 objects while the L2 file system would have less free: bytes (or KiB..TiB), a percentage of the file system's size (5%), or both comma-separated, the larger applying; 0: no floor")
	fs.StringVar(&cfg.L3.Endpoint, "l3-endpoint", "", "S3-compatible object store host:port for the L3 tier (empty: no L3); HTTPS unless --l3-insecure")
	fs.StringVar(&cfg.L3.Bucket, "l3-bucket", "", "L3 bucket (must exist)")
	fs.StringVar(&cfg.L3.Prefix, "l3-prefix", "kvtier/", "prefix of kvtier's object names in the L3 bucket")
	fs.StringVar(&cfg.L3.CredentialsFile, "l3-credentials", "", "L3 credentials file, 0600 JSON {\"access_key_id\", \"secret_access_key\"[, \"session_token\"]} (never on the command line)")
	fs.StringVar(&cfg.L3.CAFile, "l3-ca", "", "PEM CA bundle trusted for the L3 endpoint besides the system roots")
	fs.StringVar(&cfg.L3.Region, "l3-region", cfg.L3.Region, "L3 bucket region")
	fs.BoolVar(&cfg.L3.Insecure, "l3-insecure", false, "talk plain HTTP to the L3 endpoint; refused off loopback unless --l3-insecure-remote")
	hostL1Shared := fs.String("host-l1-shared-with", "", "the other instances of this instance's share group whose rankds on this host keep their L1 in this --host-l1-dir, comma-separated (docs/sharing.md): restores read their segments after this instance's (the coordinator plans them with --share-host-l1)")
	l3Shared := fs.String("l3-shared-with", "", "the other instances of this instance's share group whose L3 objects this rank may read, under their prefixes of this bucket and --l3-prefix, comma-separated (docs/sharing.md; the coordinator plans them with --share-l3)")
	fs.BoolVar(&cfg.KeepSharedInL1, "keep-shared-in-l1", false, "with --l2-shared-with: a store deduplicated onto a member's L2 file still keeps a local L1 copy (announced in L1 only, never written to L2 or L3)")
	fs.BoolVar(&cfg.L3Encrypt, "l3-encrypt", false, "encrypt the payload of the L3 objects this rank writes (AES-256-GCM, keys derived from the storage key per instance and namespace; docs/storage-encryption.md); objects are read in either format")
	fs.BoolVar(&cfg.L3.InsecureRemote, "l3-insecure-remote", false, "with --l3-insecure: also allow plain HTTP to an L3 endpoint off loopback (signatures and KV bytes unencrypted on the network; a trusted network only)")
	fs.StringVar(&l3Bytes, "l3-bytes", "0", "bound of the L3 objects this rank writes (bytes or KiB..TiB; 0: unbounded); least recently used objects are deleted")
	fs.StringVar(&join, "join", "", "memberlist seeds, comma-separated host:port (the coordinator's gossip address)")
	fs.StringVar(&bind, "bind", "", "gossip bind address ip:port (default 0.0.0.0:7947+tp-rank)")
	fs.StringVar(&advertise, "advertise", "", "gossip address advertised to peers, ip[:port]")
	fs.StringVar(&cfg.NATSURL, "nats", "", "NATS URL (default: discovered from the coordinator's member metadata)")
	fs.StringVar(&cfg.Prefix, "prefix", cfg.Prefix, "NATS subject prefix")
	fs.StringVar(&cfg.HTTPAddr, "http", cfg.HTTPAddr, "metrics/health HTTP address (empty: none)")
	fs.StringVar(&logLevel, "log-level", "info", "debug | info | warn | error")
	fs.StringVar(&cfg.CredsDir, "creds-dir", "", "credentials directory from 'coordinator init' (required unless --insecure)")
	fs.StringVar(&cfg.SeedFile, "creds", "", "this rank's nkey seed file (default <creds-dir>/rankd-<instance>-<tp>.nk)")
	fs.StringVar(&cfg.TLSCA, "tls-ca", "", "CA certificate verifying the NATS server (default <creds-dir>/ca.pem if present)")
	fs.StringVar(&cfg.StorageKeyFile, "storage-key-file", "", "storage MAC key file, 0600: L2/L3 object headers are MACed with it and only verified objects are announced after a restart (default <creds-dir>/storage.key; required with --l2-dir or L3 unless --insecure)")
	gossipKeyFile := fs.String("gossip-key-file", "", "gossip key file, 0600, one base64 key per line, the first sent with (default <creds-dir>/gossip.key if present)")
	fs.BoolVar(&cfg.Insecure, "insecure", false, "DEVELOPMENT ONLY: no NATS credentials, unverified coordinator NATS URLs, plaintext gossip off loopback, L2/L3 headers trusted without a storage key")
	fs.DurationVar(&cfg.FlushTimeout, "shutdown-flush-timeout", cfg.FlushTimeout,
		"on SIGTERM, how long to drain and flush objects only L1 holds (write-back) to L2; the rest is logged and counted lost")
	fs.DurationVar(&cfg.StoreTimeout, "store-timeout", cfg.StoreTimeout, "bound of a store from request to commit")
	var paceGBps float64
	fs.Float64Var(&paceGBps, "restore-pace-gbps", 0, "the rate bound of a restore's copies, GB/s (10^9 B/s) for every retrieve that does not send its own (the Kvtier-Pace header): 0, the default, is full speed; a paced restore takes longer and slows the engine's other requests less (docs/gpu.md); else at least 0.105")
	fs.DurationVar(&cfg.RestorePaceWindow, "restore-pace-window", cfg.RestorePaceWindow, "a paced restore's batches: what its pace moves in this time, each at full speed and then a wait; longer windows launch fewer checksum kernels beside the engine (docs/gpu.md); 1ms..1s")
	fs.IntVar(&cfg.RetrieveRamp, "retrieve-ramp", cfg.RetrieveRamp, "how many doublings a restore's batches take to reach --retrieve-batch-bytes (the first an eighth at 3): a small first batch starts a lone restore's copies sooner, and each batch is one more checksum kernel beside the engine's forward (docs/gpu.md); 0..8")
	fs.IntVar(&cfg.RetrieveTailRamp, "retrieve-tail-ramp", cfg.RetrieveTailRamp, "how many halvings an unpaced restore's last batches take from --retrieve-batch-bytes (the last an eighth at 3): the checksum of a restore's last batch follows its last copy, so a small last batch may return the restore sooner, and each batch is one more checksum kernel beside the engine's forward (on an H100: no faster a restore, 1.22x against 1.17x a decode-shaped loop beside; docs/gpu.md); 0..8")
	fs.IntVar(&cfg.Streams, "streams", cfg.Streams, "device streams for stores and, separately, for restores (each two CUDA streams on a GPU; the driver maps them onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues, 32 as rankd sets it, and work of streams sharing a queue runs in order): for measurements; 1..1024")
	fs.StringVar(&retrieveBatch, "retrieve-batch-bytes", "1GiB", "the L1 one restore pins at a time (bytes, or with KiB/MiB/GiB; at most a quarter of L1): its chunks go through L1 and the device in batches of this size, each a transfer of its own")
	fs.BoolVar(&cfg.RetrieveSerialBatches, "retrieve-serial-batches", false, "benchmark ablation: a retrieve waits for each L1 batch before preparing the next (the behaviour before issue 12.6)")
	fs.StringVar(&opts.cpuProfile, "cpu-profile", "", "write a CPU profile of the whole run to this file (benchmarks)")
	fs.StringVar(&opts.waitProf, "wait-profile", "", "write where goroutines waited over the whole run (Go's block and mutex profiles) to this path + .block and .mutex (benchmarks)")
	fs.IntVar(&opts.cpuHz, "cpu-profile-hz", 0, "--cpu-profile's samples per second of CPU (0: the Go runtime's 100; up to 10000, for stages of a millisecond). The kernel's timer tick caps the real rate (250 Hz on some kernels): the log line at exit says how much of the CPU time the profile holds")
	_ = flagfile.Parse(fs, args) // ExitOnError: exits 2 on a bad file or flag

	// The defaults derived from the rank, now that the flags named it.
	cfg.NodeName = rankd.DefaultNodeName(cfg.Rank)
	cfg.BindPort = rankd.DefaultBindPort(cfg.Rank) // --bind without a port keeps it

	var err error
	if cfg.DMA.SumBatch, err = parseBytes(dmaSumBatch); err != nil {
		return cfg, opts, fmt.Errorf("--dma-sum-batch: %w", err)
	}
	if cfg.DMA.Queue, err = parseBytes(dmaQueue); err != nil {
		return cfg, opts, fmt.Errorf("--dma-queue: %w", err)
	}
	if cfg.RetrieveBatchBytes, err = parseBytes(retrieveBatch); err != nil {
		return cfg, opts, fmt.Errorf("--retrieve-batch-bytes: %w", err)
	}
	if !(paceGBps >= 0 && paceGBps <= 1e6) { // NaN too
		return cfg, opts, fmt.Errorf("--restore-pace-gbps %v: want 0 (full speed) or a rate in GB/s", paceGBps)
	}
	cfg.RestorePace = uint64(paceGBps * 1e9)
	if cfg.L1Bytes, err = parseBytes(l1Bytes); err != nil {
		return cfg, opts, fmt.Errorf("--l1-bytes: %w", err)
	}
	if l1Slab != "auto" {
		if cfg.L1SlabBytes, err = parseBytes(l1Slab); err != nil {
			return cfg, opts, fmt.Errorf("--l1-slab-bytes: %w", err)
		}
		if cfg.L1SlabBytes == 0 {
			return cfg, opts, fmt.Errorf("--l1-slab-bytes 0: want auto or a multiple of 4096 B")
		}
	}
	if cfg.L2Bytes, err = parseBytes(l2Bytes); err != nil {
		return cfg, opts, fmt.Errorf("--l2-bytes: %w", err)
	}
	if cfg.L2FreeFloorBytes, cfg.L2FreeFloorPercent, err = parseFloor(l2FreeFloor); err != nil {
		return cfg, opts, fmt.Errorf("--l2-free-floor: %w", err)
	}
	if cfg.L3Bytes, err = parseBytes(l3Bytes); err != nil {
		return cfg, opts, fmt.Errorf("--l3-bytes: %w", err)
	}
	if cfg.L2Policy, err = rankd.ParseL2Policy(l2Policy); err != nil {
		return cfg, opts, err
	}
	if join != "" {
		cfg.Join = strings.Split(join, ",")
	}
	if *l2Shared != "" {
		for _, inst := range strings.Split(*l2Shared, ",") {
			cfg.L2SharedWith = append(cfg.L2SharedWith, strings.TrimSpace(inst))
		}
	}
	if *hostL1Shared != "" {
		for _, inst := range strings.Split(*hostL1Shared, ",") {
			cfg.HostL1SharedWith = append(cfg.HostL1SharedWith, strings.TrimSpace(inst))
		}
	}
	if *l3Shared != "" {
		for _, inst := range strings.Split(*l3Shared, ",") {
			cfg.L3SharedWith = append(cfg.L3SharedWith, strings.TrimSpace(inst))
		}
	}
	if bind != "" {
		if cfg.BindAddr, cfg.BindPort, err = splitHostPort(bind, cfg.BindPort); err != nil {
			return cfg, opts, fmt.Errorf("--bind: %w", err)
		}
	}
	if advertise != "" {
		if cfg.AdvertiseAddr, cfg.AdvertisePort, err = splitHostPort(advertise, 0); err != nil {
			return cfg, opts, fmt.Errorf("--advertise: %w", err)
		}
	}
	if hostDir != "" {
		cfg.Host.Dir = hostDir
	}
	if hostUUID != "" {
		cfg.Host.UUID = hostUUID
	}
	if *gossipKeyFile == "" && cfg.CredsDir != "" {
		if p := filepath.Join(cfg.CredsDir, auth.GossipKeyFile); fileExists(p) {
			*gossipKeyFile = p
		}
	}
	if *gossipKeyFile != "" {
		if cfg.GossipKey, cfg.GossipSecondaryKeys, err = auth.LoadGossipKeys(*gossipKeyFile); err != nil {
			return cfg, opts, err
		}
	}
	lvl, err := zapcore.ParseLevel(logLevel)
	if err != nil {
		return cfg, opts, fmt.Errorf("--log-level: %w", err)
	}
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(lvl)
	zc.Sampling = nil
	log, err := zc.Build()
	if err != nil {
		return cfg, opts, err
	}
	cfg.Logger = log
	return cfg, opts, nil
}

// run builds the daemon from cfg, starts it and serves until ctx ends,
// then shuts it down. A config the daemon refuses is a configError; a
// failed start or shutdown is logged and returned.
func run(ctx context.Context, cfg rankd.Config, opts options) error {
	log := cfg.Logger
	defer func() { _ = log.Sync() }()
	log.Info("CUDA hardware work queues", zap.String("CUDA_DEVICE_MAX_CONNECTIONS", os.Getenv("CUDA_DEVICE_MAX_CONNECTIONS")))
	if cfg.Insecure {
		log.Warn("INSECURE MODE (--insecure): anyone who reaches NATS or gossip can speak for this rank. Development only.")
	}
	if cfg.L3.Endpoint != "" && cfg.L3.InsecureRemote {
		log.Warn("L3 over plain HTTP off loopback (--l3-insecure-remote): anyone on the path reads the KV bytes and can replay signed requests",
			zap.String("endpoint", cfg.L3.Endpoint))
	}
	d, err := rankd.New(cfg)
	if err != nil {
		return configError{err}
	}
	stopProf, err := cpuprof.Start(opts.cpuProfile, opts.cpuHz)
	if err != nil {
		return configError{err}
	}
	defer func() { cpuprof.Report(log, stopProf) }()
	stopWaits, err := cpuprof.StartWaits(opts.waitProf)
	if err != nil {
		return configError{err}
	}
	defer func() { _ = stopWaits() }()
	if err := d.Start(ctx); err != nil {
		log.Error("start failed", zap.Error(err))
		_ = d.Shutdown(context.Background())
		return err
	}
	<-ctx.Done()
	log.Info("signal received; shutting down")
	err = d.Shutdown(context.Background())
	cpuprof.Report(log, stopProf)
	_ = stopWaits()
	if err != nil {
		log.Error("shutdown", zap.Error(err))
		return err
	}
	return nil
}

// splitHostPort parses "ip:port" or "ip" (keeping defPort).
func splitHostPort(s string, defPort int) (string, int, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return s, defPort, nil //nolint:nilerr // a bare IP
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65535 {
		return "", 0, fmt.Errorf("port %q", port)
	}
	return host, p, nil
}

// parseBytes parses "1073741824", "512MiB", "1GiB", "64KiB".
// parseFloor parses --l2-free-floor: bytes, a percentage ("5%") or both
// comma-separated ("1GiB,5%"). What is not given is 0: "2GiB" is no
// percentage, "0" no floor.
func parseFloor(s string) (bytes uint64, percent float64, err error) {
	var sawBytes, sawPercent bool
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if p, ok := strings.CutSuffix(part, "%"); ok {
			if sawPercent {
				return 0, 0, fmt.Errorf("%q: two percentages", s)
			}
			sawPercent = true
			if percent, err = strconv.ParseFloat(strings.TrimSpace(p), 64); err != nil || !(percent >= 0 && percent < 100) {
				return 0, 0, fmt.Errorf("%q: want a percentage in [0, 100)", s)
			}
			continue
		}
		if sawBytes {
			return 0, 0, fmt.Errorf("%q: two sizes", s)
		}
		sawBytes = true
		if bytes, err = parseBytes(part); err != nil {
			return 0, 0, err
		}
	}
	return bytes, percent, nil
}

// formatFloor is the --l2-free-floor value of bytes and percent.
func formatFloor(bytes uint64, percent float64) string {
	var parts []string
	switch {
	case bytes == 0:
	case bytes%(1<<30) == 0:
		parts = append(parts, fmt.Sprintf("%dGiB", bytes>>30))
	default:
		parts = append(parts, strconv.FormatUint(bytes, 10))
	}
	if percent > 0 {
		parts = append(parts, strconv.FormatFloat(percent, 'g', -1, 64)+"%")
	}
	if len(parts) == 0 {
		return "0"
	}
	return strings.Join(parts, ",")
}

func parseBytes(s string) (uint64, error) {
	mult := uint64(1)
	for _, u := range []struct {
		suffix string
		m      uint64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.m
			break
		}
	}
	n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q: want bytes or a number with KiB/MiB/GiB/TiB", s)
	}
	if n > (1<<64-1)/mult {
		return 0, fmt.Errorf("%q overflows", s)
	}
	return n * mult, nil
}
