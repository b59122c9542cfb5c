package indextest

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// Slot is one placement position: an object in a tier.
type Slot struct {
	Key  dcp.Key
	Tier wire.Tier
}

// Rank simulates one rankd's placement events. It holds objects in L1 and
// L2, emits a Stored or Removed event per change, numbers events from 1 per
// incarnation, and keeps every batch of the current incarnation so a caller
// can retransmit from any sequence. Restart models a rankd restart: a new
// incarnation, L1 lost, L2 kept (the files survive).
type Rank struct {
	Rank        wire.Rank
	Incarnation uint64
	Seq         uint64

	keys    []dcp.Key
	rng     *rand.Rand
	held    map[Slot]wire.Placement
	events  []wire.Event // events of the current incarnation; events[i].Seq == i+1
	version uint64
}

// NewRank returns a simulated rank that stores and removes objects among
// keys, deterministically for seed.
func NewRank(r wire.Rank, incarnation uint64, keys []dcp.Key, seed uint64) *Rank {
	return &Rank{
		Rank: r, Incarnation: incarnation, keys: keys,
		rng:  rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		held: make(map[Slot]wire.Placement),
	}
}

// SumOf is the checksum the simulation records for version v of key k.
func SumOf(k dcp.Key, v uint64) uint64 {
	var h uint64 = 0xcbf29ce484222325
	b, _ := k.MarshalBinary()
	b = binary.LittleEndian.AppendUint64(b, v)
	for _, c := range b {
		h = (h ^ uint64(c)) * 0x100000001b3
	}
	return h
}

func (s *Rank) emit(kind wire.EventKind, sl Slot, size, sum uint64) wire.Event {
	s.Seq++
	e := wire.Event{Seq: s.Seq, Kind: kind, Tier: sl.Tier, Key: sl.Key, Size: size, Sum: sum}
	s.events = append(s.events, e)
	return e
}

// Store stores key k in tier t (replacing an older copy) and returns the
// event.
func (s *Rank) Store(k dcp.Key, t wire.Tier, size uint64) wire.Event {
	s.version++
	sl := Slot{k, t}
	p := wire.Placement{Key: k, Tier: t, Size: size, Sum: SumOf(k, s.version)}
	s.held[sl] = p
	return s.emit(wire.Stored, sl, p.Size, p.Sum)
}

// Remove removes key k from tier t (whether or not it is held: removing an
// object the rank does not hold is legal and changes nothing) and returns
// the event.
func (s *Rank) Remove(k dcp.Key, t wire.Tier) wire.Event {
	sl := Slot{k, t}
	delete(s.held, sl)
	return s.emit(wire.Removed, sl, 0, 0)
}

// Next produces a batch of n random events: stores to L1, write-behind
// copies to L2, L1 evictions, L2 removals and the odd removal of an object
// the rank does not hold.
func (s *Rank) Next(n int) wire.Batch {
	b := wire.Batch{Rank: s.Rank, Incarnation: s.Incarnation}
	for range n {
		k := s.keys[s.rng.IntN(len(s.keys))]
		size := 4096 + uint64(s.rng.IntN(1<<16))
		var e wire.Event
		switch x := s.rng.IntN(100); {
		case x < 40:
			e = s.Store(k, wire.L1, size)
		case x < 65:
			if p, ok := s.held[Slot{k, wire.L1}]; ok {
				// write-behind: same bytes, same checksum
				s.held[Slot{k, wire.L2}] = wire.Placement{Key: k, Tier: wire.L2, Size: p.Size, Sum: p.Sum}
				e = s.emit(wire.Stored, Slot{k, wire.L2}, p.Size, p.Sum)
			} else {
				e = s.Store(k, wire.L2, size)
			}
		case x < 85:
			e = s.Remove(k, wire.L1)
		default:
			e = s.Remove(k, wire.L2)
		}
		b.Events = append(b.Events, e)
	}
	return b
}

// Since returns a batch of every event after sequence seq of the current
// incarnation (a retransmission).
func (s *Rank) Since(seq uint64) wire.Batch {
	b := wire.Batch{Rank: s.Rank, Incarnation: s.Incarnation}
	if seq < uint64(len(s.events)) {
		b.Events = slices.Clone(s.events[seq:])
	}
	return b
}

// Restart starts a new incarnation: L1 is lost, L2 survives, sequences
// restart at 1.
func (s *Rank) Restart() {
	s.Incarnation++
	s.Seq = 0
	s.events = nil
	for sl := range s.held {
		if sl.Tier == wire.L1 {
			delete(s.held, sl)
		}
	}
}

// Inventory returns everything the rank holds now, sorted by key then tier.
func (s *Rank) Inventory() wire.Inventory {
	inv := wire.Inventory{Rank: s.Rank, Incarnation: s.Incarnation, Seq: s.Seq}
	for _, p := range s.held {
		inv.Objects = append(inv.Objects, p)
	}
	SortPlacements(inv.Objects)
	return inv
}

// Held returns the number of placements the rank holds.
func (s *Rank) Held() int { return len(s.held) }

// SortPlacements sorts placements by binary key, then tier.
func SortPlacements(ps []wire.Placement) {
	slices.SortFunc(ps, func(a, b wire.Placement) int {
		ka, kb := a.Key.Bytes(), b.Key.Bytes()
		for i := range ka {
			if ka[i] != kb[i] {
				return int(ka[i]) - int(kb[i])
			}
		}
		return int(a.Tier) - int(b.Tier)
	})
}

// Keys returns n distinct keys of namespace ns: chunks derived from seed,
// each with shards 0..shards-1 and groups 0..groups-1 (n rounded up to
// whole chunks).
func Keys(ns dcp.Namespace, seed uint64, n, shards, groups int) []dcp.Key {
	var out []dcp.Key
	for c := uint64(0); len(out) < n; c++ {
		ch := Chunk(seed, c)
		for sh := range shards {
			for g := range groups {
				out = append(out, dcp.Key{NS: ns, Chunk: ch, Shard: uint16(sh), Group: uint16(g)})
			}
		}
	}
	return out
}

// Chunk returns a deterministic chunk hash for (seed, i).
func Chunk(seed, i uint64) dcp.ChunkHash {
	var c dcp.ChunkHash
	x := seed*0x9e3779b97f4a7c15 + i
	for j := 0; j < 16; j += 8 {
		x ^= x >> 30
		x *= 0xbf58476d1ce4e5b9
		x ^= x >> 27
		x *= 0x94d049bb133111eb
		x ^= x >> 31
		binary.BigEndian.PutUint64(c[j:], x)
		x += 0x9e3779b97f4a7c15
	}
	return c
}
