package rankd

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
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

// BenchmarkShareGroupReplay replays the Mooncake conversation trace by 4
// engine instances (issue 26's acceptance) against a real coordinator, as
// BenchmarkTraceReplayThroughNATS does for one: embedded NATS with auth
// on, bbolt with fsync, each instance looking up on its own scoped subject
// with its own identity, its ranks publishing through rankd's publisher.
// Each instance is TP2 (shareTP) and each of its ranks holds an L2 of
// capacity C objects, least recently used first out (a Removed event per
// eviction), as rankd's --l2-bytes bound does: a rank's own reads make an
// object recent, another member's reads of its file do not (the reader
// reads the file, not the writer's catalog). L1 is left out: a share
// group shares L2 only, and in the TP8 replay every L1 object is also in
// L2. For each request the chosen instance looks up its chain; the hit is
// the prefix the coordinator's lookup returns (for a member, the plan over
// the group's copies); then each rank stores its shard of every chunk past
// the prefix that it does not hold, except, in a share group, one a rank
// of another member holds (rankd --l2-shared-with deduplicates that store:
// nothing is written or announced, docs/sharing.md). Configurations, each
// a full replay on a fresh coordinator (a sub-benchmark):
//
//	private: 4 instances in no group, requests round-robin
//	shared-rr: the 4 in one share group, round-robin
//	shared-route: the group, each request sent to the member admin.route
//	  ranks first (asked with the admin identity, as a router would);
//	  round-robin when the first two tie or nothing is held
//	ideal: one instance of capacity 4C (a single cache of the same size)
//
// Events are published without waiting for their acks, but after every
// KVTIER_SHARE_LAG requests (default 32; 0: never, as the TP8 replay) the
// replay waits until all are applied. In the trace a conversation's next
// turn comes a median of 423 requests (about 2 minutes) later, and 99 %
// of them more than 44 requests later, so the lookups see what a
// deployment's would; unbounded, the lookups run thousands of requests
// ahead of the acks on a loaded machine and the hit ratio measures the
// lag, not the cache.
//
// Each configuration reports the hit ratio (chunks in the planned
// prefixes / chunks requested), the hit ratio the ranks' own LRUs give
// (every event applied, a cross-check), the lookups that read another
// member's L2 copy (the coordinator's kvtier_coord_share_lookups_total),
// lookups/s over the replay (its
// wall time, less the bare requests' below) and events/s, the lookup
// p50/p99 with a bare NATS request/reply (an echo on the same server,
// interleaved with every lookup, same request and reply sizes) and the
// ratio of their p99s, the same ratio idle after the replay (2,000
// lookups), and for shared-route the route call's p50/p99. Knobs:
// KVTIER_TRACE_REQUESTS (the first N requests), KVTIER_SHARE_CAPACITY (C;
// default the requests' distinct chunks / 16, so 4C is a quarter of the
// working set), KVTIER_SHARE_BREAK=coord (no share group in the
// coordinator, the ranks still deduplicating) or =all (no group anywhere):
// shared-rr then falls to private's hit ratio (all) or below it (coord).
// It fails when a group member's lookups hit nothing (events not
// applied) or none reads another member's copy (the group not used).
//
//	KVTIER_TRACE=/path/to/mooncake_conversation_trace.jsonl \
//	  go test -run '^$' -bench ShareGroupReplay -benchtime 1x ./rankd/
func BenchmarkShareGroupReplay(b *testing.B) {
	reqs := loadTraceChains(b)
	if n, err := strconv.Atoi(os.Getenv("KVTIER_TRACE_REQUESTS")); err == nil && n > 0 && n < len(reqs) {
		reqs = reqs[:n]
	}
	capacity := distinctChunks(reqs) / 16
	if n, err := strconv.Atoi(os.Getenv("KVTIER_SHARE_CAPACITY")); err == nil && n > 0 {
		capacity = n
	}
	lag := 32
	if n, err := strconv.Atoi(os.Getenv("KVTIER_SHARE_LAG")); err == nil && n >= 0 {
		lag = n
	}
	brk := os.Getenv("KVTIER_SHARE_BREAK")
	n := len(shareMembers)
	setups := []shareSetup{
		{label: "private", members: n, capacity: capacity},
		{label: "shared-rr", members: n, capacity: capacity, group: true, dedupe: true},
		{label: "shared-route", members: n, capacity: capacity, group: true, dedupe: true, route: true},
		{label: "ideal", members: 1, capacity: n * capacity},
	}
	switch brk {
	case "":
	case "coord", "all":
		setups = setups[:2] // shared-rr with its group broken, against private
		setups[1].label, setups[1].group, setups[1].dedupe = "shared-rr-broken-"+brk, false, brk == "coord"
	default:
		b.Fatalf("KVTIER_SHARE_BREAK=%q: want coord or all", brk)
	}
	// The parent of sub-benchmarks prints nothing of its own when it
	// passes: its summary goes to stdout.
	head := fmt.Sprintf("%d requests, %d chunks requested, %d distinct; TP%d instances, L2 of %d objects per rank; every event applied after each %d requests; NATS auth %v",
		len(reqs), chunksIn(reqs), distinctChunks(reqs), shareTP, capacity, lag, os.Getenv("KVTIER_BENCH_INSECURE") != "1")
	var results []shareResult
	for _, s := range setups {
		var r shareResult
		if !b.Run(s.label, func(b *testing.B) {
			for b.Loop() {
				r = shareReplayOnce(b, reqs, s, lag)
			}
			b.Logf("%s: %s", s.label, r.line())
			if s.group && r.hitRatio == 0 {
				b.Fatal("no lookup of a share-group member hit anything: the events were not applied")
			}
			if s.group && r.shareLookups == 0 {
				b.Fatal("no lookup of a share-group member read another member's copy (kvtier_coord_share_lookups_total 0): the group was not used")
			}
			b.ReportMetric(r.hitRatio, "hit-ratio")
			b.ReportMetric(r.lookupsPerSec, "lookups/s")
			b.ReportMetric(r.p99, "lookup-p99-us")
			b.ReportMetric(r.p99/r.bare99, "lookup/bare-p99")
		}) {
			return
		}
		results = append(results, r)
	}
	fmt.Printf("\nshare-group replay of the Mooncake trace: %s\n\n%s\n", head, shareTable(results))
}

