package index_test

import (
	"context"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	bolt "go.etcd.io/bbolt"
)

// TestApplyRules walks one rank through every C7 rule and checks each
// outcome, the index contents, the counters and Verify after every step.
func TestApplyRules(t *testing.T) {
	ix := openTest(t, "", nil)
	r := wire.Rank{Instance: "eng-a", TPRank: 0}
	k1, k2, k3 := key(1, 0, 0), key(2, 0, 0), key(3, 0, 0)
	batch := func(inc uint64, evs ...wire.Event) wire.Batch {
		return wire.Batch{Rank: r, Incarnation: inc, Events: evs}
	}
	count := func(reason string) float64 {
		return testutil.Metric(t, ix.reg, "kvtier_index_dropped_total", "reason", reason)
	}

	// In order: applied.
	o := mustApply(t, ix.Index, batch(7, stored(1, wire.L1, k1, 100, 11), stored(2, wire.L2, k1, 100, 11),
		stored(3, wire.L1, k2, 200, 22)))
	if o.Applied != 3 || o.LastSeq != 3 || o.Incarnation != 7 || o.Resync {
		t.Fatalf("first batch: %+v", o)
	}
	mustVerify(t, ix.Index)

	// The same batch again: all duplicates, nothing changes.
	o = mustApply(t, ix.Index, batch(7, stored(1, wire.L1, k1, 100, 11), stored(2, wire.L2, k1, 100, 11),
		stored(3, wire.L1, k2, 200, 22)))
	if o.Applied != 0 || o.Duplicates != 3 || o.LastSeq != 3 {
		t.Fatalf("duplicate batch: %+v", o)
	}
	if got := count("duplicate"); got != 3 {
		t.Fatalf("duplicate counter %v, want 3", got)
	}

	// Overlapping: 2,3 duplicates, 4,5 applied (5 removes k2 from L1).
	o = mustApply(t, ix.Index, batch(7, stored(2, wire.L2, k1, 100, 11), stored(3, wire.L1, k2, 200, 22),
		stored(4, wire.L2, k2, 200, 22), removed(5, wire.L1, k2)))
	if o.Applied != 2 || o.Duplicates != 2 || o.LastSeq != 5 {
		t.Fatalf("overlapping batch: %+v", o)
	}
	if h := ix.Get(k2); len(h) != 1 || h[0].Tier != wire.L2 || h[0].Seq != 4 {
		t.Fatalf("k2 holders %+v, want one L2 copy at seq 4", h)
	}

	// A gap: 8 and 9 come before 6 and 7. Nothing after the gap applies.
	o = mustApply(t, ix.Index, batch(7, stored(8, wire.L1, k3, 300, 33), stored(9, wire.L2, k3, 300, 33)))
	if o.Applied != 0 || o.Dropped != 2 || o.Reason != index.DropGap || !o.Resync || o.ResyncFrom != 6 || o.LastSeq != 5 {
		t.Fatalf("gap batch: %+v", o)
	}
	if ack := o.Ack(); !ack.Resync || ack.AppliedThrough != 5 || ack.Fenced {
		t.Fatalf("gap ack %+v", ack)
	}
	if h := ix.Get(k3); len(h) != 0 {
		t.Fatalf("k3 applied past a gap: %+v", h)
	}
	if count("gap") != 2 || testutil.Metric(t, ix.reg, "kvtier_index_resyncs_requested_total", "reason", "gap") != 1 {
		t.Fatal("gap not counted")
	}
	mustVerify(t, ix.Index)

	// A gap inside a batch: 6 applies, 8 does not.
	o = mustApply(t, ix.Index, batch(7, stored(6, wire.L1, k3, 300, 33), stored(8, wire.L2, k3, 300, 33)))
	if o.Applied != 1 || o.Dropped != 1 || o.ResyncFrom != 7 || o.LastSeq != 6 {
		t.Fatalf("gap inside batch: %+v", o)
	}
	// The late batch fills the gap.
	o = mustApply(t, ix.Index, batch(7, stored(7, wire.L2, k3, 300, 33), stored(8, wire.L2, k2, 201, 23)))
	if o.Applied != 2 || o.LastSeq != 8 || o.Resync {
		t.Fatalf("filling batch: %+v", o)
	}

	// An older incarnation: dropped whole.
	o = mustApply(t, ix.Index, batch(6, stored(9, wire.L1, k3, 1, 1)))
	if o.Dropped != 1 || o.Reason != index.DropStaleIncarnation || o.Incarnation != 7 || !o.Ack().Fenced {
		t.Fatalf("stale incarnation: %+v", o)
	}
	if count("stale_incarnation") != 1 {
		t.Fatal("stale incarnation not counted")
	}
	mustVerify(t, ix.Index)

	// A new incarnation: L1 of incarnation 7 (k1, k3) fenced, L2 stays.
	before, _ := ix.ListRank(r)
	if before.L1Placements != 2 || before.L2Placements != 3 {
		t.Fatalf("before restart: %+v", before)
	}
	o = mustApply(t, ix.Index, batch(8, stored(1, wire.L1, k2, 202, 24)))
	if !o.NewIncarnation || o.Fenced != 2 || o.Applied != 1 || o.LastSeq != 1 || o.Incarnation != 8 {
		t.Fatalf("new incarnation: %+v", o)
	}
	after, _ := ix.ListRank(r)
	if after.L1Placements != 1 || after.L2Placements != 3 || after.Incarnation != 8 {
		t.Fatalf("after restart: %+v", after)
	}
	for _, h := range ix.Get(k1) {
		if h.Tier == wire.L1 {
			t.Fatalf("fenced L1 copy of k1 still listed: %+v", h)
		}
	}
	if testutil.Metric(t, ix.reg, "kvtier_index_fenced_placements_total", "cause", "new_incarnation") != 2 {
		t.Fatal("fenced placements not counted")
	}
	mustVerify(t, ix.Index)

	// The old incarnation's late batch after the restart: stale.
	o = mustApply(t, ix.Index, batch(7, stored(9, wire.L1, k3, 1, 1)))
	if o.Reason != index.DropStaleIncarnation {
		t.Fatalf("late old-incarnation batch: %+v", o)
	}

	// A newer incarnation that does not start at 1: fenced, then a gap.
	o = mustApply(t, ix.Index, batch(9, stored(3, wire.L1, k3, 1, 1)))
	if !o.NewIncarnation || o.Fenced != 1 || o.Reason != index.DropGap || o.ResyncFrom != 1 || o.LastSeq != 0 {
		t.Fatalf("new incarnation past a gap: %+v", o)
	}
	mustVerify(t, ix.Index)

	// Resync with an inventory: it replaces everything.
	inv := wire.Inventory{Rank: r, Incarnation: 9, Seq: 3, Objects: []wire.Placement{
		{Key: k1, Tier: wire.L2, Size: 100, Sum: 11},
		{Key: k3, Tier: wire.L1, Size: 1, Sum: 1},
	}}
	io := mustInventory(t, ix.Index, inv)
	if !io.Applied || io.Replaced != 3 || io.Placements != 2 || io.LastSeq != 3 {
		t.Fatalf("inventory: %+v", io)
	}
	info, _ := ix.ListRank(r)
	index.SortPlacements(inv.Objects)
	if len(info.Placements) != 2 || info.Placements[0] != inv.Objects[0] || info.Placements[1] != inv.Objects[1] {
		t.Fatalf("after inventory: %+v", info.Placements)
	}
	mustVerify(t, ix.Index)

	// Events continue after the inventory.
	o = mustApply(t, ix.Index, batch(9, stored(3, wire.L2, k3, 1, 1), stored(4, wire.L2, k3, 1, 1)))
	if o.Duplicates != 1 || o.Applied != 1 || o.LastSeq != 4 {
		t.Fatalf("after inventory: %+v", o)
	}

	// A stale inventory (same incarnation, behind the last event): dropped.
	io = mustInventory(t, ix.Index, wire.Inventory{Rank: r, Incarnation: 9, Seq: 2})
	if io.Applied || io.Reason != index.DropStaleInventory {
		t.Fatalf("stale inventory: %+v", io)
	}
	io = mustInventory(t, ix.Index, wire.Inventory{Rank: r, Incarnation: 8, Seq: 99})
	if io.Applied || io.Reason != index.DropStaleIncarnation {
		t.Fatalf("old-incarnation inventory: %+v", io)
	}
	if count("stale_inventory") != 1 || count("stale_incarnation") != 3 {
		t.Fatalf("stale inventory counters: %v %v", count("stale_inventory"), count("stale_incarnation"))
	}

	// Memberlist declares the rank dead: L1 fenced at once, L2 stays.
	n, err := ix.FenceRank(ctx, r, math.MaxUint64)
	if err != nil || n != 1 {
		t.Fatalf("fence: %d, %v", n, err)
	}
	info, _ = ix.ListRank(r)
	if !info.Fenced || info.L1Placements != 0 || info.L2Placements != 2 {
		t.Fatalf("after fence: %+v", info)
	}
	if testutil.Metric(t, ix.reg, "kvtier_index_fenced_placements_total", "cause", "rank_dead") != 1 {
		t.Fatal("dead fence not counted")
	}
	mustVerify(t, ix.Index)
	// Its batches are refused until it resyncs.
	o = mustApply(t, ix.Index, batch(9, stored(5, wire.L1, k2, 5, 5)))
	if o.Reason != index.DropFencedRank || !o.Resync || o.ResyncFrom != 5 || o.Applied != 0 {
		t.Fatalf("fenced rank batch: %+v", o)
	}
	mustInventory(t, ix.Index, wire.Inventory{Rank: r, Incarnation: 9, Seq: 4, Objects: []wire.Placement{
		{Key: k2, Tier: wire.L1, Size: 5, Sum: 5}}})
	o = mustApply(t, ix.Index, batch(9, stored(5, wire.L1, k2, 5, 5)))
	if o.Applied != 1 || o.LastSeq != 5 {
		t.Fatalf("after fence and resync: %+v", o)
	}
	// Fencing an unknown rank is not an error.
	if n, err := ix.FenceRank(ctx, wire.Rank{Instance: "nobody", TPRank: 3}, math.MaxUint64); err != nil || n != 0 {
		t.Fatalf("fence unknown: %d %v", n, err)
	}
	// A late death notice of the older incarnation 8 never fences incarnation 9.
	if n, err := ix.FenceRank(ctx, r, 8); err != nil || n != 0 {
		t.Fatalf("fence of superseded incarnation 8: %d %v, want 0", n, err)
	}
	if info, _ = ix.ListRank(r); info.Fenced || info.L1Placements != 1 {
		t.Fatalf("after a superseded incarnation's fence: %+v", info)
	}
	// Rank is ListRank without the placements, in constant time.
	quick, ok := ix.Rank(r)
	info.Placements = nil
	if !ok || !reflect.DeepEqual(quick, info) {
		t.Fatalf("Rank = %+v, %v; ListRank without placements = %+v", quick, ok, info)
	}
	if _, ok := ix.Rank(wire.Rank{Instance: "nobody", TPRank: 3}); ok {
		t.Fatal("Rank reports an unknown rank as known")
	}
	// A removal of something not held is applied (sequence advances) and counted.
	o = mustApply(t, ix.Index, batch(9, removed(6, wire.L2, k2)))
	if o.Applied != 1 || o.RemovedUnknown != 1 {
		t.Fatalf("unknown removal: %+v", o)
	}
	mustVerify(t, ix.Index)

	// Everything survives a reopen exactly.
	want := ix.Ranks()
	wantStats := ix.Stats()
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	ix2 := openTest(t, dirOf(ix.path), nil)
	if got := ix2.Ranks(); !reflect.DeepEqual(got, want) {
		t.Fatalf("after reopen ranks %+v, want %+v", got, want)
	}
	if got := ix2.Stats(); got != wantStats {
		t.Fatalf("after reopen stats %+v, want %+v", got, wantStats)
	}
	mustVerify(t, ix2.Index)
}

