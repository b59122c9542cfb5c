package transfer

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer/tier"
	"github.com/kvtier/kvtier/wire"
)

// twoGroupSpec: a 656-byte-row group and a group with an opaque tail (rows
// of 40 B declared, 32 B semantic, 80 B stride per row... as pages).
func twoGroupSpec() dcp.Spec {
	return dcp.Spec{Model: "l2", Layout: dcp1, ChunkTokens: 32, Groups: []dcp.Group{
		{Kind: dcp.Attention, BlockSize: 16, Layers: 2, KVFormat: "fp8_ds_mla",
			SemanticBytes: 16 * 656, PageBytes: 16 * 656, StrideBytes: 16 * 656},
		{Kind: dcp.Attention, BlockSize: 16, Layers: 1, KVFormat: "bf16",
			SemanticBytes: 16 * 32, PageBytes: 16 * 40, StrideBytes: 16 * 80}}}
}

func keyOf(r *rig, c chunk, group int) dcp.Key {
	return dcp.Key{NS: r.res.Namespace, Chunk: c.hash, Shard: uint16(r.res.ReadShard(group, 0)), Group: uint16(group)}
}

func quarantined(t *testing.T, root string) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(root, tier.QuarantineDir))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".why") {
			out = append(out, e.Name())
		}
	}
	return out
}

// TestL2DamageFailsOnlyItsChunk corrupts, truncates and deletes L2 files
// under a running engine (after its rescan), then before a restart: each
// damaged object fails its chunk, nothing is written into that chunk's
// pages, the failure is counted and logged, and the other chunks restore.
func TestL2DamageFailsOnlyItsChunk(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, twoGroupSpec(), []int64{16, 16})
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = root
	e1 := newEngine(t, cfg)
	r.register(e1)
	cs := make([]chunk, 4)
	for i := range cs {
		cs[i] = r.newChunk(i, r.consecutiveN(i))
	}
	storeAll(t, e1, r, "damage", cs...)
	closeEngine(t, e1)

	core, logs := observer.New(zap.WarnLevel)
	cfg.Logger = zap.New(core)
	cfg.Incarnation = 0
	cfg.Registerer = nil
	cfg2 := cfg
	cfg2.Registerer = newRegistry()
	e2 := newEngine(t, cfg2)
	r.register(e2)
	ft := e2.L2().(*FileTier)

	// Damage after the rescan: a flipped payload byte, a truncation, a
	// deletion.
	flip := func(path string, off int64) {
		t.Helper()
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var b [1]byte
		if _, err := f.ReadAt(b[:], off); err != nil {
			t.Fatal(err)
		}
		b[0] ^= 0x40
		if _, err := f.WriteAt(b[:], off); err != nil {
			t.Fatal(err)
		}
	}
	p1 := ft.Path(keyOf(r, cs[1], 1))
	st, _ := os.Stat(p1)
	flip(p1, st.Size()-3)
	p2 := ft.Path(keyOf(r, cs[2], 0))
	st, _ = os.Stat(p2)
	if err := os.Truncate(p2, st.Size()-100); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(ft.Path(keyOf(r, cs[3], 1))); err != nil {
		t.Fatal(err)
	}

	tgt := [][][]int64{r.consecutiveN(4), r.consecutiveN(5), r.consecutiveN(6), r.consecutiveN(7)}
	rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, cs, tgt))
	if err != nil {
		t.Fatal(err)
	}
	want := map[[2]int]Reason{
		{0, 0}: ReasonNone, {0, 1}: ReasonNone,
		{1, 0}: ReasonSibling, {1, 1}: ReasonCorrupt,
		{2, 0}: ReasonCorrupt, {2, 1}: ReasonSibling,
		{3, 0}: ReasonSibling, {3, 1}: ReasonMissing,
	}
	for _, it := range rr.Items {
		w := want[[2]int{it.Chunk, it.Group}]
		if it.Reason != w || it.OK != (w == ReasonNone) {
			t.Errorf("chunk %d group %d: ok=%v reason %q (%v), want reason %q", it.Chunk, it.Group, it.OK, it.Reason, it.Err, w)
		}
	}
	if got := rr.FailedChunks(); len(got) != 3 || got[0] != 1 || got[2] != 3 {
		t.Fatalf("failed chunks %v, want [1 2 3]", got)
	}
	r.expectRestored(cs[0], tgt[0])
	r.check("after a retrieve with damaged L2 files (chunks 1-3 must be untouched)")

	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_checksum_failures_total", "tier", "L2"); v != 2 {
		t.Errorf("checksum_failures_total{tier=L2} = %v, want 2", v)
	}
	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_quarantined_files_total"); v != 2 {
		t.Errorf("quarantined_files_total = %v, want 2", v)
	}
	for reason, n := range map[string]float64{"corrupt": 2, "missing": 1, "sibling": 3} {
		if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_retrieve_failures_total", "reason", reason); v != n {
			t.Errorf("retrieve_failures_total{reason=%s} = %v, want %v", reason, v, n)
		}
	}
	if n := logs.FilterLevelExact(zap.ErrorLevel).FilterMessage("L2 object failed verification; not served").Len(); n != 2 {
		t.Errorf("%d error logs of failed verification, want 2", n)
	}
	if n := logs.FilterLevelExact(zap.ErrorLevel).FilterMessage("an L2 object of this rank vanished").Len(); n != 1 {
		t.Errorf("%d error logs of a vanished object, want 1", n)
	}
	if q := quarantined(t, root); len(q) != 2 {
		t.Errorf("quarantine holds %v, want 2 files", q)
	}
	// The inventory no longer lists the damaged objects in L2.
	for _, p := range e2.Inventory().Objects {
		if p.Tier == wire.L2 && (p.Key == keyOf(r, cs[1], 1) || p.Key == keyOf(r, cs[2], 0) || p.Key == keyOf(r, cs[3], 1)) {
			t.Errorf("inventory still lists damaged %s in L2", p.Key)
		}
	}
	closeEngine(t, e2)

	// Damage while the rank is down: the rescan quarantines it.
	p0 := ft.Path(keyOf(r, cs[0], 0))
	flip(p0, 20) // inside the key in the header
	cfg3 := cfg
	cfg3.Registerer = newRegistry()
	logs.TakeAll()
	e3 := newEngine(t, cfg3)
	r.register(e3)
	if v := testutil.Metric(t, gatherer(t, e3), "kvtier_transfer_quarantined_files_total"); v != 1 {
		t.Errorf("after the rescan quarantined_files_total = %v, want 1", v)
	}
	if n := logs.FilterMessage("L2 rescan: quarantined a bad object file").Len(); n != 1 {
		t.Errorf("%d rescan quarantine logs, want 1", n)
	}
	tgt0 := [][][]int64{r.consecutiveN(7)}
	rr, err = e3.Retrieve(testCtx(t), r.retrieveReq(0, cs[:1], tgt0))
	if err != nil {
		t.Fatal(err)
	}
	if rr.ChunkOK(0) || rr.Items[0].Reason != ReasonMissing || rr.Items[1].Reason != ReasonSibling {
		t.Fatalf("retrieve of a chunk quarantined at rescan: %+v", rr.Items)
	}
	r.check("after a retrieve of a chunk quarantined at rescan")
}

