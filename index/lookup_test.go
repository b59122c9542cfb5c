package index_test

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
)

func mlaSpec(tp, w int) dcp.Spec {
	return dcp.Spec{
		Model: "deepseek", Layout: dcp.Layout{TP: tp, DCP: w, Interleave: 1, PP: 1}, ChunkTokens: 64 * w,
		Groups: []dcp.Group{{Kind: dcp.Attention, MLA: true, BlockSize: 64, Layers: 2, KVFormat: "fp8_ds_mla",
			SemanticBytes: 64 * 656, PageBytes: 64 * 656, StrideBytes: 64 * 656}},
	}
}

// gqaSpec is a non-MLA model with two attention groups (full and sliding
// window): every rank stores and reads its own shard of each.
func gqaSpec(tp int) dcp.Spec {
	g := dcp.Group{Kind: dcp.Attention, BlockSize: 16, Layers: 4, KVFormat: "bf16",
		SemanticBytes: 16 * 1024, PageBytes: 16 * 1024, StrideBytes: 16 * 1024}
	sw := g
	sw.Kind = dcp.SlidingWindow
	return dcp.Spec{Model: "llama", Layout: dcp.Layout{TP: tp, DCP: 1, Interleave: 1, PP: 1}, ChunkTokens: 256,
		Groups: []dcp.Group{g, sw}}
}

// world feeds a namespace's placements through Apply, one sequence per rank.
type world struct {
	t    *testing.T
	ix   *index.Index
	ns   dcp.Namespace
	seqs map[wire.Rank]uint64
	inc  map[wire.Rank]uint64
}

func newWorld(t *testing.T, ix *index.Index, spec dcp.Spec) (*world, *dcp.Resolved) {
	res, err := ix.RegisterNamespace(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	return &world{t: t, ix: ix, ns: res.Namespace, seqs: map[wire.Rank]uint64{}, inc: map[wire.Rank]uint64{}}, res
}

func sumFor(chunk, shard, group int, tier wire.Tier) uint64 {
	return uint64(chunk)<<32 | uint64(shard)<<16 | uint64(group)<<8 | uint64(tier)
}

func (w *world) event(r wire.Rank, kind wire.EventKind, tier wire.Tier, chunk, shard, group int) {
	w.t.Helper()
	if w.inc[r] == 0 {
		w.inc[r] = 1
	}
	w.seqs[r]++
	k := dcp.Key{NS: w.ns, Chunk: indextest.Chunk(7, uint64(chunk)), Shard: uint16(shard), Group: uint16(group)}
	e := wire.Event{Seq: w.seqs[r], Kind: kind, Tier: tier, Key: k, Size: 1000 + uint64(shard), Sum: sumFor(chunk, shard, group, 1)}
	o := mustApply(w.t, w.ix, wire.Batch{Rank: r, Incarnation: w.inc[r], Events: []wire.Event{e}})
	if o.Applied != 1 {
		w.t.Fatalf("event not applied: %+v", o)
	}
}

func (w *world) store(r wire.Rank, tier wire.Tier, chunk, shard, group int) {
	w.t.Helper()
	w.event(r, wire.Stored, tier, chunk, shard, group)
}

func (w *world) restart(r wire.Rank) {
	w.inc[r]++
	w.seqs[r] = 0
}

func chunks(n int) []dcp.ChunkHash {
	out := make([]dcp.ChunkHash, n)
	for i := range out {
		out[i] = indextest.Chunk(7, uint64(i))
	}
	return out
}

func lookup(t *testing.T, ix *index.Index, inst string, ns dcp.Namespace, n int) index.LookupResult {
	t.Helper()
	res, err := ix.Lookup(inst, ns, chunks(n))
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Sources) != res.Prefix*len(res.Expectations) {
		t.Fatalf("%d sources for prefix %d x %d expectations", len(res.Sources), res.Prefix, len(res.Expectations))
	}
	return res
}

func rk(inst string, tp int) wire.Rank { return wire.Rank{Instance: inst, TPRank: tp} }

