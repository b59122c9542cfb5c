package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// putScanObjects writes n objects of owner's shard (3,000 B each) in
// their list order and returns their keys.
func putScanObjects(t *testing.T, tier *L3Tier, owner wire.Rank, n int) []dcp.Key {
	t.Helper()
	var keys []dcp.Key
	for i := range n {
		key := dcp.Key{NS: dcp.Namespace{1}, Chunk: dcp.ChunkHash{byte(i + 1)}, Shard: uint16(owner.TPRank), Group: 0}
		payload := bytes.Repeat([]byte{byte(i)}, 3000)
		obj := L2Object{Key: key, Writer: owner, Incarnation: 7, Size: uint64(len(payload)), Sum: checksum.Sum(payload),
			Created: time.Unix(100, 0)}
		if err := tier.Put(context.Background(), obj, payload); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, key)
	}
	return keys
}

// TestL3ScanPastTruncatedObject (campaign finding, seed 41: an L3 object
// truncated to 0 bytes answered the scan's ranged header read with 416,
// the scan stopped there as an I/O error, and every object listed after it
// was missing from the rank's inventory at each restart, so the index
// dropped their L3 placements, 50 of them): an object too short for a
// header is corrupt, deleted and reported, and the scan goes on to the
// objects after it.
func TestL3ScanPastTruncatedObject(t *testing.T) {
	st, srv := openL3(t)
	tier := NewL3Tier(st, "eng", nil)
	owner := wire.Rank{Instance: "eng", TPRank: 1}
	ctx := context.Background()
	keys := putScanObjects(t, tier, owner, 4)
	// The first object in list order cut to 0 bytes, the second to 10.
	for i, n := range []int{0, 10} {
		name := "kv/" + tier.Name(keys[i])
		o, err := srv.Backend.GetObject(srv.Bucket, name, nil)
		if err != nil {
			t.Fatal(err)
		}
		b := make([]byte, n)
		_, _ = o.Contents.Read(b)
		o.Contents.Close()
		if _, err := srv.Backend.PutObject(srv.Bucket, name, map[string]string{}, bytes.NewReader(b), int64(n), nil); err != nil {
			t.Fatal(err)
		}
	}
	var good, bad []dcp.Key
	if err := tier.Scan(ctx, owner, func(e ScanEntry) {
		if e.Err != nil {
			bad = append(bad, e.Object.Key)
		} else {
			good = append(good, e.Object.Key)
		}
	}); err != nil {
		t.Fatalf("scan stopped: %v (found %d good, %d bad)", err, len(good), len(bad))
	}
	if len(good) != 2 || good[0] != keys[2] || good[1] != keys[3] || len(bad) != 2 || bad[0] != keys[0] || bad[1] != keys[1] {
		t.Fatalf("scan found good %v, bad %v; want good %v, bad %v", good, bad, keys[2:], keys[:2])
	}
	for _, k := range keys[:2] {
		if _, _, err := st.Open(ctx, tier.Name(k), 0, 0); err == nil {
			t.Fatalf("truncated object %s still in the bucket", k)
		}
	}
}

// failingOpens is an ObjectStore whose Open of one name fails with an I/O
// error the first fails times (every time when fails < 0).
type failingOpens struct {
	ObjectStore
	name  string
	fails int
	opens int
}

func (f *failingOpens) Open(ctx context.Context, name string, off, n int64) (io.ReadCloser, int64, error) {
	if name == f.name {
		f.opens++
		if f.fails < 0 || f.opens <= f.fails {
			return nil, 0, errors.New("connection reset by peer")
		}
	}
	return f.ObjectStore.Open(ctx, name, off, n)
}

// TestL3ScanPastUnreadableObject: an object whose header read fails with an
// I/O error (not a bad header) no longer stops the scan: the objects after
// it are found, it is read again after the listing (found when the second
// read works), and one that fails twice is left out, neither reported nor
// deleted, and named in Scan's error. Seen failing before: the scan stopped
// at the object, and the three listed after it were missing.
func TestL3ScanPastUnreadableObject(t *testing.T) {
	for _, fails := range []int{1, -1} {
		t.Run(fmt.Sprintf("fails=%d", fails), func(t *testing.T) {
			st, _ := openL3(t)
			owner := wire.Rank{Instance: "eng", TPRank: 1}
			ctx := context.Background()
			put := NewL3Tier(st, "eng", nil)
			keys := putScanObjects(t, put, owner, 4)
			fo := &failingOpens{ObjectStore: st, name: put.Name(keys[0]), fails: fails}
			tier := NewL3Tier(fo, "eng", nil)
			var good, bad []dcp.Key
			err := tier.Scan(ctx, owner, func(e ScanEntry) {
				if e.Err != nil {
					bad = append(bad, e.Object.Key)
				} else {
					good = append(good, e.Object.Key)
				}
			})
			want := keys[1:]
			if fails > 0 {
				want = append(slices.Clone(keys[1:]), keys[0]) // found on the second read
				if err != nil {
					t.Fatalf("scan: %v", err)
				}
			} else if err == nil || !errors.Is(err, ErrIO) || !strings.Contains(err.Error(), "1 of its objects unreadable twice") {
				t.Fatalf("scan with an object unreadable twice: %v, want an ErrIO naming 1 object", err)
			}
			if !slices.Equal(good, want) || len(bad) != 0 {
				t.Fatalf("scan found good %v, bad %v; want good %v and none bad", good, bad, want)
			}
			if fo.opens != 2 {
				t.Fatalf("the unreadable object was opened %d times, want 2", fo.opens)
			}
			body, _, err := st.Open(ctx, put.Name(keys[0]), 0, 0)
			if err != nil {
				t.Fatalf("the unreadable object is gone from the bucket: %v", err)
			}
			body.Close()
		})
	}
}
