package index

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/kvtier/kvtier/dcp"
)

// The chunk shards' slabs (chunkmap.go): what a lookup, a txn, Verify's
// undo record and a clone hold of a chunk stays the chunk's published
// version whatever the shard's writer does afterwards.

func TestChunkShardSize(t *testing.T) {
	if n := unsafe.Sizeof(chunkShard{}); n != 64 {
		t.Fatalf("chunkShard is %d bytes, want 64 (one cache line per shard)", n)
	}
}

// slabVersion is version v of chunk i in the slab tests: 1 + v%5
// placements in slot order, each naming the chunk, the version and the
// count.
func slabVersion(i int, v uint64) []placement {
	n := 1 + int(v%5)
	s := make([]placement, n)
	for j := range s {
		s[j] = placement{size: uint64(n), sum: uint64(i)<<32 | v, seq: v, shard: uint16(j)}
	}
	return s
}

// wholeVersion says what is wrong with s as read for chunk i ("" when
// it is a whole version of it, or nil: no chunk).
func wholeVersion(i int, s []placement) string {
	if s == nil {
		return ""
	}
	if len(s) == 0 {
		return fmt.Sprintf("chunk %d: empty, not nil", i)
	}
	if want := slabVersion(i, s[0].seq); !slices.Equal(s, want) {
		return fmt.Sprintf("chunk %d: %+v is not a whole version of it (its version %d is %+v)", i, s, s[0].seq, want)
	}
	return ""
}

// slabChunk spreads the slab tests' chunks over two shards.
func slabChunk(i int) dcp.ChunkHash { return dcp.ChunkHash{byte(i % 2), byte(i), byte(i >> 8)} }

// TestSlabCompactionUnderLookups: lookups (loadAll) read two shards'
// chunks while their writer replaces and removes them, which compacts
// the slabs under them again and again. Every slice read is one whole
// published version of its chunk, and stays the same while it is held
// across later writes and compactions (and under -race nothing read is
// written). Seen red with: set writing a version over the previous one's
// range when it fits (a held slice changes; data race); compaction keeping
// the old offsets (slices of other chunks' ranges, or out of range);
// compaction copying into the old array from its start (a held slice
// changes; data race).
func TestSlabCompactionUnderLookups(t *testing.T) {
	defer func(m uint32) { slabCompactMin = m }(slabCompactMin)
	slabCompactMin = 16
	const chunks, rounds = 64, 300
	cm := newChunkMap()
	hashes := make([]dcp.ChunkHash, chunks)
	for i := range hashes {
		hashes[i] = slabChunk(i)
	}
	var round atomic.Uint64
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			type held struct {
				i       int
				s, want []placement
				at      uint64
			}
			var hold []held
			out := make([][]placement, chunks)
			for n := 0; ; n++ {
				r := round.Load()
				cm.loadAll(hashes, out)
				for i, s := range out {
					if msg := wholeVersion(i, s); msg != "" {
						t.Errorf("round %d: %s", r, msg)
						return
					}
				}
				if i := n % chunks; out[i] != nil {
					hold = append(hold, held{i: i, s: out[i], want: slices.Clone(out[i]), at: r})
				}
				k := 0
				for _, h := range hold {
					if !slices.Equal(h.s, h.want) {
						t.Errorf("chunk %d as read in round %d changed by round %d: %+v, was %+v", h.i, h.at, r, h.s, h.want)
						return
					}
					if r-h.at < 30 { // held across several rounds, each some compactions
						hold[k] = h
						k++
					}
				}
				hold = hold[:k]
				select {
				case <-done:
					return
				default:
				}
			}
		})
	}
	for v := uint64(1); v <= rounds; v++ {
		for i, c := range hashes {
			if (uint64(i)+v)%7 == 0 {
				cm.del(c)
			} else {
				cm.set(c, chunkVal{s: slabVersion(i, v), epoch: uint32(v)})
			}
		}
		round.Store(v)
	}
	close(done)
	wg.Wait()
	t.Logf("%d compactions", cm.sh[0].gen+cm.sh[1].gen)
	if g := cm.sh[0].gen + cm.sh[1].gen; g < 20 {
		t.Fatalf("%d compactions in %d rounds: the test did not compact under the lookups", g, rounds)
	}
	for i, c := range hashes {
		v, ok := cm.get(c)
		if (i+rounds)%7 == 0 {
			if ok {
				t.Fatalf("chunk %d: deleted in the last round, reads %+v", i, v)
			}
			continue
		}
		if !ok || !slices.Equal(v.s, slabVersion(i, rounds)) || v.epoch != rounds {
			t.Fatalf("chunk %d after the last round: %+v, %v; want %+v epoch %d", i, v, ok, slabVersion(i, rounds), rounds)
		}
	}
}

