package wire

import (
	"errors"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

func sampleBatch() *Batch {
	return &Batch{
		Rank: Rank{Instance: "engine-a", TPRank: 3}, Incarnation: 42,
		Events: []Event{
			{Seq: 1, Kind: Stored, Tier: L1, Key: dcp.Key{NS: dcp.Namespace{1}, Chunk: dcp.ChunkHash{2}, Shard: 3, Group: 1}, Size: 561, Sum: 0xdeadbeef},
			{Seq: 2, Kind: Removed, Tier: L2, Key: dcp.Key{NS: dcp.Namespace{9}}, Size: 1 << 40, Sum: 1},
		},
	}
}

func TestBatchRoundTrip(t *testing.T) {
	b := sampleBatch()
	p, err := b.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var got Batch
	if err := got.UnmarshalBinary(p); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(&got, b) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, *b)
	}
}

func TestBatchRejectsMalformed(t *testing.T) {
	p, _ := sampleBatch().MarshalBinary()
	for name, q := range map[string][]byte{
		"empty":      nil,
		"magic":      append([]byte("XXXX"), p[4:]...),
		"truncated":  p[:len(p)-1],
		"extra":      append(append([]byte(nil), p...), 0),
		"bad kind":   func() []byte { q := append([]byte(nil), p...); q[5+8+16+8] = 7; return q }(),
		"bad tier":   func() []byte { q := append([]byte(nil), p...); q[5+8+16+9] = 0; return q }(),
		"bad keyver": func() []byte { q := append([]byte(nil), p...); q[5+8+16+10] = 2; return q }(),
	} {
		var b Batch
		if err := b.UnmarshalBinary(q); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", name, err)
		}
	}
}

func TestRankString(t *testing.T) {
	r := Rank{Instance: "a/b", TPRank: 7}
	got, err := ParseRank(r.String())
	if err != nil || got != r {
		t.Fatalf("ParseRank(%q) = %+v, %v", r.String(), got, err)
	}
	for _, bad := range []string{"", "x", "/1", "x/", "x/-1", "x/99999"} {
		if _, err := ParseRank(bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("ParseRank(%q) err = %v", bad, err)
		}
	}
}

func FuzzBatchUnmarshal(f *testing.F) {
	p, _ := sampleBatch().MarshalBinary()
	f.Add(p)
	f.Add([]byte("KVB1"))
	f.Fuzz(func(t *testing.T, p []byte) {
		var b Batch
		if err := b.UnmarshalBinary(p); err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		q, err := b.MarshalBinary()
		if err != nil || string(q) != string(p) {
			t.Fatalf("decoded batch does not re-encode to its input")
		}
	})
}

// PageInventory and AssembleInventory are inverses for every size, and
// assembly refuses pages of mixed snapshots, gaps and wrong counts.
func TestInventoryPagesRoundTrip(t *testing.T) {
	for _, n := range []int{0, 1, 4, 5, 9, 100} {
		for _, size := range []int{1, 2, 5, 4096} {
			inv := Inventory{Rank: Rank{Instance: "e", TPRank: 1}, Incarnation: 3, Seq: 77}
			for i := range n {
				inv.Objects = append(inv.Objects, Placement{Tier: L1, Size: uint64(i), Sum: uint64(i) * 7})
			}
			pages := PageInventory(&inv, "s", size)
			if want := max(1, (n+size-1)/size); len(pages) != want {
				t.Fatalf("%d objects in pages of %d: %d pages, want %d", n, size, len(pages), want)
			}
			got, err := AssembleInventory(pages)
			if err != nil || got.Rank != inv.Rank || got.Seq != inv.Seq || got.Incarnation != inv.Incarnation ||
				len(got.Objects) != n || (n > 0 && !reflect.DeepEqual(got.Objects, inv.Objects)) {
				t.Fatalf("%d objects in pages of %d: reassembled %+v, %v", n, size, got, err)
			}
		}
	}
	inv := Inventory{Seq: 1, Objects: make([]Placement, 6)}
	for name, mutate := range map[string]func(p []InventoryPage) []InventoryPage{
		"none":         func(p []InventoryPage) []InventoryPage { return nil },
		"missing page": func(p []InventoryPage) []InventoryPage { return p[:2] },
		"reordered":    func(p []InventoryPage) []InventoryPage { p[1], p[2] = p[2], p[1]; return p },
		"other seq":    func(p []InventoryPage) []InventoryPage { p[2].Seq++; return p },
		"other id":     func(p []InventoryPage) []InventoryPage { p[1].Snapshot = "t"; return p },
		"other count":  func(p []InventoryPage) []InventoryPage { p[1].Pages = 4; return p },
	} {
		if _, err := AssembleInventory(mutate(PageInventory(&inv, "s", 2))); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
}