// TestLookupMLANoDCP: TP4/DCP1 MLA. Rank 0 stores the only shard; all four
// ranks read it. Rank 0's L1 copy serves only rank 0; ranks 1..3 need the
// instance's L2 copy.
func TestLookupMLANoDCP(t *testing.T) {
	ix := openTest(t, "", nil)
	w, res := newWorld(t, ix.Index, mlaSpec(4, 1))
	if exps := res.Expectations(); len(exps) != 4 {
		t.Fatalf("expectations %+v", exps)
	}
	for c := range 3 {
		w.store(rk("e1", 0), wire.L1, c, 0, 0)
	}
	if got := lookup(t, ix.Index, "e1", w.ns, 3); got.Prefix != 0 {
		t.Fatalf("L1 only: prefix %d, want 0 (ranks 1..3 cannot read rank 0's L1)", got.Prefix)
	}
	w.store(rk("e1", 0), wire.L2, 0, 0, 0)
	w.store(rk("e1", 0), wire.L2, 1, 0, 0)
	got := lookup(t, ix.Index, "e1", w.ns, 3)
	if got.Prefix != 2 {
		t.Fatalf("prefix %d, want 2", got.Prefix)
	}
	for i := range got.Prefix {
		for j, e := range got.Expectations {
			s := got.Source(i, j)
			wantTier := wire.L2
			if e.Rank == 0 {
				wantTier = wire.L1 // the holder reads its own L1 first
			}
			if got.Holder(i, j) != rk("e1", 0) || s.Tier != wantTier || s.Sum != sumFor(i, 0, 0, 1) {
				t.Fatalf("chunk %d reader %d: source %+v, want rank 0 %s", i, e.Rank, s, wantTier)
			}
		}
	}
	// Another instance cannot read e1's L2 root.
	if got := lookup(t, ix.Index, "e2", w.ns, 3); got.Prefix != 0 {
		t.Fatalf("other instance: prefix %d", got.Prefix)
	}
	// Rank 0 dies: its L1 is fenced, its L2 files still serve everyone.
	if _, err := ix.FenceRank(ctx, rk("e1", 0), math.MaxUint64); err != nil {
		t.Fatal(err)
	}
	got = lookup(t, ix.Index, "e1", w.ns, 3)
	if got.Prefix != 2 || got.Source(0, 0).Tier != wire.L2 {
		t.Fatalf("after fence: prefix %d source %+v", got.Prefix, got.Source(0, 0))
	}
	mustVerify(t, ix.Index)
}

// TestLookupMLADCP: TP4/DCP4 MLA. Each rank stores and reads its own
// shard; every rank must hold its shard for a chunk to count.
func TestLookupMLADCP(t *testing.T) {
	ix := openTest(t, "", nil)
	w, _ := newWorld(t, ix.Index, mlaSpec(4, 4))
	for c := range 4 {
		for r := range 4 {
			if c == 2 && r == 2 {
				continue // rank 2 lacks chunk 2
			}
			w.store(rk("e", r), wire.L1, c, r, 0)
		}
	}
	got := lookup(t, ix.Index, "e", w.ns, 4)
	if got.Prefix != 2 {
		t.Fatalf("prefix %d, want 2", got.Prefix)
	}
	for i := range 2 {
		for j, e := range got.Expectations {
			if s := got.Source(i, j); got.Holder(i, j) != rk("e", e.Rank) || s.Tier != wire.L1 || s.Size != 1000+uint64(e.Shard) {
				t.Fatalf("chunk %d exp %+v: %+v", i, e, s)
			}
		}
	}
	// Shard 2 of chunk 2 held in L1 by the wrong rank is no use to rank 2.
	w.store(rk("e", 3), wire.L1, 2, 2, 0)
	if got := lookup(t, ix.Index, "e", w.ns, 4); got.Prefix != 2 {
		t.Fatalf("foreign L1: prefix %d, want 2", got.Prefix)
	}
	// ... but in L2 of the same instance it is.
	w.store(rk("e", 3), wire.L2, 2, 2, 0)
	if got := lookup(t, ix.Index, "e", w.ns, 4); got.Prefix != 4 || got.Holder(2, 2) != rk("e", 3) || got.Source(2, 2).Tier != wire.L2 {
		t.Fatalf("foreign L2: prefix %d", got.Prefix)
	}
	// Rank 2 also writes chunk 0 to L2, then restarts: its L1 copies are
	// fenced, chunk 0 stays restorable from its own L2, chunk 1 does not.
	w.store(rk("e", 2), wire.L2, 0, 2, 0)
	w.restart(rk("e", 2))
	w.store(rk("e", 2), wire.L1, 9, 2, 0) // first event of the new incarnation
	got = lookup(t, ix.Index, "e", w.ns, 4)
	if got.Prefix != 1 || got.Source(0, 2).Tier != wire.L2 || got.Holder(0, 2) != rk("e", 2) {
		t.Fatalf("after restart: prefix %d, source %+v", got.Prefix, got.Source(0, 2))
	}
	mustVerify(t, ix.Index)
}

