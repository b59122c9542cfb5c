package tier

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// FuzzReadHeader: any bytes give a header or an error, never a panic, and
// an accepted header re-encodes to the same bytes.
func FuzzReadHeader(f *testing.F) {
	obj := L2Object{Key: dcp.Key{NS: dcp.Namespace{1}}, Writer: wire.Rank{Instance: "x", TPRank: 1}, Size: 3, Created: time.Unix(0, 1)}
	good := append(encodeHeader(obj), 1, 2, 3)
	f.Add(good)
	f.Add(good[:20])
	f.Add([]byte("KVTO"))
	f.Fuzz(func(t *testing.T, b []byte) {
		o, h, err := readHeader(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			return
		}
		if h < fileFixedHdr+8 || h > len(b) {
			t.Fatalf("accepted header length %d of %d bytes", h, len(b))
		}
		if enc := encodeHeader(o); string(enc) != string(b[:h]) {
			t.Fatalf("accepted header does not re-encode: %x vs %x", enc, b[:h])
		}
	})
}
