package coordinator

import (
	"slices"
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestLookupTokensAndRestoreChunks: coord.lookup counts tokens (chunks x
// the namespace's chunk_tokens) asked and found, and a decided restore
// counts its chunks as verified, bytes_wrong (a rank's verification
// failed, or a checksum other than the recorded one) or failed.
func TestLookupTokensAndRestoreChunks(t *testing.T) {
	f := newRestoreFixture(t, 5) // chunk_tokens 16, stored by both ranks
	tokens := testSpec(2).ChunkTokens
	for _, kind := range restoreChunkKinds {
		if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restore_chunks_total", "outcome", kind); got != 0 {
			t.Fatalf("%s chunks on a fresh coordinator = %v", kind, got)
		}
	}

	// 5 stored chunks, then 3 nobody stored.
	ask := append(slices.Clone(f.chunks), chain(f.ns, 8, 99)[5:]...)
	rep := call[wire.LookupReply](t, f.nc, f.c.subj.Coord(wire.CoordLookup), wire.LookupRequest{Namespace: f.ns, Chunks: ask})
	if rep.Prefix != 5 {
		t.Fatalf("lookup prefix %d, want 5", rep.Prefix)
	}
	call[wire.LookupReply](t, f.nc, f.c.subj.Coord(wire.CoordLookup), wire.LookupRequest{Namespace: f.ns, Chunks: ask[5:]})
	if got, want := testutil.Metric(t, f.c.reg, "kvtier_coord_lookup_tokens_total"), float64((8+3)*tokens); got != want {
		t.Errorf("tokens looked up = %v, want %v", got, want)
	}
	if got, want := testutil.Metric(t, f.c.reg, "kvtier_coord_lookup_hit_tokens_total"), float64(5*tokens); got != want {
		t.Errorf("tokens hit = %v, want %v", got, want)
	}
	// A restore begin (which follows a lookup) counts no tokens again.
	plan := f.begin(t, f.chunks)
	if got, want := testutil.Metric(t, f.c.reg, "kvtier_coord_lookup_tokens_total"), float64((8+3)*tokens); got != want {
		t.Errorf("tokens after a restore begin = %v, want %v", got, want)
	}

	// Rank 1: chunk 1 failed its verification at the rank, chunk 3 placed
	// with another checksum than the recorded one, chunk 4 missing.
	w := f.waitAsync(t, plan.RestoreID)
	f.report(t, plan.RestoreID, 0, results(plan.Ranks["eng/0"]))
	res := results(plan.Ranks["eng/1"])
	res[1] = wire.ItemResult{Chunk: res[1].Chunk, Group: res[1].Group, Reason: "corrupt"}
	res[3].Sum ^= 1
	res[4] = wire.ItemResult{Chunk: res[4].Chunk, Group: res[4].Group, Reason: "missing"}
	f.report(t, plan.RestoreID, 1, res)
	if v := recv(t, w); v.State != wire.VerdictFailed || !slices.Equal(v.Failed, []int{1, 3, 4}) {
		t.Fatalf("verdict = %+v, want failed [1 3 4]", v)
	}
	for kind, want := range map[string]float64{"verified": 2, "bytes_wrong": 2, "failed": 1} {
		if got := testutil.Metric(t, f.c.reg, "kvtier_coord_restore_chunks_total", "outcome", kind); got != want {
			t.Errorf("%s chunks = %v, want %v", kind, got, want)
		}
	}
}
