package transfer

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// planMem is a pool of a given size: planning reads only its size.
type planMem struct{ size uint64 }

func (m *planMem) Size() uint64   { return m.size }
func (m *planMem) Release() error { return nil }

// planGeometries are the seed geometries of the transfer tests and every
// enginesim spec file (the built-in scenarios, every seed geometry row,
// odd rows, block ids near 2^31), each with every TP rank.
func planGeometries(t *testing.T) []seedCase {
	t.Helper()
	var out []seedCase
	for _, sc := range seedCases() {
		for tp := range sc.spec.Layout.TP {
			out = append(out, seedCase{name: fmt.Sprintf("%s/tp%d", sc.name, tp), spec: sc.spec, tp: tp})
		}
	}
	files, err := filepath.Glob("../enginesim/specs/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("enginesim spec files: %v (%d)", err, len(files))
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		spec := specFile(t, b)
		for tp := range spec.Layout.TP {
			out = append(out, seedCase{name: fmt.Sprintf("%s/tp%d", filepath.Base(f), tp), spec: spec, tp: tp})
		}
	}
	return out
}

// planCase is a session (its pools of fake sizes) and an engine config
// enough for both planners.
type planCase struct {
	e   *Engine
	sp  *space
	res *dcp.Resolved
	tp  int
}

// newPlanCase gives group g's layer l a pool of sizes(g, l) bytes.
func newPlanCase(t *testing.T, sc seedCase, sizes func(g dcp.PageGeometry, layer int) uint64) *planCase {
	t.Helper()
	res, err := sc.spec.Resolve()
	if err != nil {
		t.Fatalf("%s: %v", sc.name, err)
	}
	sp := &space{res: res, pools: make([][]cuda.Mem, len(res.Groups))}
	for gi, g := range res.Geometry {
		for li := range g.Layers {
			sp.pools[gi] = append(sp.pools[gi], &planMem{size: sizes(g, li)})
		}
	}
	e := &Engine{}
	e.cfg.Rank = wire.Rank{Instance: "plan", TPRank: sc.tp}
	return &planCase{e: e, sp: sp, res: res, tp: sc.tp}
}

// request builds a retrieve of chunks chunks whose block ids are drawn,
// distinct per group, from ids(g).
func (pc *planCase) request(rng *rand.Rand, chunks int, ids func(gi int, n int) []int64) RetrieveRequest {
	req := RetrieveRequest{RestoreID: "plan", Namespace: pc.res.Namespace, Session: "s"}
	pick := make([][]int64, len(pc.res.Groups))
	for gi := range pc.res.Groups {
		pick[gi] = ids(gi, chunks*pc.res.BlocksPerChunk(gi))
		rng.Shuffle(len(pick[gi]), func(a, b int) { pick[gi][a], pick[gi][b] = pick[gi][b], pick[gi][a] })
	}
	for c := range chunks {
		for gi := range pc.res.Groups {
			n := pc.res.BlocksPerChunk(gi)
			key := dcp.Key{NS: pc.res.Namespace, Chunk: chunkHash(c), Shard: uint16(pc.res.ReadShard(gi, pc.tp)), Group: uint16(gi)}
			req.Items = append(req.Items, wire.RetrieveItem{Chunk: c, Group: gi, Key: key,
				Blocks: slices.Clone(pick[gi][c*n : (c+1)*n])})
		}
	}
	return req
}

// compare runs both planners on req and fails unless they agree: the same
// spans (pool, offset, length, in order) when the reference accepts, a
// refusal by the fast planner when it refuses. It returns the reference's
// error.
func (pc *planCase) compare(t *testing.T, what string, req RetrieveRequest) error {
	t.Helper()
	want, werr := pc.e.planRetrieveChecked(pc.sp, req)
	got, ok := planFast(pc.res, pc.sp.pools, pc.tp, req)
	switch {
	case werr != nil && ok:
		t.Fatalf("%s: the fast planner accepted what the reference refuses: %v", what, werr)
	case werr != nil:
		if !errors.Is(werr, ErrBadRequest) {
			t.Fatalf("%s: reference refused with %v, want ErrBadRequest", what, werr)
		}
		return werr
	case !ok:
		t.Fatalf("%s: the fast planner refused what the reference accepts", what)
	}
	if len(got) != len(want) {
		t.Fatalf("%s: %d items planned, the reference %d", what, len(got), len(want))
	}
	for i := range want {
		if !slices.Equal(got[i], want[i]) {
			t.Fatalf("%s: item %d: spans differ from the reference's\n got %v\nwant %v", what, i, got[i], want[i])
		}
		if cap(got[i]) != len(got[i]) {
			t.Fatalf("%s: item %d: spans have room beyond them (cap %d, len %d): an append would write the next item's", what, i, cap(got[i]), len(got[i]))
		}
	}
	_, err := pc.e.planRetrieve(pc.sp, req)
	if err != nil {
		t.Fatalf("%s: planRetrieve: %v", what, err)
	}
	return nil
}