// TestInvalidInput: bad input gets a clear error and changes nothing.
func TestInvalidInput(t *testing.T) {
	ix := openTest(t, "", nil)
	r := wire.Rank{Instance: "eng", TPRank: 1}
	mustApply(t, ix.Index, wire.Batch{Rank: r, Incarnation: 1, Events: []wire.Event{stored(1, wire.L1, key(1, 0, 0), 1, 1)}})
	before := ix.Stats()
	bad := []wire.Batch{
		{Rank: wire.Rank{}, Incarnation: 1, Events: []wire.Event{stored(2, wire.L1, key(2, 0, 0), 1, 1)}},
		{Rank: wire.Rank{Instance: "x", TPRank: -1}, Incarnation: 1},
		{Rank: r, Incarnation: 1, Events: []wire.Event{stored(2, wire.L1, key(2, 0, 0), 1, 1), stored(3, 9, key(3, 0, 0), 1, 1)}},
		{Rank: r, Incarnation: 1, Events: []wire.Event{{Seq: 2, Kind: 7, Tier: wire.L1, Key: key(2, 0, 0)}}},
		{Rank: r, Incarnation: 1, Events: []wire.Event{stored(0, wire.L1, key(2, 0, 0), 1, 1)}},
	}
	for i, b := range bad {
		if _, err := ix.Apply(ctx, b); !errors.Is(err, index.ErrInvalid) {
			t.Fatalf("bad batch %d: err %v, want ErrInvalid", i, err)
		}
	}
	badInv := []wire.Inventory{
		{Rank: r, Incarnation: 1, Seq: 5, Objects: []wire.Placement{{Key: key(1, 0, 0), Tier: wire.L1, Sum: 1}, {Key: key(1, 0, 0), Tier: wire.L1, Sum: 1}}},
		{Rank: r, Incarnation: 1, Seq: 5, Objects: []wire.Placement{{Key: key(1, 0, 0), Tier: 4, Sum: 1}}},
	}
	for i, inv := range badInv {
		if _, err := ix.ApplyInventory(ctx, inv); !errors.Is(err, index.ErrInvalid) {
			t.Fatalf("bad inventory %d: err %v, want ErrInvalid", i, err)
		}
	}
	if after := ix.Stats(); after != before {
		t.Fatalf("bad input changed the index: %+v -> %+v", before, after)
	}
	if info, _ := ix.ListRank(r); info.LastSeq != 1 {
		t.Fatalf("bad input moved the sequence: %+v", info)
	}
	mustVerify(t, ix.Index)
}

