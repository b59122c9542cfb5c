package rankd

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"runtime/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/coordinator"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// BenchmarkShareScaleThroughNATS measures issue 26 item 5: the
// coordinator's scale targets with share-group lookups included, on the
// production path of the other NATS benchmarks (embedded NATS with auth
// on, bbolt with fsync, rankd's publisher). The four replay instances
// (shareMembers) form one share group; the first one's 8 ranks hold a
// 128-chunk chain in L2, and the second one looks it up, so every chunk of
// its plan is another member's copy (the lookup that a share group adds).
// A bare NATS request/reply of the same request and reply sizes (an echo
// on the same server, answered on a rankd's engine subject) is interleaved
// with every lookup. It measures, in order:
//
//	idle: the lookup and the bare echo, p50/p99 and the ratio of the p99s;
//	ingest: publishers publishing batches at full speed (each keeping at
//	  most KVTIER_SCALE_QUEUE batches queued), events/s acknowledged
//	  (acknowledged = committed with fsync, C7) over KVTIER_SCALE_SECONDS;
//	under ingest: the lookup and the bare echo again, while the
//	  publishers go on, and the events/s acknowledged meanwhile.
//
// KVTIER_SCALE_CPUPROFILE=FILE writes a CPU profile of the ingest window.
//
// Knobs (the 16-core host runs more publishers than the 2-core VM):
// KVTIER_SCALE_PUBLISHERS (default 8, at most 32: ranks of the TP8
// instances eng, load, ingest-w8 and ingest-w1), KVTIER_SCALE_BATCH
// (events per batch, default 1024, the engine's), KVTIER_SCALE_WINDOW
// (the publisher's window, default rankd's), KVTIER_SCALE_QUEUE (default
// 16), KVTIER_SCALE_SECONDS (default 5), KVTIER_SCALE_SAMPLES (lookups
// per repetition, default 3000), KVTIER_BENCH_REPS (repetitions of each
// latency measurement, default 3; the median is reported). Every stored
// event is a new chunk, as in BenchmarkIngestThroughNATS, so the index
// grows by the events ingested (about 700 B of heap each). It fails when
// a share lookup does not plan the whole chain or the coordinator's
// kvtier_coord_share_lookups_total stays 0.
//
//	go test -run '^$' -bench ShareScaleThroughNATS -benchtime 1x ./rankd/
func BenchmarkShareScaleThroughNATS(b *testing.B) {
	const shards, nchunks = 8, 128
	publishers := envInt(b, "KVTIER_SCALE_PUBLISHERS", 8)
	batchEvents := envInt(b, "KVTIER_SCALE_BATCH", 1024)
	window := envInt(b, "KVTIER_SCALE_WINDOW", DefaultConfig(wire.Rank{}).EventWindow)
	queue := envInt(b, "KVTIER_SCALE_QUEUE", 16)
	seconds := envInt(b, "KVTIER_SCALE_SECONDS", 5)
	samples := envInt(b, "KVTIER_SCALE_SAMPLES", 3000)
	ingestInstances := []string{"load", "ingest-w8", "ingest-w1", "eng"}
	if publishers > len(ingestInstances)*shards {
		b.Fatalf("KVTIER_SCALE_PUBLISHERS=%d: at most %d", publishers, len(ingestInstances)*shards)
	}
	holder, reader := shareMembers[0], shareMembers[1]

	reg := prometheus.NewRegistry()
	c := benchCoordinator(b, func(cfg *coordinator.Config) {
		cfg.Registry = reg
		cfg.ShareGroups = []coordinator.ShareGroup{{Name: shareGroup, Instances: shareMembers}}
	})
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	ctx := context.Background()
	spec := benchSpec(shards)
	var ns dcp.Namespace
	conns := make(map[string]*nats.Conn)
	for _, name := range shareMembers {
		nc := benchConnect(b, c, auth.Engine(name))
		rep, err := bus.Call[wire.RegisterReply](ctx, nc, subj.EngineCoord(name, wire.CoordRegister), spec)
		if err != nil {
			b.Fatal(err)
		}
		ns, conns[name] = rep.Namespace, nc
	}
	chunks := benchChain(ns, nchunks, 1)
	for _, br := range startBenchRanks(b, c, holder, shards, window) {
		bt := br.batch(ns, chunks)
		for i := range bt.Events {
			bt.Events[i].Tier = wire.L2 // a group shares L2 by default
		}
		if err := br.pub.Publish(bt); err != nil {
			b.Fatal(err)
		}
		br.waitApplied(b)
	}

	nc := conns[reader]
	req, err := (&wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: reader}).MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	lookupSubj := subj.EngineCoord(reader, wire.CoordLookup)
	probe, err := nc.Request(lookupSubj, req, 10*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	if rep, err := decodeLookup(probe.Data); err != nil || rep.Prefix != nchunks {
		b.Fatalf("%s's lookup of %s's chain = %+v, %v (%s): the share lookup hit nothing", reader, holder, rep, err, probe.Data)
	}
	// The bare request/reply, as BenchmarkLookupThroughNATS's: the reader
	// engine requests, its rank 0 answers with the lookup reply's size.
	echoNC := benchConnect(b, c, auth.Rankd(wire.Rank{Instance: reader}))
	echoReply := make([]byte, len(probe.Data))
	echoSubj := subj.Engine(wire.Rank{Instance: reader}, "echo")
	if _, err := echoNC.Subscribe(echoSubj, func(m *nats.Msg) { _ = m.Respond(echoReply) }); err != nil {
		b.Fatal(err)
	}
	if err := echoNC.Flush(); err != nil {
		b.Fatal(err)
	}
	lookup := func() error {
		m, err := nc.Request(lookupSubj, req, 10*time.Second)
		if err == nil && len(m.Data) != len(probe.Data) {
			// Another size is another plan: a miss, or an error.
			err = fmt.Errorf("share lookup reply %d B, want %d B: %s", len(m.Data), len(probe.Data), m.Data)
		}
		return err
	}
	echo := func() error {
		_, err := nc.Request(echoSubj, req, 10*time.Second)
		return err
	}
	b.Logf("share lookup: %s reads %s's %d chunks x %d shards (L2); request %d B, reply %d B; %d publishers, batches of %d, window %d, queue %d",
		reader, holder, nchunks, shards, len(req), len(probe.Data), publishers, batchEvents, window, queue)

	var ranks []*benchRank
	for i, name := range ingestInstances {
		if n := min(shards, publishers-i*shards); n > 0 {
			ranks = append(ranks, startBenchRanks(b, c, name, n, window)...)
		}
	}
	for b.Loop() {
		idle := measureRatio(b, "idle", samples, lookup, echo)

		in := startIngest(ns, ranks, batchEvents, queue)
		time.Sleep(500 * time.Millisecond) // let ingest reach its pace
		// Which stage caps it: with the writer (bbolt and its fsync) busy
		// nearly all the time, a commit's latency; else the committer's
		// CPU (a CPU profile shows index.(*Index).stage and land), or the
		// cores (the process's CPU).
		g0, cpu0 := groupStats(b, reg), processCPU(b)
		stopProfile := profileIngest(b)
		rate := in.ackedRate(time.Duration(seconds) * time.Second)
		stopProfile()
		g, cpu := groupStats(b, reg).since(g0), processCPU(b)-cpu0
		b.Logf("ingest: %.0f events/s acknowledged over %d s (%d publishers), process CPU %.1f cores; the index's group commits: %.1f/s, %.0f events each, %.2f ms from launch to landing (mean), writer busy %.0f %%",
			rate, seconds, publishers, cpu.Seconds()/float64(seconds), g.commits/float64(seconds), g.events/max(g.commits, 1),
			1e3*g.seconds/max(g.commits, 1), 100*g.seconds/float64(seconds))
		var under ratio
		duringRate := in.during(func() { under = measureRatio(b, "ingest", samples, lookup, echo) })
		b.Logf("ingest during the lookups: %.0f events/s acknowledged", duringRate)
		in.stop(b)

		b.ReportMetric(rate, "ingest-events/s")
		b.ReportMetric(duringRate, "ingest-during-lookups-events/s")
		b.ReportMetric(idle.r99, "idle-ratio-p99")
		b.ReportMetric(under.r99, "ingest-ratio-p99")
		b.ReportMetric(idle.l99, "idle-lookup-p99-us")
		b.ReportMetric(under.l99, "ingest-lookup-p99-us")
	}
	if n := counterValue(b, reg, "kvtier_coord_share_lookups_total"); n == 0 {
		b.Fatal("no lookup read another member's copy (kvtier_coord_share_lookups_total 0): the group was not used")
	} else {
		b.Logf("share lookups: %d; index after the run: %+v", n, c.Index().Stats())
	}
}

