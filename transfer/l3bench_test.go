package transfer

import (
	"bytes"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// BenchmarkL3 measures the L3 tier against the in-process S3 server
// (gofakes3, memory backend, over loopback HTTP through minio-go), with
// its ceiling in the same run: a raw PUT / GET of the same number of bytes
// with the client alone (raw_put, raw_get) beside the tier's PUT (header
// encoding, checksum check of nothing: the payload's sum is given) and GET
// (header checks and the payload's kvsum64 verification, into a
// preallocated buffer as a retrieve does). Report tier/raw.
//
//	go test -run '^$' -bench L3 -benchtime 40x ./transfer
func BenchmarkL3(b *testing.B) {
	for _, size := range []int{1 << 20, 8 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			st, _ := openL3(b)
			tier := NewL3Tier(st, "bench", nil)
			payload := testutil.RandomBytes(uint64(size), 7)
			sum := checksum.Sum(payload)
			var ns dcp.Namespace
			copy(ns[:], "l3-bench")
			key := func(i int) dcp.Key {
				var ch dcp.ChunkHash
				copy(ch[:], fmt.Sprintf("%016d", i%8))
				return dcp.Key{NS: ns, Chunk: ch}
			}
			obj := func(i int) L2Object {
				return L2Object{Key: key(i), Writer: wire.Rank{Instance: "bench"}, Size: uint64(size), Sum: sum, Created: time.Now()}
			}
			ctx := testCtx(b)
			b.Run("raw_put", func(b *testing.B) {
				b.SetBytes(int64(size))
				for i := 0; i < b.N; i++ {
					if err := st.Put(ctx, fmt.Sprintf("raw/%d", i%8), bytes.NewReader(payload), int64(size)); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("tier_put", func(b *testing.B) {
				b.SetBytes(int64(size))
				for i := 0; i < b.N; i++ {
					if err := tier.Put(ctx, obj(i), payload); err != nil {
						b.Fatal(err)
					}
				}
			})
			for i := range 8 { // every object the gets read
				if err := tier.Put(ctx, obj(i), payload); err != nil {
					b.Fatal(err)
				}
				if err := st.Put(ctx, fmt.Sprintf("raw/%d", i), bytes.NewReader(payload), int64(size)); err != nil {
					b.Fatal(err)
				}
			}
			dst := make([]byte, size)
			b.Run("raw_get", func(b *testing.B) {
				b.SetBytes(int64(size))
				for i := 0; i < b.N; i++ {
					body, _, err := st.Open(ctx, fmt.Sprintf("raw/%d", i%8), 0, 0)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := io.ReadFull(body, dst); err != nil {
						b.Fatal(err)
					}
					body.Close()
				}
			})
			b.Run("tier_get", func(b *testing.B) {
				b.SetBytes(int64(size))
				for i := 0; i < b.N; i++ {
					if _, err := tier.Get(ctx, key(i), [32]byte{}, dst); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
