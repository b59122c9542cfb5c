package rankd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/coordinator"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// Benchmarks of the production path: a real coordinator (embedded NATS,
// bbolt with fsync, as `coordinator serve` runs it) fed by rankd's own
// publisher, one NATS connection per rank. Every figure is the median of
// benchReps() repetitions inside one benchmark run, so run them with
// -benchtime 1x:
//
//	go test -run '^$' -bench ThroughNATS -benchtime 1x ./rankd/
//
// KVTIER_BENCH_REPS overrides the repetitions (default 3). NATS auth is on
// as production runs it (C9: a credentials directory from auth.Init, every
// connection with its own identity's nkey and permissions, the engine on
// its scoped subjects); KVTIER_BENCH_INSECURE=1 runs the coordinator
// --insecure instead.

func benchReps() int {
	if n, err := strconv.Atoi(os.Getenv("KVTIER_BENCH_REPS")); err == nil && n > 0 {
		return n
	}
	return 3
}

// benchCoord is a coordinator and the credentials directory its clients
// connect with ("" when insecure).
type benchCoord struct {
	*coordinator.Coordinator
	creds string
}

// benchInstances are the engine instances the benchmarks' credentials
// hold: TP8 each (shareMembers: the share-group replay's).
var benchInstances = append([]string{"eng", "load", "ingest-w8", "ingest-w1"}, shareMembers...)

// benchCoordinator starts a coordinator as `coordinator serve` would, on
// loopback with free ports, logging off, with NATS auth unless
// KVTIER_BENCH_INSECURE=1; opts then change its configuration.
func benchCoordinator(b *testing.B, opts ...func(*coordinator.Config)) *benchCoord {
	cfg := coordinator.DefaultConfig()
	cfg.DataDir = b.TempDir()
	bc := &benchCoord{}
	if os.Getenv("KVTIER_BENCH_INSECURE") == "1" {
		cfg.Insecure = true
	} else {
		bc.creds = filepath.Join(b.TempDir(), "creds")
		var ins []auth.Instance
		for _, name := range benchInstances {
			ins = append(ins, auth.Instance{Name: name, TPSize: 8})
		}
		if err := auth.Init(bc.creds, ins); err != nil {
			b.Fatal(err)
		}
		cfg.CredsDir = bc.creds
	}
	b.Logf("NATS auth: %v", !cfg.Insecure)
	cfg.Embedded.Port = 0
	cfg.HTTPAddr = ""
	cfg.Cluster.NodeName = "coord"
	cfg.Cluster.BindAddr = "127.0.0.1"
	cfg.Cluster.BindPort = 0
	cfg.StartupFenceGrace = 0
	// The bench's ranks are publishers without memberlist members.
	cfg.RequireMemberIncarnation = false
	cfg.Logger = zap.NewNop()
	if os.Getenv("KVTIER_BENCH_LOG") != "" { // the coordinator's warnings on stderr
		cfg.Logger = zap.Must(zap.NewDevelopmentConfig().Build(zap.IncreaseLevel(zap.WarnLevel)))
	}
	cfg.Cluster.Logger = zap.NewNop()
	for _, o := range opts {
		o(&cfg)
	}
	c, err := coordinator.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := c.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(c.Shutdown)
	bc.Coordinator = c
	return bc
}

