package index

import (
	"encoding/binary"
	"math/bits"
	"math/rand/v2"

	"github.com/kvtier/kvtier/dcp"
)

// A chunk shard's table (issue 26.5). The chunk maps outgrow the CPU
// caches, so a chunk's read misses them: a Go map (a Swiss table) reads
// a group's control word and then the slot it matches, often two cache
// lines, and holds the shard's lock through an assignment's misses. A
// chunkTable is one array of 32-byte entries, each the whole chunk hash
// and its chunkSlot (two to a cache line), with linear probing: a probe
// reads the line of the chunk's home slot and the next ones only as far
// as its run of used slots goes (a probe for an absent chunk, as for
// every new one, reads 1.8 slots on average at the table's fill after a
// growth, 8.5 at its fill before the next). The writer probes off the
// lock and holds it for the entry's write alone. No pointers: the
// collector never scans it.
//
// Its concurrency rests on three rules (see also the top of chunkmap.go):
//
//   - An entry never moves while its table is the shard's. Deletion marks
//     the entry dead (a tombstone, kept for the probes that pass it); an
//     insert fills the first dead or empty slot of its probe. Lookups
//     read slots under the shard's read lock; the writer finds its slot
//     off the lock (it is the only writer) and writes the entry under the
//     write lock.
//   - Growth, a new seed and a slab compaction build a new table off the
//     lock and swap the shard's pointer under the write lock, with the
//     slab its offsets are for. Nothing writes a table once it is
//     replaced, so a walk (chunkMap.all) that began on it finds every
//     entry it had, each once, and reads each chunk's value from the
//     shard's table now.
//   - Every table keeps an empty slot (its load stays at most maxLoad),
//     so a probe ends.
//
// The chunk hash comes from clients, so its bits cannot place an entry
// directly: keys forged to share a home slot would make probes, and the
// inserts that end them, O(n). An entry's home is a keyed hash of all 16
// bytes, the one Go's runtime hashes map keys with where the processor
// lacks AES (wyhash's: the 128-bit product of the key's halves, each xor
// a secret 64-bit word, folded to 64 bits, then multiplied again by a
// constant and folded; one round alone clusters keys with a fixed half
// and a counter in the other under some seeds), under a seed drawn from
// the runtime's random source for the shard's first table. Against keys
// chosen without the seed that is the Go map's defense: a secret seed per
// map (its hash is AES-based on amd64, this one is the runtime's portable
// one). Growth and compaction keep the seed, so a rebuild reads the old
// table in slot order and writes the new one in two sequential runs (an
// entry of home h goes to h or h + the old size), not at random. As a
// backstop for a seed that leaked (none is ever sent or logged), an
// insert that probes past maxProbe slots rebuilds the table under a new
// seed, at most once per len(slots)/8 inserts so that the rebuilds stay
// O(1) per insert.

// chunkEntry is a slot of a chunkTable: 32 bytes, two to a cache line
// (TestChunkEntrySize).
type chunkEntry struct {
	k0, k1 uint64 // the chunk hash: its bytes 0-7 and 8-15, little-endian
	chunkSlot
	state uint32 // slotEmpty, slotFull or slotDead
}

const (
	slotEmpty uint32 = iota // never used since the table was built: ends a probe
	slotFull
	slotDead // a deleted entry: a probe goes past it, an insert may reuse it
)

// chunkTable is a shard's entries. Readers (see chunkMap) read slots;
// mask and the seeds never change; the counts are the writer's.
type chunkTable struct {
	slots        []chunkEntry // a power of two of them, at least minTableSlots
	mask         uint64       // len(slots) - 1
	seed0, seed1 uint64
	// live and dead count the full and dead slots; built is their sum
	// when the table was built (maxProbe's rebuilds).
	live, dead, built int
}

const (
	// maxLoad: an insert into an empty slot that would fill more than
	// 3/4 of the slots (full or dead) rebuilds the table, to a size where
	// the live entries fill at most 3/8: doubling when nothing was
	// deleted. At 3/4, a probe for an absent chunk (every new chunk's,
	// in warmBatch) reads 8.5 slots on average, at 3/8 1.8.
	maxLoadNum, maxLoadDen = 3, 4
	minTableSlots          = 8
)

// maxProbe is the probe length, in slots, past which an insert rebuilds
// its table under a new seed (a variable for tests). Under a random hash
// the longest insert probe at the maximum load is about 120 slots in a
// table of 2^16 slots, 200 in one of 2^22 (a shard of 3 M chunks).
var maxProbe = 512

// tableSeed draws a table's seed (a variable for tests).
var tableSeed = rand.Uint64

// keyWords splits a chunk hash into the words an entry holds.
func keyWords(c *dcp.ChunkHash) (uint64, uint64) {
	return binary.LittleEndian.Uint64(c[:8]), binary.LittleEndian.Uint64(c[8:])
}

// key is e's chunk hash.
func (e *chunkEntry) key() dcp.ChunkHash {
	var c dcp.ChunkHash
	binary.LittleEndian.PutUint64(c[:8], e.k0)
	binary.LittleEndian.PutUint64(c[8:], e.k1)
	return c
}

