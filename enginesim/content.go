package enginesim

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"sync"

	"github.com/kvtier/kvtier/dcp"
)

// Table phases: the engine stores from one set of blocks and, after its
// prefix cache was reset, restores into another (block ids are whatever the
// allocator hands out then).
const (
	PhaseStoreTable   = 0
	PhaseRestoreTable = 1
)

// Plan is the pure part of a simulation: geometry, block tables and the
// content of every byte of every pool. Everything is a function of the
// scenario and the seed, so a new process rebuilds the same plan.
type Plan struct {
	Scenario Scenario
	R        *dcp.Resolved
	Seed     uint64
	// Tokens is the prompt: Chunks full chunks and a partial tail.
	Tokens []uint32
	// Hashes are the chunk hashes of the prompt's full chunks.
	Hashes []dcp.ChunkHash
	// BPC is the blocks per chunk of each group on one rank.
	BPC []int
	// BlockBase is the first block id the engine uses in every pool
	// (Scenario.BlockBase): blocks [0, BlockBase) exist but belong to
	// nobody the simulation knows; they hold the padding sentinels and
	// must never change.
	BlockBase int64
	// PoolBlocks is the number of blocks in each group's pool (per layer):
	// BlockBase plus the window of blocks the block tables draw from.
	PoolBlocks []int64
	// PoolBytes is the size of one layer's pool of each group.
	PoolBytes []uint64
	// LayerStride is the distance between two layers' pools in a group's
	// allocation (PoolBytes rounded up to 4 KiB; the slack is untouched).
	LayerStride []uint64
	// Tables are the block tables of each group, per phase: entry v is the
	// block holding virtual block v of the prompt (same on every rank, as
	// vLLM shares block tables across TP ranks).
	Tables [2][][]int64

	modelSeed uint64
}

// Bounds of a scenario's pools, so a spec file cannot ask for an
// allocation no machine has.
const (
	// MaxBlockID is the largest block id a scenario may use (2^40).
	MaxBlockID = 1 << 40
	// MaxPoolBytes bounds one layer's pool of one group (1 TiB).
	MaxPoolBytes = 1 << 40
	// MaxWindowBlocks bounds the blocks above the base a block table
	// draws from (the plan holds a permutation of them).
	MaxWindowBlocks = 1 << 22
	// MaxPromptTokens bounds the simulated prompt.
	MaxPromptTokens = 1 << 26
)

