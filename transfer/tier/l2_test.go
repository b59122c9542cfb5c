package tier

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// FuzzReadHeader: any bytes give a header or an error, never a panic; a
// header accepted with a key re-encodes to the same bytes (the fuzzer
// cannot forge a MAC, so with a key only what was encoded with it
// passes), and one accepted without a key (insecure) re-encodes to the
// same fields.
func FuzzReadHeader(f *testing.F) {
	key, err := NewMACKey(bytes.Repeat([]byte{7}, 32))
	if err != nil {
		f.Fatal(err)
	}
	obj := L2Object{Key: dcp.Key{NS: dcp.Namespace{1}}, Writer: wire.Rank{Instance: "x", TPRank: 1}, Size: 3, Created: time.Unix(0, 1)}
	good := append(encodeHeader(obj, key), 1, 2, 3)
	f.Add(good)
	f.Add(append(encodeHeader(obj, nil), 1, 2, 3))
	f.Add(good[:20])
	f.Add([]byte("KVTO"))
	f.Fuzz(func(t *testing.T, b []byte) {
		if o, h, err := readHeader(bytes.NewReader(b), int64(len(b)), key); err == nil {
			if enc := encodeHeader(o, key); string(enc) != string(b[:h]) {
				t.Fatalf("accepted header does not re-encode: %x vs %x", enc, b[:h])
			}
		}
		o, h, err := readHeader(bytes.NewReader(b), int64(len(b)), nil)
		if err != nil {
			return
		}
		if h < fileMinHdr || h > fileMaxHdr || h > len(b) {
			t.Fatalf("accepted header length %d of %d bytes", h, len(b))
		}
		o2, _, err := readHeader(bytes.NewReader(append(encodeHeader(o, nil), b[h:]...)), int64(len(encodeHeader(o, nil))+len(b)-h), nil)
		if err != nil || o2 != o {
			t.Fatalf("accepted header re-encodes to %+v, %v; want %+v", o2, err, o)
		}
	})
}
