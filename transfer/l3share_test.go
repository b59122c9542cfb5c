package transfer

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestRetrieveFromMemberL3 (issue 26.1, docs/sharing.md): a rank of
// instance a stores two chunks, written behind to L3 encrypted under a's
// prefix. A rank of b, given a in L3SharedWith, with neither L1 nor L2
// holding them, restores both byte-exact from a's prefix when its plan
// names a's L3 copies (counted in l3_shared_restored_objects_total). A
// rank of c, not given a, refuses to read them (l3_shared_refused_total).
// An object altered in the bucket fails its chunk at b's rank and stays
// in the bucket for its writer. Seen red with l3LoadFrom ignoring holder
// (b read its own prefix: "in neither L1 nor L2").
func TestRetrieveFromMemberL3(t *testing.T) {
	dev := openDevice(t, "")
	l3, _ := openL3(t)
	engineOf := func(inst string, shared ...string) (*Engine, *rig) {
		return shareMember(t, dev, inst, func(c *Config) {
			c.L3, c.StorageKey, c.L3Encrypt, c.L3SharedWith = l3, storageKey(1), true, shared
		})
	}
	ea, ra := engineOf("a")
	cs := []chunk{ra.newChunk(0, ra.consecutiveN(0)), ra.newChunk(1, ra.consecutiveN(1))}
	storeAll(t, ea, ra, "a", cs...)
	if err := ea.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	fromA := func(r *rig, cs []chunk, tgt [][][]int64) RetrieveRequest {
		req := r.retrieveReq(0, cs, tgt)
		for i := range req.Items {
			req.Items[i].Source = wire.Source{Holder: wire.Rank{Instance: "a", TPRank: 0}, Tier: wire.L3}
		}
		return req
	}

	eb, rb := engineOf("b", "a")
	tgt := [][][]int64{rb.consecutiveN(4), rb.consecutiveN(5)}
	if rr := restoreWith(t, eb, rb, "b after restoring a's L3 copies", fromA(rb, cs, tgt), cs, tgt); rr.Items[0].From != wire.L3 {
		t.Fatalf("b's retrieve from a's L3: %+v", rr)
	}
	if v := testutil.Metric(t, gatherer(t, eb), "kvtier_transfer_l3_shared_restored_objects_total"); v != 2 {
		t.Fatalf("l3_shared_restored_objects_total = %v, want 2", v)
	}

	ec, rc := engineOf("c")
	rr, err := ec.Retrieve(testCtx(t), fromA(rc, cs[:1], tgt[:1]))
	if err != nil || rr.ChunkOK(0) {
		t.Fatalf("c (not sharing with a) restored a's L3 copy: %+v %v", rr, err)
	}
	if v := testutil.Metric(t, gatherer(t, ec), "kvtier_transfer_l3_shared_refused_total"); v != 1 {
		t.Fatalf("c: l3_shared_refused_total = %v, want 1", v)
	}

	// One ciphertext byte of chunk 1's object flipped in the bucket; a
	// fresh rank of b (nothing in its L1) fails the chunk and leaves the
	// object as it found it.
	name := NewL3Tier(l3, "a", nil).Name(keyOf(ra, cs[1], 0))
	body, _, err := l3.Open(testCtx(t), name, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	obj, err := io.ReadAll(body)
	body.Close()
	if err != nil {
		t.Fatal(err)
	}
	obj[len(obj)-100] ^= 0x01
	if err := l3.Put(testCtx(t), name, bytes.NewReader(obj), int64(len(obj))); err != nil {
		t.Fatal(err)
	}
	eb2, rb2 := engineOf("b", "a")
	rr, err = eb2.Retrieve(testCtx(t), fromA(rb2, cs, tgt))
	if err != nil || !rr.ChunkOK(0) || rr.ChunkOK(1) || rr.Items[1].Reason != ReasonCorrupt {
		t.Fatalf("b's retrieve of an altered copy: %+v %v; want chunk 0 restored, chunk 1 corrupt", rr, err)
	}
	if v := testutil.Metric(t, gatherer(t, eb2), "kvtier_transfer_l3_left_for_writer_total"); v != 1 {
		t.Fatalf("l3_left_for_writer_total = %v, want 1", v)
	}
	body, _, err = l3.Open(testCtx(t), name, 0, 0)
	if err != nil {
		t.Fatalf("the altered object is gone after b's read: %v", err)
	}
	again, _ := io.ReadAll(body)
	body.Close()
	if !bytes.Equal(again, obj) {
		t.Fatal("b's read changed a's object")
	}
}

// TestL3SharedWithConfig: instances shared in L3 need an L3 and valid
// names other than the rank's own.
func TestL3SharedWithConfig(t *testing.T) {
	dev := openDevice(t, "")
	l3, _ := openL3(t)
	for name, mod := range map[string]func(*Config){
		"no L3":    func(c *Config) { c.L3SharedWith = []string{"a"} },
		"itself":   func(c *Config) { c.L3, c.L3SharedWith = l3, []string{c.Rank.Instance} },
		"bad name": func(c *Config) { c.L3, c.L3SharedWith = l3, []string{"a/b"} },
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
