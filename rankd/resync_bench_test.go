package rankd

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// BenchmarkResyncThroughNATS: a rank holding 1 M objects (L2, shard 0 of
// 1 M chunks) is resynced by a real coordinator (embedded NATS, bbolt with
// fsync, auth on) from rankd's own inventory responder (inventoryServer,
// snapshots and paging as the daemon runs them) over a synthetic
// inventory. A gap in the rank's events starts each resync, as in
// production; it ends when the index shows the inventory's sequence.
// First quiet, then while 2 other ranks ingest batches of 256 events one
// round trip at a time, whose acknowledgement latencies during the resync
// are reported. Medians of benchReps() repetitions:
//
//	go test -run '^$' -bench ResyncThroughNATS -benchtime 1x ./rankd/
func BenchmarkResyncThroughNATS(b *testing.B) {
	const objects, loaders, loadEvents = 1 << 20, 2, 256
	c := benchCoordinator(b)
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	ctx := context.Background()
	eng := benchConnect(b, c, auth.Engine("eng"))
	reg, err := bus.Call[wire.RegisterReply](ctx, eng, subj.EngineCoord("eng", wire.CoordRegister), benchSpec(8))
	if err != nil {
		b.Fatal(err)
	}
	ns := reg.Namespace
	rk := wire.Rank{Instance: "eng", TPRank: 0}
	inv := wire.Inventory{Rank: rk, Incarnation: 1, Objects: make([]wire.Placement, objects)}
	for i := range inv.Objects {
		inv.Objects[i] = wire.Placement{Key: dcp.Key{NS: ns, Chunk: benchHash(1, uint64(i))}, Tier: wire.L2,
			Size: 2048, Sum: uint64(i) + 1}
	}
	// The rank's connection: its events, and its inventory responder.
	rnc := benchConnect(b, c, auth.Rankd(rk))
	var seq atomic.Uint64 // the sequence the inventory is taken at
	var served atomic.Int64
	srv := &inventoryServer{snaps: newSnapshots(time.Minute, 4), pageSize: DefaultConfig(wire.Rank{}).InventoryPageSize,
		log: zap.NewNop(), inventory: func(string) wire.Inventory {
			cp := inv
			cp.Seq = seq.Load()
			return cp
		}}
	sub, err := rnc.Subscribe(subj.Inventory(rk), func(m *nats.Msg) {
		go func() {
			_, n, err := srv.serve(m)
			if err != nil {
				b.Error(err)
			}
			served.Add(int64(n))
		}()
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = sub.Unsubscribe() })

	// Fill the index with the rank's objects through its events.
	const fill = 4096
	for lo := 0; lo < objects; lo += fill {
		bt := wire.Batch{Rank: rk, Incarnation: 1}
		for i := lo; i < min(lo+fill, objects); i++ {
			ob := &inv.Objects[i]
			bt.Events = append(bt.Events, wire.Event{Seq: uint64(i) + 1, Kind: wire.Stored, Tier: ob.Tier, Key: ob.Key, Size: ob.Size, Sum: ob.Sum})
		}
		if ack := sendBatch(b, rnc, subj.Events(rk), &bt); ack.AppliedThrough != uint64(min(lo+fill, objects)) {
			b.Fatalf("fill: ack %+v", ack)
		}
	}
	last := uint64(objects)
	b.Logf("index filled: %+v", c.Index().Stats())

	// resyncOnce makes the rank announce a gap and waits for the resync.
	resyncOnce := func() (time.Duration, int64) {
		next := last + 2
		seq.Store(next)
		served.Store(0)
		t0 := time.Now()
		bt := wire.Batch{Rank: rk, Incarnation: 1, Events: []wire.Event{{Seq: next, Kind: wire.Stored, Tier: wire.L2,
			Key: inv.Objects[0].Key, Size: 2048, Sum: 1}}}
		if ack := sendBatch(b, rnc, subj.Events(rk), &bt); !ack.Resync {
			b.Fatalf("gap batch: ack %+v, want a resync", ack)
		}
		deadline := t0.Add(5 * time.Minute)
		for {
			if ri, ok := c.Index().Rank(rk); ok && ri.LastSeq == next {
				break
			}
			if time.Now().After(deadline) {
				b.Fatal("resync never landed")
			}
			time.Sleep(200 * time.Microsecond)
		}
		took := time.Since(t0)
		last = next
		return took, served.Load()
	}

	for b.Loop() {
		var quiet, quietBytes []float64
		for range benchReps() {
			d, n := resyncOnce()
			quiet, quietBytes = append(quiet, d.Seconds()), append(quietBytes, float64(n))
		}
		b.Logf("quiet: resync %.3f s (reps %.3f), %.1f MiB on the wire", median(quiet), quiet, median(quietBytes)/(1<<20))
		b.ReportMetric(median(quiet), "s-resync-quiet")
		b.ReportMetric(median(quietBytes), "B-wire")

		var busy, worst, p99s, p50s []float64
		ld := newLoaders(b, c, loaders)
		for rep := range benchReps() {
			ld.run(b, ns, loadEvents)
			time.Sleep(300 * time.Millisecond) // let the loaders reach their pace
			t0 := time.Now()
			d, _ := resyncOnce()
			lat := ld.stop(t0, t0.Add(d))
			// The same window without a resync, for comparison.
			ld.run(b, ns, loadEvents)
			q0 := time.Now()
			time.Sleep(d)
			base := ld.stop(q0, q0.Add(d))
			b.Logf("rep %d: without a resync, over as long: %d acks: p99 %.2f ms max %.2f ms", rep, len(base),
				us(pct(base, 0.99))/1e3, us(base[len(base)-1])/1e3)
			busy = append(busy, d.Seconds())
			worst = append(worst, us(lat[len(lat)-1])/1e3)
			p99s = append(p99s, us(pct(lat, 0.99))/1e3)
			p50s = append(p50s, us(pct(lat, 0.5))/1e3)
			b.Logf("rep %d: resync %.3f s; %d acks of %d loaders during it: p50 %.2f ms p99 %.2f ms max %.2f ms",
				rep, d.Seconds(), len(lat), loaders, p50s[rep], p99s[rep], worst[rep])
		}
		b.Logf("%d ranks ingesting: resync %.3f s (reps %.3f); their acks during it: p50 %.2f ms, p99 %.2f ms (reps %.2f), longest %.2f ms (reps %.2f)",
			loaders, median(busy), busy, median(p50s), median(p99s), p99s, median(worst), worst)
		b.ReportMetric(median(busy), "s-resync-busy")
		b.ReportMetric(median(p99s), "ms-ack-p99")
		b.ReportMetric(median(worst), "ms-ack-max")
	}
	b.Logf("index after the run: %+v", c.Index().Stats())
}

