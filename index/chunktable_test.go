package index

import (
	"encoding/binary"
	"iter"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvtier/kvtier/dcp"
)

// The chunk shards' hash tables (chunktable.go): a chunkMap behaves as a
// Go map of chunk to value under every mix of sets, removals, growths,
// rebuilds under a new seed and slab compactions; its walks keep all's
// guarantees across them; lookups under the read locks never see a
// chunk missing or half written while the writer changes the tables; and
// keys forged against the hash do not make probes long.

func TestChunkEntrySize(t *testing.T) {
	if n := unsafe.Sizeof(chunkEntry{}); n != 32 {
		t.Fatalf("chunkEntry is %d bytes, want 32 (two to a cache line, none across two)", n)
	}
}

// randomChunk is a chunk hash of shard shard, the rest random.
func randomChunk(r *rand.Rand, shard byte) dcp.ChunkHash {
	var c dcp.ChunkHash
	binary.LittleEndian.PutUint64(c[:8], r.Uint64())
	binary.LittleEndian.PutUint64(c[8:], r.Uint64())
	c[0] = shard
	return c
}

// tableProblems is checkSlabs' verdict on cm ("" when none).
func tableProblems(cm *chunkMap) string {
	var pr problems
	cm.checkSlabs(&pr, dcp.Namespace{})
	return strings.Join(pr.list, "; ")
}

// longestProbe is the longest probe, in slots, that finds an entry of t.
func longestProbe(t *chunkTable) int {
	longest := 0
	for i := range t.slots {
		if e := &t.slots[i]; e.state == slotFull {
			longest = max(longest, int((uint64(i)-t.home(e.k0, e.k1))&t.mask)+1)
		}
	}
	return longest
}

// modelWalk is one walk of chunkMap.all in TestChunkTableModel, pulled a
// few chunks at a time between the writer's changes.
type modelWalk struct {
	next     func() (dcp.ChunkHash, chunkVal, bool)
	stop     func()
	at0      map[dcp.ChunkHash]bool // the chunks when it began
	touched  map[dcp.ChunkHash]bool // set or removed since
	produced map[dcp.ChunkHash]int
	tables   [2]*chunkTable // the shards' tables when it began
}

