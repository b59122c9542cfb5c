package dcp

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func TestChunkHashesArePrefixChained(t *testing.T) {
	ns := Namespace{1, 2, 3}
	a := make([]uint32, 100)
	for i := range a {
		a[i] = uint32(i * 31)
	}
	ha := ChunkHashes(ns, a, 16)
	if len(ha) != 6 {
		t.Fatalf("%d hashes for 100 tokens in chunks of 16, want 6 (partial chunk unhashed)", len(ha))
	}
	// Same prefix -> same hashes; a change in chunk k changes k and every later one.
	b := slices.Clone(a)
	b[40] ^= 1 // chunk 2
	hb := ChunkHashes(ns, b, 16)
	for k := range ha {
		same := ha[k] == hb[k]
		if k < 2 && !same || k >= 2 && same {
			t.Fatalf("chunk %d: equal=%v after changing token 40", k, same)
		}
	}
	// A different namespace changes every hash.
	hc := ChunkHashes(Namespace{9}, a, 16)
	for k := range ha {
		if ha[k] == hc[k] {
			t.Fatalf("chunk %d equal across namespaces", k)
		}
	}
	// Identical chunk content at a different position hashes differently.
	rep := make([]uint32, 32)
	hr := ChunkHashes(ns, rep, 16)
	if hr[0] == hr[1] {
		t.Fatal("chunk hash does not depend on its prefix")
	}
	if ChunkHashes(ns, a, 0) != nil {
		t.Fatal("chunk size 0 gave hashes")
	}
}

func TestKeyRoundTrip(t *testing.T) {
	k := Key{NS: Namespace{0xde, 0xad}, Chunk: ChunkHash{0xbe, 0xef, 15: 7}, Shard: 3, Group: 65535}
	b := k.Bytes()
	if len(b) != KeySize || b[0] != 1 {
		t.Fatalf("binary key %x", b)
	}
	var k2 Key
	if err := k2.UnmarshalBinary(b); err != nil || k2 != k {
		t.Fatalf("binary round trip: %+v %v", k2, err)
	}
	s := k.String()
	if strings.ContainsAny(s, "/ *>") {
		t.Fatalf("text key %q not safe for file names and subjects", s)
	}
	k3, err := ParseKey(s)
	if err != nil || k3 != k {
		t.Fatalf("text round trip of %q: %+v %v", s, k3, err)
	}
	// Binary keys sort by namespace, then chunk, shard, group.
	lo := Key{NS: Namespace{1}, Chunk: ChunkHash{0xff}, Shard: 9}
	hi := Key{NS: Namespace{2}}
	if bytes.Compare(lo.Bytes(), hi.Bytes()) >= 0 {
		t.Fatal("binary keys do not sort by namespace first")
	}
}

func TestParseKeyErrors(t *testing.T) {
	good := Key{NS: Namespace{0xab, 0xcd}, Shard: 1, Group: 2}.String()
	parts := strings.Split(good, ".")
	for _, bad := range []string{
		"",
		"a.b.c",
		good + ".1",
		strings.ToUpper(parts[0]) + "." + parts[1] + ".1.2",
		parts[0][:31] + "." + parts[1] + ".1.2",
		parts[0] + "." + parts[1] + ".01.2",
		parts[0] + "." + parts[1] + ".1.65536",
		parts[0] + "." + parts[1] + ".-1.2",
		parts[0] + "." + parts[1] + ".1.",
		parts[0] + "." + parts[1] + ".1.2 ",
		"zz" + parts[0][2:] + "." + parts[1] + ".1.2",
	} {
		if _, err := ParseKey(bad); !errors.Is(err, ErrKey) {
			t.Errorf("ParseKey(%q) err = %v, want ErrKey", bad, err)
		}
	}
	var k Key
	for _, b := range [][]byte{nil, make([]byte, 36), append([]byte{2}, make([]byte, 36)...)} {
		if err := k.UnmarshalBinary(b); !errors.Is(err, ErrKey) {
			t.Errorf("UnmarshalBinary(%x) err = %v, want ErrKey", b, err)
		}
	}
}

func FuzzParseKey(f *testing.F) {
	f.Add(Key{Shard: 1, Group: 2}.String())
	f.Add("")
	f.Add("....")
	f.Add(strings.Repeat("a", 32) + "." + strings.Repeat("0", 32) + ".65535.0")
	f.Fuzz(func(t *testing.T, s string) {
		k, err := ParseKey(s)
		if err != nil {
			if !errors.Is(err, ErrKey) {
				t.Fatalf("error %v does not wrap ErrKey", err)
			}
			return
		}
		// Whatever parses is canonical: it prints back to the same text.
		if k.String() != s {
			t.Fatalf("ParseKey(%q).String() = %q", s, k.String())
		}
	})
}

func FuzzKeyBinary(f *testing.F) {
	f.Add(Key{Shard: 7}.Bytes())
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		var k Key
		if err := k.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrKey) {
				t.Fatalf("error %v does not wrap ErrKey", err)
			}
			return
		}
		if !bytes.Equal(k.Bytes(), b) {
			t.Fatalf("round trip %x -> %x", b, k.Bytes())
		}
	})
}

// Geometry validation never panics, whatever the numbers.
func FuzzGroupResolve(f *testing.F) {
	f.Add(uint8(1), true, 64, 1, uint64(528*64), uint64(561*64), uint64(561*64+37), 4, 4, 2)
	f.Add(uint8(3), false, 2304, 2, uint64(1085440), uint64(1085440), uint64(1085440), 8, 8, 1)
	f.Fuzz(func(t *testing.T, kind uint8, mla bool, bs, layers int, sem, decl, stride uint64, tp, w, il int) {
		g := Group{Kind: Kind(kind), MLA: mla, BlockSize: bs, Layers: layers, SemanticBytes: sem, PageBytes: decl, StrideBytes: stride}
		pg, err := g.Resolve(Layout{TP: tp, DCP: w, Interleave: il, PP: 1})
		if err != nil {
			if !errors.Is(err, ErrGeometry) && !errors.Is(err, ErrLayout) {
				t.Fatalf("error %v wraps neither ErrGeometry nor ErrLayout", err)
			}
			return
		}
		if !(sem <= decl && decl <= stride) {
			t.Fatalf("accepted semantic %d, declared %d, stride %d", sem, decl, stride)
		}
		if uint64(pg.Slots)*pg.SlotBytes != decl {
			t.Fatalf("%d slots x %d B != declared %d", pg.Slots, pg.SlotBytes, decl)
		}
		_, _ = pg.PageExtent(int64(bs) * 1000)
	})
}

func TestJSONUsesHex(t *testing.T) {
	type msg struct {
		NS    Namespace   `json:"ns"`
		Chunk []ChunkHash `json:"chunks"`
		Key   Key         `json:"key"`
	}
	in := msg{NS: Namespace{0xab}, Chunk: []ChunkHash{{1}, {2, 15: 0xff}}, Key: Key{Shard: 2}}
	b, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"ns":"ab000000000000000000000000000000"`) {
		t.Fatalf("namespace not hex in %s", b)
	}
	var out msg
	if err := json.Unmarshal(b, &out); err != nil || !reflect.DeepEqual(in, out) {
		t.Fatalf("JSON round trip: %+v %v", out, err)
	}
	if err := json.Unmarshal([]byte(`{"ns":"AB000000000000000000000000000000"}`), &out); !errors.Is(err, ErrKey) {
		t.Fatalf("uppercase namespace: err = %v", err)
	}
}