// TestFileTierRejectsEveryDamage flips every byte of an object file's
// header, one at a time, and some payload bytes: each Get fails with a
// CorruptError, quarantines the file, and never returns the bytes.
func TestFileTierRejectsEveryDamage(t *testing.T) {
	root := t.TempDir()
	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := dcp.Key{NS: dcp.Namespace{1}, Chunk: dcp.ChunkHash{2}, Shard: 3, Group: 4}
	payload := testutil.RandomBytes(5000, 1)
	obj := L2Object{Key: key, Fingerprint: [32]byte{9}, Writer: wire.Rank{Instance: "i", TPRank: 3},
		Incarnation: 7, Size: uint64(len(payload)), Sum: checksum.Sum(payload), Created: time.Unix(100, 5)}
	put := func() {
		t.Helper()
		if err := ft.Put(ctx, obj, payload); err != nil {
			t.Fatal(err)
		}
	}
	put()
	dst := make([]byte, len(payload))
	got, err := ft.Get(ctx, key, obj.Fingerprint, dst)
	if err != nil || got.Writer != obj.Writer || got.Sum != obj.Sum || got.Incarnation != 7 || !got.Created.Equal(obj.Created) || string(dst) != string(payload) {
		t.Fatalf("Get = %+v, %v", got, err)
	}
	// Wrong fingerprint and wrong length are verification failures too.
	if _, err := ft.Get(ctx, key, [32]byte{8}, dst); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("wrong fingerprint: %v", err)
	}
	put()
	if _, err := ft.Get(ctx, key, obj.Fingerprint, dst[:10]); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("wrong length: %v", err)
	}
	if _, err := ft.Get(ctx, key, obj.Fingerprint, dst); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get after quarantine: %v, want ErrNotFound", err)
	}
	hdr := int(tier.HeaderBytes(obj.Writer.Instance))
	positions := []int{}
	for i := range hdr {
		positions = append(positions, i)
	}
	positions = append(positions, hdr, hdr+1, hdr+len(payload)/2, hdr+len(payload)-1)
	for _, pos := range positions {
		put()
		path := ft.Path(key)
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		b[pos] ^= 0x01
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err = ft.Get(ctx, key, obj.Fingerprint, dst)
		var ce *CorruptError
		if !errors.As(err, &ce) || !errors.Is(err, ErrCorrupt) || ce.Quarantine == "" {
			t.Fatalf("byte %d flipped: Get = %v, want a quarantined CorruptError", pos, err)
		}
		if _, err := os.Stat(path); !os.IsNotExist(err) {
			t.Fatalf("byte %d flipped: file still in place", pos)
		}
	}
	// Truncations at every interesting length.
	for _, n := range []int{0, 3, 8, hdr - 1, hdr, hdr + 1, hdr + len(payload) - 1} {
		put()
		if err := os.Truncate(ft.Path(key), int64(n)); err != nil {
			t.Fatal(err)
		}
		if _, err := ft.Get(ctx, key, obj.Fingerprint, dst); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("truncated to %d: %v", n, err)
		}
	}
	// Delete, and Scan of a clean tier.
	put()
	if err := ft.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	if _, err := ft.Get(ctx, key, obj.Fingerprint, dst); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get after Delete: %v", err)
	}
	put()
	var seen []ScanEntry
	if err := ft.Scan(ctx, obj.Writer, true, func(s ScanEntry) { seen = append(seen, s) }); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 1 || seen[0].Err != nil || seen[0].Object.Key != key {
		t.Fatalf("Scan = %+v", seen)
	}
	// Another writer's files are not this rank's.
	seen = nil
	if err := ft.Scan(ctx, wire.Rank{Instance: "i", TPRank: 1}, true, func(s ScanEntry) { seen = append(seen, s) }); err != nil || len(seen) != 0 {
		t.Fatalf("Scan as another rank = %+v, %v", seen, err)
	}
}

