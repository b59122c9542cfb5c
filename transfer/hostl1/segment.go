package hostl1

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"os"
	"runtime"
	"sync/atomic"
	"unsafe"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// Host-shared L1 (issue 15.1). With transfer.Config.HostL1Dir set, a
// rank's L1 is the data region of a shared segment (a file in a private
// directory under /dev/shm), and the segment also holds a catalog of the
// objects L1 holds: an open-addressed hash table of slots keyed by object
// key, which the holder (the one writer: the engine calls Publish and
// Retire under its own lock) publishes and readers of the
// same host and instance (peer rankds) search without any message to the
// holder. Layout, little-endian, every field 8-byte aligned:
//
//	header (segHeaderBytes):
//	  0 magic 0x3147534c3154564b (bytes "KVT1LSG1")   8 version   16 slots   24 slab bytes
//	  32 slabs   40 data offset   48 holder incarnation   56 closed
//	  64 holder pid
//	The holder keeps an exclusive flock(2) on the file for as long as it
//	lives: the kernel drops it when the process dies, even by kill -9, so a
//	peer that can take a shared lock knows the holder is gone and reads
//	nothing from the segment (its closed word was never set).
//	Version 2 added the lock; a version-1 segment is refused.
//	slots (slots x segSlotBytes, padded to a page):
//	  0 seq: a seqlock; odd while the holder rewrites the slot, bumped by
//	    2 on every publish and retire, so it is also the generation of the
//	    object a reader found
//	  8 state (u32: empty, live, tombstone)   12 leases (i32)
//	  16 lease time (unix ns of the last lease taken)
//	  24 key (dcp.Key: namespace, chunk, shard, group; 40 B)
//	  64 offset in the data region   72 size   80 kvsum64
//	data: the L1 slabs.
//
// A reader finds a slot whose seq is even and equal before and after it
// read the fields (else torn: retried), takes a lease (leases+1, lease
// time) and checks that seq is still what it read (else stale: the object
// was evicted or replaced; the lease is dropped and the read fails). While
// a lease younger than leaseTTL is held the holder does not choose the
// object for eviction; a race the lease cannot exclude (an eviction chosen
// just before the lease was taken) is caught by the checksum the reader's
// scatter computes over what it placed (C5): the chunk fails, it is never
// restored with wrong bytes.

const (
	segMagic       = 0x3147534c3154564b // bytes "KVT1LSG1" on disk (little-endian)
	segVersion     = 2
	segHeaderBytes = 4096
	segSlotBytes   = 128
	segPage        = 4096

	slotEmpty     = 0
	slotLive      = 1
	slotTombstone = 2

	// segSpins bounds a reader's retries of a slot the holder is rewriting.
	segSpins = 64
)

// Geometry is the layout of a segment for an L1 of slabs x slabBytes.
type Geometry struct {
	slots     uint64 // a power of two, >= 2*slabs
	slabBytes uint64
	slabs     uint64
	dataOff   uint64
}

func NewGeometry(slabs, slabBytes uint64) Geometry {
	n := uint64(64)
	for n < 2*slabs {
		n *= 2
	}
	tbl := (n*segSlotBytes + segPage - 1) / segPage * segPage
	return Geometry{slots: n, slabBytes: slabBytes, slabs: slabs, dataOff: segHeaderBytes + tbl}
}

func (g Geometry) Size() uint64 { return g.dataOff + g.slabs*g.slabBytes }

// Segment is a mapped segment: the holder's (read-write) or a peer's (the
// header and slots read-write for leases, the data read-only).
type Segment struct {
	meta []byte // header and slots
	data []byte // the L1 slabs
	geo  Geometry
	// The holder's own segment: its one mapping, the file's inode, the
	// open file that holds the exclusive lock, and where the file is.
	whole []byte
	ino   uint64
	lock  *os.File
	dir   string
	rank  wire.Rank
}

// Data is the segment's data region: the holder's L1 slabs (read-write in
// the holder's segment).
func (s *Segment) Data() []byte { return s.data }

func (s *Segment) u64(off uint64) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&s.meta[off]))
}

func (s *Segment) slot(i uint64) uint64 { return segHeaderBytes + i*segSlotBytes }

func (s *Segment) seq(i uint64) *atomic.Uint64 { return s.u64(s.slot(i)) }
func (s *Segment) state(i uint64) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&s.meta[s.slot(i)+8]))
}
func (s *Segment) leases(i uint64) *atomic.Int32 {
	return (*atomic.Int32)(unsafe.Pointer(&s.meta[s.slot(i)+12]))
}
func (s *Segment) leaseAt(i uint64) *atomic.Int64 {
	return (*atomic.Int64)(unsafe.Pointer(&s.meta[s.slot(i)+16]))
}