// TestLookupNonMLA: TP4 GQA with two groups: every rank reads its own
// shard of each group; a missing group on one rank ends the prefix.
func TestLookupNonMLA(t *testing.T) {
	ix := openTest(t, "", nil)
	w, res := newWorld(t, ix.Index, gqaSpec(4))
	if len(res.Expectations()) != 8 {
		t.Fatalf("expectations %+v", res.Expectations())
	}
	for c := range 5 {
		for r := range 4 {
			for g := range 2 {
				if c == 1 && r == 3 && g == 1 {
					continue
				}
				w.store(rk("e", r), wire.L1, c, r, g)
			}
		}
	}
	if got := lookup(t, ix.Index, "e", w.ns, 5); got.Prefix != 1 {
		t.Fatalf("prefix %d, want 1", got.Prefix)
	}
	w.store(rk("e", 3), wire.L2, 1, 3, 1)
	got := lookup(t, ix.Index, "e", w.ns, 5)
	if got.Prefix != 5 {
		t.Fatalf("prefix %d, want 5", got.Prefix)
	}
	// A prefix, not a count: a hole in chunk 0 hides every later chunk.
	w.event(rk("e", 0), wire.Removed, wire.L1, 0, 0, 1)
	if got := lookup(t, ix.Index, "e", w.ns, 5); got.Prefix != 0 {
		t.Fatalf("hole at chunk 0: prefix %d", got.Prefix)
	}
	// Own L2 preferred over another rank's L2 copy of the same object.
	w.store(rk("e", 1), wire.L2, 0, 0, 1)
	w.store(rk("e", 0), wire.L2, 0, 0, 1)
	got = lookup(t, ix.Index, "e", w.ns, 5)
	if got.Prefix != 5 {
		t.Fatalf("prefix %d", got.Prefix)
	}
	for j, e := range got.Expectations {
		if e.Rank == 0 && e.Group == 1 {
			if s := got.Source(0, j); got.Holder(0, j) != rk("e", 0) || s.Tier != wire.L2 {
				t.Fatalf("preference: %+v", s)
			}
		}
	}
	// The restore built from this lookup completes only with every sum.
	exp := index.ExpectFromLookup(&got, got.Prefix, false)
	r, err := index.NewRestore("r1", w.ns, chunks(got.Prefix), exp, time.Unix(100, 0))
	if err != nil {
		t.Fatal(err)
	}
	for rank := range 4 {
		var results []wire.ItemResult
		for _, e := range exp {
			if e.Rank == rank {
				results = append(results, wire.ItemResult{Chunk: e.Chunk, Group: e.Group, OK: true, Sum: e.Sum})
			}
		}
		if _, err := r.Report(rank, results); err != nil {
			t.Fatal(err)
		}
	}
	if v := r.Verdict(); v.State != wire.VerdictComplete {
		t.Fatalf("verdict %+v", v)
	}
	mustVerify(t, ix.Index)
}

