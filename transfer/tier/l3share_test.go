package tier

import (
	"bytes"
	"errors"
	"slices"
	"testing"
)

// TestL3GetOfMember (issue 26.1, docs/sharing.md): a tier of instance
// "b" reads, through GetOf, the objects instance "test" wrote under its
// own prefix of the same bucket, plain or encrypted (opened under the
// writer's payload key), byte-exact; Get, which reads b's own prefix,
// finds nothing; an object altered in the bucket fails as corrupt, one
// of another cluster's storage key as unverified, both left in the
// bucket. Seen failing with get deriving the payload key of its own
// instance: "payload does not decrypt".
func TestL3GetOfMember(t *testing.T) {
	ctx := t.Context()
	key := testKey(t, 1)
	for _, encrypt := range []bool{false, true} {
		st := newMemStore()
		w := NewL3Tier(st, "test", key)
		if encrypt {
			w = encTier(t, st, "test", key)
		}
		o, p := testObj(3)
		if err := w.Put(ctx, o, p); err != nil {
			t.Fatal(err)
		}
		b := NewL3Tier(st, "b", key)
		dst := make([]byte, len(p))
		if _, err := b.Get(ctx, o.Key, o.Fingerprint, dst); !errors.Is(err, ErrNotFound) {
			t.Fatalf("encrypt %v: b's Get of its own prefix: %v, want ErrNotFound", encrypt, err)
		}
		got, err := b.GetOf(ctx, "test", o.Key, o.Fingerprint, dst)
		if err != nil || !bytes.Equal(dst, p) || got.Sum != o.Sum || got.Writer != o.Writer {
			t.Fatalf("encrypt %v: GetOf: %+v, %v (bytes equal %v)", encrypt, got, err, bytes.Equal(dst, p))
		}
		name := w.Name(o.Key)
		good := st.get(name)
		bad := slices.Clone(good)
		bad[len(bad)-1] ^= 0x01 // the payload's (or the GCM tag's) last byte
		st.set(name, bad)
		var ce *CorruptError
		if _, err := b.GetOf(ctx, "test", o.Key, o.Fingerprint, dst); !errors.As(err, &ce) || !ce.Kept || ce.Unverified ||
			ce.Path != "l3:"+name {
			t.Fatalf("encrypt %v: altered object: %v, want corrupt, kept, at l3:%s", encrypt, err, name)
		}
		if !bytes.Equal(st.get(name), bad) {
			t.Fatalf("encrypt %v: a reader of another instance changed the object", encrypt)
		}
		st.set(name, good)
		other := NewL3Tier(st, "b", testKey(t, 2))
		if _, err := other.GetOf(ctx, "test", o.Key, o.Fingerprint, dst); !errors.Is(err, ErrUnverified) {
			t.Fatalf("encrypt %v: another cluster's key: %v, want unverified", encrypt, err)
		}
	}
}