// tableSlots is the size of a table for n live entries: at most 3/8 full
// (so growth doubles it).
func tableSlots(n int) int {
	s := minTableSlots
	for s*maxLoadNum < 2*maxLoadDen*n {
		s *= 2
	}
	return s
}

// newChunkTable returns an empty table for n entries, with room for as
// many more before it grows (at least one), under the seed of like (a
// new one if like is nil).
func newChunkTable(n int, like *chunkTable) *chunkTable {
	s := tableSlots(n)
	t := &chunkTable{slots: make([]chunkEntry, s), mask: uint64(s - 1)}
	// A new array's pages are mapped at their first touch, and add reads
	// a slot before it writes it: a read maps the shared zero page, the
	// write then faults again to copy it. Writing the array first, in
	// order, faults each page once (rebuilds took 1.0 s of the 10 s of CPU
	// of BenchmarkCommitterIngest without it, 0.14 s with it).
	clear(t.slots)
	if like != nil {
		t.seed0, t.seed1 = like.seed0, like.seed1
	} else {
		t.seed0, t.seed1 = tableSeed(), tableSeed()
	}
	return t
}

// home is the slot where the probe for a key starts: the hash Go's
// runtime gives 16 bytes where the processor lacks AES (memhashFallback
// in runtime/hash64.go), with t's seed in place of the runtime's random
// words.
func (t *chunkTable) home(k0, k1 uint64) uint64 {
	return mix(0x1d8e4e27c47d124f^16, mix(k0^t.seed0, k1^t.seed1)) & t.mask
}

// mix folds the 128-bit product of a and b to 64 bits (wyhash's mum).
func mix(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	return hi ^ lo
}

// find returns c's entry; t may be nil (an empty shard). A reader under
// the shard's read lock, or the writer.
func (t *chunkTable) find(c *dcp.ChunkHash) (chunkSlot, bool) {
	if t == nil {
		return chunkSlot{}, false
	}
	k0, k1 := keyWords(c)
	for i := t.home(k0, k1); ; i = (i + 1) & t.mask {
		e := &t.slots[i]
		if e.k0 == k0 && e.k1 == k1 && e.state == slotFull {
			return e.chunkSlot, true
		}
		if e.state == slotEmpty {
			return chunkSlot{}, false
		}
	}
}

// slotFor returns the slot of the entry of key k0, k1 (found), or where
// an insert of it goes: the first dead slot of its probe, else the empty
// slot that ends it; probe is the number of slots read. The writer only.
func (t *chunkTable) slotFor(k0, k1 uint64) (i uint64, found bool, probe int) {
	free := ^uint64(0)
	for i = t.home(k0, k1); ; i = (i + 1) & t.mask {
		probe++
		e := &t.slots[i]
		switch {
		case e.k0 == k0 && e.k1 == k1 && e.state == slotFull:
			return i, true, probe
		case e.state == slotEmpty:
			if free != ^uint64(0) {
				return free, false, probe
			}
			return i, false, probe
		case e.state == slotDead && free == ^uint64(0):
			free = i
		}
	}
}

// rebuildFor says whether an insert into slot i (where slotFor, not
// finding the key after a probe of length probe, put it) must go into a
// rebuilt table instead: when it would leave t without its empty slots
// (grow), or probed past maxProbe, a sign of keys forged for t's seed
// (reseed; at most once per len(slots)/8 inserts since t was built).
func (t *chunkTable) rebuildFor(i uint64, probe int) (grow, reseed bool) {
	if t.slots[i].state == slotEmpty && (t.live+t.dead+1)*maxLoadDen > len(t.slots)*maxLoadNum {
		return true, false
	}
	if probe > maxProbe && (t.live+t.dead-t.built)*8 >= len(t.slots) {
		return false, true
	}
	return false, false
}

// add puts an entry into a table no reader can reach yet, without a
// lookup: its key is not in t.
func (t *chunkTable) add(e chunkEntry) {
	i := t.home(e.k0, e.k1)
	for t.slots[i].state != slotEmpty {
		i = (i + 1) & t.mask
	}
	e.state = slotFull
	t.slots[i] = e
	t.live++
	t.built++
}

// rebuilt returns a table with t's live entries (t may be nil) and room
// for more, under t's seed or a new one (reseed); the writer only,
// off the lock.
func (t *chunkTable) rebuilt(reseed bool) *chunkTable {
	if t == nil {
		return newChunkTable(1, nil)
	}
	like := t
	if reseed {
		like = nil
	}
	nt := newChunkTable(t.live, like)
	for i := range t.slots { // in slot order: see the top of this file
		if t.slots[i].state == slotFull {
			nt.add(t.slots[i])
		}
	}
	return nt
}

// clone returns a copy of t (nil for nil).
func (t *chunkTable) clone() *chunkTable {
	if t == nil {
		return nil
	}
	c := *t
	c.slots = append([]chunkEntry(nil), t.slots...)
	return &c
}
