package index_test

import (
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestBatchGrowth: what a batch would add to and remove from its rank's
// placements, against the published state, each slot counted once by
// what the batch leaves of it (issue 28.3's budget check reads it).
func TestBatchGrowth(t *testing.T) {
	ix := openTest(t, "", nil)
	r := wire.Rank{Instance: "g", TPRank: 0}
	mustApply(t, ix.Index, wire.Batch{Rank: r, Incarnation: 1, Events: []wire.Event{
		stored(1, wire.L1, key(1, 0, 0), 10, 1), stored(2, wire.L2, key(1, 0, 0), 10, 1), stored(3, wire.L1, key(2, 0, 0), 10, 1)}})
	other := wire.Rank{Instance: "g", TPRank: 1}
	mustApply(t, ix.Index, wire.Batch{Rank: other, Incarnation: 1, Events: []wire.Event{stored(1, wire.L1, key(3, 0, 0), 10, 1)}})
	for _, tc := range []struct {
		name           string
		rank           wire.Rank
		events         []wire.Event
		held           int64
		added, removed int
	}{
		{"new slots", r, []wire.Event{stored(4, wire.L1, key(3, 0, 0), 10, 1), stored(5, wire.L1, key(4, 0, 0), 10, 1)}, 3, 2, 0},
		{"held slot stored again", r, []wire.Event{stored(4, wire.L1, key(1, 0, 0), 10, 2)}, 3, 0, 0},
		{"same new slot twice", r, []wire.Event{stored(4, wire.L1, key(5, 0, 0), 10, 1), stored(5, wire.L1, key(5, 0, 0), 10, 2)}, 3, 1, 0},
		{"other tier of a held key", r, []wire.Event{stored(4, wire.L2, key(2, 0, 0), 10, 1)}, 3, 1, 0},
		{"other shard of a held chunk", r, []wire.Event{stored(4, wire.L1, key(1, 1, 0), 10, 1)}, 3, 1, 0},
		{"removals", r, []wire.Event{removed(4, wire.L1, key(1, 0, 0)), removed(5, wire.L1, key(9, 0, 0))}, 3, 0, 1},
		{"removed twice", r, []wire.Event{removed(4, wire.L1, key(1, 0, 0)), removed(5, wire.L1, key(1, 0, 0))}, 3, 0, 1},
		{"removed then stored", r, []wire.Event{removed(4, wire.L1, key(1, 0, 0)), stored(5, wire.L1, key(1, 0, 0), 10, 1)}, 3, 0, 0},
		{"stored then removed", r, []wire.Event{stored(4, wire.L1, key(6, 0, 0), 10, 1), removed(5, wire.L1, key(6, 0, 0))}, 3, 0, 0},
		{"another rank's slot", r, []wire.Event{stored(4, wire.L1, key(3, 0, 0), 10, 1)}, 3, 1, 0},
		{"unknown rank", wire.Rank{Instance: "new", TPRank: 0}, []wire.Event{stored(1, wire.L1, key(1, 0, 0), 10, 1)}, 0, 1, 0},
	} {
		held, added, rem := ix.BatchGrowth(&wire.Batch{Rank: tc.rank, Incarnation: 1, Events: tc.events})
		if held != tc.held || added != tc.added || rem != tc.removed {
			t.Errorf("%s: held %d added %d removed %d, want %d %d %d", tc.name, held, added, rem, tc.held, tc.added, tc.removed)
		}
	}
	if got := ix.MinObjectSize(); got != 0 {
		t.Fatalf("MinObjectSize with no namespace registered = %d, want 0", got)
	}
	res, err := ix.RegisterNamespace(ctx, benchGQA(2))
	if err != nil {
		t.Fatal(err)
	}
	want := res.ObjectSize(0)
	for gi := range res.Groups {
		want = min(want, res.ObjectSize(gi))
	}
	if got := ix.MinObjectSize(); got != want || got == 0 {
		t.Fatalf("MinObjectSize = %d, want %d", got, want)
	}
}