// shareTP is each instance's TP size in the share-group replay: small
// enough for four instances' replays to run in minutes on two cores.
const shareTP = 2

// shareGroup and shareMembers name the replay's group and instances
// (benchInstances gives them credentials).
const shareGroup = "sg"

var shareMembers = []string{"sg-a", "sg-b", "sg-c", "sg-d"}

// shareSetup is one configuration of the replay.
type shareSetup struct {
	label    string
	members  int  // instances the requests are spread over
	capacity int  // L2 objects per rank
	group    bool // the coordinator's share group
	dedupe   bool // the ranks skip a store another member's rank holds (--l2-shared-with)
	route    bool // assign by admin.route, else round-robin
}

// shareMember is one instance of the replay: its engine connection, its
// ranks' publishers and their L2s.
type shareMember struct {
	name   string
	nc     *nats.Conn
	lookup string // its scoped lookup subject
	echo   string // the bare request/reply's subject
	ranks  []*benchRank
	l2     []traceRank
	served int // requests sent to it
}

type shareResult struct {
	shareSetup
	requests, events, deduped int
	shareLookups              int // lookups reading another member's copy (kvtier_coord_share_lookups_total)
	seconds, lookupsPerSec    float64
	eventsPerSec              float64
	hitRatio, modelHitRatio   float64
	p50, p99, bare50, bare99  float64 // us, during the replay
	idle99, idleBare99        float64 // us, after it
	route50, route99          float64 // us; 0 without routing
	served                    []int
}

