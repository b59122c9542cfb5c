package dcp

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
)

// Spec is everything that determines the identity and geometry of an engine
// instance's stored KV objects.
type Spec struct {
	// Model names the model and its weights revision.
	Model string `json:"model"`
	// CacheSalt separates tenants or other caches that must never share KV.
	CacheSalt string `json:"cache_salt,omitempty"`
	Layout    Layout `json:"layout"`
	// Groups are the KV cache groups; a group's index is its object group.
	Groups []Group `json:"groups"`
	// ChunkTokens is the number of tokens one chunk key covers; a multiple
	// of the scheduler block.
	ChunkTokens int `json:"chunk_tokens"`
}

// Resolved is a validated Spec with everything derived from it.
type Resolved struct {
	Spec
	Geometry       []PageGeometry
	SchedulerBlock int64
	// Fingerprint is the SHA-256 of the canonical layout encoding.
	Fingerprint [32]byte
	Namespace   Namespace
}

// Limits on a Spec, so a hostile or broken request cannot make us allocate
// without bound.
const (
	MaxGroups    = 64
	MaxNameBytes = 256
)

// Resolve validates s and derives its geometry and identity.
func (s Spec) Resolve() (*Resolved, error) {
	if err := s.Layout.Validate(); err != nil {
		return nil, err
	}
	switch {
	case s.Model == "":
		return nil, fmt.Errorf("model name is empty: %w", ErrGeometry)
	case len(s.Model) > MaxNameBytes || len(s.CacheSalt) > MaxNameBytes:
		return nil, fmt.Errorf("model name %d B or cache salt %d B over the %d B limit: %w",
			len(s.Model), len(s.CacheSalt), MaxNameBytes, ErrGeometry)
	case len(s.Groups) == 0 || len(s.Groups) > MaxGroups:
		return nil, fmt.Errorf("%d KV groups, want 1..%d: %w", len(s.Groups), MaxGroups, ErrGeometry)
	case s.ChunkTokens < 1:
		return nil, fmt.Errorf("chunk size %d tokens must be >= 1: %w", s.ChunkTokens, ErrGeometry)
	}
	r := &Resolved{Spec: s}
	for _, g := range s.Groups {
		pg, err := g.Resolve(s.Layout)
		if err != nil {
			return nil, err
		}
		r.Geometry = append(r.Geometry, pg)
	}
	sb, err := SchedulerBlock(r.Geometry)
	if err != nil {
		return nil, err
	}
	if int64(s.ChunkTokens)%sb != 0 {
		return nil, fmt.Errorf("chunk size %d tokens is not a multiple of the scheduler block %d: %w",
			s.ChunkTokens, sb, ErrGeometry)
	}
	r.SchedulerBlock = sb
	r.Fingerprint = sha256.Sum256(r.canonical())
	r.Namespace = newNamespace(s.Model, s.CacheSalt, r.Fingerprint)
	return r, nil
}

// canonical is the stable binary encoding of everything that decides where
// bytes go and who must confirm them: TP size, DCP size, interleave, chunk
// size and every group's kind, MLA flag, block size, layers, semantic,
// declared and stride bytes and KV format, then, under PP > 1, the PP size
// and stage. Group names are excluded.
//
// TP is included even when every group is MLA (whose bytes do not depend on
// TP): the set of ranks that must confirm a restore does, and the
// coordinator keeps one spec per namespace.
func (r *Resolved) canonical() []byte {
	b := []byte("kvtier/layout/v1")
	u64 := func(v uint64) { b = binary.BigEndian.AppendUint64(b, v) }
	str := func(s string) { u64(uint64(len(s))); b = append(b, s...) }
	u64(uint64(r.Layout.TP))
	u64(uint64(r.Layout.DCP))
	u64(uint64(r.Layout.Interleave))
	u64(uint64(r.ChunkTokens))
	u64(uint64(len(r.Groups)))
	for _, g := range r.Groups {
		mla := uint64(0)
		if g.MLA {
			mla = 1
		}
		u64(uint64(g.Kind))
		u64(mla)
		u64(uint64(g.BlockSize))
		u64(uint64(g.Layers))
		u64(g.SemanticBytes)
		u64(g.PageBytes)
		u64(g.StrideBytes)
		str(g.KVFormat)
	}
	// A pipeline stage is a world of its own (Layout.PPStage): PP > 1
	// appends the size and the stage, so every stage has its own namespace
	// while PP 1 keeps the encoding it always had.
	if r.Layout.PP > 1 {
		str("pp")
		u64(uint64(r.Layout.PP))
		u64(uint64(r.Layout.PPStage))
	}
	return b
}

