package transfer

import (
	"bytes"
	"encoding/binary"
	"io"
	"os"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// storageKey is a test cluster's storage MAC key (seed picks the cluster).
func storageKey(seed byte) []byte { return bytes.Repeat([]byte{seed}, 32) }

// forgeObject replaces the payload of an encoded object (L2 file or L3
// object) with other bytes of the same length and rewrites what a writer
// without the storage key can: the header's payload kvsum64 and the
// header checksum. The MAC stays the old one.
func forgeObject(t *testing.T, b []byte, seed uint64) []byte {
	t.Helper()
	b = slices.Clone(b)
	h := int(binary.BigEndian.Uint16(b[6:8]))
	other := testutil.RandomBytes(uint64(len(b)-h), seed)
	copy(b[h:], other)
	binary.BigEndian.PutUint64(b[85:93], checksum.Sum(other))
	binary.BigEndian.PutUint64(b[h-8:h], checksum.Sum(b[:h-8]))
	return b
}

// asFormat1 rewrites an encoded object as format version 1 (no MAC), as a
// kvtier before storage MACs wrote it.
func asFormat1(t *testing.T, b []byte) []byte {
	t.Helper()
	h := int(binary.BigEndian.Uint16(b[6:8]))
	h1 := h - 32
	out := append(slices.Clone(b[:h1-8]), make([]byte, 8)...)
	binary.BigEndian.PutUint16(out[4:6], 1)
	binary.BigEndian.PutUint16(out[6:8], uint16(h1))
	binary.BigEndian.PutUint64(out[h1-8:], checksum.Sum(out[:h1-8]))
	return append(out, b[h:]...)
}

// TestStorageMACL2RescanAnnouncesOnlyVerified (issue 28.1, C12): objects in
// the L2 directory replaced while the rank was down — other bytes with a
// recomputed header sum, an object another cluster's key MACed, an object
// of format 1 (no MAC) — are not announced by the rescan: quarantined,
// counted in unverified_objects_total{tier="L2"}, announced removed, never
// served. The valid objects restore byte-exact after the restart. Seen red
// with the MAC check removed: the forged object was announced with its
// forged sum and restored "OK" with the forged bytes.
func TestStorageMACL2RescanAnnouncesOnlyVerified(t *testing.T) {
	dev := openDevice(t, "")
	const n = 8
	r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.StorageKey = root, storageKey(1)
	cfg.Registerer = newRegistry()
	e1 := newEngine(t, cfg)
	for _, tier := range []string{"L2", "L3"} {
		if v := testutil.Metric(t, gatherer(t, e1), "kvtier_transfer_unverified_objects_total", "tier", tier); v != 0 {
			t.Fatalf("unverified_objects_total{tier=%s} = %v at start, want 0", tier, v)
		}
	}
	r.register(e1)
	var cs []chunk
	for i := range n {
		c := r.newChunk(i, r.consecutiveN(i))
		cs = append(cs, c)
		storeAll(t, e1, r, "s", c)
	}
	if err := e1.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	ft := e1.L2().(*FileTier)
	closeEngine(t, e1)

	// While the rank is down: chunk 1 forged, chunk 3 rewritten by another
	// cluster (its own key), chunk 5 turned into format 1.
	rewrite := func(c chunk, f func([]byte) []byte) {
		t.Helper()
		p := ft.Path(keyOf(r, c, 0))
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, f(b), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	rewrite(cs[1], func(b []byte) []byte { return forgeObject(t, b, 11) })
	rewrite(cs[3], func(b []byte) []byte {
		other, err := NewMACKey(storageKey(2))
		if err != nil {
			t.Fatal(err)
		}
		ob, err := ft.Stat(testCtx(t), keyOf(r, cs[3], 0))
		if err != nil {
			t.Fatal(err)
		}
		return EncodeObject(ob, cs[3].packed[0], other)
	})
	rewrite(cs[5], func(b []byte) []byte { return asFormat1(t, b) })
	bad := map[dcp.Key]bool{keyOf(r, cs[1], 0): true, keyOf(r, cs[3], 0): true, keyOf(r, cs[5], 0): true}

	cfg2 := cfg
	cfg2.Registerer, cfg2.KeepEvents = newRegistry(), true
	e2 := newEngine(t, cfg2)
	pub := recordEvents(t, e2)
	defer closeEngine(t, e2)
	if err := e2.WaitRescan(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	for _, p := range e2.Inventory().Objects {
		if bad[p.Key] {
			t.Fatalf("the rescan announced unverified object %s (sum %016x)", p.Key, p.Sum)
		}
	}
	if st := e2.Stats(); st.L2Objects != n-3 || st.UnverifiedL2 != 3 {
		t.Fatalf("after the rescan: %d L2 objects, %d unverified; want %d and 3", st.L2Objects, st.UnverifiedL2, n-3)
	}
	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_unverified_objects_total", "tier", "L2"); v != 3 {
		t.Fatalf("unverified_objects_total{tier=L2} = %v, want 3", v)
	}
	if q := quarantined(t, root); len(q) != 3 {
		t.Fatalf("quarantined %v, want the 3 unverified objects", q)
	}
	waitPublished(t, e2)
	for _, ev := range pub.events() {
		if bad[ev.Key] && ev.Kind == wire.Stored {
			t.Fatalf("announced %+v", ev)
		}
	}
	r.register(e2)
	for i := range n {
		tgt := [][][]int64{r.consecutiveN(n + 1 + i%2)}
		rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, cs[i:i+1], tgt))
		if err != nil {
			t.Fatal(err)
		}
		if bad[keyOf(r, cs[i], 0)] {
			if rr.ChunkOK(0) {
				t.Fatalf("chunk %d (unverified in L2) restored: %+v", i, rr.Items[0])
			}
			r.check("after an unverified chunk: nothing written")
			continue
		}
		if !rr.ChunkOK(0) || rr.Items[0].From != wire.L2 {
			t.Fatalf("chunk %d: %+v, want restored from L2", i, rr.Items[0])
		}
		r.expectRestored(cs[i], tgt[0])
		r.check("restored from L2 after the restart")
	}
}