// TestCloseAndContext: Close is idempotent and stops the committer; calls
// after it fail with ErrClosed; a cancelled context applies nothing.
func TestCloseAndContext(t *testing.T) {
	ix := openTest(t, "", nil)
	r := wire.Rank{Instance: "eng", TPRank: 0}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := ix.Apply(cctx, wire.Batch{Rank: r, Incarnation: 1, Events: []wire.Event{stored(1, wire.L1, key(1, 0, 0), 1, 1)}}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled apply: %v", err)
	}
	if _, err := ix.ListRank(r); !errors.Is(err, index.ErrUnknownRank) {
		t.Fatalf("cancelled apply created the rank: %v", err)
	}
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ix.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if _, err := ix.Apply(ctx, wire.Batch{Rank: r, Incarnation: 1}); !errors.Is(err, index.ErrClosed) {
		t.Fatalf("apply after close: %v", err)
	}
	if _, err := ix.Verify(ctx); !errors.Is(err, index.ErrClosed) {
		t.Fatalf("verify after close: %v", err)
	}
}

// TestConfigValidate names the rule that failed.
func TestConfigValidate(t *testing.T) {
	cases := []func(*index.Config){
		func(c *index.Config) { c.Path = "" },
		func(c *index.Config) { c.MaxGroupEvents = 0 },
		func(c *index.Config) { c.MaxGroupDelay = -1 },
		func(c *index.Config) { c.QueueDepth = 0 },
		func(c *index.Config) { c.CheckpointBytes = 0 },
		func(c *index.Config) { c.Logger = nil },
		func(c *index.Config) { c.OpenTimeout = 0 },
		func(c *index.Config) { c.PublishFan = 0 },
		func(c *index.Config) { c.PublishFan = 65 },
	}
	for i, mod := range cases {
		c := index.DefaultConfig()
		c.Path = "x"
		mod(&c)
		if err := c.Validate(); !errors.Is(err, index.ErrConfig) {
			t.Fatalf("case %d: %v", i, err)
		}
		if _, err := index.Open(c); !errors.Is(err, index.ErrConfig) {
			t.Fatalf("open case %d: %v", i, err)
		}
	}
}

