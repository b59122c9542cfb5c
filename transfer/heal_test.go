package transfer

import (
	"os"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// TestReStoreAfterCorruptionHeals (issue 11.12): MLA at TP2, rank 0 writes
// shard 0 to the shared L2 and keeps it in L1; its file is truncated;
// rank 1's restore detects it (quarantined, failed). The engine stores the
// prompt again: rank 0 must write the object to L2 again (no dedupe
// against the quarantined copy) and announce it, so the next restore on
// rank 1 succeeds byte-exact.
func TestReStoreAfterCorruptionHeals(t *testing.T) {
	dev := openDevice(t, "")
	spec := c1Spec()
	spec.Layout = dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}
	r0 := newRig(t, dev, spec, []int64{8})
	r1 := newRig(t, dev, spec, []int64{8})
	root := t.TempDir()
	cfg0 := engineConfig(t, dev, 0, 2)
	cfg0.L2Dir, cfg0.KeepEvents = root, true
	cfg1 := engineConfig(t, dev, 1, 2)
	cfg1.L2Dir = root
	e0, e1 := newEngine(t, cfg0), newEngine(t, cfg1)
	pub := recordEvents(t, e0)
	r0.register(e0)
	r1.register(e1)
	c := r0.newChunk(0, r0.consecutiveN(0))
	storeAll(t, e0, r0, "a", c)
	if err := e0.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	key := keyOf(r0, c, 0)
	ft := e0.L2().(*FileTier)
	if err := os.Truncate(ft.Path(key), 200); err != nil {
		t.Fatal(err)
	}
	rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, []chunk{c}, [][][]int64{r1.consecutiveN(2)}))
	if err != nil {
		t.Fatal(err)
	}
	if rr.ChunkOK(0) || rr.Items[0].Reason != ReasonCorrupt {
		t.Fatalf("restore of a truncated object: %+v, want corrupt", rr.Items[0])
	}
	if len(quarantined(t, root)) != 1 {
		t.Fatal("the truncated file was not quarantined")
	}

	// The engine recomputes and stores the prompt again.
	storeAll(t, e0, r0, "again", c)
	if err := e0.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	tgt := r1.consecutiveN(3)
	rr, err = e1.Retrieve(testCtx(t), r1.retrieveReq(1, []chunk{c}, [][][]int64{tgt}))
	if err != nil {
		t.Fatal(err)
	}
	if !rr.ChunkOK(0) {
		t.Fatalf("restore after the re-store: %+v (the re-store left a hole)", rr.Items[0])
	}
	r1.expectRestored(c, tgt)
	r1.check("rank 1 after the healed restore")

	// The new L2 copy is announced again.
	waitPublished(t, e0)
	var l2Stored int
	for _, ev := range pub.events() {
		if ev.Key == key && ev.Tier == wire.L2 && ev.Kind == wire.Stored {
			l2Stored++
		}
	}
	if l2Stored != 2 {
		t.Fatalf("%d Stored L2 events for %s, want 2 (the first write and the rewrite)", l2Stored, key)
	}
}
