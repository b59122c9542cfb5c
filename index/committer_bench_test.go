package index_test

import (
	"path/filepath"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
)

// BenchmarkCommitterIngest measures the committer alone, in process (fsync
// on, no NATS): 8 ranks each keep KVTIER_BENCH_QUEUE (default 16) batches
// of 1,024 events in flight with ApplyAsync, every event a new chunk (the
// worst case of issue 26.5's NATS benchmark, BenchmarkShareScaleThroughNATS
// in rankd), KVTIER_BENCH_EVENTS events in all (default 4 M). It reports
// events/s acknowledged; the coordinator's durable ingest cannot go faster
// than this. KVTIER_BENCH_FAN sets Config.PublishFan (default the default's);
// KVTIER_BENCH_SHARED=1 has the 8 ranks store their shards of the same
// chunks, as the ranks of a TP8 engine do (a new chunk per 8 events).
//
//	go test -run '^$' -bench CommitterIngest -benchtime 1x ./index/
func BenchmarkCommitterIngest(b *testing.B) {
	const ranks, batch = 8, 1024
	total := envInt(b, "KVTIER_BENCH_EVENTS", 4<<20)
	queue := envInt(b, "KVTIER_BENCH_QUEUE", 16)
	shared := envInt(b, "KVTIER_BENCH_SHARED", 0) == 1
	per := total / ranks / batch
	for b.Loop() {
		cfg := index.DefaultConfig()
		cfg.Path = filepath.Join(b.TempDir(), "index.db")
		cfg.Logger = zap.NewNop()
		cfg.PublishFan = envInt(b, "KVTIER_BENCH_FAN", cfg.PublishFan)
		ix, ns := openBenchIndex(b, cfg, ranks)
		// Batches built first: the producers only enqueue.
		work := make([][]wire.Batch, ranks)
		for tp := range ranks {
			r := wire.Rank{Instance: "commit", TPRank: tp}
			for bi := range per {
				bt := wire.Batch{Rank: r, Incarnation: 1, Events: make([]wire.Event, batch)}
				for e := range batch {
					seq := uint64(bi*batch + e + 1)
					seed := uint64(tp + 1)
					if shared {
						seed = 0 // every rank stores its shard of the same chunks, as a TP group does
					}
					k := dcp.Key{NS: ns, Chunk: indextest.Chunk(seed, seq), Shard: uint16(tp)}
					bt.Events[e] = wire.Event{Seq: seq, Kind: wire.Stored, Tier: wire.L1, Key: k, Size: 2048, Sum: seq}
				}
				work[tp] = append(work[tp], bt)
			}
		}
		var wg sync.WaitGroup
		t0 := time.Now()
		for tp := range ranks {
			wg.Go(func() {
				q := make([]*index.Pending, 0, queue)
				for _, bt := range work[tp] {
					if len(q) == queue {
						if _, err := q[0].Wait(); err != nil {
							b.Error(err)
							return
						}
						q = q[1:]
					}
					p, err := ix.ApplyAsync(ctx, bt)
					if err != nil {
						b.Error(err)
						return
					}
					q = append(q, p)
				}
				for _, p := range q {
					if o, err := p.Wait(); err != nil || o.Applied != batch {
						b.Errorf("outcome %+v, %v", o, err)
						return
					}
				}
			})
		}
		wg.Wait()
		el := time.Since(t0)
		n := float64(ranks * per * batch)
		b.ReportMetric(n/el.Seconds(), "events/s")
		b.Logf("%.0f events in %v: %.0f k events/s", n, el, n/el.Seconds()/1e3)
		b.StopTimer()
		if err := ix.Close(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}

// openBenchIndex opens an index with cfg and registers the benchmarks'
// TP-tp namespace in it.
func openBenchIndex(b *testing.B, cfg index.Config, tp int) (*index.Index, dcp.Namespace) {
	ix, err := index.Open(cfg)
	if err != nil {
		b.Fatal(err)
	}
	res, err := ix.RegisterNamespace(ctx, benchGQA(tp))
	if err != nil {
		b.Fatal(err)
	}
	return ix, res.Namespace
}