// initHeader writes a new segment's header (the holder, before anyone can
// open it).
func (s *Segment) initHeader(incarnation uint64, pid int) {
	g := s.geo
	h := s.meta[:segHeaderBytes]
	binary.LittleEndian.PutUint64(h[0:], segMagic)
	binary.LittleEndian.PutUint64(h[8:], segVersion)
	binary.LittleEndian.PutUint64(h[16:], g.slots)
	binary.LittleEndian.PutUint64(h[24:], g.slabBytes)
	binary.LittleEndian.PutUint64(h[32:], g.slabs)
	binary.LittleEndian.PutUint64(h[40:], g.dataOff)
	binary.LittleEndian.PutUint64(h[48:], incarnation)
	binary.LittleEndian.PutUint64(h[64:], uint64(pid))
}

// parseSegHeader checks a peer's header against the file's size.
func parseSegHeader(h []byte, fileSize uint64) (Geometry, uint64, error) {
	if len(h) < segHeaderBytes {
		return Geometry{}, 0, fmt.Errorf("segment header of %d B, want %d B: %w", len(h), segHeaderBytes, ErrCorrupt)
	}
	le := binary.LittleEndian
	if m := le.Uint64(h[0:]); m != segMagic {
		return Geometry{}, 0, fmt.Errorf("segment magic %#x, want %#x: %w", m, uint64(segMagic), ErrCorrupt)
	}
	if v := le.Uint64(h[8:]); v != segVersion {
		return Geometry{}, 0, fmt.Errorf("segment version %d, this rankd reads %d: %w", v, segVersion, ErrCorrupt)
	}
	slabs, slabBytes := le.Uint64(h[32:]), le.Uint64(h[24:])
	if slabs == 0 || slabs > 1<<24 || slabBytes < segPage || slabBytes%segPage != 0 || slabBytes > 1<<30 {
		return Geometry{}, 0, fmt.Errorf("segment of %d slabs of %d B breaks the L1 rules: %w", slabs, slabBytes, ErrCorrupt)
	}
	g := NewGeometry(slabs, slabBytes)
	if got := le.Uint64(h[16:]); got != g.slots || le.Uint64(h[40:]) != g.dataOff {
		return Geometry{}, 0, fmt.Errorf("segment of %d slabs names %d slots at data offset %d, want %d at %d: %w",
			slabs, got, le.Uint64(h[40:]), g.slots, g.dataOff, ErrCorrupt)
	}
	if g.Size() != fileSize {
		return Geometry{}, 0, fmt.Errorf("segment file of %d B, its header describes %d B: %w", fileSize, g.Size(), ErrCorrupt)
	}
	return g, le.Uint64(h[48:]), nil
}

// Closed reports whether the holder closed the segment.
func (s *Segment) Closed() bool { return s.u64(56).Load() != 0 }

func (s *Segment) markClosed() { s.u64(56).Store(1) }