// TestCommitFailureIsSticky: when bbolt cannot commit (here: the file may
// not grow), the caller gets an error, nothing of the failed group is
// visible, later writes are refused, queries keep answering from the last
// committed state, and a reopen recovers exactly what was acknowledged.
func TestCommitFailureIsSticky(t *testing.T) {
	dir := t.TempDir()
	ix := openTest(t, dir, func(c *index.Config) { c.MaxFileBytes = 1 << 20 })
	s := indextest.NewRank(wire.Rank{Instance: "full", TPRank: 0}, 1, indextest.Keys(testNS, 2, 1<<14, 1, 1), 2)
	var acked uint64
	var failErr error
	for i := 0; i < 1000 && failErr == nil; i++ {
		b := s.Next(512)
		o, err := ix.Apply(ctx, b)
		if err != nil {
			failErr = err
			break
		}
		acked = o.LastSeq
	}
	if !errors.Is(failErr, index.ErrFailed) {
		t.Fatalf("filling a capped file: %v, want ErrFailed", failErr)
	}
	if _, err := ix.Apply(ctx, s.Next(1)); !errors.Is(err, index.ErrFailed) {
		t.Fatalf("write after failure: %v", err)
	}
	info, err := ix.ListRank(s.Rank)
	if err != nil || info.LastSeq != acked {
		t.Fatalf("after failure the index shows seq %d, acknowledged %d (%v)", info.LastSeq, acked, err)
	}
	mustVerify(t, ix.Index)
	if err := ix.Close(); err != nil {
		t.Logf("close after failure: %v", err)
	}
	ix2 := openTest(t, dir, nil)
	info2, err := ix2.ListRank(s.Rank)
	if err != nil || info2.LastSeq != acked || !reflect.DeepEqual(info2.Placements, info.Placements) {
		t.Fatalf("after reopen seq %d (%d placements), acknowledged %d (%d placements)",
			info2.LastSeq, len(info2.Placements), acked, len(info.Placements))
	}
	mustVerify(t, ix2.Index)
}

