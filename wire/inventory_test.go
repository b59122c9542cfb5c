package wire

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

func samplePage() *InventoryPage {
	ns1, ns2 := dcp.Namespace{1, 2, 3}, dcp.Namespace{0xaa}
	return &InventoryPage{Rank: Rank{Instance: "e", TPRank: 3}, Incarnation: 7, Seq: 9, Snapshot: "s1", Page: 1, Pages: 2,
		Objects: []Placement{
			{Key: dcp.Key{NS: ns1, Chunk: dcp.ChunkHash{0xc1}, Shard: 1, Group: 2}, Tier: L2, Size: 561, Sum: 0x0102030405060708},
			{Key: dcp.Key{NS: ns2, Chunk: dcp.ChunkHash{0xc2}, Shard: 0, Group: 0}, Tier: L1, Size: 1, Sum: 2},
			{Key: dcp.Key{NS: ns1, Chunk: dcp.ChunkHash{0xc3}, Shard: 7, Group: 0}, Tier: L3, Size: 3, Sum: 4},
		}}
}

// The encoding of a sample page, byte for byte, written out by hand from
// the format comment (not by the encoder).
func TestInventoryPageBinaryGolden(t *testing.T) {
	h := func(s string) []byte {
		b, err := hex.DecodeString(s)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	ns := func(b ...byte) []byte { return append(b, make([]byte, 16-len(b))...) }
	obj := func(idx uint32, chunk byte, shard, group uint16, tier byte, size, sum uint64) []byte {
		o := binary.BigEndian.AppendUint32(nil, idx)
		o = append(o, ns(chunk)...)
		o = binary.BigEndian.AppendUint16(o, shard)
		o = binary.BigEndian.AppendUint16(o, group)
		o = append(o, tier)
		o = binary.BigEndian.AppendUint64(o, size)
		return binary.BigEndian.AppendUint64(o, sum)
	}
	var want []byte
	want = append(want, "KVI1"...)
	want = append(want, h("01")...)
	want = append(want, 'e')
	want = append(want, h("00000003"+"0000000000000007"+"0000000000000009")...)
	want = append(want, h("02")...)
	want = append(want, "s1"...)
	want = append(want, h("00000001"+"00000002"+"00000002")...)
	want = append(want, ns(1, 2, 3)...)
	want = append(want, ns(0xaa)...)
	want = append(want, h("00000003")...)
	want = append(want, obj(0, 0xc1, 1, 2, 2, 561, 0x0102030405060708)...)
	want = append(want, obj(1, 0xc2, 0, 0, 1, 1, 2)...)
	want = append(want, obj(0, 0xc3, 7, 0, 3, 3, 4)...)
	got, err := samplePage().MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if hex.EncodeToString(got) != hex.EncodeToString(want) {
		t.Fatalf("encoding\n got %x\nwant %x", got, want)
	}
	var back InventoryPage
	if err := back.UnmarshalBinary(want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(&back, samplePage()) {
		t.Fatalf("decoded %+v\nwant %+v", back, *samplePage())
	}
	if len(got) != 4+1+1+4+8+8+1+2+12+2*16+4+3*invObjectSize || invObjectSize != 41 {
		t.Fatalf("page of %d B, object %d B", len(got), invObjectSize)
	}
}

// Random pages round-trip exactly, and an empty page too.
func TestInventoryPageBinaryRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, 2, 100, MaxInventoryPageSize} {
		p := &InventoryPage{Rank: Rank{Instance: "inst", TPRank: rng.IntN(dcp.MaxTP + 1)}, Incarnation: rng.Uint64(),
			Seq: rng.Uint64(), Snapshot: "0123456789abcdef0123456789abcdef", Page: 0, Pages: 1 + rng.IntN(100),
			Objects: make([]Placement, n)}
		nss := []dcp.Namespace{{1}, {2}, {3}}
		for i := range p.Objects {
			o := &p.Objects[i]
			o.Key.NS = nss[rng.IntN(len(nss))]
			for j := range o.Key.Chunk {
				o.Key.Chunk[j] = byte(rng.Uint32())
			}
			o.Key.Shard, o.Key.Group = uint16(rng.Uint32()), uint16(rng.Uint32())
			o.Tier, o.Size, o.Sum = Tier(1+rng.IntN(3)), rng.Uint64(), rng.Uint64()
		}
		b, err := p.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		if len(b) > MaxInventoryPageBytes {
			t.Fatalf("%d objects: %d B over MaxInventoryPageBytes %d", n, len(b), MaxInventoryPageBytes)
		}
		var q InventoryPage
		if err := q.UnmarshalBinary(b); err != nil {
			t.Fatalf("%d objects: %v", n, err)
		}
		if n == 0 {
			q.Objects = p.Objects
		}
		if !reflect.DeepEqual(p, &q) {
			t.Fatalf("%d objects: round trip differs", n)
		}
	}
}

