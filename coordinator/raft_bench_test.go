package coordinator

import (
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// BenchmarkRaftVsSingle measures, in one run, event ingest (events/s,
// applied and acknowledged; 8 ranks, one batch of 4096 events in flight
// each) and the p50/p99 of a 128-chunk, 8-shard lookup round trip, for one
// coordinator without raft and for three replicas (acknowledged after the
// quorum commit and the leader's index), and prints the ratios. Both run
// against the same kind of NATS: one in-process embedded server the
// coordinators connect to (an in-process shortcut: rankds' own publishers
// and separate processes are the e2e benchmark's). All replicas share this
// machine's cores and disk. Run:
//
//	go test -run '^$' -bench RaftVsSingle -benchtime 3x ./coordinator/
func BenchmarkRaftVsSingle(b *testing.B) {
	const ranks, batches, events, lookups = 8, 8, 4096, 2000
	quiet := func(c *Config) { c.Logger = zap.NewNop(); c.Cluster.Logger = zap.NewNop() }

	ecfg := bus.DefaultEmbeddedConfig()
	ecfg.Port, ecfg.Insecure = 0, true
	srv, err := bus.StartEmbedded(ecfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(srv.Shutdown)
	single := startCoord(b, func(c *Config) { quiet(c); c.NATSURL = srv.ClientURL(); c.HTTPAddr = "" })
	nc1 := connect(b, single)

	rc := newRaftCluster(b, 3, func(c *Config) {
		quiet(c)
		d := DefaultRaftConfig() // production timeouts, not the tests' short ones
		c.Raft.HeartbeatTimeout, c.Raft.ElectionTimeout, c.Raft.LeaderLeaseTimeout = d.HeartbeatTimeout, d.ElectionTimeout, d.LeaderLeaseTimeout
	})
	rc.leader()

	var retries atomic.Int64
	type result struct {
		rate     float64
		p50, p99 time.Duration
	}
	run := func(nc *nats.Conn, subj wire.Subjects, iter int, name string) result {
		ns := retryCall[wire.RegisterReply](b, nc, subj.Coord(wire.CoordRegister), testSpec(ranks)).Namespace
		work := ingestBatches(ns, ranks, batches, events)
		inst := sanitize(fmt.Sprintf("%s%d", name, iter))
		payloads := make([][][]byte, ranks)
		for tp, bs := range work {
			for _, bt := range bs {
				bt.Rank.Instance = inst
				p, _ := bt.MarshalBinary()
				payloads[tp] = append(payloads[tp], p)
			}
		}
		t0 := time.Now()
		var wg sync.WaitGroup
		for tp := range ranks {
			wg.Go(func() {
				for bi, p := range payloads[tp] {
					// Resend while nobody answers or the answer is
					// unavailable (an election), as a rankd does.
					for attempt := 0; ; attempt++ {
						if attempt == 200 {
							b.Errorf("batch %d of rank %d: no ack after %d attempts", bi, tp, attempt)
							return
						}
						msg, err := nc.Request(subj.Events(work[tp][bi].Rank), p, 30*time.Second)
						if err != nil {
							retries.Add(1)
							time.Sleep(10 * time.Millisecond)
							continue
						}
						var rep wire.Reply[wire.EventAck]
						if err := json.Unmarshal(msg.Data, &rep); err != nil {
							b.Errorf("ack %s", msg.Data)
							return
						}
						if rep.Error != nil && rep.Error.Code == wire.CodeUnavailable {
							retries.Add(1)
							continue
						}
						if rep.Error != nil || rep.OK.AppliedThrough != uint64((bi+1)*events) {
							b.Errorf("ack %s", msg.Data)
							return
						}
						break
					}
				}
			})
		}
		wg.Wait()
		res := result{rate: float64(ranks*batches*events) / time.Since(t0).Seconds()}
		chunks := make([]dcp.ChunkHash, 0, 128)
		for _, e := range work[0][0].Events[:128] {
			chunks = append(chunks, e.Key.Chunk)
		}
		// Every shard of those chunks: the batches of rank tp stored shard tp
		// of other chunks, so store the 8 shards of these 128 first.
		for tp := range ranks {
			r := wire.Rank{Instance: inst + "l", TPRank: tp}
			bt := storeBatch(r, 1, 0, ns, chunks, wire.L1)
			if name == "single" {
				if _, werr := sendBatch(b, nc, subj, bt); werr != nil {
					b.Fatal(werr)
				}
			} else if _, werr := rc.send(bt); werr != nil {
				b.Fatal(werr)
			}
		}
		req := wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: inst + "l"}
		d := make([]time.Duration, 0, lookups)
		for range lookups {
			t0 := time.Now()
			rep := retryCall[wire.LookupReply](b, nc, subj.Coord(wire.CoordLookup), req)
			d = append(d, time.Since(t0))
			if rep.Prefix != len(chunks) {
				b.Fatalf("%s lookup prefix %d, want %d", name, rep.Prefix, len(chunks))
			}
		}
		slices.Sort(d)
		res.p50, res.p99 = d[len(d)/2], d[len(d)*99/100]
		return res
	}
	var one, three result
	for i := 0; b.Loop(); i++ {
		one = run(nc1, single.subj, i, "single")
		three = run(rc.nc, rc.subj, i, "raft")
	}
	b.ReportMetric(one.rate, "single-events/s")
	b.ReportMetric(three.rate, "raft3-events/s")
	b.ReportMetric(three.rate/one.rate, "ingest-ratio")
	b.ReportMetric(float64(one.p99.Microseconds()), "single-lookup-p99-us")
	b.ReportMetric(float64(three.p99.Microseconds()), "raft3-lookup-p99-us")
	b.ReportMetric(float64(one.p50.Microseconds()), "single-lookup-p50-us")
	b.ReportMetric(float64(three.p50.Microseconds()), "raft3-lookup-p50-us")
	b.ReportMetric(float64(three.p99)/float64(one.p99), "lookup-p99-ratio")
	b.ReportMetric(float64(retries.Load()), "resends")
	b.ReportMetric(testutil.Metric(b, rc.nodes[rc.leader()].reg, "kvtier_raft_leader_changes_total"), "leader-changes-seen")
}

// BenchmarkRaftFailover measures, per iteration, the time from stopping
// the leader of three replicas (Shutdown without leaving the raft
// configuration) to a lookup answered by the new leader through NATS,
// with the production raft timeouts; it reports p50, p99 and max over the
// iterations. In-process: the stopped node's process does not die, its
// sockets close (a kill -9 in e2e leaves peers to time out the same way).
//
//	go test -run '^$' -bench RaftFailover -benchtime 20x ./coordinator/
func BenchmarkRaftFailover(b *testing.B) {
	rc := newRaftCluster(b, 3, func(c *Config) { c.Logger = zap.NewNop(); c.Cluster.Logger = zap.NewNop() })
	rc.leader()
	ns, chunks := rc.storeFixture(16)
	req := wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: "eng"}
	var took []time.Duration
	for b.Loop() {
		l := rc.leader()
		t0 := time.Now()
		rc.stop(l)
		for {
			rep, err := bus.Call[wire.LookupReply](tctx(b), rc.nc, rc.subj.Coord(wire.CoordLookup), req)
			if err == nil && rep.Prefix == len(chunks) {
				break
			}
			time.Sleep(time.Millisecond)
		}
		took = append(took, time.Since(t0))
		rc.start(l)
	}
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Milliseconds()), "failover-p50-ms")
	b.ReportMetric(float64(took[len(took)*99/100].Milliseconds()), "failover-p99-ms")
	b.ReportMetric(float64(took[len(took)-1].Milliseconds()), "failover-max-ms")
}