// TestNamespaceRegistry: registration is durable and idempotent, a
// conflicting spec is refused, an unknown namespace is an error.
func TestNamespaceRegistry(t *testing.T) {
	ix := openTest(t, "", nil)
	res, err := ix.RegisterNamespace(ctx, mlaSpec(4, 1))
	if err != nil {
		t.Fatal(err)
	}
	again, err := ix.RegisterNamespace(ctx, mlaSpec(4, 1))
	if err != nil || again.Namespace != res.Namespace {
		t.Fatalf("re-register: %v", err)
	}
	// A TP8 instance of the same model gets its own namespace (its readers
	// differ) and registers next to the TP4 one.
	tp8, err := ix.RegisterNamespace(ctx, mlaSpec(8, 1))
	if err != nil || tp8.Namespace == res.Namespace {
		t.Fatalf("TP8 registration: %v (namespace shared with TP4: %v)", err, err == nil && tp8.Namespace == res.Namespace)
	}
	bad := mlaSpec(4, 3)
	if _, err := ix.RegisterNamespace(ctx, bad); !errors.Is(err, index.ErrInvalid) {
		t.Fatalf("invalid spec: %v", err)
	}
	if _, err := ix.Lookup("e", dcp.Namespace{1}, chunks(1)); !errors.Is(err, index.ErrUnknownNamespace) {
		t.Fatalf("unknown namespace: %v", err)
	}
	if _, err := ix.ListNamespace(dcp.Namespace{1}); !errors.Is(err, index.ErrUnknownNamespace) {
		t.Fatalf("unknown namespace list: %v", err)
	}
	mustVerify(t, ix.Index)
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	ix2 := openTest(t, dirOf(ix.path), nil)
	info, err := ix2.ListNamespace(res.Namespace)
	if err != nil || info.Spec == nil || info.Spec.Layout.TP != 4 {
		t.Fatalf("after reopen: %+v %v", info, err)
	}
	if got := lookup(t, ix2.Index, "e", res.Namespace, 2); got.Prefix != 0 || len(got.Expectations) != 4 {
		t.Fatalf("lookup after reopen: %+v", got)
	}
	mustVerify(t, ix2.Index)
}

// TestLookupMatchesModel compares Lookup with a brute-force model built
// from Get, on random worlds: three specs, two instances, random L1/L2
// placements of any shard by any rank, restarts and fences.
func TestLookupMatchesModel(t *testing.T) {
	specs := []dcp.Spec{mlaSpec(4, 1), mlaSpec(4, 4), mlaSpec(4, 2), gqaSpec(4)}
	for seed := range uint64(12) {
		rng := rand.New(rand.NewPCG(seed, 3))
		ix := openTest(t, "", func(c *index.Config) { c.NoSync = true })
		w, res := newWorld(t, ix.Index, specs[seed%uint64(len(specs))])
		shards, groups := 0, len(res.Groups)
		for _, e := range res.Expectations() {
			shards = max(shards, e.Shard+1)
		}
		const nChunks = 6
		for range 150 {
			r := rk([]string{"i0", "i1"}[rng.IntN(2)], rng.IntN(4))
			switch x := rng.IntN(100); {
			case x < 3:
				w.restart(r)
			case x < 5:
				if _, err := ix.FenceRank(ctx, r, math.MaxUint64); err != nil {
					t.Fatal(err)
				}
				w.restart(r) // a fenced rank comes back as a new incarnation
			default:
				kind := wire.Stored
				if rng.IntN(5) == 0 {
					kind = wire.Removed
				}
				w.event(r, kind, wire.Tier(1+rng.IntN(2)), rng.IntN(nChunks), rng.IntN(shards), rng.IntN(groups))
			}
		}
		for _, inst := range []string{"i0", "i1", "nobody"} {
			got := lookup(t, ix.Index, inst, w.ns, nChunks)
			// Model.
			prefix := 0
			var want []index.Source
			for i := range nChunks {
				var row []index.Source
				for _, e := range got.Expectations {
					k := dcp.Key{NS: w.ns, Chunk: indextest.Chunk(7, uint64(i)), Shard: uint16(e.Shard), Group: uint16(e.Group)}
					best, bestScore := index.Holder{}, 0
					for _, h := range ix.Get(k) {
						sc := 0
						switch {
						case h.Rank == rk(inst, e.Rank) && h.Tier == wire.L1:
							sc = 4
						case h.Rank == rk(inst, e.Rank):
							sc = 3
						case h.Tier == wire.L2 && h.Rank.Instance == inst:
							sc = 2
						}
						if sc > bestScore || (sc == 2 && bestScore == 2 && h.Rank.TPRank < best.Rank.TPRank) {
							best, bestScore = h, sc
						}
					}
					if bestScore == 0 {
						row = nil
						break
					}
					row = append(row, index.Source{HolderTP: int32(best.Rank.TPRank), Tier: best.Tier, Size: best.Size, Sum: best.Sum})
				}
				if row == nil {
					break
				}
				want = append(want, row...)
				prefix++
			}
			if got.Prefix != prefix || !slices.Equal(got.Sources, want) {
				t.Fatalf("seed %d instance %s: prefix %d sources %+v, model prefix %d sources %+v",
					seed, inst, got.Prefix, got.Sources, prefix, want)
			}
		}
		mustVerify(t, ix.Index)
	}
}