// TestPlanFastMatchesChecked compares the fast retrieve planner with the
// reference over every seed geometry and TP rank: dense and sparse block
// ids, pools of exact and ragged sizes (a partial last page, layers of
// different sizes, pools near 2^64 B), and every check broken in turn
// (duplicates within and across items, the block past the last whole
// page, negative and overflowing ids, block counts, group, namespace,
// key group and shard).
func TestPlanFastMatchesChecked(t *testing.T) {
	rng := rand.New(rand.NewPCG(25, 4))
	for _, sc := range planGeometries(t) {
		t.Run(sc.name, func(t *testing.T) {
			res, err := sc.spec.Resolve()
			if err != nil {
				t.Fatal(err)
			}
			chunks := 1 + rng.IntN(4)
			need := func(gi int) int64 { return int64(chunks * res.BlocksPerChunk(gi)) }
			type poolCase struct {
				name  string
				sizes func(g dcp.PageGeometry, layer int) uint64
				ids   func(pc *planCase, gi, n int) []int64 // n distinct ids that fit
			}
			dense := func(base int64) func(pc *planCase, gi, n int) []int64 {
				return func(_ *planCase, _ int, n int) []int64 {
					out := make([]int64, n)
					for k := range out {
						out[k] = base + int64(k)
					}
					return out
				}
			}
			pools := []poolCase{
				{"exact", func(g dcp.PageGeometry, _ int) uint64 { return g.PoolBytes(4 * need(0) * 64) }, nil},
				// The last block's page ends exactly at the pool's end
				// (stride padding cut off) in one layer, a byte short in
				// none: the highest id is the last one that fits.
				{"ragged", func(g dcp.PageGeometry, l int) uint64 {
					n := int64(3*chunks*64) + int64(l)
					return uint64(n-1)*g.StrideBytes + g.PageBytes + uint64(l%2)*(g.PageBytes-1)
				}, nil},
				// Ids far apart (sorted, not a bitmap), high in a huge pool.
				{"sparse", func(g dcp.PageGeometry, _ int) uint64 { return math.MaxUint64 - uint64(rng.IntN(1000)) },
					func(pc *planCase, gi, n int) []int64 {
						out := make([]int64, n)
						for k := range out {
							out[k] = int64(k)<<40 + int64(rng.IntN(1000))
						}
						return out
					}},
			}
			for _, p := range pools {
				pc := newPlanCase(t, sc, p.sizes)
				ids := p.ids
				if ids == nil {
					ids = func(pc *planCase, gi, n int) []int64 {
						// All fitting ids, the highest included.
						top := (pc.sp.pools[gi][0].Size() - res.Geometry[gi].PageBytes) / res.Geometry[gi].StrideBytes
						for _, m := range pc.sp.pools[gi] {
							top = min(top, (m.Size()-res.Geometry[gi].PageBytes)/res.Geometry[gi].StrideBytes)
						}
						out := dense(int64(top)-int64(n)+1)(pc, gi, n)
						return out
					}
				}
				req := pc.request(rng, chunks, func(gi, n int) []int64 { return ids(pc, gi, n) })
				if err := pc.compare(t, p.name, req); err != nil {
					t.Fatalf("%s: the reference refused a good request: %v", p.name, err)
				}
				for _, m := range planMutations(pc, req) {
					if err := pc.compare(t, p.name+": "+m.name, m.req); err == nil {
						t.Fatalf("%s: %s: the reference accepted it", p.name, m.name)
					}
				}
			}
		})
	}
}

type planMutation struct {
	name string
	req  RetrieveRequest
}

