package transfer

import (
	"os"
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestMemberL2GoneFallsBackToMemberL3 (issue 26): a rank of instance a
// stores two chunks, written to the L2 directory it shares with b and
// behind to L3 under a's prefix. Chunk 0's file is then deleted and chunk
// 1's damaged. A rank of b (sharing a's L2 and L3), whose plan names a's
// L2 copies only (the coordinator prefers them), restores both chunks
// byte-exact from a's L3 copies, each checked as any read from a's prefix
// (MAC, key, size, and the recorded sum). A rank of c, sharing a's L2 but
// not its L3, fails both chunks and counts no refusal (its plan never
// named a's L3). Seen red with the fallback reading this
// instance's L3 prefix only (b: "is in neither L1 nor L2").
func TestMemberL2GoneFallsBackToMemberL3(t *testing.T) {
	dev := openDevice(t, "")
	root := t.TempDir()
	l3, _ := openL3(t)
	engineOf := func(inst string, l3Shared []string, l2Shared ...string) (*Engine, *rig) {
		return shareMember(t, dev, inst, func(c *Config) {
			c.L2Dir, c.L2SharedWith = root, l2Shared
			c.L3, c.StorageKey, c.L3Encrypt, c.L3SharedWith = l3, storageKey(1), true, l3Shared
		})
	}
	ea, ra := engineOf("a", nil)
	cs := []chunk{ra.newChunk(0, ra.consecutiveN(0)), ra.newChunk(1, ra.consecutiveN(1))}
	stored := storeAll(t, ea, ra, "a", cs...)
	if err := ea.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := ea.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	ft := ea.L2().(*FileTier)
	if err := os.Remove(ft.Path(stored.Objects[0].Key)); err != nil {
		t.Fatal(err)
	}
	p1 := ft.Path(stored.Objects[1].Key)
	body, err := os.ReadFile(p1)
	if err != nil {
		t.Fatal(err)
	}
	body[len(body)-3] ^= 0x40
	if err := os.WriteFile(p1, body, 0o600); err != nil {
		t.Fatal(err)
	}
	// The plan of b's restore, with the recorded sums: a's L2 copies.
	fromAL2 := func(r *rig, tgt [][][]int64) RetrieveRequest {
		req := r.retrieveReq(0, cs, tgt)
		for i := range req.Items {
			req.Items[i].Sum = stored.Objects[i].Sum
			req.Items[i].Source = wire.Source{Holder: wire.Rank{Instance: "a", TPRank: 0}, Tier: wire.L2}
		}
		return req
	}

	eb, rb := engineOf("b", []string{"a"}, "a")
	tgt := [][][]int64{rb.consecutiveN(4), rb.consecutiveN(5)}
	rr := restoreWith(t, eb, rb, "b, a's L2 copies gone or damaged", fromAL2(rb, tgt), cs, tgt)
	for i, it := range rr.Items {
		if it.From != wire.L3 || it.Sum != stored.Objects[i].Sum {
			t.Fatalf("b's item %d: %+v, want from a's L3 with sum %016x", i, it, stored.Objects[i].Sum)
		}
	}
	if v := testutil.Metric(t, gatherer(t, eb), "kvtier_transfer_l3_shared_restored_objects_total"); v != 2 {
		t.Fatalf("b: l3_shared_restored_objects_total = %v, want 2", v)
	}
	// b's L1 copies are local copies of a's objects, as after a read of
	// a's L2 file (TestStoreAfterLoadingMemberL2KeepsMemberFile): a
	// re-store deduplicates onto them and writes them neither to L2 nor to
	// b's L3 (a second L3 copy in the group). Seen red before: both
	// written to b's L3 prefix.
	res := storeAll(t, eb, rb, "b again", cs...)
	for i, o := range res.Objects {
		if o.Status != Deduped || o.Sum != stored.Objects[i].Sum {
			t.Fatalf("b's re-store of object %d: %+v, want deduplicated onto its L1 copy", i, o)
		}
	}
	if err := eb.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := eb.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if st := eb.L3Stats(); st.Written != 0 || st.Queued != 0 {
		t.Fatalf("b wrote a's objects to its L3 prefix: %+v", st)
	}
	if inv := eb.Inventory(); tierCount(inv, wire.L2) != 0 || tierCount(inv, wire.L3) != 0 {
		t.Fatalf("b's inventory %+v, want L1 copies only", inv.Objects)
	}

	// c (b quarantined the damaged file: both are missing now).
	ec, rc := engineOf("c", nil, "a")
	rr, err = ec.Retrieve(testCtx(t), fromAL2(rc, tgt))
	if err != nil || rr.ChunkOK(0) || rr.ChunkOK(1) || rr.Items[0].Reason != ReasonMissing || rr.Items[1].Reason != ReasonMissing {
		t.Fatalf("c (not sharing a's L3): %+v %v; want both chunks missing", rr, err)
	}
	if v := testutil.Metric(t, gatherer(t, ec), "kvtier_transfer_l3_shared_refused_total"); v != 0 {
		t.Fatalf("c: l3_shared_refused_total = %v, want 0 (its plan named no L3 copy of a)", v)
	}
}

// TestStoreAfterLoadingMemberL2KeepsMemberFile (issue 26): a rank of b,
// sharing the L2 directory with a (L2SharedWith), restores two chunks from
// a's L2 files into its L1, then stores the same chunks again. The
// member's files stay a's: b's L1 copies are local copies of a's objects
// (as a store deduplicated with KeepSharedInL1), never written to L2 (the
// path is the key's, so b's write would replace a's file) nor to b's L3,
// and b announces no L2 copy. Seen red before: b's re-store marked its
// clean L1 copy dirty and rewrote the file as b's own.
func TestStoreAfterLoadingMemberL2KeepsMemberFile(t *testing.T) {
	dev := openDevice(t, "")
	root := t.TempDir()
	l3, _ := openL3(t)
	engineOf := func(inst string, shared ...string) (*Engine, *rig) {
		return shareMember(t, dev, inst, func(c *Config) { c.L2Dir, c.L2SharedWith, c.L3 = root, shared, l3 })
	}
	ea, ra := engineOf("a")
	cs := []chunk{ra.newChunk(0, ra.consecutiveN(0)), ra.newChunk(1, ra.consecutiveN(1))}
	stored := storeAll(t, ea, ra, "a", cs...)
	if err := ea.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	writers := func(what string) {
		t.Helper()
		for i := range cs {
			o, err := ea.L2().Stat(testCtx(t), stored.Objects[i].Key)
			if err != nil || o.Writer.Instance != "a" {
				t.Fatalf("%s: object %d's file written by %s (%v), want a's", what, i, o.Writer, err)
			}
		}
	}

	eb, rb := engineOf("b", "a")
	tgt := [][][]int64{rb.consecutiveN(4), rb.consecutiveN(5)}
	if rr := restoreAll(t, eb, rb, "b from a's files", cs, tgt); rr.Items[0].From != wire.L2 {
		t.Fatalf("b's retrieve: %+v, want from a's L2 files", rr)
	}
	res := storeAll(t, eb, rb, "b", cs...)
	for i, o := range res.Objects {
		if o.Status != Deduped || o.Sum != stored.Objects[i].Sum {
			t.Fatalf("b's store of object %d: %+v, want deduplicated onto its L1 copy (sum %016x)", i, o, stored.Objects[i].Sum)
		}
	}
	if err := eb.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := eb.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	writers("after b's store")
	if inv := eb.Inventory(); tierCount(inv, wire.L2) != 0 || tierCount(inv, wire.L1) != 2 {
		t.Fatalf("b's inventory %+v, want its 2 L1 copies only", inv.Objects)
	}
	if st := eb.L3Stats(); st.Written != 0 || st.Queued != 0 {
		t.Fatalf("b wrote a's objects to its L3: %+v", st)
	}
	// b still restores them, from its L1.
	tgt = [][][]int64{rb.consecutiveN(6), rb.consecutiveN(7)}
	if rr := restoreAll(t, eb, rb, "b from its L1", cs, tgt); rr.Items[0].From != wire.L1 {
		t.Fatalf("b's second retrieve: %+v, want from its L1", rr)
	}
}