// TestChunkTableModel: random sets, replacements and removals on the
// chunks of two shards, in phases that grow the tables, churn them
// (tombstones reused, rebuilt at the same size), shrink them and empty
// them, with slab compactions and rebuilds under new seeds forced often
// (small slabCompactMin, maxProbe 4), against a Go map. After every few
// steps every chunk reads as the model says (get, loadAll), len agrees
// and checkSlabs finds nothing (counts, offsets, every entry where its
// probe ends). Meanwhile up to three walks of all are pulled a few chunks
// at a time: each produces every chunk it began with and that was not
// touched since exactly once, and each chunk it produces with its value
// in the model at that moment. Seen red with: a removal emptying its slot
// rather than marking it dead (counts off, chunks past it lost); the
// wrap of find's or slotFor's probe one slot short of the table's end
// (chunks lost); a rebuild copying dead entries as live; a reused dead
// slot not taken off the dead count; a rebuild written into the table
// object a walk holds rather than a new one (a chunk produced twice);
// all reading a replaced table's offsets in the current slab; a
// compaction keeping the old offsets; add stopping one slot after a used
// home slot, whatever that slot holds (chunks overwritten).
func TestChunkTableModel(t *testing.T) {
	defer func(m uint32, p int, s func() uint64) { slabCompactMin, maxProbe, tableSeed = m, p, s }(slabCompactMin, maxProbe, tableSeed)
	slabCompactMin, maxProbe = 8, 4
	var compactions, reseeds, walks, spanned int
	for seed := range uint64(6) {
		r := rand.New(rand.NewPCG(seed, 0x7ab1e))
		tableSeed = r.Uint64
		cm := newChunkMap()
		model := map[dcp.ChunkHash]chunkVal{}
		index := map[dcp.ChunkHash]int{}
		var keys []dcp.ChunkHash
		var version uint64
		var open []*modelWalk
		startWalk := func() {
			w := &modelWalk{at0: map[dcp.ChunkHash]bool{}, touched: map[dcp.ChunkHash]bool{}, produced: map[dcp.ChunkHash]int{}}
			for c := range model {
				w.at0[c] = true
			}
			w.tables = [2]*chunkTable{cm.sh[0].t, cm.sh[1].t}
			next, stop := iter.Pull2(cm.all())
			w.next = func() (dcp.ChunkHash, chunkVal, bool) { return next() }
			w.stop = stop
			open = append(open, w)
			walks++
		}
		endWalk := func(w *modelWalk, why string) {
			if w.tables != [2]*chunkTable{cm.sh[0].t, cm.sh[1].t} {
				spanned++
			}
			for c := range w.at0 {
				if !w.touched[c] && w.produced[c] != 1 {
					t.Fatalf("seed %d: a walk (%s) produced chunk %d, untouched during it, %d times", seed, why, index[c], w.produced[c])
				}
			}
		}
		pull := func(w *modelWalk, n int) bool {
			for range n {
				c, v, ok := w.next()
				if !ok {
					endWalk(w, "ended")
					return false
				}
				want, in := model[c]
				if !in {
					t.Fatalf("seed %d: a walk produced chunk %x, not in the map", seed, c)
				}
				if !slices.Equal(v.s, want.s) || v.epoch != want.epoch {
					t.Fatalf("seed %d: a walk produced chunk %d as %+v epoch %d, the map holds %+v epoch %d", seed, index[c], v.s, v.epoch, want.s, want.epoch)
				}
				w.produced[c]++
				if w.produced[c] > 1 && !w.touched[c] {
					t.Fatalf("seed %d: a walk produced chunk %d, untouched during it, twice", seed, index[c])
				}
			}
			return true
		}
		touch := func(c dcp.ChunkHash) {
			for _, w := range open {
				w.touched[c] = true
			}
		}
		check := func(step int) {
			t.Helper()
			if cm.len() != len(model) {
				t.Fatalf("seed %d step %d: len %d, model %d", seed, step, cm.len(), len(model))
			}
			out := make([][]placement, len(keys))
			cm.loadAll(keys, out)
			for i, c := range keys {
				v, ok := cm.get(c)
				want, in := model[c]
				if ok != in || !slices.Equal(v.s, want.s) || v.epoch != want.epoch || !slices.Equal(out[i], want.s) {
					t.Fatalf("seed %d step %d: chunk %d reads %+v epoch %d (%v), loadAll %+v; model %+v epoch %d (%v)", seed, step, i, v.s, v.epoch, ok, out[i], want.s, want.epoch, in)
				}
			}
			if msg := tableProblems(cm); msg != "" {
				t.Fatalf("seed %d step %d: %s", seed, step, msg)
			}
		}
		// Phases: grow to ~2,400 chunks, churn, shrink, empty, grow again.
		type phase struct {
			steps   int
			newKey  float64 // of the sets, the share on a chunk not set before
			removal float64 // of the steps, the share of removals
		}
		seeds := [2]uint64{}
		for _, ph := range []phase{{3000, 0.9, 0.1}, {4000, 0.5, 0.5}, {3000, 0.2, 0.7}, {2000, 0, 1}, {1500, 0.9, 0.1}} {
			for step := range ph.steps {
				switch {
				case len(open) < 3 && r.IntN(100) == 0:
					startWalk()
				case len(open) > 0 && r.IntN(4) == 0:
					k := r.IntN(len(open))
					if !pull(open[k], 1+r.IntN(24)) {
						open = slices.Delete(open, k, k+1)
					}
				}
				if r.Float64() < ph.removal {
					if len(keys) == 0 {
						continue
					}
					c := keys[r.IntN(len(keys))]
					cm.del(c)
					delete(model, c)
					touch(c)
				} else {
					var c dcp.ChunkHash
					if len(keys) == 0 || r.Float64() < ph.newKey {
						c = randomChunk(r, byte(r.IntN(2)))
						index[c] = len(keys)
						keys = append(keys, c)
					} else {
						c = keys[r.IntN(len(keys))]
					}
					version++
					v := chunkVal{s: slabVersion(index[c], version), epoch: uint32(version)}
					cm.set(c, v)
					model[c] = chunkVal{s: slices.Clone(v.s), epoch: v.epoch}
					touch(c)
				}
				for i := range 2 {
					switch sh := &cm.sh[i]; {
					case sh.t == nil:
						seeds[i] = 0 // its next table draws a seed: no rebuild
					case sh.t.seed0 != seeds[i]:
						if seeds[i] != 0 {
							reseeds++
						}
						seeds[i] = sh.t.seed0
					}
				}
				if step%50 == 0 {
					check(step)
				}
			}
			check(ph.steps)
		}
		for _, w := range open {
			for pull(w, 100) {
			}
			w.stop()
		}
		compactions += int(cm.sh[0].gen + cm.sh[1].gen)
	}
	t.Logf("%d slab compactions, %d rebuilds under a new seed, %d walks, %d across a table's replacement", compactions, reseeds, walks, spanned)
	if compactions < 20 || reseeds < 50 || walks < 100 || spanned < 50 {
		t.Fatalf("%d compactions, %d reseeds, %d walks, %d across a replacement: the test did not exercise them", compactions, reseeds, walks, spanned)
	}
}

