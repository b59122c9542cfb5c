package index

import (
	"errors"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

func testState() *state {
	st := newState()
	st.addRank(wire.Rank{Instance: "a", TPRank: 0}, rankMeta{inc: 3, last: 100})
	st.addRank(wire.Rank{Instance: "a", TPRank: 1}, rankMeta{inc: 1, last: 7})
	return st
}

// TestCodecRoundTrip: chunk records, rank records and log records decode
// to what was encoded; replaying a txn's log record on the same start
// state gives the same chunks.
func TestCodecRoundTrip(t *testing.T) {
	s := []placement{
		{shard: 0, group: 0, tier: wire.L1, rank: 1, inc: 3, seq: 9, size: 1 << 40, sum: 0xdeadbeefcafef00d},
		{shard: 0, group: 0, tier: wire.L2, rank: 2, inc: 1, seq: 7, size: 5, sum: 1},
		{shard: 7, group: 3, tier: wire.L2, rank: 1, inc: 2, seq: 1 << 62, size: 0, sum: 0},
	}
	got, err := parseChunk(appendChunk(nil, s), 3)
	if err != nil || !slices.Equal(got, s) {
		t.Fatalf("chunk round trip: %+v %v", got, err)
	}
	r, m := wire.Rank{Instance: "inst-x", TPRank: 4095}, rankMeta{inc: 1 << 63, last: 12, fenced: true, fenceGen: 1 << 40}
	id, r2, m2, err := parseRank(appendRankKey(nil, 9), appendRank(nil, r, m))
	if err != nil || id != 9 || r2 != r || m2 != m {
		t.Fatalf("rank round trip: %d %v %+v %v", id, r2, m2, err)
	}
	ref := chunkRef{dcp.Namespace{1, 2}, dcp.ChunkHash{3, 4}}
	for _, gen := range []uint32{legacyGen, 1, 7 << 20, maxGen} {
		got, g, err := parseSnapshotKey(appendSnapshotKey(nil, gen, ref))
		if err != nil || got != ref || g != gen {
			t.Fatalf("snapshot key round trip at generation %d: %v %d %v", gen, got, g, err)
		}
	}
	for _, gen := range []uint32{maxGen + 1, noRecord} {
		if _, _, err := parseSnapshotKey(appendSnapshotKey(nil, gen, ref)); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("snapshot key of generation %d: %v, want ErrCorrupt", gen, err)
		}
	}
	if k := appendSnapshotKey(nil, 1, ref); len(k) != snapshotKeySize {
		t.Fatalf("snapshot key is %d bytes, want %d", len(k), snapshotKeySize)
	}

	// A txn's ops, replayed on the same start state, give the same result.
	live, replayed := testState(), testState()
	var enc opEncoder
	enc.reset()
	tx := newTxn(live, &enc)
	tx.applyBatch(&wire.Batch{Rank: live.ranks[1].rank, Incarnation: 3, Events: []wire.Event{
		{Seq: 101, Kind: wire.Stored, Tier: wire.L1, Key: dcp.Key{NS: ref.ns, Chunk: ref.chunk, Shard: 1}, Size: 9, Sum: 9},
		{Seq: 102, Kind: wire.Stored, Tier: wire.L2, Key: dcp.Key{NS: ref.ns, Chunk: ref.chunk, Shard: 1}, Size: 9, Sum: 9},
		{Seq: 103, Kind: wire.Removed, Tier: wire.L1, Key: dcp.Key{NS: ref.ns, Chunk: ref.chunk, Shard: 1}},
		{Seq: 104, Kind: wire.Stored, Tier: wire.L1, Key: dcp.Key{NS: ref.ns, Chunk: dcp.ChunkHash{9}, Shard: 2}, Size: 1, Sum: 2},
	}})
	tx.applyBatch(&wire.Batch{Rank: live.ranks[2].rank, Incarnation: 2, Events: []wire.Event{
		{Seq: 1, Kind: wire.Stored, Tier: wire.L2, Key: dcp.Key{NS: dcp.Namespace{7}, Chunk: ref.chunk}, Size: 3, Sum: 4},
	}})
	tx.applyInventory(&wire.Inventory{Rank: live.ranks[1].rank, Incarnation: 4, Seq: 0, Objects: []wire.Placement{
		{Key: dcp.Key{NS: ref.ns, Chunk: ref.chunk, Shard: 1}, Tier: wire.L2, Size: 9, Sum: 9}}}, 0, false)
	live.publishRanks(tx)
	live.publishChunks(tx, 0, len(tx.staged))
	rt := newTxn(replayed, nil)
	if err := replay(enc.buf, rt, len(replayed.ranks)); err != nil {
		t.Fatal(err)
	}
	replayed.publishChunks(rt, 0, len(rt.staged))
	var pr problems
	compareChunksOnly(&pr, live, replayed)
	if len(pr.list) > 0 {
		t.Fatalf("replay differs: %v", pr.list)
	}
}

// compareChunksOnly compares the chunks of two states.
func compareChunksOnly(pr *problems, a, b *state) {
	for ns, na := range a.ns {
		nb := b.ns[ns]
		for c, va := range na.chunks.all() {
			if nb == nil || !slices.Equal(va.s, func() []placement { v, _ := nb.chunks.get(c); return v.s }()) {
				pr.add("chunk %s/%s differs", ns, c)
			}
		}
		if nb != nil && nb.chunks.len() != na.chunks.len() {
			pr.add("namespace %s: %d chunks vs %d", ns, na.chunks.len(), nb.chunks.len())
		}
	}
}

// FuzzDecoders: no byte string makes a decoder panic; each either decodes
// or returns an error wrapping ErrCorrupt.
func FuzzDecoders(f *testing.F) {
	f.Add(appendChunk(nil, []placement{{shard: 1, tier: wire.L1, rank: 1, size: 3}}))
	f.Add(appendRank(nil, wire.Rank{Instance: "a", TPRank: 1}, rankMeta{inc: 1}))
	var enc opEncoder
	enc.reset()
	enc.put(chunkRef{}, &placement{rank: 1, inc: 3, tier: wire.L2, seq: 5})
	enc.del(chunkRef{}, 0, 0, wire.L1, 2, 1)
	enc.fence(1, 4)
	enc.drop(2)
	f.Add(slices.Clone(enc.buf))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = parseChunk(b, 3)
		_, _, _, _ = parseRank([]byte{0, 0, 0, 1}, b)
		_, _, _ = parseSnapshotKey(b)
		st := testState()
		_ = replay(b, newTxn(st, nil), len(st.ranks))
	})
}

// Records written before sealing (version 1, no checksum) still read; a
// sealed record read back is the same; a sealed record cut short is
// refused.
func TestUnsealedRecordsStillRead(t *testing.T) {
	s := []placement{{shard: 1, group: 0, tier: wire.L2, rank: 1, inc: 3, seq: 9, size: 561, sum: 0xfeed}}
	v2 := appendChunk(nil, s)
	if v2[0] != sealedVersion {
		t.Fatalf("appendChunk wrote version %d, want %d", v2[0], sealedVersion)
	}
	v1 := append([]byte{formatVersion}, v2[1:len(v2)-4]...)
	for name, v := range map[string][]byte{"v1": v1, "v2": v2} {
		got, err := parseChunk(v, 2)
		if err != nil || len(got) != 1 || got[0].sum != 0xfeed || got[0].size != 561 {
			t.Fatalf("%s: %+v %v", name, got, err)
		}
	}
	if _, err := parseChunk(v2[:len(v2)-1], 2); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("sealed record cut short: %v", err)
	}
}
