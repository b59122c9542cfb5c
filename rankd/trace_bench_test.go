package rankd

import (
	"bufio"
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// BenchmarkTraceReplayThroughNATS replays the Mooncake conversation trace
// (issue 12 item 8) as one TP8 engine instance against a real coordinator
// (embedded NATS with auth on, bbolt with fsync): for each request in
// order the engine looks up its whole chain (binary request on its scoped
// subject, with its own identity); then each of the 8 ranks stores its
// shard of every chunk past the prefix hit in L1 (LRU of 32,768 objects,
// a Removed event per eviction) and writes it behind to L2, and publishes
// those events through rankd's own publisher on its own connection (rankd
// identity, window 8), as rankd does, without waiting for the acks. The
// ranks are publishers, not whole rankd daemons: no KV bytes move. It
// reports lookups/s and events/s over the replay (until the last ack),
// the hit ratio (chunks in the looked-up prefixes / chunks requested) and
// the lookup latency p50/p99, medians of KVTIER_BENCH_REPS replays (each
// on a fresh coordinator).
//
//	KVTIER_TRACE=/path/to/mooncake_conversation_trace.jsonl \
//	  go test -run '^$' -bench TraceReplayThroughNATS -benchtime 1x ./rankd/
func BenchmarkTraceReplayThroughNATS(b *testing.B) {
	reqs := loadTraceChains(b)
	for b.Loop() {
		var lps, eps, hit, p50, p99 []float64
		for range benchReps() {
			r := replayOnce(b, reqs)
			lps, eps, hit = append(lps, r.lookupsPerSec), append(eps, r.eventsPerSec), append(hit, r.hitRatio)
			p50, p99 = append(p50, r.p50), append(p99, r.p99)
			b.Logf("replay: %d lookups, %d events in %.1f s: %.0f lookups/s, %.0f events/s, hit ratio %.3f, lookup p50 %.0f us p99 %.0f us",
				r.lookups, r.events, r.seconds, r.lookupsPerSec, r.eventsPerSec, r.hitRatio, r.p50, r.p99)
		}
		if median(hit) == 0 {
			b.Fatal("no lookup hit anything: the events were not applied")
		}
		b.Logf("trace replay TP8 through NATS (auth %v), median of %d: %.0f lookups/s, %.0f events/s, hit ratio %.3f, lookup p50 %.0f us, p99 %.0f us",
			os.Getenv("KVTIER_BENCH_INSECURE") != "1", len(lps), median(lps), median(eps), median(hit), median(p50), median(p99))
		b.ReportMetric(median(lps), "lookups/s")
		b.ReportMetric(median(eps), "events/s")
		b.ReportMetric(median(hit), "hit-ratio")
		b.ReportMetric(median(p99), "lookup-p99-us")
	}
}

type replayResult struct {
	lookups, events                                int
	seconds, lookupsPerSec, eventsPerSec, hitRatio float64
	p50, p99                                       float64
}

// traceRank is one rank's LRU of objects (its L1 in the TP8 replay, its
// L2 in the share-group replay) as the replay drives it.
type traceRank struct {
	lru   *list.List // of dcp.Key, front = most recent
	where map[dcp.Key]*list.Element
}

func newTraceRank() traceRank {
	return traceRank{lru: list.New(), where: make(map[dcp.Key]*list.Element)}
}

// holds reports whether the rank holds k, without using it.
func (r *traceRank) holds(k dcp.Key) bool { _, ok := r.where[k]; return ok }

// touch marks k most recently used and reports whether the rank held it.
func (r *traceRank) touch(k dcp.Key) bool {
	e, ok := r.where[k]
	if ok {
		r.lru.MoveToFront(e)
	}
	return ok
}

// add stores k, which the rank does not hold, as the most recently used
// object and, past capacity objects, evicts the least recently used one
// and returns it.
func (r *traceRank) add(k dcp.Key, capacity int) (evicted dcp.Key, ok bool) {
	r.where[k] = r.lru.PushFront(k)
	if r.lru.Len() <= capacity {
		return dcp.Key{}, false
	}
	old := r.lru.Remove(r.lru.Back()).(dcp.Key)
	delete(r.where, old)
	return old, true
}

// event is the rank's next event (its sequence advanced); size and sum
// are 0 for a removal.
func (br *benchRank) event(kind wire.EventKind, tier wire.Tier, k dcp.Key, size, sum uint64) wire.Event {
	br.seq++
	return wire.Event{Seq: br.seq, Kind: kind, Tier: tier, Key: k, Size: size, Sum: sum}
}

// publishAll publishes evs through the rank's publisher in batches of
// 1024 (the engine's batch), without waiting for the acks, waiting only
// while the publisher's queue is full.
func (br *benchRank) publishAll(evs []wire.Event) {
	for i := 0; i < len(evs); i += 1024 {
		part := wire.Batch{Rank: br.r, Incarnation: 1, Events: evs[i:min(i+1024, len(evs))]}
		for br.pub.Publish(part) != nil {
			time.Sleep(200 * time.Microsecond) // the publisher's queue is full
		}
	}
}

func replayOnce(b *testing.B, reqs [][]dcp.ChunkHash) replayResult {
	const tp, l1Objects = 8, 32768
	c := benchCoordinator(b)
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	nc := benchConnect(b, c, auth.Engine("eng"))
	ctx := context.Background()
	spec := traceSpec(tp)
	reg, err := bus.Call[wire.RegisterReply](ctx, nc, subj.EngineCoord("eng", wire.CoordRegister), spec)
	if err != nil {
		b.Fatal(err)
	}
	ns := reg.Namespace
	res, err := spec.Resolve()
	if err != nil {
		b.Fatal(err)
	}
	objSize := res.ObjectSize(0) // the coordinator refuses other sizes (limits.go)
	ranks := startBenchRanks(b, c, "eng", tp, DefaultConfig(wire.Rank{}).EventWindow)
	l1 := make([]traceRank, tp)
	for i := range l1 {
		l1[i] = newTraceRank()
	}
	lookupSubj := subj.EngineCoord("eng", wire.CoordLookup)
	var lat []time.Duration
	hits, asked, events := 0, 0, 0
	t0 := time.Now()
	for _, chain := range reqs {
		req, err := (&wire.LookupRequest{Namespace: ns, Chunks: chain, Instance: "eng"}).MarshalBinary()
		if err != nil {
			b.Fatal(err)
		}
		l0 := time.Now()
		m, err := nc.Request(lookupSubj, req, 30*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(l0))
		rep, err := decodeLookup(m.Data)
		if err != nil {
			b.Fatal(err)
		}
		hits, asked = hits+rep.Prefix, asked+len(chain)
		for t, br := range ranks {
			r := &l1[t]
			var evs []wire.Event
			for i, ch := range chain {
				k := dcp.Key{NS: ns, Chunk: ch, Shard: uint16(t)}
				if r.touch(k) {
					continue
				}
				if i < rep.Prefix {
					continue // read from another tier (L2); not stored again
				}
				sum := binary.LittleEndian.Uint64(ch[:]) ^ uint64(t)
				evs = append(evs, br.event(wire.Stored, wire.L1, k, objSize, sum),
					br.event(wire.Stored, wire.L2, k, objSize, sum)) // write-behind
				if old, ok := r.add(k, l1Objects); ok {
					evs = append(evs, br.event(wire.Removed, wire.L1, old, 0, 0))
				}
			}
			br.publishAll(evs)
			events += len(evs)
		}
	}
	for _, br := range ranks {
		br.waitApplied(b)
	}
	secs := time.Since(t0).Seconds()
	slices.Sort(lat)
	return replayResult{lookups: len(reqs), events: events, seconds: secs,
		lookupsPerSec: float64(len(reqs)) / secs, eventsPerSec: float64(events) / secs,
		hitRatio: float64(hits) / float64(max(asked, 1)), p50: us(pct(lat, 0.5)), p99: us(pct(lat, 0.99))}
}

// traceSpec is the replays' model: 512-token chunks (the trace's block
// size), one attention group of 32 layers, TP tp.
func traceSpec(tp int) dcp.Spec {
	return dcp.Spec{Model: "trace-gqa", Layout: dcp.Layout{TP: tp, DCP: 1, Interleave: 1, PP: 1}, ChunkTokens: 512,
		Groups: []dcp.Group{{Name: "attn", Kind: dcp.Attention, BlockSize: 16, Layers: 32, KVFormat: "bf16",
			SemanticBytes: 16 * 1024, PageBytes: 16 * 1024, StrideBytes: 16 * 1024}}}
}

// loadTraceChains reads the trace's requests as chunk chains: hash id ->
// the first 16 bytes of SHA-256 of its 8 little-endian bytes (as
// index/bench_test.go maps them). $KVTIER_TRACE, else
// ../shared/data/traces/mooncake_conversation_trace.jsonl beside the
// repository; skipped when absent.
func loadTraceChains(b *testing.B) [][]dcp.ChunkHash {
	path := os.Getenv("KVTIER_TRACE")
	if path == "" {
		dir, _ := os.Getwd()
		path = filepath.Join(dir, "..", "..", "shared", "data", "traces", "mooncake_conversation_trace.jsonl")
	}
	f, err := os.Open(path)
	if err != nil {
		b.Skipf("trace not available (%v); set KVTIER_TRACE", err)
	}
	defer f.Close()
	var reqs [][]dcp.ChunkHash
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var rec struct {
			HashIDs []uint64 `json:"hash_ids"`
		}
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			b.Fatalf("%s: %v", path, err)
		}
		chain := make([]dcp.ChunkHash, len(rec.HashIDs))
		for i, id := range rec.HashIDs {
			var k [8]byte
			binary.LittleEndian.PutUint64(k[:], id)
			s := sha256.Sum256(k[:])
			chain[i] = dcp.ChunkHash(s[:16])
		}
		reqs = append(reqs, chain)
	}
	if err := sc.Err(); err != nil {
		b.Fatal(err)
	}
	return reqs
}