// TestChunkTableUnderLookups: lookups (loadAll) read chunks of two shards
// while the writer grows their tables from 8 slots to 4,096, rebuilds
// them at the same size under new seeds (maxProbe 2), removes most chunks
// (dead entries, compactions) and replaces others, again and again. A chunk present throughout reads as
// a whole version of it every time, a chunk never set reads nil, and
// under -race nothing read is written. Seen red under -race (a data
// race) with: set's entry, or del's dead mark, written outside the
// shard's write lock; a rebuild made in place, the table's array swapped
// in the table object lookups hold, or a same-size rebuild copied into
// the array they read.
func TestChunkTableUnderLookups(t *testing.T) {
	defer func(m uint32, p int) { slabCompactMin, maxProbe = m, p }(slabCompactMin, maxProbe)
	slabCompactMin, maxProbe = 64, 2
	const stable, churn, rounds = 64, 6000, 4
	r := rand.New(rand.NewPCG(1, 2))
	cm := newChunkMap()
	hashes := make([]dcp.ChunkHash, stable+churn+64)
	for i := range hashes {
		hashes[i] = randomChunk(r, byte(i%2))
	}
	// stable: set first, only ever replaced; churn: set and removed;
	// the last 64: never set.
	for i := range stable {
		cm.set(hashes[i], chunkVal{s: slabVersion(i, 1), epoch: 1})
	}
	var done atomic.Bool
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			out := make([][]placement, len(hashes))
			for !done.Load() {
				cm.loadAll(hashes, out)
				for i, s := range out {
					switch {
					case i < stable && s == nil:
						t.Errorf("chunk %d, present throughout, read nil", i)
					case i >= stable+churn && s != nil:
						t.Errorf("chunk %d, never set, read %+v", i, s)
					}
					if msg := wholeVersion(i, s); msg != "" {
						t.Error(msg)
					}
				}
				if t.Failed() {
					return
				}
			}
		})
	}
	version := uint64(1)
	for range rounds {
		for i := stable; i < stable+churn; i++ {
			version++
			cm.set(hashes[i], chunkVal{s: slabVersion(i, version), epoch: uint32(version)})
			if i%97 == 0 {
				cm.set(hashes[i%stable], chunkVal{s: slabVersion(i%stable, version), epoch: uint32(version)})
			}
		}
		for i := stable; i < stable+churn; i++ {
			if i%8 != 0 {
				cm.del(hashes[i])
			}
		}
		for i := stable; i < stable+churn; i += 8 {
			cm.del(hashes[i])
		}
	}
	done.Store(true)
	wg.Wait()
	if msg := tableProblems(cm); msg != "" {
		t.Fatal(msg)
	}
}