func (r *shareResult) line() string {
	s := fmt.Sprintf("%d lookups, %d events (%d stores deduplicated) in %.1f s: %.0f lookups/s, %.0f events/s, hit ratio %.4f (all events applied: %.4f; %d lookups read another member's copy), lookup p50 %.0f us p99 %.0f us, bare p50 %.0f us p99 %.0f us (p99 ratio %.2f); idle: lookup p99 %.0f us, bare p99 %.0f us (ratio %.2f); requests per member %v",
		r.requests, r.events, r.deduped, r.seconds, r.lookupsPerSec, r.eventsPerSec, r.hitRatio, r.modelHitRatio, r.shareLookups,
		r.p50, r.p99, r.bare50, r.bare99, r.p99/r.bare99, r.idle99, r.idleBare99, r.idle99/r.idleBare99, r.served)
	if r.route {
		s += fmt.Sprintf("; route p50 %.0f us p99 %.0f us", r.route50, r.route99)
	}
	return s
}

func shareReplayOnce(b *testing.B, reqs [][]dcp.ChunkHash, s shareSetup, lag int) shareResult {
	names := shareMembers[:s.members]
	reg := prometheus.NewRegistry()
	c := benchCoordinator(b, func(cfg *coordinator.Config) {
		cfg.Registry = reg
		if s.group {
			cfg.ShareGroups = []coordinator.ShareGroup{{Name: shareGroup, Instances: names}}
		}
	})
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	ctx := context.Background()
	spec := traceSpec(shareTP)
	res, err := spec.Resolve()
	if err != nil {
		b.Fatal(err)
	}
	objSize := res.ObjectSize(0) // the coordinator refuses other sizes (limits.go)
	var ns dcp.Namespace
	members := make([]*shareMember, len(names))
	for i, name := range names {
		nc := benchConnect(b, c, auth.Engine(name))
		reg, err := bus.Call[wire.RegisterReply](ctx, nc, subj.EngineCoord(name, wire.CoordRegister), spec)
		if err != nil {
			b.Fatal(err)
		}
		if i > 0 && reg.Namespace != ns {
			b.Fatalf("instance %s registered namespace %s, %s registered %s: one model and layout is one namespace", name, reg.Namespace, names[0], ns)
		}
		ns = reg.Namespace
		m := &shareMember{name: name, nc: nc, lookup: subj.EngineCoord(name, wire.CoordLookup),
			echo:  subj.Engine(wire.Rank{Instance: name}, "echo"),
			ranks: startBenchRanks(b, c, name, shareTP, DefaultConfig(wire.Rank{}).EventWindow)}
		for range shareTP {
			m.l2 = append(m.l2, newTraceRank())
		}
		members[i] = m
	}
	lookupReq := func(m *shareMember, chain []dcp.ChunkHash) []byte {
		req, err := (&wire.LookupRequest{Namespace: ns, Chunks: chain, Instance: m.name}).MarshalBinary()
		if err != nil {
			b.Fatal(err)
		}
		return req
	}
	// The bare request/reply answers with a lookup reply's size, on a
	// subject the engine may request and its rank 0 may answer (its
	// engine API), so with auth on both pass the same permission checks
	// as the lookup (as BenchmarkLookupThroughNATS does).
	probe, err := members[0].nc.Request(members[0].lookup, lookupReq(members[0], reqs[0]), 30*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	echoReply := slices.Clone(probe.Data)
	for _, m := range members {
		enc := benchConnect(b, c, auth.Rankd(wire.Rank{Instance: m.name}))
		if _, err := enc.Subscribe(m.echo, func(msg *nats.Msg) { _ = msg.Respond(echoReply) }); err != nil {
			b.Fatal(err)
		}
		if err := enc.Flush(); err != nil {
			b.Fatal(err)
		}
	}
	admin := benchConnect(b, c, auth.Identity{Role: auth.RoleAdmin})
	routeSubj := subj.Admin(wire.AdminRoute)

	r := shareResult{shareSetup: s, requests: len(reqs)}
	var lat, bare, routeLat []time.Duration
	var inEcho time.Duration
	hits, modelHits, asked := 0, 0, 0
	t0 := time.Now()
	for qi, chain := range reqs {
		target := qi % len(members)
		if s.route {
			r0 := time.Now()
			rep, err := bus.Call[wire.RouteReply](ctx, admin, routeSubj, wire.RouteRequest{Namespace: ns, Chunks: chain, Group: shareGroup})
			if err != nil {
				b.Fatal(err)
			}
			routeLat = append(routeLat, time.Since(r0))
			if i, ok := routeTarget(rep, names); ok {
				target = i
			}
		}
		m := members[target]
		m.served++
		req := lookupReq(m, chain)
		l0 := time.Now()
		msg, err := m.nc.Request(m.lookup, req, 30*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(l0))
		e0 := time.Now()
		if _, err := m.nc.Request(m.echo, req, 30*time.Second); err != nil {
			b.Fatal(err)
		}
		bare = append(bare, time.Since(e0))
		inEcho += bare[len(bare)-1]
		rep, err := decodeLookup(msg.Data)
		if err != nil {
			b.Fatal(err)
		}
		hits, asked = hits+rep.Prefix, asked+len(chain)
		modelHits += modelPrefix(members, m, ns, chain, s.group)
		for t, br := range m.ranks {
			var evs []wire.Event
			for i, ch := range chain {
				k := dcp.Key{NS: ns, Chunk: ch, Shard: uint16(t)}
				if m.l2[t].touch(k) || i < rep.Prefix {
					continue // held, or read from another member's L2: not stored again
				}
				if s.dedupe && heldByOther(members, m, t, k) {
					r.deduped++
					continue
				}
				sum := binary.LittleEndian.Uint64(ch[:]) ^ uint64(t)
				evs = append(evs, br.event(wire.Stored, wire.L2, k, objSize, sum))
				if old, ok := m.l2[t].add(k, s.capacity); ok {
					evs = append(evs, br.event(wire.Removed, wire.L2, old, 0, 0))
				}
			}
			br.publishAll(evs)
			r.events += len(evs)
		}
		if lag > 0 && (qi+1)%lag == 0 {
			waitAllApplied(b, members)
		}
	}
	waitAllApplied(b, members)
	r.shareLookups = counterValue(b, reg, "kvtier_coord_share_lookups_total") // before the idle lookups
	for _, m := range members {
		r.served = append(r.served, m.served)
	}
	r.seconds = time.Since(t0).Seconds()
	// The interleaved bare request/replies are the benchmark's, not the
	// engines': lookups/s leaves their time out.
	r.lookupsPerSec = float64(len(reqs)) / (r.seconds - inEcho.Seconds())
	r.eventsPerSec = float64(r.events) / r.seconds
	r.hitRatio = float64(hits) / float64(max(asked, 1))
	r.modelHitRatio = float64(modelHits) / float64(max(asked, 1))
	slices.Sort(lat)
	slices.Sort(bare)
	r.p50, r.p99, r.bare50, r.bare99 = us(pct(lat, 0.5)), us(pct(lat, 0.99)), us(pct(bare, 0.5)), us(pct(bare, 0.99))
	if len(routeLat) > 0 {
		slices.Sort(routeLat)
		r.route50, r.route99 = us(pct(routeLat, 0.5)), us(pct(routeLat, 0.99))
	}

	// Idle: every event applied, nothing published, the first requests'
	// lookups again (round-robin), each followed by the bare request.
	var reqBytes [][]byte
	var who []*shareMember
	for i := range min(len(reqs), 2000) {
		who = append(who, members[i%len(members)])
		reqBytes = append(reqBytes, lookupReq(who[i], reqs[i]))
	}
	li, ei := 0, 0
	d := latencies(b, len(reqBytes), func() error {
		m := who[li]
		_, err := m.nc.Request(m.lookup, reqBytes[li], 30*time.Second)
		li++
		return err
	}, func() error {
		m := who[ei]
		_, err := m.nc.Request(m.echo, reqBytes[ei], 30*time.Second)
		ei++
		return err
	})
	r.idle99, r.idleBare99 = us(pct(d[0], 0.99)), us(pct(d[1], 0.99))
	return r
}

// routeTarget is the index in names of the member the routing hint ranks
// first, unless the first two tie on every key the coordinator ranks by
// (prefix, L1 prefix, own prefix, load) or it holds nothing.
func routeTarget(rep *wire.RouteReply, names []string) (int, bool) {
	in := rep.Instances
	if len(in) == 0 || in[0].Prefix == 0 {
		return 0, false
	}
	if len(in) > 1 && in[0].Prefix == in[1].Prefix && in[0].L1Prefix == in[1].L1Prefix && in[0].OwnPrefix == in[1].OwnPrefix &&
		in[0].Load == in[1].Load {
		return 0, false
	}
	i := slices.Index(names, in[0].Instance)
	return i, i >= 0
}

// modelPrefix is the prefix m's lookup would return with every event
// applied: the leading chunks each of whose shards m's rank holds or, in
// a group, a rank of another member holds.
func modelPrefix(members []*shareMember, m *shareMember, ns dcp.Namespace, chain []dcp.ChunkHash, group bool) int {
	for i, ch := range chain {
		for t := range m.l2 {
			k := dcp.Key{NS: ns, Chunk: ch, Shard: uint16(t)}
			if !m.l2[t].holds(k) && !(group && heldByOther(members, m, t, k)) {
				return i
			}
		}
	}
	return len(chain)
}

func waitAllApplied(b *testing.B, members []*shareMember) {
	for _, m := range members {
		for _, br := range m.ranks {
			br.waitApplied(b)
		}
	}
}

// heldByOther reports whether rank t of a member other than m holds k.
func heldByOther(members []*shareMember, m *shareMember, t int, k dcp.Key) bool {
	for _, o := range members {
		if o != m && o.l2[t].holds(k) {
			return true
		}
	}
	return false
}

// counterValue is the value of the counter name in reg.
func counterValue(b *testing.B, reg *prometheus.Registry, name string) int {
	mfs, err := reg.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return int(mf.GetMetric()[0].GetCounter().GetValue())
		}
	}
	b.Fatalf("no metric %s", name)
	return 0
}