// TestStoreAfterL2FileQuarantinedElsewhere: an object this rank wrote to
// L2 and no longer holds in L1, whose file another rank (sharing the L2
// root) quarantined, is stored again rather than deduplicated against the
// stale inventory; the inventory drops it with a Removed L2 event.
func TestStoreAfterL2FileQuarantinedElsewhere(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir = root
	e1 := newEngine(t, cfg)
	r.register(e1)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e1, r, "first", c)
	if err := e1.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	closeEngine(t, e1)

	// A restart empties L1; the rescan puts the object in the L2 inventory.
	cfg2 := cfg
	cfg2.Registerer, cfg2.KeepEvents = newRegistry(), true
	e2 := newEngine(t, cfg2)
	pub := recordEvents(t, e2)
	r.register(e2)
	key := keyOf(r, c, 0)
	if st := e2.Stats(); st.L2Objects != 1 {
		t.Fatalf("%d L2 objects after the rescan, want 1", st.L2Objects)
	}

	// Another rank reading the shared L2 quarantines the file.
	other, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Quarantine(testCtx(t), key, "test: damaged"); err != nil {
		t.Fatal(err)
	}

	res := storeAll(t, e2, r, "again", c)
	if s := res.Objects[0].Status; s != Stored {
		t.Fatalf("store after the quarantine: status %v, want %v (a dedupe drops the only copy)", s, Stored)
	}
	if err := e2.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Stat(testCtx(t), key); err != nil {
		t.Fatalf("L2 file after the re-store and Flush: %v", err)
	}
	tgt := [][][]int64{r.consecutiveN(1)}
	rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, tgt))
	if err != nil {
		t.Fatal(err)
	}
	if !rr.ChunkOK(0) {
		t.Fatalf("retrieve after the re-store: %+v", rr.Items)
	}
	r.expectRestored(c, tgt[0])
	r.check("after a retrieve of the re-stored chunk")

	waitPublished(t, e2)
	removed := 0
	for _, ev := range pub.events() {
		if ev.Kind == wire.Removed && ev.Tier == wire.L2 && ev.Key == key {
			removed++
		}
	}
	if removed != 1 {
		t.Fatalf("%d Removed L2 events for %s, want 1", removed, key)
	}
	closeEngine(t, e2)
}