// NewPlan validates the scenario's spec and derives the plan.
func NewPlan(sc Scenario, seed uint64) (*Plan, error) {
	r, err := sc.Spec.Resolve()
	if err != nil {
		return nil, fmt.Errorf("scenario %s: %w", sc.Name, err)
	}
	if sc.Chunks < 1 {
		return nil, fmt.Errorf("scenario %s: %d chunks, want >= 1", sc.Name, sc.Chunks)
	}
	if sc.TailTokens < 0 || sc.TailTokens >= sc.Spec.ChunkTokens {
		return nil, fmt.Errorf("scenario %s: %d tail tokens, want 0..%d (less than a chunk of %d)",
			sc.Name, sc.TailTokens, sc.Spec.ChunkTokens-1, sc.Spec.ChunkTokens)
	}
	if sc.BlockBase < 0 || sc.BlockBase > MaxBlockID {
		return nil, fmt.Errorf("scenario %s: block id base %d, want 0..%d", sc.Name, sc.BlockBase, int64(MaxBlockID))
	}
	if sc.PoolBlocks < 0 {
		return nil, fmt.Errorf("scenario %s: %d pool blocks, want >= 0 (0: twice the blocks the prompt uses, plus 3)", sc.Name, sc.PoolBlocks)
	}
	if int64(sc.Chunks)*int64(sc.Spec.ChunkTokens) > MaxPromptTokens {
		return nil, fmt.Errorf("scenario %s: %d chunks x %d tokens exceeds the %d-token prompt limit",
			sc.Name, sc.Chunks, sc.Spec.ChunkTokens, MaxPromptTokens)
	}
	if sc.PoolBlocks > MaxWindowBlocks {
		return nil, fmt.Errorf("scenario %s: %d pool blocks, limit %d", sc.Name, sc.PoolBlocks, MaxWindowBlocks)
	}
	p := &Plan{Scenario: sc, R: r, Seed: seed, BlockBase: sc.BlockBase}
	h := sha256.Sum256([]byte(sc.Spec.Model))
	p.modelSeed = binary.LittleEndian.Uint64(h[:8]) ^ seed

	// The prompt: deterministic token ids.
	n := sc.Chunks*sc.Spec.ChunkTokens + sc.TailTokens
	if sc.Tokens != nil {
		if len(sc.Tokens) != n {
			return nil, fmt.Errorf("scenario %s: prompt of %d tokens, want %d chunks x %d + %d tail = %d",
				sc.Name, len(sc.Tokens), sc.Chunks, sc.Spec.ChunkTokens, sc.TailTokens, n)
		}
		p.Tokens = append([]uint32(nil), sc.Tokens...)
	} else {
		rng := rand.New(rand.NewPCG(p.modelSeed, 0x70726f6d7074))
		p.Tokens = make([]uint32, n)
		for i := range p.Tokens {
			p.Tokens[i] = rng.Uint32N(151936)
		}
	}
	p.Hashes = dcp.ChunkHashes(r.Namespace, p.Tokens, sc.Spec.ChunkTokens)

	for gi, g := range r.Geometry {
		bpc := r.BlocksPerChunk(gi)
		used := int64(bpc * sc.Chunks)
		blocks := 2*used + 3
		if sc.PoolBlocks > 0 {
			if sc.PoolBlocks < used {
				return nil, fmt.Errorf("scenario %s: group %q: %d pool blocks, the prompt uses %d (%d chunks x %d blocks)",
					sc.Name, g.Name, sc.PoolBlocks, used, sc.Chunks, bpc)
			}
			blocks = sc.PoolBlocks
		}
		if blocks > MaxWindowBlocks {
			return nil, fmt.Errorf("scenario %s: group %q: the prompt's %d chunks use %d blocks, a pool of %d, limit %d",
				sc.Name, g.Name, sc.Chunks, used, blocks, MaxWindowBlocks)
		}
		total := sc.BlockBase + blocks
		hi, pb := bits.Mul64(uint64(total-1), g.StrideBytes)
		if total > MaxBlockID+1 || hi != 0 || pb+g.PageBytes < pb || pb+g.PageBytes > MaxPoolBytes {
			return nil, fmt.Errorf("scenario %s: group %q: a pool of %d blocks (block id base %d + %d) of stride %d B exceeds %d B",
				sc.Name, g.Name, total, sc.BlockBase, blocks, g.StrideBytes, uint64(MaxPoolBytes))
		}
		pb = g.PoolBytes(total)
		p.BPC = append(p.BPC, bpc)
		p.PoolBlocks = append(p.PoolBlocks, total)
		p.PoolBytes = append(p.PoolBytes, pb)
		p.LayerStride = append(p.LayerStride, (pb+4095)&^4095)
		for phase := range 2 {
			prng := rand.New(rand.NewPCG(p.modelSeed, uint64(1000*phase+gi+1)))
			perm := prng.Perm(int(blocks))
			t := make([]int64, used)
			for v := range t {
				if sc.Consecutive {
					t[v] = sc.BlockBase + int64(phase)*(blocks-used) + int64(v)
				} else {
					t[v] = sc.BlockBase + int64(perm[v])
				}
			}
			p.Tables[phase] = append(p.Tables[phase], t)
		}
	}
	return p, nil
}

// AllocBytes is the size of group gi's allocation holding all its layers.
func (p *Plan) AllocBytes(gi int) uint64 {
	g := p.R.Geometry[gi]
	return uint64(g.Layers-1)*p.LayerStride[gi] + p.PoolBytes[gi]
}

// Shard returns the shard whose content TP rank t holds for group gi: the
// DCP rank for MLA groups (identical on the TP ranks of one DCP rank), the
// TP rank otherwise.
func (p *Plan) Shard(gi, t int) int { return p.R.ReadShard(gi, t) }

// splitmix64 step.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func (p *Plan) seedOf(vals ...uint64) uint64 {
	s := p.modelSeed
	for _, v := range vals {
		s = mix(s ^ v)
	}
	return s
}

// fill writes the deterministic byte stream of seed s into dst.
func fill(dst []byte, s uint64) {
	for len(dst) >= 8 {
		s = mix(s)
		binary.LittleEndian.PutUint64(dst, s)
		dst = dst[8:]
	}
	if len(dst) > 0 {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], mix(s))
		copy(dst, w[:])
	}
}

// TokenPos returns the prompt position of row j of virtual block v of an
// attention group on DCP rank d: the inverse of vLLM's local slot formula
// (vbo = (j/I)*W*I + d*I + j%I).
func (p *Plan) TokenPos(gi, v, j, d int) int64 {
	g := p.R.Geometry[gi]
	w, in := int64(p.R.Layout.DCP), int64(p.R.Layout.Interleave)
	jj := int64(j)
	vbo := (jj/in)*w*in + int64(d)*in + jj%in
	return int64(v)*g.Span + vbo
}

