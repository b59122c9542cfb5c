package coordinator

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// BenchmarkRaftApply measures raft apply through three replicas on
// loopback (issue 28.4: the cost of the raft port's TLS): the latency of
// one event batch (16 events) proposed at a time, from the NATS request to
// the leader's acknowledgement (committed on a quorum and applied by the
// leader's index), p50 and p99 over 300 batches; and the throughput of 8
// ranks each with one batch of 256 events in flight (40 batches each). In
// process (one NATS server, three coordinators sharing the machine's cores
// and disk); run it on the same machine before and after a transport
// change:
//
//	go test -run '^$' -bench RaftApply -benchtime 3x ./coordinator/
func BenchmarkRaftApply(b *testing.B) {
	const seqBatches, seqEvents, ranks, parBatches, parEvents = 300, 16, 8, 40, 256
	rc := newRaftCluster(b, 3, func(c *Config) {
		c.Logger, c.Cluster.Logger = zap.NewNop(), zap.NewNop()
		d := DefaultRaftConfig()
		c.Raft.HeartbeatTimeout, c.Raft.ElectionTimeout, c.Raft.LeaderLeaseTimeout = d.HeartbeatTimeout, d.ElectionTimeout, d.LeaderLeaseTimeout
	})
	rc.leader()
	ns := retryCall[wire.RegisterReply](b, rc.nc, rc.subj.Coord(wire.CoordRegister), testSpec(ranks)).Namespace
	var lat []time.Duration
	var seqRate, parRate float64
	for i := 0; b.Loop(); i++ {
		// One at a time: latency.
		r := wire.Rank{Instance: fmt.Sprintf("seq%d", i), TPRank: 0}
		chunks := chain(ns, seqBatches*seqEvents, uint32(1000+i))
		t0 := time.Now()
		for k := range seqBatches {
			bt := storeBatch(r, 1, uint64(k*seqEvents), ns, chunks[k*seqEvents:(k+1)*seqEvents], wire.L2)
			s := time.Now()
			if ack, werr := rc.send(bt); werr != nil || ack.AppliedThrough != uint64((k+1)*seqEvents) {
				b.Fatalf("batch %d: %+v %v", k, ack, werr)
			}
			lat = append(lat, time.Since(s))
		}
		seqRate = float64(seqBatches) / time.Since(t0).Seconds()
		// 8 ranks, one batch each in flight: throughput.
		inst := fmt.Sprintf("par%d", i)
		t0 = time.Now()
		var wg sync.WaitGroup
		for tp := range ranks {
			wg.Go(func() {
				r := wire.Rank{Instance: inst, TPRank: tp}
				chunks := chain(ns, parBatches*parEvents, uint32(5000+100*i+tp))
				for k := range parBatches {
					bt := storeBatch(r, 1, uint64(k*parEvents), ns, chunks[k*parEvents:(k+1)*parEvents], wire.L2)
					if ack, werr := rc.send(bt); werr != nil || ack.AppliedThrough != uint64((k+1)*parEvents) {
						b.Errorf("rank %d batch %d: %+v %v", tp, k, ack, werr)
						return
					}
				}
			})
		}
		wg.Wait()
		parRate = float64(ranks*parBatches*parEvents) / time.Since(t0).Seconds()
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "apply-p50-us")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "apply-p99-us")
	b.ReportMetric(seqRate, "seq-batches/s")
	b.ReportMetric(parRate, "par-events/s")
}