// TestChunkTableForgedKeys: chunk hashes come from clients. Key sets with
// structure (one half fixed, a counter in the other; the counter in the
// high bytes) spread like random ones under the keyed hash, under every
// seed tried, never probing past maxProbe; keys forged for a table's seed
// (which a client never learns) share one home slot there but not in
// another map's table; and once their probes pass maxProbe, the table is
// rebuilt under a new seed and the longest probe is short again. Seen red
// with: the home taken from the key's first word alone (a fixed first
// half: every key in one slot); one round of the multiply, without the
// second (a fixed half and a counter: probes of hundreds of slots under
// some seeds, rebuilt under new ones); every table drawing the same seed
// (the forged keys collide in the second map too); the rebuild under a
// new seed left out (probes of 1,500 slots).
func TestChunkTableForgedKeys(t *testing.T) {
	defer func(s func() uint64) { tableSeed = s }(tableSeed)
	r := rand.New(rand.NewPCG(3, 4))
	draws := 0
	tableSeed = func() uint64 { draws++; return r.Uint64() }
	val := chunkVal{s: slabVersion(0, 1), epoch: 1}
	structured := map[string]func(i uint64) dcp.ChunkHash{
		"first half fixed": func(i uint64) dcp.ChunkHash {
			var c dcp.ChunkHash
			binary.LittleEndian.PutUint64(c[8:], i)
			return c
		},
		"second half fixed": func(i uint64) dcp.ChunkHash {
			var c dcp.ChunkHash
			binary.LittleEndian.PutUint64(c[:8], i<<8)
			return c
		},
		"high bytes counting": func(i uint64) dcp.ChunkHash {
			var c dcp.ChunkHash
			binary.BigEndian.PutUint64(c[:8], i)
			binary.BigEndian.PutUint64(c[8:], i)
			c[0] = 0
			return c
		},
	}
	// 20,000 keys fill a table of 32,768 slots to 0.61: random keys'
	// longest probe is about 60 slots there.
	for _, name := range slices.Sorted(maps.Keys(structured)) {
		longest := 0
		for range 16 {
			cm := newChunkMap()
			draws = 0
			for i := range uint64(20000) {
				cm.set(structured[name](i), val)
			}
			if cm.len() != 20000 {
				t.Fatalf("%s: %d chunks, want 20000", name, cm.len())
			}
			if draws != 2 {
				t.Errorf("%s: %d seeds drawn for one table, want 1 (a second one: an insert probed past maxProbe %d)", name, draws/2, maxProbe)
			}
			longest = max(longest, longestProbe(cm.sh[0].t))
		}
		t.Logf("%s: longest probe %d slots in 16 tables of 32,768", name, longest)
		if longest > 200 {
			t.Errorf("%s: longest probe %d slots in 16 tables of 32,768", name, longest)
		}
	}

	// Forged: keys whose first word is seed0 all hash alike (the first
	// multiply is by 0), whatever their second word. The seeds drawn
	// here end in the byte 0, so that the forged keys' first byte, their
	// shard, is 0.
	tableSeed = func() uint64 { return r.Uint64() &^ 0xff }
	const shard = 0
	cm, other := newChunkMap(), newChunkMap()
	fill := func(m *chunkMap, n int) {
		for range n {
			m.set(randomChunk(r, shard), val)
		}
	}
	fill(cm, 1)
	tb := cm.sh[shard].t
	for tb == nil || len(tb.slots) < 8192 || (tb.live+tb.dead-tb.built)*8 < len(tb.slots) {
		fill(cm, 64)
		tb = cm.sh[shard].t
	}
	const forged = 1500
	if (tb.live+forged)*maxLoadDen > len(tb.slots)*maxLoadNum {
		t.Fatalf("table of %d slots holds %d: %d more would grow it", len(tb.slots), tb.live, forged)
	}
	fill(other, 1)
	keys := make([]dcp.ChunkHash, forged)
	for j := range keys {
		binary.LittleEndian.PutUint64(keys[j][:8], tb.seed0)
		binary.LittleEndian.PutUint64(keys[j][8:], r.Uint64())
	}
	home := tb.home(keyWords(&keys[0]))
	for j := range keys {
		if h := tb.home(keyWords(&keys[j])); h != home || keys[j][0] != shard {
			t.Fatalf("forged key %d: shard %d home %d, want %d, %d", j, keys[j][0], h, shard, home)
		}
	}
	seed := tb.seed0
	for _, c := range keys {
		cm.set(c, val)
		other.set(c, val)
	}
	if p := longestProbe(other.sh[shard].t); p > 64 {
		t.Errorf("keys forged for one map's seed: longest probe %d slots in another's", p)
	}
	tb = cm.sh[shard].t
	if tb.seed0 == seed {
		t.Errorf("keys forged for a table's seed: not rebuilt under a new one")
	}
	if p := longestProbe(tb); p > maxProbe {
		t.Errorf("keys forged for a table's seed: longest probe %d slots, past maxProbe %d", p, maxProbe)
	}
	for _, c := range keys {
		if _, ok := cm.get(c); !ok {
			t.Fatalf("forged chunk %x lost", c)
		}
	}
	if msg := tableProblems(cm); msg != "" {
		t.Fatal(msg)
	}
}