// TestSlabCloneIsolated: a clone (state.snapshot: Dump's and Verify's
// copy) keeps the chunks as they were when it was taken while the
// original is written, appended to in its array's spare room, and
// compacted; writing the clone leaves the original alone. Seen red with
// the clone sharing the slab's spare room (slab[:len] rather than
// slab[:len:len]): the clone's and the original's next appends wrote one
// range of one array.
func TestSlabCloneIsolated(t *testing.T) {
	defer func(m uint32) { slabCompactMin = m }(slabCompactMin)
	slabCompactMin = 4
	cm := newChunkMap()
	want := map[int]uint64{} // the original's chunks: version
	for i := range 40 {
		cm.set(slabChunk(i), chunkVal{s: slabVersion(i, 1), epoch: 1})
		want[i] = 1
	}
	if sh := &cm.sh[0]; cap(sh.slab) == len(sh.slab) {
		t.Fatalf("slab of %d placements has no spare room: the test would not share any", len(sh.slab))
	}
	cl := cm.clone()
	clWant := map[int]uint64{}
	for i, v := range want {
		clWant[i] = v
	}
	check := func(what string, m *chunkMap, w map[int]uint64) {
		t.Helper()
		if m.len() != len(w) {
			t.Fatalf("%s: %d chunks, want %d", what, m.len(), len(w))
		}
		for i, v := range w {
			got, ok := m.get(slabChunk(i))
			if !ok || !slices.Equal(got.s, slabVersion(i, v)) {
				t.Fatalf("%s: chunk %d is %+v (%v), want version %d %+v", what, i, got.s, ok, v, slabVersion(i, v))
			}
		}
		n := 0
		for c, val := range m.all() {
			i := int(c[1]) | int(c[2])<<8
			if !slices.Equal(val.s, slabVersion(i, w[i])) {
				t.Fatalf("%s: all() gives chunk %d as %+v, want version %d", what, i, val.s, w[i])
			}
			n++
		}
		if n != len(w) {
			t.Fatalf("%s: all() gives %d chunks, want %d", what, n, len(w))
		}
	}
	// A new chunk each, in shard 0, clone first.
	cl.set(slabChunk(100), chunkVal{s: slabVersion(100, 3), epoch: 3})
	clWant[100] = 3
	cm.set(slabChunk(102), chunkVal{s: slabVersion(102, 4), epoch: 4})
	want[102] = 4
	check("clone after one write each", cl, clWant)
	check("original after one write each", cm, want)
	gen := cm.sh[0].gen
	for v := uint64(5); v < 15; v++ {
		for i := range want {
			if i%5 == 0 && v == 10 {
				cm.del(slabChunk(i))
				delete(want, i)
				continue
			}
			cm.set(slabChunk(i), chunkVal{s: slabVersion(i, v), epoch: uint32(v)})
			want[i] = v
		}
	}
	if cm.sh[0].gen == gen {
		t.Fatal("the original's shard 0 was never compacted")
	}
	check("clone after the original's writes and compactions", cl, clWant)
	check("original", cm, want)
}

