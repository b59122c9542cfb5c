package wire

import (
	"encoding/hex"
	"errors"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

func sampleLookup() LookupRequest {
	r := LookupRequest{Instance: "eng-1", Detail: true, Chunks: make([]dcp.ChunkHash, 2)}
	for i := range r.Namespace {
		r.Namespace[i] = byte(i)
	}
	for i := range r.Chunks {
		for j := range r.Chunks[i] {
			r.Chunks[i][j] = byte(0xa0 + 16*i + j)
		}
	}
	return r
}

// The binary lookup request is pinned byte for byte (the Python client
// encodes it too).
func TestLookupBinaryGolden(t *testing.T) {
	r := sampleLookup()
	p, err := r.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	const want = "4b564c31" + "01" + "000102030405060708090a0b0c0d0e0f" + "05" + "656e672d31" + "00000002" +
		"a0a1a2a3a4a5a6a7a8a9aaabacadaeaf" + "b0b1b2b3b4b5b6b7b8b9babbbcbdbebf"
	if got := hex.EncodeToString(p); got != want {
		t.Fatalf("encoding\n got %s\nwant %s", got, want)
	}
	var back LookupRequest
	if err := back.UnmarshalBinary(p); err != nil || !reflect.DeepEqual(back, r) {
		t.Fatalf("round trip = %+v, %v", back, err)
	}
	if !IsBinaryLookup(p) || IsBinaryLookup([]byte(`{"namespace":""}`)) {
		t.Fatal("IsBinaryLookup does not tell binary from JSON")
	}
	// StateAtEnd is flag bit 1, alone or beside Detail.
	for _, detail := range []bool{false, true} {
		r.Detail, r.StateAtEnd = detail, true
		p, err := r.MarshalBinary()
		if err != nil || p[4] != map[bool]byte{false: 2, true: 3}[detail] {
			t.Fatalf("flags %#x (%v), want StateAtEnd as bit 1", p[4], err)
		}
		var back LookupRequest
		if err := back.UnmarshalBinary(p); err != nil || !reflect.DeepEqual(back, r) {
			t.Fatalf("round trip with StateAtEnd = %+v, %v", back, err)
		}
	}
}

func TestLookupBinaryRejects(t *testing.T) {
	good, _ := func() ([]byte, error) { r := sampleLookup(); return r.MarshalBinary() }()
	mut := func(f func(p []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for name, p := range map[string][]byte{
		"empty":         {},
		"magic":         mut(func(p []byte) []byte { p[3] = '2'; return p }),
		"flags":         mut(func(p []byte) []byte { p[4] = 5; return p }),
		"header":        good[:20],
		"instance len":  mut(func(p []byte) []byte { p[21] = 65; return p }),
		"short count":   good[:28],
		"count too big": mut(func(p []byte) []byte { p[27], p[28], p[29], p[30] = 0x10, 0, 0, 0; return p }),
		"extra byte":    append(append([]byte(nil), good...), 0),
		"missing byte":  good[:len(good)-1],
	} {
		var r LookupRequest
		if err := r.UnmarshalBinary(p); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", name, err)
		}
	}
	long := LookupRequest{Instance: string(make([]byte, 65))}
	if _, err := long.MarshalBinary(); !errors.Is(err, ErrMalformed) {
		t.Errorf("encode with a 65-byte instance: %v", err)
	}
}

func FuzzLookupUnmarshal(f *testing.F) {
	r := sampleLookup()
	p, _ := r.MarshalBinary()
	fuzzCanonical(f, [][]byte{p, []byte(lookupMagic)}, func(p []byte) (*LookupRequest, error) {
		var r LookupRequest
		return &r, r.UnmarshalBinary(p)
	})
}