// Page writes the content of virtual block v of group gi, layer, as TP rank
// t holds it, into dst (PageBytes long). Tiled attention pages are rows of
// per-token content, a function of the token's position; opaque pages and
// recurrent states are a function of the block index.
func (p *Plan) Page(t, gi, layer, v int, dst []byte) {
	g := p.R.Geometry[gi]
	shard := uint64(p.Shard(gi, t))
	if g.Kind != dcp.Recurrent && g.Tiled {
		d := p.R.Layout.DCPRank(t)
		for j := range g.Slots {
			pos := p.TokenPos(gi, v, j, d)
			row := dst[uint64(j)*g.SlotBytes : uint64(j+1)*g.SlotBytes]
			fill(row, p.seedOf(1, shard, uint64(gi), uint64(layer), uint64(pos), uint64(p.Tokens[pos])))
		}
		return
	}
	fill(dst[:g.PageBytes], p.seedOf(2, shard, uint64(gi), uint64(layer), uint64(v)))
}

// PadByte is the sentinel of byte off of an allocation outside any declared
// page (padding after pages, slack between layers); it must never change.
func PadByte(off uint64) byte { return byte(0xA5 ^ (off>>3)*0x3b) }

// WipeByte is the content of a declared page byte after the engine's
// prefix cache was reset (or before anything was computed).
func WipeByte(off uint64) byte { return byte(0x5A ^ off*0x1f ^ off>>9) }

// Blank writes the initial image of group gi's allocation into dst
// (AllocBytes long): wipe bytes in every declared page, sentinels elsewhere.
func (p *Plan) Blank(gi int, dst []byte) { p.BlankRange(gi, 0, dst) }

// BlankRange writes bytes [off, off+len(dst)) of the initial image of group
// gi's allocation into dst, so that a large pool is initialized in pieces.
// Blocks below BlockBase are not the engine's: they hold sentinels.
func (p *Plan) BlankRange(gi int, off uint64, dst []byte) {
	fillPad(off, dst)
	end := off + uint64(len(dst))
	p.eachPage(gi, func(po, n uint64) {
		lo, hi := max(po, off), min(po+n, end)
		for i := lo; i < hi; i++ {
			dst[i-off] = WipeByte(i)
		}
	})
}

// padPeriod is the period of PadByte: it depends on off only through the
// low 8 bits of off>>3.
const padPeriod = 2048

// padPiece is the largest piece padding is checked or filled in at once.
const padPiece = 16 << 20

var padPattern = sync.OnceValue(func() []byte {
	b := make([]byte, padPiece+padPeriod)
	for i := range b {
		b[i] = PadByte(uint64(i))
	}
	return b
})

// fillPad writes the sentinels of allocation bytes [off, off+len(dst)).
func fillPad(off uint64, dst []byte) {
	pat := padPattern()
	for len(dst) > 0 {
		n := min(len(dst), padPiece)
		copy(dst[:n], pat[off%padPeriod:])
		dst, off = dst[n:], off+uint64(n)
	}
}

// eachPage calls f with the allocation offset and length of every declared
// page of every layer of group gi that the engine uses: blocks BlockBase
// and above.
func (p *Plan) eachPage(gi int, f func(off, n uint64)) {
	g := p.R.Geometry[gi]
	for l := range g.Layers {
		for b := p.BlockBase; b < p.PoolBlocks[gi]; b++ {
			f(p.PageOffset(gi, l, b), g.PageBytes)
		}
	}
}

// PageOffset is the allocation offset of block b of layer l of group gi.
func (p *Plan) PageOffset(gi, l int, b int64) uint64 {
	return uint64(l)*p.LayerStride[gi] + uint64(b)*p.R.Geometry[gi].StrideBytes
}

// Mismatch describes the differences found in one allocation.
type Mismatch struct {
	// Chunks maps a chunk index to the bytes that differ in its pages.
	Chunks map[int]uint64
	// Outside counts differing bytes outside the expected pages: padding,
	// layer slack, and declared pages that should still hold the wipe.
	Outside uint64
	// First describes the first difference, "" when none.
	First string
	// Bytes is the number of bytes compared.
	Bytes uint64
}

// Verify compares group gi's allocation on TP rank t, read back into got,
// with what it must hold after a restore into table phase: the content of
// every chunk not in skip in its table pages, the wipe in every other
// declared page, the sentinels everywhere else. Chunks in skip (failed,
// the engine recomputes them) may hold anything in their table pages.
func (p *Plan) Verify(t, gi, phase int, got []byte, skip map[int]bool) Mismatch {
	m, _ := p.VerifyFrom(t, gi, phase, func(off uint64, dst []byte) error {
		copy(dst, got[off:])
		return nil
	}, uint64(len(got)), skip, nil)
	return m
}

