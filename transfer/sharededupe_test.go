package transfer

import (
	"errors"
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestStoreDedupedOntoShareGroupCopy (issue 26.3): ranks of instances a
// and b write one L2 directory. a stores two chunks. b, configured to
// share with a (L2SharedWith), stores the same chunks: both deduplicated
// against a's files with a's sums, counted in dedupe_shared_total,
// nothing gathered into L1, written or announced, a's files untouched; b
// restores them byte-exact from a's files. A rank of instance c sharing
// with b only (not a), and one of instance d sharing with nobody, store
// their own copies. Seen red with sharedCopy off (b stored its own
// copies, the files then b's).
func TestStoreDedupedOntoShareGroupCopy(t *testing.T) {
	dev := openDevice(t, "")
	root := t.TempDir()
	engineOf := func(inst string, shared ...string) (*Engine, *rig) {
		return shareMember(t, dev, inst, func(c *Config) { c.L2Dir, c.L2SharedWith = root, shared })
	}
	ea, ra := engineOf("a")
	cs := []chunk{ra.newChunk(0, ra.consecutiveN(0)), ra.newChunk(1, ra.consecutiveN(1))}
	stored := storeAll(t, ea, ra, "a", cs...)
	if err := ea.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	writer := func(i int) wire.Rank {
		t.Helper()
		o, err := ea.L2().Stat(testCtx(t), stored.Objects[i].Key)
		if err != nil {
			t.Fatal(err)
		}
		return o.Writer
	}

	eb, rb := engineOf("b", "a")
	res := storeAll(t, eb, rb, "b", cs...)
	for i, o := range res.Objects {
		if o.Status != Deduped || o.Sum != stored.Objects[i].Sum {
			t.Fatalf("b's object %d: %+v, want deduplicated onto a's copy (sum %016x)", i, o, stored.Objects[i].Sum)
		}
		if w := writer(i); w.Instance != "a" {
			t.Fatalf("object %d's file now written by %s", i, w)
		}
	}
	if v := testutil.Metric(t, gatherer(t, eb), "kvtier_transfer_dedupe_shared_total"); v != 2 {
		t.Fatalf("dedupe_shared_total = %v, want 2", v)
	}
	if inv := eb.Inventory(); len(inv.Objects) != 0 || inv.Seq != 0 {
		t.Fatalf("b holds or announced %+v after deduplicating", inv)
	}
	// b restores them from a's files (its engine's restore plan would
	// name a's placements: the coordinator's share group).
	tgt := [][][]int64{rb.consecutiveN(4), rb.consecutiveN(5)}
	if rr := restoreAll(t, eb, rb, "b after restoring a's copies", cs, tgt); rr.Items[0].From != wire.L2 {
		t.Fatalf("b's retrieve: %+v", rr)
	}

	// c shares with b only, d with nobody: each stores its own copy.
	for _, x := range []struct {
		inst   string
		shared []string
	}{{"c", []string{"b"}}, {"d", nil}} {
		e, r := engineOf(x.inst, x.shared...)
		res := storeAll(t, e, r, x.inst, cs[0])
		if res.Objects[0].Status != Stored {
			t.Fatalf("%s sharing with %v: %+v, want its own copy", x.inst, x.shared, res.Objects[0])
		}
		if err := e.Flush(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if w := writer(0); w.Instance != x.inst {
			t.Fatalf("%s's copy: the file is written by %s", x.inst, w)
		}
		if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_dedupe_shared_total"); v != 0 {
			t.Fatalf("%s: dedupe_shared_total = %v, want 0", x.inst, v)
		}
	}
}

// TestL2SharedWithConfig: shared instances need an L2 and valid names
// other than the rank's own.
func TestL2SharedWithConfig(t *testing.T) {
	dev := openDevice(t, "")
	for name, mod := range map[string]func(*Config){
		"no L2":    func(c *Config) { c.L2SharedWith = []string{"a"} },
		"itself":   func(c *Config) { c.L2Dir, c.L2SharedWith = t.TempDir(), []string{c.Rank.Instance} },
		"bad name": func(c *Config) { c.L2Dir, c.L2SharedWith = t.TempDir(), []string{"a.b"} },
	} {
		cfg := engineConfig(t, dev, 0, 1)
		mod(&cfg)
		if e, err := New(cfg); !errors.Is(err, ErrConfig) {
			if e != nil {
				closeEngine(t, e)
			}
			t.Errorf("%s: New = %v, want ErrConfig", name, err)
		}
	}
}

// TestStoreDedupedKeepsLocalL1Copy (issue 26.3): with KeepSharedInL1, b's
// store of what a's files hold still gathers a local copy into b's L1,
// announced as L1 only and counted in dedupe_shared_l1_total besides
// dedupe_shared_total; nothing is written to L2 (a's files stay a's) or
// L3, neither then nor when b stores the chunks again; b restores them
// from its L1. Seen red with the store ignoring KeepSharedInL1 (no L1
// placement), and with commitLocked ignoring sharedOnly (b's writes
// replaced a's files).
func TestStoreDedupedKeepsLocalL1Copy(t *testing.T) {
	dev := openDevice(t, "")
	root := t.TempDir()
	l3, _ := openL3(t)
	engineOf := func(inst string, keep bool, shared ...string) (*Engine, *rig) {
		return shareMember(t, dev, inst, func(c *Config) {
			c.L2Dir, c.L2SharedWith, c.KeepSharedInL1 = root, shared, keep
			if keep {
				c.L3 = l3
			}
		})
	}
	ea, ra := engineOf("a", false)
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

	eb, rb := engineOf("b", true, "a")
	for round := range 2 {
		res := storeAll(t, eb, rb, "b", cs...)
		for i, o := range res.Objects {
			if o.Sum != stored.Objects[i].Sum || (round == 0) != (o.Status == Stored) {
				t.Fatalf("round %d: b's object %d: %+v, want stored (then deduplicated) with a's sum %016x", round, i, o, stored.Objects[i].Sum)
			}
		}
		if err := eb.Flush(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if err := eb.FlushL3(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		writers("after b's stores")
	}
	inv := eb.Inventory()
	if tierCount(inv, wire.L1) != 2 || len(inv.Objects) != 2 {
		t.Fatalf("b's inventory %+v, want its 2 L1 copies only", inv.Objects)
	}
	if st := eb.L3Stats(); st.Written != 0 || st.Queued != 0 {
		t.Fatalf("b wrote to L3: %+v", st)
	}
	g := gatherer(t, eb)
	if v := testutil.Metric(t, g, "kvtier_transfer_dedupe_shared_total"); v != 2 {
		t.Fatalf("dedupe_shared_total = %v, want 2", v)
	}
	if v := testutil.Metric(t, g, "kvtier_transfer_dedupe_shared_l1_total"); v != 2 {
		t.Fatalf("dedupe_shared_l1_total = %v, want 2", v)
	}
	tgt := [][][]int64{rb.consecutiveN(4), rb.consecutiveN(5)}
	if rr := restoreAll(t, eb, rb, "b after restoring its L1 copies", cs, tgt); rr.Items[0].From != wire.L1 {
		t.Fatalf("b's retrieve: %+v, want both chunks from its L1", rr)
	}
}