// benchConnect connects to c's NATS as id (with its credentials unless
// insecure).
func benchConnect(b *testing.B, c *benchCoord, id auth.Identity) *nats.Conn {
	var opts []nats.Option
	if c.creds != "" {
		var err error
		if opts, err = (auth.Client{Identity: id, Dir: c.creds}).Options(); err != nil {
			b.Fatal(err)
		}
	}
	nc, err := bus.Connect(c.NATSURL(), "bench-"+id.Name(), opts...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(nc.Close)
	return nc
}

func benchSpec(tp int) dcp.Spec {
	return dcp.Spec{
		Model: "bench-model", Layout: dcp.Layout{TP: tp, DCP: 1, Interleave: 1, PP: 1}, ChunkTokens: 16,
		Groups: []dcp.Group{{Name: "attn", Kind: dcp.Attention, BlockSize: 16, Layers: 2, KVFormat: "bf16",
			SemanticBytes: 16 * 64, PageBytes: 16 * 64, StrideBytes: 16 * 64}},
	}
}

func benchChain(ns dcp.Namespace, n int, seed uint64) []dcp.ChunkHash {
	toks := make([]uint32, n*16)
	for i := range toks {
		toks[i] = uint32(seed*1000003) + uint32(i)
	}
	return dcp.ChunkHashes(ns, toks, 16)
}

// benchRank is one rank's publisher on its own connection, as rankd runs
// it.
type benchRank struct {
	r    wire.Rank
	pub  *publisher
	seq  uint64
	stop chan struct{}
	done chan struct{}
}

func startBenchRanks(b *testing.B, c *benchCoord, instance string, n, window int) []*benchRank {
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	out := make([]*benchRank, n)
	for tp := range n {
		r := wire.Rank{Instance: instance, TPRank: tp}
		nc := benchConnect(b, c, auth.Rankd(r))
		br := &benchRank{r: r, stop: make(chan struct{}), done: make(chan struct{}),
			pub: newPublisher(subj.Events(r), 30*time.Second, 1<<20, window, zap.NewNop(), newMetrics(r.String()))}
		br.pub.setConn(nc)
		go func() { defer close(br.done); br.pub.run(br.stop) }()
		b.Cleanup(func() { close(br.stop); <-br.done })
		out[tp] = br
	}
	return out
}

// batch of n new L1 objects of chunks, continuing the rank's sequence.
func (br *benchRank) batch(ns dcp.Namespace, chunks []dcp.ChunkHash) wire.Batch {
	bt := wire.Batch{Rank: br.r, Incarnation: 1, Events: make([]wire.Event, len(chunks))}
	for i, ch := range chunks {
		br.seq++
		k := dcp.Key{NS: ns, Chunk: ch, Shard: uint16(br.r.TPRank)}
		bt.Events[i] = wire.Event{Seq: br.seq, Kind: wire.Stored, Tier: wire.L1, Key: k, Size: 2048, Sum: br.seq}
	}
	return bt
}

// waitApplied waits until the publisher has nothing queued.
func (br *benchRank) waitApplied(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for br.pub.pending() > 0 {
		if ctx.Err() != nil {
			b.Fatalf("rank %s: %d batches unacknowledged", br.r, br.pub.pending())
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// ingestOnce publishes batches x events per rank from every rank at once
// and returns events/s from the first Publish to the last acknowledgement.
func ingestOnce(b *testing.B, ns dcp.Namespace, ranks []*benchRank, batches, events int, seed uint64) float64 {
	work := make([][]wire.Batch, len(ranks))
	for i, br := range ranks {
		for bi := range batches {
			work[i] = append(work[i], br.batch(ns, benchChain(ns, events, seed+uint64(i*batches+bi))))
		}
	}
	t0 := time.Now()
	var wg sync.WaitGroup
	for i, br := range ranks {
		wg.Go(func() {
			for _, bt := range work[i] {
				for br.pub.Publish(bt) != nil {
					time.Sleep(time.Millisecond)
				}
			}
			br.waitApplied(b)
		})
	}
	wg.Wait()
	return float64(len(ranks)*batches*events) / time.Since(t0).Seconds()
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkIngestThroughNATS: 8 ranks, batches of 1024 events (the engine
// default), rankd's publisher with its default window (8) and with a
// window of 1 (one batch per round trip), into a coordinator with fsync.
func BenchmarkIngestThroughNATS(b *testing.B) {
	const ranks, batches, events = 8, 64, 1024
	c := benchCoordinator(b)
	nc := benchConnect(b, c, auth.Engine("eng"))
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	ctx := context.Background()
	reg, err := bus.Call[wire.RegisterReply](ctx, nc, subj.EngineCoord("eng", wire.CoordRegister), benchSpec(ranks))
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		for _, window := range []int{DefaultConfig(wire.Rank{}).EventWindow, 1} {
			rs := startBenchRanks(b, c, fmt.Sprintf("ingest-w%d", window), ranks, window)
			var rates []float64
			for rep := range benchReps() {
				rates = append(rates, ingestOnce(b, reg.Namespace, rs, batches, events, uint64(window*1000000+rep*10000)))
			}
			b.Logf("window %d: events/s %.0f (reps %.0f)", window, median(rates), rates)
			b.ReportMetric(median(rates), fmt.Sprintf("events/s-window%d", window))
		}
	}
	b.Logf("index after the run: %+v", c.Index().Stats())
}

// latencies measures n round trips of each of two requests, interleaved,
// and returns them sorted.
func latencies(b *testing.B, n int, calls ...func() error) [][]time.Duration {
	out := make([][]time.Duration, len(calls))
	for range n {
		for i, f := range calls {
			t0 := time.Now()
			if err := f(); err != nil {
				b.Fatal(err)
			}
			out[i] = append(out[i], time.Since(t0))
		}
	}
	for _, d := range out {
		slices.Sort(d)
	}
	return out
}

func pct(d []time.Duration, q float64) time.Duration { return d[int(q*float64(len(d)-1))] }

// BenchmarkLookupThroughNATS: a 128-chunk chain over 8 shards, looked up
// through the coordinator, against a bare NATS request/reply of the same
// request and reply sizes on the same server (an echo on its own
// connection), interleaved in the same run; idle, then while 8 ranks
// ingest through rankd's publisher. Each phase also times the chain's
// restore.begin with Lookup set, the vLLM connector's lookup (its rows
// "idle-begin" and "ingest-begin").
func BenchmarkLookupThroughNATS(b *testing.B) {
	const shards, nchunks, samples = 8, 128, 3000
	// Room for every begin of a measurement (cancelled after it).
	c := benchCoordinator(b, func(cfg *coordinator.Config) {
		cfg.MaxActiveRestores = max(cfg.MaxActiveRestores, 4*samples*benchReps())
		cfg.MaxActiveRestoresPerInstance = max(cfg.MaxActiveRestoresPerInstance, 4*samples*benchReps())
	})
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	nc := benchConnect(b, c, auth.Engine("eng"))
	ctx := context.Background()
	reg, err := bus.Call[wire.RegisterReply](ctx, nc, subj.EngineCoord("eng", wire.CoordRegister), benchSpec(shards))
	if err != nil {
		b.Fatal(err)
	}
	ns := reg.Namespace
	chunks := benchChain(ns, nchunks, 1)
	stored := startBenchRanks(b, c, "eng", shards, 8)
	for _, br := range stored {
		if err := br.pub.Publish(br.batch(ns, chunks)); err != nil {
			b.Fatal(err)
		}
		br.waitApplied(b)
	}
	lreq := wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: "eng"}
	jsonReq, err := jsonBytes(lreq)
	if err != nil {
		b.Fatal(err)
	}
	req, err := lreq.MarshalBinary() // the compact form (wire/lookup.go)
	if err != nil {
		b.Fatal(err)
	}
	lookupSubj := subj.EngineCoord("eng", wire.CoordLookup)
	probe, err := nc.Request(lookupSubj, req, 10*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	rep, err := decodeLookup(probe.Data)
	if err != nil || rep.Prefix != nchunks {
		b.Fatalf("lookup = %+v, %v (%s)", rep, err, probe.Data)
	}
	// The bare request/reply: same server, its own connection, a reply of
	// the lookup reply's size, on a subject the engine may request and a
	// rankd may answer (its engine API), so with auth on both sides pass
	// the same permission checks as the lookup.
	echoNC := benchConnect(b, c, auth.Rankd(wire.Rank{Instance: "eng", TPRank: 0}))
	echoReply := make([]byte, len(probe.Data))
	echoSubj := subj.Engine(wire.Rank{Instance: "eng", TPRank: 0}, "echo")
	if _, err := echoNC.Subscribe(echoSubj, func(m *nats.Msg) { _ = m.Respond(echoReply) }); err != nil {
		b.Fatal(err)
	}
	if err := echoNC.Flush(); err != nil {
		b.Fatal(err)
	}
	lookup := func() error {
		m, err := nc.Request(lookupSubj, req, 10*time.Second)
		if err == nil && len(m.Data) != len(probe.Data) {
			err = fmt.Errorf("lookup reply %d B, want %d B: %s", len(m.Data), len(probe.Data), m.Data)
		}
		return err
	}
	echo := func() error {
		_, err := nc.Request(echoSubj, req, 10*time.Second)
		return err
	}
	lookupJSON := func() error {
		_, err := nc.Request(lookupSubj, jsonReq, 10*time.Second)
		return err
	}
	echoJSON := func() error {
		_, err := nc.Request(echoSubj, jsonReq, 10*time.Second)
		return err
	}
	b.Logf("request %d B binary (%d B JSON), reply %d B", len(req), len(jsonReq), len(probe.Data))

	// The engine's lookup since 60317c6 is a restore.begin with Lookup set
	// (one round trip for the lookup and the plan); this one asks the
	// chain's plan in binary. Each takes a restore slot: cancelBegun
	// cancels them after each measurement, outside the timing (the
	// coordinator above has room for a measurement's begins).
	breq := wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: ns, Chunks: chunks}, Instance: "eng",
		PlanEncoding: wire.PlanEncodingBinary, Lookup: true}
	beginReq, err := breq.MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	beginSubj := subj.EngineCoord("eng", wire.CoordRestoreBegin)
	var begunMu sync.Mutex
	var begun []string
	beginOn := func(nc *nats.Conn) error {
		m, err := nc.Request(beginSubj, beginReq, 10*time.Second)
		if err != nil {
			return err
		}
		plan, err := wire.DecodePlanBinary(m.Data, chunks)
		if err != nil {
			return fmt.Errorf("restore.begin: %w: %.200s", err, m.Data)
		}
		if plan.Prefix != nchunks {
			return fmt.Errorf("restore.begin: prefix %d of %d (%s)", plan.Prefix, nchunks, plan.Reason)
		}
		begunMu.Lock()
		begun = append(begun, plan.RestoreID)
		begunMu.Unlock()
		return nil
	}
	begin := func() error { return beginOn(nc) }
	lookupOn := func(nc *nats.Conn) error {
		m, err := nc.Request(lookupSubj, req, 10*time.Second)
		if err == nil && len(m.Data) != len(probe.Data) {
			err = fmt.Errorf("lookup reply %d B, want %d B: %s", len(m.Data), len(probe.Data), m.Data)
		}
		return err
	}
	// Several engines at once (the connector's lookups of a batch's
	// requests, from every instance of a share group): begins against
	// lookups, each from clients connections of its own, interleaved in
	// the same run.
	const clients = 4
	conns := make([]*nats.Conn, clients)
	for i := range conns {
		conns[i] = benchConnect(b, c, auth.Engine("eng"))
	}
	throughput := func(f func(*nats.Conn) error) float64 {
		t0 := time.Now()
		var wg sync.WaitGroup
		errs := make([]error, clients)
		for i, cn := range conns {
			wg.Go(func() {
				for range samples / clients {
					if errs[i] = f(cn); errs[i] != nil {
						return
					}
				}
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			b.Fatal(err)
		}
		return float64(clients*(samples/clients)) / time.Since(t0).Seconds()
	}
	cancelBegun := func() {
		for _, id := range begun {
			_, err := bus.Call[wire.CancelReply](ctx, nc, subj.EngineCoord("eng", wire.CoordRestoreCancel), wire.RestoreCancel{RestoreID: id})
			var we *wire.Error
			if err != nil && !(errors.As(err, &we) && we.Code == wire.CodeNotFound) { // not_found: its deadline passed
				b.Fatal(err)
			}
		}
		begun = begun[:0]
	}
	measure := func(label string, lookup, echo func() error) {
		var r50, r99, l50, l99, e50, e99 []float64
		for range benchReps() {
			d := latencies(b, samples, lookup, echo)
			l50, l99 = append(l50, us(pct(d[0], 0.5))), append(l99, us(pct(d[0], 0.99)))
			e50, e99 = append(e50, us(pct(d[1], 0.5))), append(e99, us(pct(d[1], 0.99)))
			r50 = append(r50, float64(pct(d[0], 0.5))/float64(pct(d[1], 0.5)))
			r99 = append(r99, float64(pct(d[0], 0.99))/float64(pct(d[1], 0.99)))
		}
		b.Logf("%s: lookup p50 %.0f us p99 %.0f us; bare p50 %.0f us p99 %.0f us; ratio p50 %.2f p99 %.2f (p99 ratios %.2f)",
			label, median(l50), median(l99), median(e50), median(e99), median(r50), median(r99), r99)
		b.ReportMetric(median(l99), label+"-lookup-p99-us")
		b.ReportMetric(median(e99), label+"-bare-p99-us")
		b.ReportMetric(median(r50), label+"-ratio-p50")
		b.ReportMetric(median(r99), label+"-ratio-p99")
	}
	concurrent := func(label string) {
		var br, lr, ratio []float64
		for range benchReps() {
			l := throughput(lookupOn)
			bg := throughput(beginOn)
			cancelBegun()
			br, lr, ratio = append(br, bg), append(lr, l), append(ratio, bg/l)
		}
		b.Logf("%s: %d clients at once: begins %.0f/s, lookups %.0f/s, ratio %.2f (ratios %.2f)",
			label, clients, median(br), median(lr), median(ratio), ratio)
		b.ReportMetric(median(br), label+"-begins/s")
		b.ReportMetric(median(ratio), label+"-begin-lookup-ratio")
	}
	for b.Loop() {
		measure("idle", lookup, echo)
		measure("idle-json", lookupJSON, echoJSON)
		measure("idle-begin", begin, echo)
		cancelBegun()
		concurrent("idle-x4")

		// Under ingest: 8 ranks publishing batches of 1024 without pause.
		ingest := startBenchRanks(b, c, "load", shards, DefaultConfig(wire.Rank{}).EventWindow)
		var stop atomic.Bool
		var events atomic.Int64
		var wg sync.WaitGroup
		for i, br := range ingest {
			wg.Go(func() {
				for seed := uint64(1 << 30); !stop.Load(); seed++ {
					if br.pub.pending() > 16 {
						time.Sleep(200 * time.Microsecond)
						continue
					}
					if br.pub.Publish(br.batch(ns, benchChain(ns, 1024, seed*16+uint64(i)))) == nil {
						events.Add(1024)
					}
				}
				br.waitApplied(b)
			})
		}
		time.Sleep(500 * time.Millisecond) // let ingest reach its pace
		e0, t0 := events.Load(), time.Now()
		measure("ingest", lookup, echo)
		measure("ingest-begin", begin, echo)
		cancelBegun()
		concurrent("ingest-x4")
		rate := float64(events.Load()-e0) / time.Since(t0).Seconds()
		stop.Store(true)
		wg.Wait()
		b.Logf("ingest during the measurement: %.0f events/s published", rate)
		b.ReportMetric(rate, "ingest-events/s")
	}
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

func jsonBytes(v any) ([]byte, error) { return json.Marshal(v) }

func decodeLookup(data []byte) (*wire.LookupReply, error) {
	var rep wire.Reply[wire.LookupReply]
	if err := json.Unmarshal(data, &rep); err != nil {
		return nil, err
	}
	if rep.Error != nil {
		return nil, rep.Error
	}
	return rep.OK, nil
}
