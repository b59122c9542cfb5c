package transfer

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// TestL3ScanPastTruncatedObject (campaign finding, seed 41: an L3 object
// truncated to 0 bytes answered the scan's ranged header read with 416,
// the scan stopped there as an I/O error, and every object listed after it
// was missing from the rank's inventory at each restart, so the index
// dropped their L3 placements, 50 of them): an object too short for a
// header is corrupt, deleted and reported, and the scan goes on to the
// objects after it.
func TestL3ScanPastTruncatedObject(t *testing.T) {
	st, srv := openL3(t)
	tier := NewL3Tier(st, "eng")
	owner := wire.Rank{Instance: "eng", TPRank: 1}
	ctx := context.Background()
	var keys []dcp.Key
	for i := range 4 {
		key := dcp.Key{NS: dcp.Namespace{1}, Chunk: dcp.ChunkHash{byte(i + 1)}, Shard: 1, Group: 0}
		payload := bytes.Repeat([]byte{byte(i)}, 3000)
		obj := L2Object{Key: key, Writer: owner, Incarnation: 7, Size: uint64(len(payload)), Sum: checksum.Sum(payload),
			Created: time.Unix(100, 0)}
		if err := tier.Put(ctx, obj, payload); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, key)
	}
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
