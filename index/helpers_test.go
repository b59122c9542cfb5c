package index_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"
)

var ctx = context.Background()

type testIndex struct {
	*index.Index
	reg  *prometheus.Registry
	path string
}

// openTest opens an index in dir (a new temp dir when ""), closed at the
// end of the test.
func openTest(t testing.TB, dir string, mod func(*index.Config)) *testIndex {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	cfg := index.DefaultConfig()
	cfg.Path = filepath.Join(dir, "index.db")
	cfg.Logger = zaptest.NewLogger(t)
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	if mod != nil {
		mod(&cfg)
	}
	ix, err := index.Open(cfg)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { _ = ix.Close() })
	return &testIndex{Index: ix, reg: reg, path: cfg.Path}
}

// mustVerify re-derives the state from bbolt and fails the test on any
// difference or broken invariant (STYLE 16).
func mustVerify(t testing.TB, ix *index.Index) index.VerifyReport {
	t.Helper()
	rep, err := ix.Verify(ctx)
	if err != nil {
		for _, p := range rep.Problems {
			t.Log(p)
		}
		t.Fatalf("verify: %v", err)
	}
	return rep
}

// agree checks the index holds exactly what each simulated rank holds,
// with the rank's incarnation and sequence, unfenced.
func agree(t testing.TB, ix *index.Index, sims ...*indextest.Rank) {
	t.Helper()
	agreeRanks(t, ix, sims...)
	mustVerify(t, ix)
}

// agreeRanks is agree without Verify.
func agreeRanks(t testing.TB, ix *index.Index, sims ...*indextest.Rank) {
	t.Helper()
	for _, s := range sims {
		info, err := ix.ListRank(s.Rank)
		if err != nil {
			t.Fatalf("list %s: %v", s.Rank, err)
		}
		inv := s.Inventory()
		if info.Incarnation != s.Incarnation || info.LastSeq != s.Seq || info.Fenced {
			t.Fatalf("rank %s: index at incarnation %d seq %d fenced %v, rank at %d seq %d",
				s.Rank, info.Incarnation, info.LastSeq, info.Fenced, s.Incarnation, s.Seq)
		}
		if !slices.Equal(info.Placements, inv.Objects) {
			t.Fatalf("rank %s: index holds %d placements, rank %d; first difference: %s",
				s.Rank, len(info.Placements), len(inv.Objects), firstDiff(info.Placements, inv.Objects))
		}
	}
}

func firstDiff(a, b []wire.Placement) string {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return fmt.Sprintf("at %d index %+v, rank %+v", i, a[i], b[i])
		}
	}
	if len(a) > len(b) {
		return fmt.Sprintf("index has extra %+v", a[len(b)])
	}
	if len(b) > len(a) {
		return fmt.Sprintf("rank has extra %+v", b[len(a)])
	}
	return "none"
}

func mustApply(t testing.TB, ix *index.Index, b wire.Batch) index.Outcome {
	t.Helper()
	o, err := ix.Apply(ctx, b)
	if err != nil {
		t.Fatalf("apply %s inc %d: %v", b.Rank, b.Incarnation, err)
	}
	return o
}

func mustInventory(t testing.TB, ix *index.Index, inv wire.Inventory) index.InventoryOutcome {
	t.Helper()
	o, err := ix.ApplyInventory(ctx, inv)
	if err != nil {
		t.Fatalf("inventory %s: %v", inv.Rank, err)
	}
	return o
}

// testNS is a namespace for tests that do not register a spec.
var testNS = dcp.Namespace{0xab, 0xcd}

func key(chunk uint64, shard, group int) dcp.Key {
	return dcp.Key{NS: testNS, Chunk: indextest.Chunk(1, chunk), Shard: uint16(shard), Group: uint16(group)}
}

func stored(seq uint64, tier wire.Tier, k dcp.Key, size, sum uint64) wire.Event {
	return wire.Event{Seq: seq, Kind: wire.Stored, Tier: tier, Key: k, Size: size, Sum: sum}
}

func removed(seq uint64, tier wire.Tier, k dcp.Key) wire.Event {
	return wire.Event{Seq: seq, Kind: wire.Removed, Tier: tier, Key: k}
}

func dirOf(path string) string { return filepath.Dir(path) }