// VerifyFrom is Verify reading the allocation of size bytes through read,
// in pieces of at most 16 MiB (or one page), so that a pool of gigabytes
// (block ids near 2^31) is checked without a copy of it in memory. It
// returns read's first error. The table pages of the chunks in left (not
// in skip) must still hold the wipe: the restore was not to write them
// (a recurrent group's inner chunks under Config.StateAtEnd); a changed
// byte counts in Chunks.
func (p *Plan) VerifyFrom(t, gi, phase int, read func(off uint64, dst []byte) error, size uint64, skip, left map[int]bool) (Mismatch, error) {
	g := p.R.Geometry[gi]
	m := Mismatch{Chunks: map[int]uint64{}, Bytes: size}
	note := func(what string, off uint64, want, have byte) {
		if m.First == "" {
			m.First = fmt.Sprintf("%s: byte %d of group %s allocation: want %#02x, got %#02x", what, off, g.Name, want, have)
		}
	}
	rd := &rangeReader{read: read, size: size, buf: make([]byte, max(min(padPiece, size), g.PageBytes))}
	// Which block of each layer holds which virtual block.
	owner := make(map[int64]int, len(p.Tables[phase][gi]))
	for v, b := range p.Tables[phase][gi] {
		owner[b] = v
	}
	page := make([]byte, g.PageBytes)
	covered := uint64(0) // end of the last checked range
	pat := padPattern()
	checkPad := func(from, to uint64) error {
		for from < to {
			n := min(to-from, padPiece)
			have, err := rd.get(from, n)
			if err != nil {
				return err
			}
			if want := pat[from%padPeriod : from%padPeriod+n]; !bytes.Equal(have, want) {
				for i := range have {
					if have[i] != want[i] {
						m.Outside++
						note("padding changed", from+uint64(i), want[i], have[i])
					}
				}
			}
			from += n
		}
		return nil
	}
	for l := range g.Layers {
		for b := p.BlockBase; b < p.PoolBlocks[gi]; b++ {
			off := p.PageOffset(gi, l, b)
			if err := checkPad(covered, off); err != nil {
				return m, err
			}
			covered = off + g.PageBytes
			have, err := rd.get(off, g.PageBytes)
			if err != nil {
				return m, err
			}
			v, ok := owner[b]
			if !ok {
				for i := range have {
					if have[i] != WipeByte(off+uint64(i)) {
						m.Outside++
						note("page outside the block table changed", off+uint64(i), WipeByte(off+uint64(i)), have[i])
					}
				}
				continue
			}
			c := v / p.BPC[gi]
			if skip[c] {
				continue
			}
			if left[c] {
				for i := range have {
					if want := WipeByte(off + uint64(i)); have[i] != want {
						m.Chunks[c]++
						note(fmt.Sprintf("chunk %d layer %d block %d (virtual %d), which the restore was not to write, changed", c, l, b, v),
							off+uint64(i), want, have[i])
					}
				}
				continue
			}
			p.Page(t, gi, l, v, page)
			if bytes.Equal(have, page) {
				continue
			}
			for i := range have {
				if have[i] != page[i] {
					m.Chunks[c]++
					note(fmt.Sprintf("chunk %d layer %d block %d (virtual %d) differs", c, l, b, v), off+uint64(i), page[i], have[i])
				}
			}
		}
	}
	return m, checkPad(covered, size)
}

// rangeReader serves forward reads of an allocation from a buffer it
// refills in pieces of len(buf).
type rangeReader struct {
	read     func(off uint64, dst []byte) error
	size     uint64
	buf      []byte
	off, end uint64 // the allocation range buf holds
}

// get returns bytes [off, off+n) of the allocation, n <= len(buf); the
// slice is valid until the next get.
func (r *rangeReader) get(off, n uint64) ([]byte, error) {
	if off < r.off || off+n > r.end {
		if off > r.size || n > r.size-off || n > uint64(len(r.buf)) {
			return nil, fmt.Errorf("enginesim: verify read [%d, +%d) of a %d B allocation", off, n, r.size)
		}
		r.off, r.end = off, off+min(uint64(len(r.buf)), r.size-off)
		if err := r.read(r.off, r.buf[:r.end-r.off]); err != nil {
			r.off, r.end = 0, 0
			return nil, err
		}
	}
	return r.buf[off-r.off : off-r.off+n], nil
}

// ChunkBytes returns the declared bytes one chunk of group gi occupies on
// one rank (all layers).
func (p *Plan) ChunkBytes(gi int) uint64 {
	g := p.R.Geometry[gi]
	return uint64(p.BPC[gi]) * uint64(g.Layers) * g.PageBytes
}

// ChunkBlocks returns the block ids of chunk c of group gi in the table of
// phase.
func (p *Plan) ChunkBlocks(phase, gi, c int) []int64 {
	t := p.Tables[phase][gi]
	return append([]int64(nil), t[c*p.BPC[gi]:(c+1)*p.BPC[gi]]...)
}