// benchHash is a synthetic chunk hash: unique per (space, i).
func benchHash(space, i uint64) dcp.ChunkHash {
	var h dcp.ChunkHash
	binary.BigEndian.PutUint64(h[:8], space)
	binary.BigEndian.PutUint64(h[8:], i)
	return h
}

// sendBatch sends one binary batch as rankd's publisher does and returns
// its acknowledgement.
func sendBatch(b *testing.B, nc *nats.Conn, subject string, bt *wire.Batch) *wire.EventAck {
	data, err := bt.MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	m, err := nc.Request(subject, data, time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	var rep wire.Reply[wire.EventAck]
	if err := json.Unmarshal(m.Data, &rep); err != nil {
		b.Fatal(err)
	}
	if rep.Error != nil || rep.OK == nil {
		b.Fatalf("batch of %s refused: %+v", bt.Rank, rep.Error)
	}
	return rep.OK
}

// loaders are ranks ingesting batches one round trip at a time, each ack's
// latency recorded with its send time. They keep their incarnation and
// sequence from one run to the next.
type loaders struct {
	ranks []*loader
	stopc chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex // guards the following
	sent  []time.Time
	lat   []time.Duration
}

type loader struct {
	r   wire.Rank
	nc  *nats.Conn
	seq uint64
}

func newLoaders(b *testing.B, c *benchCoord, n int) *loaders {
	ld := &loaders{}
	for tp := range n {
		r := wire.Rank{Instance: "load", TPRank: tp}
		ld.ranks = append(ld.ranks, &loader{r: r, nc: benchConnect(b, c, auth.Rankd(r))})
	}
	return ld
}

// run starts the loaders: batches of events new L1 objects of ns.
func (ld *loaders) run(b *testing.B, ns dcp.Namespace, events int) {
	ld.stopc = make(chan struct{})
	ld.sent, ld.lat = nil, nil
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	for _, l := range ld.ranks {
		ld.wg.Go(func() {
			for {
				select {
				case <-ld.stopc:
					return
				default:
				}
				bt := wire.Batch{Rank: l.r, Incarnation: 1, Events: make([]wire.Event, events)}
				for i := range bt.Events {
					l.seq++
					bt.Events[i] = wire.Event{Seq: l.seq, Kind: wire.Stored, Tier: wire.L1, Size: 2048, Sum: l.seq,
						Key: dcp.Key{NS: ns, Chunk: benchHash(100+uint64(l.r.TPRank), l.seq), Shard: uint16(l.r.TPRank)}}
				}
				t0 := time.Now()
				sendBatch(b, l.nc, subj.Events(l.r), &bt)
				d := time.Since(t0)
				ld.mu.Lock()
				ld.sent, ld.lat = append(ld.sent, t0), append(ld.lat, d)
				ld.mu.Unlock()
			}
		})
	}
}

// stop stops the loaders and returns, sorted, the latencies of the acks
// of batches sent in [from, to] or still in flight at from.
func (ld *loaders) stop(from, to time.Time) []time.Duration {
	close(ld.stopc)
	ld.wg.Wait()
	var out []time.Duration
	for i, t := range ld.sent {
		if !t.After(to) && !t.Add(ld.lat[i]).Before(from) {
			out = append(out, ld.lat[i])
		}
	}
	slices.Sort(out)
	if len(out) == 0 {
		out = append(out, 0)
	}
	return out
}
