package index

import (
	"bytes"
	"cmp"
	"fmt"
	"slices"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// The rules a batch or an inventory must follow before it is queued. Every
// entry point that writes placements (Apply, ApplyAsync, ApplyInventory,
// ApplyInventoryAt, ApplyReplicated) checks them, and so does a replicated
// coordinator before it proposes (ValidateBatch, ValidateInventory): the
// index owns the placements, so it owns the rules about them (STYLE 31);
// its callers keep admission policy (rates, budgets, membership).

// ValidateBatch checks a batch as Apply does (a replicated coordinator
// checks before it proposes, so the log holds no entry every replica
// refuses).
func ValidateBatch(b *wire.Batch) error { return validateBatch(b) }

// ValidateInventory checks an inventory as ApplyInventory does, sorting
// its objects in place as ApplyInventory does.
func ValidateInventory(inv *wire.Inventory) error { return validateInventory(inv) }

// validateBatch checks a batch before it is queued; nothing of an invalid
// batch is applied.
func validateBatch(b *wire.Batch) error { return checkBatch(b, true) }

// checkBatch is validateBatch; sums false lets a Stored event of sum 0
// through, which only ApplyLegacyBatchForTest asks for.
func checkBatch(b *wire.Batch, sums bool) error {
	if err := validateRank(b.Rank); err != nil {
		return fmt.Errorf("batch: %w", err)
	}
	for i := range b.Events {
		e := &b.Events[i]
		switch {
		case e.Seq == 0:
			return fmt.Errorf("batch from %s: event %d has sequence 0 (sequences start at 1): %w", b.Rank, i, ErrInvalid)
		case e.Kind != wire.Stored && e.Kind != wire.Removed:
			return fmt.Errorf("batch from %s: event %d (seq %d) has kind %d, want 1 (stored) or 2 (removed): %w",
				b.Rank, i, e.Seq, e.Kind, ErrInvalid)
		case !e.Tier.Valid():
			return fmt.Errorf("batch from %s: event %d (seq %d) has tier %d, want 1 (L1), 2 (L2) or 3 (L3): %w",
				b.Rank, i, e.Seq, e.Tier, ErrInvalid)
		case sums && e.Kind == wire.Stored && e.Sum == 0:
			// 0 is what an unset sum looks like, and a restore could
			// never check the bytes against it (issue 11.8).
			return fmt.Errorf("batch from %s incarnation %d: event %d (seq %d) stores %s in %s with sum 0: %w",
				b.Rank, b.Incarnation, i, e.Seq, e.Key, e.Tier, ErrZeroSum)
		}
	}
	return nil
}

// validateInventory checks an inventory before it is queued. It sorts
// inv.Objects in place (by key, then tier; cmpPlacement) and finds a slot
// listed twice as two neighbours: no memory on top of the inventory's own
// (issue 28.3: a set of the slots seen cost about 80 B an object, 1.3 GB
// for the 16 Mi objects an inventory could carry). The order of an
// inventory's objects means nothing to its apply; the rules checked per
// object are checked before the sort, so an error names the object by its
// place in the inventory as sent.
func validateInventory(inv *wire.Inventory) error {
	if err := validateRank(inv.Rank); err != nil {
		return fmt.Errorf("inventory: %w", err)
	}
	for i := range inv.Objects {
		ob := &inv.Objects[i]
		switch {
		case !ob.Tier.Valid():
			return fmt.Errorf("inventory of %s: object %d (%s) has tier %d, want 1 (L1), 2 (L2) or 3 (L3): %w",
				inv.Rank, i, ob.Key, ob.Tier, ErrInvalid)
		case ob.Sum == 0:
			// Every object of an inventory is stored (as validateBatch).
			return fmt.Errorf("inventory of %s incarnation %d: object %d (%s, %s) has sum 0: %w",
				inv.Rank, inv.Incarnation, i, ob.Key, ob.Tier, ErrZeroSum)
		}
	}
	objs := inv.Objects
	if !slices.IsSortedFunc(objs, cmpPlacement) {
		slices.SortFunc(objs, cmpPlacement)
	}
	for i := 1; i < len(objs); i++ {
		if cmpPlacement(objs[i-1], objs[i]) == 0 {
			ob := &objs[i]
			return fmt.Errorf("inventory of %s: object %s in %s is listed twice: %w", inv.Rank, ob.Key, ob.Tier, ErrInvalid)
		}
	}
	return nil
}

// cmpPlacement orders inventory objects by key (namespace, chunk, shard,
// group), then tier, without allocating.
func cmpPlacement(a, b wire.Placement) int {
	if c := bytes.Compare(a.Key.NS[:], b.Key.NS[:]); c != 0 {
		return c
	}
	if c := bytes.Compare(a.Key.Chunk[:], b.Key.Chunk[:]); c != 0 {
		return c
	}
	if c := cmp.Compare(a.Key.Shard, b.Key.Shard); c != 0 {
		return c
	}
	if c := cmp.Compare(a.Key.Group, b.Key.Group); c != 0 {
		return c
	}
	return cmp.Compare(a.Tier, b.Tier)
}

func validateRank(r wire.Rank) error {
	switch {
	case r.Instance == "":
		return fmt.Errorf("rank has an empty instance name: %w", ErrInvalid)
	case len(r.Instance) > 255:
		return fmt.Errorf("rank instance name is %d B, limit 255 B: %w", len(r.Instance), ErrInvalid)
	case r.TPRank < 0 || r.TPRank > dcp.MaxTP:
		return fmt.Errorf("rank %s: TP rank %d not in 0..%d: %w", r, r.TPRank, dcp.MaxTP, ErrInvalid)
	}
	return nil
}
