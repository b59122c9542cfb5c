package transfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestL3EncryptedRestore (issue 28 item 1, optional encryption at rest):
// with Config.L3Encrypt the objects in the bucket are format 3 and hold
// none of the stored bytes; after L1 and L2 are lost (a restart on a wiped
// L2 root) the start-up scan announces them and a retrieve restores them
// byte-exact from L3. An object whose GCM tag was altered in the bucket
// fails its chunk as corrupt (counted, nothing written into the pages);
// the others still restore. Without a storage key New refuses the
// option. Seen red before Config.L3Encrypt existed (the objects were
// format 2, the stored bytes in the clear).
func TestL3EncryptedRestore(t *testing.T) {
	dev := openDevice(t, "")
	const n = 4
	r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
	l3, _ := openL3(t)
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.L3, cfg.StorageKey, cfg.L3Encrypt = root, l3, storageKey(1), true
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
	read := func(c chunk) []byte {
		t.Helper()
		body, _, err := l3.Open(testCtx(t), names.Name(keyOf(r, c, 0)), 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer body.Close()
		b, err := io.ReadAll(body)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for i, c := range cs {
		obj, p := read(c), c.packed[0]
		if v := binary.BigEndian.Uint16(obj[4:6]); v != 3 {
			t.Fatalf("chunk %d: L3 object of format %d, want 3 (encrypted)", i, v)
		}
		if bytes.Contains(obj, p[len(p)/2:len(p)/2+64]) {
			t.Fatalf("chunk %d: the bucket holds the stored bytes in the clear", i)
		}
	}
	// The GCM tag of chunk 1's object altered while the rank is down.
	bad := read(cs[1])
	bad[len(bad)-1] ^= 0x80
	if err := l3.Put(testCtx(t), names.Name(keyOf(r, cs[1], 0)), bytes.NewReader(bad), int64(len(bad))); err != nil {
		t.Fatal(err)
	}

	wipe(t, root)
	c2 := cfg
	c2.Registerer = newRegistry()
	e2 := newEngine(t, c2)
	if err := e2.WaitL3Scan(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	r.register(e2)
	if got := tierCount(e2.Inventory(), wire.L3); got != n {
		t.Fatalf("after the restart: %d L3 placements, want %d (headers verify; payloads are checked on read)", got, n)
	}
	for i := range n {
		tg := [][][]int64{r.consecutiveN(n + 1 + i%2)}
		rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, cs[i:i+1], tg))
		if err != nil {
			t.Fatal(err)
		}
		if i == 1 {
			if rr.ChunkOK(0) || rr.Items[0].Reason != ReasonCorrupt {
				t.Fatalf("chunk 1 (tag altered): %+v, want failed as corrupt", rr.Items[0])
			}
			r.check("after the altered object: nothing written")
			continue
		}
		if !rr.ChunkOK(0) || rr.Items[0].From != wire.L3 {
			t.Fatalf("chunk %d: %+v, want restored from L3", i, rr.Items[0])
		}
		r.expectRestored(cs[i], tg[0])
		r.check("restored from encrypted L3")
	}
	if st := e2.L3Stats(); st.Checksum != 1 || st.RestoredFrom != n-1 {
		t.Fatalf("L3 stats: %+v, want 1 checksum failure and %d restores", st, n-1)
	}
	closeEngine(t, e2)

	c3 := cfg
	c3.StorageKey = nil
	if e, err := New(c3); !errors.Is(err, ErrConfig) {
		if e != nil {
			closeEngine(t, e)
		}
		t.Fatalf("L3Encrypt without a storage key: %v, want ErrConfig", err)
	}
}
