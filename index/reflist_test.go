package index

import (
	"slices"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

// TestRefList: segments cover exactly the range asked for across block
// boundaries (a first block of any size, then refBlock-sized ones), and a
// view keeps its entries while the list it was taken from grows.
func TestRefList(t *testing.T) {
	ref := func(i int) chunkRef { return chunkRef{chunk: dcp.ChunkHash{byte(i), byte(i >> 8), byte(i >> 16)}} }
	first := make([]chunkRef, 0, 10)
	for i := range 7 {
		first = append(first, ref(i))
	}
	l := fromRefs(first)
	var want []chunkRef
	want = append(want, first...)
	for i := 7; i < 2*refBlock+100; i++ {
		l.add(ref(i))
		want = append(want, ref(i))
	}
	if l.len() != len(want) || len(l.blocks) != 4 {
		t.Fatalf("len %d in %d blocks, want %d in 4 (7+3 spare, two full, one partial)", l.len(), len(l.blocks), len(want))
	}
	if !slices.Equal(l.flat(), want) {
		t.Fatal("flat differs from the entries appended")
	}
	for _, r := range [][2]int{{0, 0}, {0, 10}, {5, 12}, {9, 10 + refBlock}, {10 + refBlock - 1, 10 + refBlock + 1}, {0, len(want)}, {len(want) - 1, len(want)}} {
		var got []chunkRef
		for _, seg := range l.segments(r[0], r[1]) {
			got = append(got, seg...)
		}
		if !slices.Equal(got, want[r[0]:r[1]]) {
			t.Fatalf("segments(%d, %d): %d entries, want %d", r[0], r[1], len(got), r[1]-r[0])
		}
	}
	v := l.view()
	for i := range refBlock {
		l.add(ref(1<<20 + i))
	}
	if v.len() != len(want) || !slices.Equal(v.flat(), want) {
		t.Fatal("the view changed as the list grew")
	}
	n := 0
	for range v.all {
		n++
	}
	if n != len(want) {
		t.Fatalf("all yields %d entries, want %d", n, len(want))
	}
}