// planMutations returns req broken in every way planning must refuse.
func planMutations(pc *planCase, req RetrieveRequest) []planMutation {
	clone := func() RetrieveRequest {
		r := req
		r.Items = slices.Clone(req.Items)
		for i := range r.Items {
			r.Items[i].Blocks = slices.Clone(r.Items[i].Blocks)
		}
		return r
	}
	var out []planMutation
	add := func(name string, f func(r *RetrieveRequest)) {
		r := clone()
		f(&r)
		out = append(out, planMutation{name, r})
	}
	last := len(req.Items) - 1
	top := func(gi int) int64 {
		g := pc.res.Geometry[gi]
		t := uint64(math.MaxInt64)
		for _, m := range pc.sp.pools[gi] {
			t = min(t, (m.Size()-g.PageBytes)/g.StrideBytes)
		}
		return int64(t)
	}
	if n := len(req.Items[last].Blocks); n > 1 {
		add("duplicate block within an item", func(r *RetrieveRequest) { r.Items[last].Blocks[n-1] = r.Items[last].Blocks[0] })
	}
	for i := range last {
		if req.Items[i].Group == req.Items[last].Group {
			add("duplicate block across items", func(r *RetrieveRequest) { r.Items[last].Blocks[0] = r.Items[i].Blocks[0] })
			break
		}
	}
	g := req.Items[last].Group
	if top(g) < math.MaxInt64 {
		add("block past the last whole page", func(r *RetrieveRequest) { r.Items[last].Blocks[0] = top(g) + 1 })
	}
	add("negative block", func(r *RetrieveRequest) { r.Items[0].Blocks[0] = -1 })
	if pc.res.Geometry[req.Items[0].Group].StrideBytes > 1 {
		add("block whose offset overflows", func(r *RetrieveRequest) { r.Items[0].Blocks[0] = math.MaxInt64 })
	}
	add("a block too many", func(r *RetrieveRequest) { r.Items[0].Blocks = append(r.Items[0].Blocks, top(r.Items[0].Group)-1e6) })
	add("a block too few", func(r *RetrieveRequest) { r.Items[0].Blocks = r.Items[0].Blocks[1:] })
	add("group out of range", func(r *RetrieveRequest) { r.Items[last].Group = len(pc.res.Groups) })
	add("negative group", func(r *RetrieveRequest) { r.Items[last].Group = -1 })
	add("key of another namespace", func(r *RetrieveRequest) { r.Items[last].Key.NS[0] ^= 1 })
	add("key of another group", func(r *RetrieveRequest) { r.Items[last].Key.Group++ })
	add("key of another shard", func(r *RetrieveRequest) { r.Items[last].Key.Shard++ })
	return out
}

// A chunk of consecutive blocks is planned as one span per pool where its
// pages continue each other (no padding between them), by both planners
// alike; the merged spans cover exactly the bytes of the page-by-page
// spans, in the same order. Shuffled blocks keep a span per page.
func TestPlanMergesConsecutivePages(t *testing.T) {
	for _, sc := range planGeometries(t) {
		t.Run(sc.name, func(t *testing.T) {
			pc := newPlanCase(t, sc, func(g dcp.PageGeometry, _ int) uint64 { return g.PoolBytes(1 << 12) })
			res := pc.res
			req := RetrieveRequest{RestoreID: "plan", Namespace: res.Namespace, Session: "s"}
			for gi := range res.Groups {
				n := res.BlocksPerChunk(gi)
				for c := range 3 {
					blocks := make([]int64, n)
					for k := range blocks {
						blocks[k] = int64(100 + c*n + k)
					}
					key := dcp.Key{NS: res.Namespace, Chunk: chunkHash(c), Shard: uint16(res.ReadShard(gi, pc.tp)), Group: uint16(gi)}
					req.Items = append(req.Items, wire.RetrieveItem{Chunk: c, Group: gi, Key: key, Blocks: blocks})
				}
			}
			if err := pc.compare(t, "consecutive", req); err != nil {
				t.Fatalf("refused: %v", err)
			}
			got, _ := planFast(res, pc.sp.pools, pc.tp, req)
			for i, it := range req.Items {
				g := res.Geometry[it.Group]
				pages, err := layerSpans(g, pc.sp.pools[it.Group], it.Blocks, false)
				if err != nil {
					t.Fatal(err)
				}
				sameBytes(t, fmt.Sprintf("item %d", i), got[i], pages)
				if g.StrideBytes == g.PageBytes && len(pages) == len(it.Blocks)*g.Layers && len(got[i]) != g.Layers {
					t.Fatalf("item %d (group %d, %d B pages without padding): %d spans for %d layers", i, it.Group, g.PageBytes, len(got[i]), g.Layers)
				}
			}
			// Reversed blocks continue nothing: a span per page, as before.
			for i := range req.Items {
				slices.Reverse(req.Items[i].Blocks)
			}
			if err := pc.compare(t, "reversed", req); err != nil {
				t.Fatalf("refused: %v", err)
			}
			got, _ = planFast(res, pc.sp.pools, pc.tp, req)
			for i, it := range req.Items {
				g := res.Geometry[it.Group]
				pages, _ := layerSpans(g, pc.sp.pools[it.Group], it.Blocks, false)
				if len(it.Blocks) > 1 && len(got[i]) != len(pages) {
					t.Fatalf("item %d, blocks reversed: %d spans, %d pages", i, len(got[i]), len(pages))
				}
			}
		})
	}
}

// sameBytes fails unless merged covers the bytes of pages in order: each
// merged span is a run of pages that continue each other in its pool.
func sameBytes(t *testing.T, what string, merged, pages []cuda.Span) {
	t.Helper()
	k := 0
	for _, m := range merged {
		off := m.Off
		for off < m.Off+m.Len {
			if k >= len(pages) || pages[k].Mem != m.Mem || pages[k].Off != off || off+pages[k].Len > m.Off+m.Len {
				t.Fatalf("%s: merged span %+v does not match the pages from %d: %v", what, m, k, pages)
			}
			off += pages[k].Len
			k++
		}
	}
	if k != len(pages) {
		t.Fatalf("%s: merged spans cover %d of %d pages", what, k, len(pages))
	}
}