// TestCorruptStore: bytes that do not decode make Open fail with
// ErrCorrupt; a store that decodes but breaks an invariant opens, and
// Verify names the problem.
func TestCorruptStore(t *testing.T) {
	dir := t.TempDir()
	ix := openTest(t, dir, nil)
	r := wire.Rank{Instance: "t", TPRank: 0}
	mustApply(t, ix.Index, wire.Batch{Rank: r, Incarnation: 1, Events: []wire.Event{
		stored(1, wire.L1, key(1, 0, 0), 10, 1), stored(2, wire.L2, key(1, 0, 0), 10, 1)}})
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	tamper := func(bucket, k, v []byte) {
		t.Helper()
		db, err := bolt.Open(ix.path, 0o600, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Put(k, v) }); err != nil {
			t.Fatal(err)
		}
	}
	// The rank record says nothing past seq 0 was applied.
	tamper([]byte("ranks"), []byte{0, 0, 0, 1}, []byte{1, 1, 't', 0, 1, 0, 0})
	ix2 := openTest(t, dir, nil)
	rep, err := ix2.Verify(ctx)
	if !errors.Is(err, index.ErrInconsistent) || !strings.Contains(strings.Join(rep.Problems, "\n"), "last applied seq is 0") {
		t.Fatalf("verify of a broken invariant: %v %v", err, rep.Problems)
	}
	if err := ix2.Close(); err != nil {
		t.Fatal(err)
	}
	tamper([]byte("chunks"), []byte("not a key"), []byte{1})
	cfg := index.DefaultConfig()
	cfg.Path = ix.path
	if _, err := index.Open(cfg); !errors.Is(err, index.ErrCorrupt) {
		t.Fatalf("open of a corrupt store: %v", err)
	}
}