// TestPipelinedTxnsAcrossSlabCompactions is TestPipelinedTxnsMatchSequential
// with every chunk in one shard and that shard compacted whenever its
// garbage outgrows its live placements: a child txn stages a chunk from
// the live value it read (chunkVal.s, a slice of the slab) and publishes
// it after its parent's publish compacted the shard; the counts it takes
// off with that old value must be the chunk's then. Seen red with
// compaction copying into the old array from its start (the child's old
// values read other placements: counts off, state unlike the sequential
// one).
func TestPipelinedTxnsAcrossSlabCompactions(t *testing.T) {
	defer func(m uint32) { slabCompactMin = m }(slabCompactMin)
	slabCompactMin = 1
	oneShard := func(ops []op) {
		re := func(k *dcp.Key) { k.Chunk = dcp.ChunkHash{0, k.Chunk[0], k.NS[0]} }
		for _, o := range ops {
			if o.batch != nil {
				for i := range o.batch.Events {
					re(&o.batch.Events[i].Key)
				}
			}
			if o.inv != nil {
				for i := range o.inv.Objects {
					re(&o.inv.Objects[i].Key)
				}
			}
		}
	}
	var gens uint32
	for seed := range uint64(300) {
		_, pipeSt := pipelinedVsSequential(t, seed, oneShard)
		for _, n := range pipeSt.ns {
			gens += n.chunks.sh[0].gen
		}
	}
	t.Logf("%d slab compactions", gens)
	if gens < 1000 {
		t.Fatalf("%d slab compactions in all: the test did not compact between stagings and publishes", gens)
	}
}

// TestVerifyUndoAcrossSlabCompaction: Verify copies the chunks off the
// committer (copyChunks) while a batch removes most chunks of the shard
// its copy is walking, which compacts that shard, replaces one and adds
// some. The copy puts back the barrier values of the chunks changed (the
// undo record: slices of the slab as it was) and takes the others from
// the walk, which now spans a compaction. Verify then compares the
// barrier's state with bbolt's and passes. Seen red with: all() resolving
// the walk's old entries in the new slab (placements of other chunks, or
// out of range); compaction copying into the old array from its start
// (the undo record's slices changed).
func TestVerifyUndoAcrossSlabCompaction(t *testing.T) {
	defer func(m uint32) { slabCompactMin = m }(slabCompactMin)
	slabCompactMin = 8
	v := newVerifyRig(t, func(i int) dcp.ChunkHash { return dcp.ChunkHash{0, byte(i), byte(i >> 8)} }) // all in shard 0
	b := v.batch()
	for i := range 200 {
		v.stored(&b, i, uint64(i)+1, uint64(i)+1)
	}
	if _, err := v.ix.Apply(v.ctx, b); err != nil {
		t.Fatal(err)
	}

	verified, resume := v.holdVerify(t)
	v.ix.mu.RLock()
	gen := v.ix.st.ns[v.ns].chunks.sh[0].gen
	v.ix.mu.RUnlock()
	b = v.batch()
	for i := range 120 {
		v.removed(&b, i*5/3) // spread over the whole shard: 120 of 200, garbage 120 > 80 live
	}
	v.stored(&b, 199, 200, 9999) // replaced
	for i := 300; i < 310; i++ {
		v.stored(&b, i, uint64(i)+1, uint64(i)+1) // new
	}
	v.applyHeld(t, b, resume)
	v.ix.mu.RLock()
	compacted := v.ix.st.ns[v.ns].chunks.sh[0].gen != gen
	v.ix.mu.RUnlock()
	if !compacted {
		close(resume)
		t.Fatal("the batch did not compact the shard the copy was walking")
	}
	close(resume)
	res := <-verified
	if res.err != nil {
		t.Fatalf("verify across the compaction: %v %v", res.err, res.rep.Problems)
	}
	if res.rep.Chunks != 200 || res.rep.Placements != 200 {
		t.Fatalf("verify reported %d chunks, %d placements; want the barrier's 200, 200", res.rep.Chunks, res.rep.Placements)
	}
	rep, err := v.ix.Verify(v.ctx)
	if err != nil || rep.Chunks != 90 || rep.Placements != 90 {
		t.Fatalf("second verify: %+v, %v; want 90 chunks, 90 placements", rep, err)
	}
}