// Every damaged encoding is refused with ErrMalformed: each truncation,
// a trailing byte, and each field out of its range.
func TestInventoryPageBinaryRefused(t *testing.T) {
	good, err := samplePage().MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	check := func(name string, b []byte) {
		t.Helper()
		var p InventoryPage
		if err := p.UnmarshalBinary(b); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", name, err)
		}
	}
	for n := range len(good) {
		check("truncated", good[:n])
	}
	check("trailing byte", append(append([]byte(nil), good...), 0))
	// Offsets in the sample: header 4+1+1+4+8+8+1+2 = 29, page 29, pages
	// 33, table size 37, table 41, count 73, objects 77.
	const page, pages, tableLen, table, count, objs = 29, 33, 37, 41, 73, 77
	mut := func(name string, f func(b []byte)) {
		b := append([]byte(nil), good...)
		f(b)
		check(name, b)
	}
	mut("bad magic", func(b []byte) { b[3] = '2' })
	mut("TP rank over MaxTP", func(b []byte) { binary.BigEndian.PutUint32(b[6:], dcp.MaxTP+1) })
	mut("page == pages", func(b []byte) { binary.BigEndian.PutUint32(b[page:], 2) })
	mut("zero pages", func(b []byte) { binary.BigEndian.PutUint32(b[page:], 0); binary.BigEndian.PutUint32(b[pages:], 0) })
	mut("table larger than the objects", func(b []byte) { binary.BigEndian.PutUint32(b[tableLen:], 4) })
	mut("duplicate namespace", func(b []byte) { copy(b[table+16:table+32], b[table:table+16]) })
	mut("count over the page limit", func(b []byte) { binary.BigEndian.PutUint32(b[count:], MaxInventoryPageSize+1) })
	mut("count short", func(b []byte) { binary.BigEndian.PutUint32(b[count:], 2) })
	mut("index outside the table", func(b []byte) { binary.BigEndian.PutUint32(b[objs+invObjectSize:], 2) })
	mut("index out of first-use order", func(b []byte) { binary.BigEndian.PutUint32(b[objs:], 1) })
	mut("tier 0", func(b []byte) { b[objs+24] = 0 })
	mut("tier 4", func(b []byte) { b[objs+2*invObjectSize+24] = 4 })
	// A table entry never used.
	p := samplePage()
	p.Objects[1].Key.NS = p.Objects[0].Key.NS
	b, _ := p.MarshalBinary()
	b = append(b[:table+16], append(make([]byte, 16), b[table+16:]...)...)
	binary.BigEndian.PutUint32(b[tableLen:], 2)
	b[table+16] = 0xee
	check("unused table entry", b)
	check("over MaxInventoryPageBytes", make([]byte, MaxInventoryPageBytes+1))

	// And the encoder refuses what it cannot encode.
	for name, f := range map[string]func(p *InventoryPage){
		"too many objects": func(p *InventoryPage) { p.Objects = make([]Placement, MaxInventoryPageSize+1) },
		"page >= pages":    func(p *InventoryPage) { p.Page = 2 },
		"long snapshot":    func(p *InventoryPage) { p.Snapshot = string(make([]byte, 256)) },
		"long instance":    func(p *InventoryPage) { p.Rank.Instance = string(make([]byte, 256)) },
	} {
		p := samplePage()
		f(p)
		if _, err := p.MarshalBinary(); !errors.Is(err, ErrMalformed) {
			t.Errorf("encode %s: err = %v", name, err)
		}
	}
}

func FuzzInventoryPageUnmarshal(f *testing.F) {
	b, _ := samplePage().MarshalBinary()
	f.Add(b)
	f.Add([]byte("KVI1"))
	empty, _ := (&InventoryPage{Pages: 1}).MarshalBinary()
	f.Add(empty)
	f.Fuzz(func(t *testing.T, b []byte) {
		var p InventoryPage
		if err := p.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		q, err := p.MarshalBinary()
		if err != nil || string(q) != string(b) {
			t.Fatalf("decoded page does not re-encode to its input (%v)", err)
		}
	})
}