// ratio is one latency measurement's medians over the repetitions: the
// lookup's and the bare echo's p50 and p99 (us), and the p99s' ratio.
type ratio struct{ l50, l99, e50, e99, r99 float64 }

// measureRatio measures samples interleaved round trips of lookup and echo,
// benchReps() times, and logs and returns the medians.
func measureRatio(b *testing.B, label string, samples int, lookup, echo func() error) ratio {
	var l50, l99, e50, e99, r99 []float64
	for range benchReps() {
		d := latencies(b, samples, lookup, echo)
		l50, l99 = append(l50, us(pct(d[0], 0.5))), append(l99, us(pct(d[0], 0.99)))
		e50, e99 = append(e50, us(pct(d[1], 0.5))), append(e99, us(pct(d[1], 0.99)))
		r99 = append(r99, float64(pct(d[0], 0.99))/float64(pct(d[1], 0.99)))
	}
	r := ratio{median(l50), median(l99), median(e50), median(e99), median(r99)}
	b.Logf("%s: share lookup p50 %.0f us p99 %.0f us; bare p50 %.0f us p99 %.0f us; ratio p50 %.2f p99 %.2f (p99 ratios %.2f)",
		label, r.l50, r.l99, r.e50, r.e99, r.l50/r.e50, r.r99, r99)
	return r
}