// BlocksPerChunk returns how many blocks of group gi one chunk holds on a rank.
func (r *Resolved) BlocksPerChunk(gi int) int {
	return int(int64(r.ChunkTokens) / r.Geometry[gi].Span)
}

// ObjectSize returns the packed size of one object of group gi.
func (r *Resolved) ObjectSize(gi int) uint64 {
	return r.Geometry[gi].PackedSize(r.BlocksPerChunk(gi))
}

// ShardPlan says who writes a shard of a group and who must read it back.
type ShardPlan struct {
	Shard   int
	Writer  int   // TP rank that stores the shard
	Readers []int // TP ranks that restore it and must confirm it
}

// Shards returns the shard plan of group gi (DESIGN "who stores what"):
//   - not MLA (attention or recurrent): every TP rank stores and restores
//     its own shard;
//   - MLA without DCP: TP rank 0 stores shard 0, every TP rank restores it;
//   - MLA with DCP W: TP rank s < W stores shard s, the TP/W ranks t with
//     t % W == s restore it.
func (r *Resolved) Shards(gi int) []ShardPlan {
	tp, w := r.Layout.TP, r.Layout.DCP
	if !r.Groups[gi].MLA {
		out := make([]ShardPlan, tp)
		for t := range tp {
			out[t] = ShardPlan{Shard: t, Writer: t, Readers: []int{t}}
		}
		return out
	}
	out := make([]ShardPlan, w)
	for s := range w {
		out[s] = ShardPlan{Shard: s, Writer: s}
		for t := s; t < tp; t += w {
			out[s].Readers = append(out[s].Readers, t)
		}
	}
	return out
}

// StoreShard returns the shard TP rank t stores for group gi, and false if
// it stores none.
func (r *Resolved) StoreShard(gi, t int) (int, bool) {
	if !r.Groups[gi].MLA {
		return t, true
	}
	if t < r.Layout.DCP {
		return t, true
	}
	return 0, false
}

// ReadShard returns the shard TP rank t restores for group gi.
func (r *Resolved) ReadShard(gi, t int) int {
	if !r.Groups[gi].MLA {
		return t
	}
	return t % r.Layout.DCP
}

// Expectation is one (rank, shard, group) whose bytes must be confirmed
// before a restore counts as complete.
type Expectation struct {
	Rank  int
	Shard int
	Group int
}

// Expectations returns, for every TP rank, every shard of every group it
// must restore and confirm, ordered by rank then group.
func (r *Resolved) Expectations() []Expectation {
	var out []Expectation
	for t := range r.Layout.TP {
		for gi := range r.Groups {
			out = append(out, Expectation{Rank: t, Shard: r.ReadShard(gi, t), Group: gi})
		}
	}
	return out
}

// ObjectKeys returns the keys of the distinct objects one chunk consists of:
// one per (shard, group), ordered by group then shard.
func (r *Resolved) ObjectKeys(chunk ChunkHash) []Key {
	var out []Key
	for gi := range r.Groups {
		for _, sp := range r.Shards(gi) {
			out = append(out, Key{NS: r.Namespace, Chunk: chunk, Shard: uint16(sp.Shard), Group: uint16(gi)})
		}
	}
	return out
}