// TestLoadAllLockOrder: lookups whose chunks name two shards in opposite
// orders, while writers update both shards, never deadlock. A read lock
// waits behind a writer queued on its shard, so two lookups that each hold
// one shard and want the other, with a writer queued on each, wait for
// each other for good: until stop 66 loadAll took the shards' locks in
// the order of its chunks, and a coordinator's lookup workers hung that
// way under ingest, whose install writes shards from several goroutines at
// once (BenchmarkLookupThroughNATS, one run in five). The locks are now
// taken in shard order.
func TestLoadAllLockOrder(t *testing.T) {
	cm := newChunkMap()
	var a, b dcp.ChunkHash
	a[0], a[1] = 3, 1
	b[0], b[1] = 5, 1
	cm.set(a, chunkVal{s: slabVersion(0, 1), epoch: 1})
	cm.set(b, chunkVal{s: slabVersion(1, 1), epoch: 1})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var lookups atomic.Int64
	for _, cs := range [][]dcp.ChunkHash{{a, b}, {b, a}, {a, b}, {b, a}} {
		wg.Go(func() {
			out := make([][]placement, len(cs))
			for {
				select {
				case <-stop:
					return
				default:
				}
				cm.loadAll(cs, out)
				if out[0] == nil || out[1] == nil {
					t.Error("a chunk went missing")
					return
				}
				lookups.Add(1)
			}
		})
	}
	// A writer a shard: the committer's install fans out (installAll), one
	// shard at a time each.
	for i, c := range []dcp.ChunkHash{a, b} {
		wg.Go(func() {
			for v := uint64(2); ; v++ {
				select {
				case <-stop:
					return
				default:
				}
				cm.set(c, chunkVal{s: slabVersion(i, v), epoch: uint32(v)})
			}
		})
	}
	time.Sleep(2 * time.Second)
	close(stop)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("lookups and the writer deadlocked (%d lookups done)", lookups.Load())
	}
	t.Logf("%d lookups", lookups.Load())
}