// ingest is the publishers' full-speed load: each publishes batches of new
// chunks while it holds fewer than queue unacknowledged ones.
type ingest struct {
	ranks       []*benchRank
	batchEvents int
	published   []atomic.Int64 // batches, per rank
	halt        atomic.Bool
	wg          sync.WaitGroup
}

// profileIngest starts a CPU profile of the ingest window alone when
// KVTIER_SCALE_CPUPROFILE names a file (-test.cpuprofile would also take
// the idle lookups and the final fold at Close); the returned func stops
// it.
func profileIngest(b *testing.B) func() {
	path := os.Getenv("KVTIER_SCALE_CPUPROFILE")
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		b.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

func startIngest(ns dcp.Namespace, ranks []*benchRank, batchEvents, queue int) *ingest {
	in := &ingest{ranks: ranks, batchEvents: batchEvents, published: make([]atomic.Int64, len(ranks))}
	for i, br := range ranks {
		in.wg.Go(func() {
			// Chunk hashes from a counter: the index takes a stored chunk's
			// hash as given, and hashing tokens would spend the cores the
			// coordinator is measured on.
			var next uint64
			for !in.halt.Load() {
				if br.pub.pending() >= queue {
					time.Sleep(100 * time.Microsecond)
					continue
				}
				bt := wire.Batch{Rank: br.r, Incarnation: 1, Events: make([]wire.Event, batchEvents)}
				for j := range bt.Events {
					var ch dcp.ChunkHash
					binary.LittleEndian.PutUint64(ch[:], next)
					binary.LittleEndian.PutUint64(ch[8:], uint64(i)+1<<32)
					next++
					bt.Events[j] = br.event(wire.Stored, wire.L1, dcp.Key{NS: ns, Chunk: ch, Shard: uint16(br.r.TPRank)}, 2048, next)
				}
				if br.pub.Publish(bt) != nil {
					br.seq -= uint64(batchEvents) // not taken: the same sequence numbers again
					next -= uint64(batchEvents)
					time.Sleep(time.Millisecond)
					continue
				}
				in.published[i].Add(1)
			}
		})
	}
	return in
}

// acked is the events acknowledged so far: published less those still held.
func (in *ingest) acked() int64 {
	var n int64
	for i, br := range in.ranks {
		n += (in.published[i].Load() - int64(br.pub.pending())) * int64(in.batchEvents)
	}
	return n
}

// ackedRate returns the events/s acknowledged over d.
func (in *ingest) ackedRate(d time.Duration) float64 {
	return in.during(func() { time.Sleep(d) })
}

// during runs f and returns the events/s acknowledged while it ran.
func (in *ingest) during(f func()) float64 {
	a0, t0 := in.acked(), time.Now()
	f()
	return float64(in.acked()-a0) / time.Since(t0).Seconds()
}

// stop ends the publishers and waits until all they published is applied.
func (in *ingest) stop(b *testing.B) {
	in.halt.Store(true)
	in.wg.Wait()
	for _, br := range in.ranks {
		br.waitApplied(b)
	}
}

// commitStats are the index's group commit histograms' counts and sums.
type commitStats struct{ commits, seconds, events float64 }

func groupStats(b *testing.B, reg *prometheus.Registry) commitStats {
	mfs, err := reg.Gather()
	if err != nil {
		b.Fatal(err)
	}
	var s commitStats
	for _, mf := range mfs {
		switch mf.GetName() {
		case "kvtier_index_commit_seconds":
			h := mf.GetMetric()[0].GetHistogram()
			s.commits, s.seconds = float64(h.GetSampleCount()), h.GetSampleSum()
		case "kvtier_index_group_events":
			s.events = mf.GetMetric()[0].GetHistogram().GetSampleSum()
		}
	}
	return s
}

func (s commitStats) since(o commitStats) commitStats {
	return commitStats{s.commits - o.commits, s.seconds - o.seconds, s.events - o.events}
}

// processCPU is the CPU time the process has used, user and system.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// envInt is the positive integer in the environment variable name, else
// def.
func envInt(b *testing.B, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		b.Fatalf("%s=%q: want a positive integer", name, s)
	}
	return n
}