func chunksIn(reqs [][]dcp.ChunkHash) int {
	n := 0
	for _, c := range reqs {
		n += len(c)
	}
	return n
}

func distinctChunks(reqs [][]dcp.ChunkHash) int {
	seen := make(map[dcp.ChunkHash]struct{})
	for _, c := range reqs {
		for _, ch := range c {
			seen[ch] = struct{}{}
		}
	}
	return len(seen)
}

// shareTable is the results as a markdown table.
func shareTable(rs []shareResult) string {
	var sb strings.Builder
	sb.WriteString("| configuration | instances x TP | L2 per rank (objects) | hit ratio | hit ratio, all events applied | lookups reading another member's L2 | lookups/s | events/s | lookup p50 / p99 (us) | bare p99 (us) | lookup/bare p99 | idle: lookup / bare p99 (us), ratio | route p50 / p99 (us) | requests per instance |\n")
	sb.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rs {
		route := "-"
		if r.route {
			route = fmt.Sprintf("%.0f / %.0f", r.route50, r.route99)
		}
		fmt.Fprintf(&sb, "| %s | %d x TP%d | %d | %.4f | %.4f | %d | %.0f | %.0f | %.0f / %.0f | %.0f | %.2f | %.0f / %.0f, %.2f | %s | %v |\n",
			r.label, r.members, shareTP, r.capacity, r.hitRatio, r.modelHitRatio, r.shareLookups, r.lookupsPerSec, r.eventsPerSec,
			r.p50, r.p99, r.bare99, r.p99/r.bare99, r.idle99, r.idleBare99, r.idle99/r.idleBare99, route, r.served)
	}
	return sb.String()
}
