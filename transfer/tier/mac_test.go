package tier

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/wire"
)

func testKey(t testing.TB, seed byte) *MACKey {
	t.Helper()
	k, err := NewMACKey(bytes.Repeat([]byte{seed}, 32))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestMACKeyMismatchRefused (issue 28.1, C12): an object written under
// another cluster's storage key is refused by Get (ErrUnverified, wrapped
// with ErrCorrupt, quarantined), by Stat and by Scan (reported unverified,
// quarantined); the same object is served under its own key, and by a
// tier without a key (insecure: headers trusted). Seen red with the MAC
// check removed (verify always true): Get served the other cluster's
// object.
func TestMACKeyMismatchRefused(t *testing.T) {
	ctx := t.Context()
	root := t.TempDir()
	theirs, err := OpenFileTier(root, testKey(t, 2))
	if err != nil {
		t.Fatal(err)
	}
	o, p := testObj(1)
	if err := theirs.Put(ctx, o, p); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, len(p))
	if _, err := theirs.Get(ctx, o.Key, o.Fingerprint, dst); err != nil || !bytes.Equal(dst, p) {
		t.Fatalf("Get under the writer's own key: %v", err)
	}
	insecure, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := insecure.Get(ctx, o.Key, o.Fingerprint, dst); err != nil {
		t.Fatalf("Get without a key (insecure): %v", err)
	}
	ours, err := OpenFileTier(root, testKey(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ours.Stat(ctx, o.Key); !errors.Is(err, ErrUnverified) || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Stat of another cluster's object: %v, want ErrUnverified and ErrCorrupt", err)
	}
	_, err = ours.Get(ctx, o.Key, o.Fingerprint, dst)
	var ce *CorruptError
	if !errors.Is(err, ErrUnverified) || !errors.As(err, &ce) || !ce.Unverified || ce.Quarantine == "" {
		t.Fatalf("Get of another cluster's object: %v, want an unverified *CorruptError, quarantined", err)
	}
	if _, err := ours.Get(ctx, o.Key, o.Fingerprint, dst); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get after the quarantine: %v, want ErrNotFound", err)
	}

	// Scan: another cluster's object of this writer is reported unverified
	// and quarantined; one of ours is found.
	o2, p2 := testObj(2)
	if err := theirs.Put(ctx, o2, p2); err != nil {
		t.Fatal(err)
	}
	o3, p3 := testObj(3)
	if err := ours.Put(ctx, o3, p3); err != nil {
		t.Fatal(err)
	}
	var found, unverified []ScanEntry
	if err := ours.Scan(ctx, o.Writer, true, func(e ScanEntry) {
		switch {
		case errors.Is(e.Err, ErrUnverified):
			unverified = append(unverified, e)
		case e.Err == nil && e.Skipped == "":
			found = append(found, e)
		default:
			t.Errorf("unexpected scan entry %+v", e)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if len(found) != 1 || found[0].Object.Key != o3.Key || len(unverified) != 1 || unverified[0].Object.Key != o2.Key {
		t.Fatalf("scan found %+v, unverified %+v; want %s found and %s unverified", found, unverified, o3.Key, o2.Key)
	}
	if _, err := os.Stat(ours.Path(o2.Key)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("unverified object still in place after the scan: %v", err)
	}
}

// TestMACCoversEveryHeaderField: changing any header field (key,
// fingerprint, length, sum, writer, incarnation, created) under the same
// MAC, with the header checksum recomputed, makes the header unverified.
func TestMACCoversEveryHeaderField(t *testing.T) {
	key := testKey(t, 1)
	o, p := testObj(4)
	o.Writer = wire.Rank{Instance: "test", TPRank: 3}
	enc := EncodeObject(o, p, key)
	h := int(HeaderBytes(o.Writer.Instance))
	if _, _, err := readHeader(bytes.NewReader(enc), int64(len(enc)), key); err != nil {
		t.Fatal(err)
	}
	for off := 8; off < h-40; off++ {
		if off >= 77 && off < 85 {
			continue // the length: changing it breaks the file length first
		}
		b := bytes.Clone(enc)
		b[off] ^= 1
		copy(b[h-8:h], be64(checksum.Sum(b[:h-8])))
		_, _, err := readHeader(bytes.NewReader(b), int64(len(b)), key)
		if err == nil {
			t.Fatalf("header byte %d changed: still verifies", off)
		}
	}
}

func be64(v uint64) []byte {
	var b [8]byte
	for i := range 8 {
		b[i] = byte(v >> (56 - 8*i))
	}
	return b[:]
}

// BenchmarkObjectMAC is the cost of the storage MAC per 1 MiB object (the
// figures docs/storage-mac.md gives). store: a header encoded, with and
// without the MAC; restore-header: a header read and checked, with and
// without the MAC; restore: a header read and checked plus the payload's
// kvsum64, which every restore verifies anyway (MB/s of the payload).
func BenchmarkObjectMAC(b *testing.B) {
	const size = 1 << 20
	o, _ := testObj(5)
	p := bytes.Repeat([]byte{0x5a}, size)
	o.Size, o.Sum = size, checksum.Sum(p)
	for _, kc := range []struct {
		name string
		key  *MACKey
	}{{"nomac", nil}, {"mac", testKey(b, 1)}} {
		b.Run(fmt.Sprintf("store/%s", kc.name), func(b *testing.B) {
			for b.Loop() {
				_ = encodeHeader(o, kc.key)
			}
		})
		enc := EncodeObject(o, p, kc.key)
		r := bytes.NewReader(enc)
		b.Run(fmt.Sprintf("restore-header/%s", kc.name), func(b *testing.B) {
			for b.Loop() {
				if _, _, err := readHeader(r, int64(len(enc)), kc.key); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("restore/%s", kc.name), func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				got, h, err := readHeader(r, int64(len(enc)), kc.key)
				if err != nil || checksum.Sum(enc[h:]) != got.Sum {
					b.Fatal(err)
				}
			}
		})
	}
}