// keyWords packs k into the five words a slot stores.
func keyWords(k dcp.Key) [5]uint64 {
	var b [40]byte
	copy(b[0:16], k.NS[:])
	copy(b[16:32], k.Chunk[:])
	binary.LittleEndian.PutUint16(b[32:], k.Shard)
	binary.LittleEndian.PutUint16(b[34:], k.Group)
	var w [5]uint64
	for i := range w {
		w[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	return w
}

func (s *Segment) home(w [5]uint64) uint64 {
	h := w[0] ^ bits.RotateLeft64(w[1], 17) ^ bits.RotateLeft64(w[2], 31) ^ bits.RotateLeft64(w[3], 47) ^ w[4]*0x9e3779b97f4a7c15
	h ^= h >> 29
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 32
	return h & (s.geo.slots - 1)
}

// Publish enters a live object (holder only, one writer) and returns
// its slot. The holder never has two live slots of one key.
func (s *Segment) Publish(k dcp.Key, off, size, sum uint64) (uint64, error) {
	w := keyWords(k)
	mask := s.geo.slots - 1
	i := s.home(w)
	for range s.geo.slots {
		if st := s.state(i).Load(); st != slotLive {
			s.write(i, slotLive, w, off, size, sum)
			return i, nil
		}
		i = (i + 1) & mask
	}
	return 0, fmt.Errorf("host L1 catalog: all %d slots live (%d slabs): %w", s.geo.slots, s.geo.slabs, ErrFull)
}

// Retire turns slot i into a tombstone (holder only): readers that find it
// afterwards, or that hold its old generation, no longer use the object.
func (s *Segment) Retire(i uint64) {
	s.write(i, slotTombstone, [5]uint64{}, 0, 0, 0)
}

func (s *Segment) write(i uint64, state uint32, w [5]uint64, off, size, sum uint64) {
	seq := s.seq(i)
	v := seq.Load()
	seq.Store(v + 1) // odd: being rewritten
	base := s.slot(i)
	// The leases were the old object's: a reader that died holding one
	// would otherwise hold every later object of the slot (issue 29.5).
	// A live reader's late give-back finds 0 and leaves it (unlease).
	s.leases(i).Store(0)
	s.leaseAt(i).Store(0)
	s.state(i).Store(state)
	for j, x := range w {
		s.u64(base + 24 + 8*uint64(j)).Store(x)
	}
	s.u64(base + 64).Store(off)
	s.u64(base + 72).Store(size)
	s.u64(base + 80).Store(sum)
	seq.Store(v + 2)
}

// Slot is a consistent read of one live slot: where its object lies in
// the data region (Off, Size) and the kvsum64 it was published with.
type Slot struct {
	slot           uint64
	gen            uint64 // the slot's seq when read
	Off, Size, Sum uint64
}

// Miss says what Find found: a hit, or why not.
type Miss uint8

const (
	Hit    Miss = iota // a live slot of the key, its fields consistent
	Absent             // not in the catalog
	Busy               // a slot on the way stayed mid-rewrite: treated as a miss
)

// Find searches the catalog for k (any process). It never returns a torn
// slot: each slot's fields are taken only when its seq was even and equal
// before and after reading them. A hit is checked against the data region
// (a damaged catalog is a miss, never an out-of-range read).
func (s *Segment) Find(k dcp.Key) (Slot, Miss) {
	w := keyWords(k)
	mask := s.geo.slots - 1
	i := s.home(w)
	for range s.geo.slots {
		v, st, ok := s.read(i, w)
		if !ok {
			return Slot{}, Busy
		}
		switch st {
		case slotEmpty:
			return Slot{}, Absent
		case slotLive:
			if v.Size != 0 && v.Off <= uint64(len(s.data)) && v.Size <= uint64(len(s.data))-v.Off {
				return v, Hit
			}
			if v.Size != 0 {
				return Slot{}, Absent
			}
		}
		i = (i + 1) & mask
	}
	return Slot{}, Absent
}

// read takes a consistent copy of slot i; st is slotLive only when its key
// is w. ok is false when the slot stayed mid-rewrite for segSpins tries.
func (s *Segment) read(i uint64, w [5]uint64) (v Slot, st uint32, ok bool) {
	base := s.slot(i)
	seq := s.seq(i)
	for try := 0; try < segSpins; try++ {
		if try > 0 {
			runtime.Gosched()
		}
		g1 := seq.Load()
		if g1&1 != 0 {
			continue
		}
		st = s.state(i).Load()
		match := true
		for j, x := range w {
			if s.u64(base+24+8*uint64(j)).Load() != x {
				match = false
			}
		}
		v = Slot{slot: i, gen: g1, Off: s.u64(base + 64).Load(), Size: s.u64(base + 72).Load(), Sum: s.u64(base + 80).Load()}
		if seq.Load() != g1 {
			continue // torn: the holder rewrote it meanwhile
		}
		if st == slotLive && !match {
			st = slotTombstone // someone else's: keep probing
		}
		return v, st, true
	}
	return Slot{}, 0, false
}

// Lease takes a lease on a slot found by Find, stamped now (unix ns), and
// reports whether the slot still holds the same generation; when not, the
// lease is already given back.
func (s *Segment) Lease(v Slot, now int64) bool {
	s.leases(v.slot).Add(1)
	s.leaseAt(v.slot).Store(now)
	if s.seq(v.slot).Load() != v.gen {
		s.unlease(v.slot)
		return false
	}
	return true
}

// Unlease gives a lease back.
func (s *Segment) Unlease(v Slot) { s.unlease(v.slot) }

// unlease takes one lease off slot i, never below zero: a rewrite of the
// slot reset its count, and a give-back of a lease on the old object that
// comes after it must not eat a lease on the new one. (What it may still
// eat is a lease taken between the reset and the give-back; an eviction
// chosen then is caught by the reader's checksum, C5.)
func (s *Segment) unlease(i uint64) {
	l := s.leases(i)
	for {
		n := l.Load()
		if n <= 0 || l.CompareAndSwap(n, n-1) {
			return
		}
	}
}

// Leased reports whether slot i has a lease taken less than ttl ns before
// now (a lease of a reader that died is ignored once it is older).
func (s *Segment) Leased(i uint64, now, ttl int64) bool {
	return s.leases(i).Load() > 0 && now-s.leaseAt(i).Load() < ttl
}