// TestStorageMACL3ScanAnnouncesOnlyVerified (issue 28.1, C12; the attack
// observed: a bucket writer replaced a rank's L3 objects with other bytes
// and a matching header sum, the rank's L2 was lost, and the restarted
// rank announced the forged sums): on a restart with a wiped L2 the L3
// scan announces only objects whose MAC verifies; the forged one, another
// cluster's and a format-1 one are counted in
// unverified_objects_total{tier="L3"}, left in the bucket, announced
// removed and never served; the valid ones restore byte-exact from L3.
// The bucket is a real S3 server over HTTP (gofakes3, in this process;
// the e2e test TestStorageMACBucketWriter runs one in its own process).
// Seen red with the MAC check removed: the forged object was announced.
func TestStorageMACL3ScanAnnouncesOnlyVerified(t *testing.T) {
	dev := openDevice(t, "")
	const n = 6
	r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
	l3, _ := openL3(t)
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.L3, cfg.StorageKey = root, l3, storageKey(1)
	e1 := newEngine(t, cfg)
	r.register(e1)
	var cs []chunk
	for i := range n {
		c := r.newChunk(i, r.consecutiveN(i))
		cs = append(cs, c)
		storeAll(t, e1, r, "s", c)
	}
	if err := e1.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	closeEngine(t, e1)

	names := NewL3Tier(l3, cfg.Rank.Instance, nil)
	rewrite := func(c chunk, f func([]byte) []byte) {
		t.Helper()
		name := names.Name(keyOf(r, c, 0))
		body, _, err := l3.Open(testCtx(t), name, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(body)
		body.Close()
		if err != nil {
			t.Fatal(err)
		}
		b = f(b)
		if err := l3.Put(testCtx(t), name, bytes.NewReader(b), int64(len(b))); err != nil {
			t.Fatal(err)
		}
	}
	other, err := NewMACKey(storageKey(2))
	if err != nil {
		t.Fatal(err)
	}
	rewrite(cs[0], func(b []byte) []byte { return forgeObject(t, b, 21) })
	rewrite(cs[2], func(b []byte) []byte {
		o := L2Object{Key: keyOf(r, cs[2], 0), Fingerprint: r.res.Fingerprint, Writer: cfg.Rank, Incarnation: 1,
			Size: uint64(len(cs[2].packed[0])), Sum: checksum.Sum(cs[2].packed[0])}
		return EncodeObject(o, cs[2].packed[0], other)
	})
	rewrite(cs[4], func(b []byte) []byte { return asFormat1(t, b) })
	bad := map[dcp.Key]bool{keyOf(r, cs[0], 0): true, keyOf(r, cs[2], 0): true, keyOf(r, cs[4], 0): true}

	wipe(t, root) // the rank's L2 is lost: the case L3 exists for
	cfg2 := cfg
	cfg2.Registerer, cfg2.KeepEvents = newRegistry(), true
	e2 := newEngine(t, cfg2)
	pub := recordEvents(t, e2)
	defer closeEngine(t, e2)
	if err := e2.WaitL3Scan(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	inv := e2.Inventory()
	for _, p := range inv.Objects {
		if bad[p.Key] {
			t.Fatalf("the L3 scan announced unverified object %s (sum %016x)", p.Key, p.Sum)
		}
	}
	if got := tierCount(inv, wire.L3); got != n-3 {
		t.Fatalf("inventory holds %d L3 placements, want %d", got, n-3)
	}
	if v := testutil.Metric(t, gatherer(t, e2), "kvtier_transfer_unverified_objects_total", "tier", "L3"); v != 3 {
		t.Fatalf("unverified_objects_total{tier=L3} = %v, want 3", v)
	}
	for k := range bad {
		body, _, err := l3.Open(testCtx(t), names.Name(k), 0, 0)
		if err != nil {
			t.Fatalf("unverified object %s not left in the bucket: %v", k, err)
		}
		body.Close()
	}
	waitPublished(t, e2)
	for _, ev := range pub.events() {
		if bad[ev.Key] && ev.Kind == wire.Stored {
			t.Fatalf("announced %+v", ev)
		}
	}
	r.register(e2)
	for i := range n {
		tgt := [][][]int64{r.consecutiveN(n + 1 + i%2)}
		rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, cs[i:i+1], tgt))
		if err != nil {
			t.Fatal(err)
		}
		if bad[keyOf(r, cs[i], 0)] {
			if rr.ChunkOK(0) {
				t.Fatalf("chunk %d (unverified in L3) restored: %+v", i, rr.Items[0])
			}
			r.check("after an unverified chunk: nothing written")
			continue
		}
		if !rr.ChunkOK(0) || rr.Items[0].From != wire.L3 {
			t.Fatalf("chunk %d: %+v, want restored from L3", i, rr.Items[0])
		}
		r.expectRestored(cs[i], tgt[0])
		r.check("restored from L3 after the restart")
	}
}
