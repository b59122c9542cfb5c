package coordinator

import (
	"encoding/json"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// Benchmarks: timings with ratios against a ceiling measured in the same
// run (STYLE 18). Run with: go test -run '^$' -bench . ./coordinator/

// benchCoord is a coordinator with logging off, after edits.
func benchCoord(b *testing.B, edits ...func(*Config)) *Coordinator {
	return startCoord(b, func(cfg *Config) {
		cfg.Logger = zap.NewNop()
		cfg.Cluster.Logger = zap.NewNop()
		for _, edit := range edits {
			edit(cfg)
		}
	})
}

// ingestBatches builds, per rank, batches of n events each storing a new
// object (L1), sequence-numbered from 1.
func ingestBatches(ns dcp.Namespace, ranks, batches, n int) [][]*wire.Batch {
	out := make([][]*wire.Batch, ranks)
	for tp := range ranks {
		r := wire.Rank{Instance: "bench", TPRank: tp}
		seq := uint64(0)
		for bi := range batches {
			chunks := chain(ns, n, uint32(tp*100000+bi))
			b := storeBatch(r, 1, seq, ns, chunks, wire.L1)
			seq += uint64(n)
			out[tp] = append(out[tp], b)
		}
	}
	return out
}

// BenchmarkIngest measures events/s applied durably through NATS (encode,
// request, decode, apply, commit, ack; one batch in flight per rank) and,
// side by side, straight into an index (the ceiling).
func BenchmarkIngest(b *testing.B) {
	const ranks, batches, events = 8, 8, 4096
	c := benchCoord(b)
	nc := connect(b, c)
	ns := register(b, nc, c.subj, testSpec(ranks))
	var natsRate, directRate float64
	for i := 0; b.Loop(); i++ {
		// Each iteration uses a fresh instance name so sequences start at 1.
		work := ingestBatches(ns, ranks, batches, events)
		inst := "bench" + string(rune('a'+i%26)) + time.Now().Format("150405.000000")
		inst = sanitize(inst)
		for _, bs := range work {
			for _, bt := range bs {
				bt.Rank.Instance = inst
			}
		}
		payloads := make([][][]byte, ranks)
		for tp, bs := range work {
			for _, bt := range bs {
				p, _ := bt.MarshalBinary()
				payloads[tp] = append(payloads[tp], p)
			}
		}
		t0 := time.Now()
		var wg sync.WaitGroup
		for tp := range ranks {
			wg.Go(func() {
				for bi, p := range payloads[tp] {
					msg, err := nc.Request(c.subj.Events(work[tp][bi].Rank), p, 30*time.Second)
					if err != nil {
						b.Error(err)
						return
					}
					var rep wire.Reply[wire.EventAck]
					if err := json.Unmarshal(msg.Data, &rep); err != nil || rep.Error != nil || rep.OK.AppliedThrough != uint64((bi+1)*events) {
						b.Errorf("ack %s", msg.Data)
						return
					}
				}
			})
		}
		wg.Wait()
		natsRate = float64(ranks*batches*events) / time.Since(t0).Seconds()

		// The ceiling: the same batches applied straight to an index.
		icfg := index.DefaultConfig()
		icfg.Path = filepath.Join(b.TempDir(), "direct.db")
		ix, err := index.Open(icfg)
		if err != nil {
			b.Fatal(err)
		}
		t0 = time.Now()
		for tp := range ranks {
			wg.Go(func() {
				for _, bt := range work[tp] {
					if _, err := ix.Apply(tctx(b), *bt); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		directRate = float64(ranks*batches*events) / time.Since(t0).Seconds()
		_ = ix.Close()
	}
	b.ReportMetric(natsRate, "events/s")
	b.ReportMetric(directRate, "direct-events/s")
	b.ReportMetric(natsRate/directRate, "ratio")
}

func sanitize(s string) string {
	out := []byte(s)
	for i, c := range out {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9') {
			out[i] = '-'
		}
	}
	return string(out)
}

// BenchmarkLookup measures a 128-chunk lookup over 8 shards through NATS
// (p50/p99 of the round trip) against the index's Lookup in the same run.
func BenchmarkLookup(b *testing.B) {
	const shards, nchunks = 8, 128
	c := benchCoord(b)
	nc := connect(b, c)
	ns := register(b, nc, c.subj, testSpec(shards))
	chunks := chain(ns, nchunks, 1)
	for tp := range shards {
		sendBatch(b, nc, c.subj, storeBatch(wire.Rank{Instance: "eng", TPRank: tp}, 1, 0, ns, chunks, wire.L1))
	}
	req := wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: "eng"}
	var viaNATS, direct []time.Duration
	for b.Loop() {
		t0 := time.Now()
		rep := call[wire.LookupReply](b, nc, c.subj.Coord(wire.CoordLookup), req)
		viaNATS = append(viaNATS, time.Since(t0))
		if rep.Prefix != nchunks {
			b.Fatalf("prefix %d", rep.Prefix)
		}
		t0 = time.Now()
		res, err := c.idx.Lookup("eng", ns, chunks)
		direct = append(direct, time.Since(t0))
		if err != nil || res.Prefix != nchunks {
			b.Fatal(err)
		}
	}
	p := func(d []time.Duration, q float64) time.Duration {
		slices.Sort(d)
		return d[int(q*float64(len(d)-1))]
	}
	b.ReportMetric(float64(p(viaNATS, 0.99).Microseconds()), "nats-p99-us")
	b.ReportMetric(float64(p(direct, 0.99).Microseconds()), "index-p99-us")
	b.ReportMetric(float64(p(viaNATS, 0.5).Microseconds()), "nats-p50-us")
}
