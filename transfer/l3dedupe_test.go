package transfer

import (
	"bytes"
	"context"
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/transfer/tier"
	"github.com/kvtier/kvtier/wire"
)

// flakyStore refuses every Put while fail is set: a bucket that was down
// when an object was first stored.
type flakyStore struct {
	ObjectStore
	fail atomic.Bool
}

func (s *flakyStore) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	if s.fail.Load() {
		return errors.New("503 service unavailable")
	}
	return s.ObjectStore.Put(ctx, name, r, size)
}

// l3Holds reads key's object from the bucket through the L3 tier
// (verified) and compares its payload with want.
func l3Holds(t *testing.T, st ObjectStore, r *rig, key dcp.Key, want []byte) error {
	t.Helper()
	got := make([]byte, len(want))
	if _, err := NewL3Tier(st, "test", nil).Get(testCtx(t), key, r.res.Fingerprint, got); err != nil {
		return err
	}
	if !bytes.Equal(got, want) {
		return errors.New("payload differs")
	}
	return nil
}

// TestL3DedupedStoreQueuesWhatL3Lacks (issue 15, tiers4.2): a store that
// finds its object already held — in L1, or only in this rank's L2 after a
// restart — writes it behind to L3 when this rank's L3 copy is missing (a
// bucket that was down at the first store); an object L3 already holds is
// not written again. Seen failing before the fix: both deduplicated stores
// left L3 without the object (0 written).
func TestL3DedupedStoreQueuesWhatL3Lacks(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{24})
	l3, _ := openL3(t)
	flaky := &flakyStore{ObjectStore: l3}
	flaky.fail.Store(true)
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.L3, cfg.L3Writers = root, flaky, 1
	a, b := r.newChunk(0, r.consecutiveN(0)), r.newChunk(1, r.consecutiveN(1))

	// The bucket is down: b's write behind fails; b is in L1 and L2.
	e1 := newEngine(t, cfg)
	r.register(e1)
	storeAll(t, e1, r, "b", b)
	if err := e1.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if st := e1.L3Stats(); st.Failed != 1 || st.Written != 0 {
		t.Fatalf("with the bucket down: %+v, want 1 failed write", st)
	}
	closeEngine(t, e1)

	// Restarted with the bucket up: b is in L2 only; a is stored while the
	// bucket is down again, so it is in L1 (and L2) but not L3.
	c2 := cfg
	c2.Registerer, c2.KeepEvents = newRegistry(), true
	e2 := newEngine(t, c2)
	recordEvents(t, e2)
	r.register(e2)
	storeAll(t, e2, r, "a", a)
	if err := e2.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	flaky.fail.Store(false)
	if st := e2.L3Stats(); st.Failed != 1 || st.Written != 0 {
		t.Fatalf("after a's store with the bucket down: %+v, want 1 failed write", st)
	}

	// Both stores again, both deduplicated: each queues its object to L3.
	for i, c := range []chunk{a, b} {
		res := storeAll(t, e2, r, "again", c)
		if res.Objects[0].Status != Deduped {
			t.Fatalf("second store of chunk %d: %v, want deduped", i, res.Objects[0].Status)
		}
	}
	if err := e2.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	st := e2.L3Stats()
	if st.Written != 2 || st.Objects != 2 || tierCount(e2.Inventory(), wire.L3) != 2 {
		t.Fatalf("after the deduplicated stores: %+v, L3 placements %d; want 2 written", st, tierCount(e2.Inventory(), wire.L3))
	}
	for i, c := range []chunk{a, b} {
		if err := l3Holds(t, l3, r, keyOf(r, c, 0), c.packed[0]); err != nil {
			t.Fatalf("chunk %d in the bucket: %v", i, err)
		}
	}
	// L3 holds them now: a third store writes nothing.
	storeAll(t, e2, r, "third", a, b)
	if err := e2.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if st := e2.L3Stats(); st.Written != 2 {
		t.Fatalf("after a store of objects L3 holds: %+v, want still 2 written", st)
	}
}

// gatedDeletes holds the first Delete of one object name until released,
// saying when it started and when the bucket's delete returned.
type gatedDeletes struct {
	ObjectStore
	name             string
	started, deleted chan struct{}
	release          chan struct{}
	once             atomic.Bool
}

func (s *gatedDeletes) Delete(ctx context.Context, name string) error {
	if name != s.name || !s.once.CompareAndSwap(false, true) {
		return s.ObjectStore.Delete(ctx, name)
	}
	close(s.started)
	select {
	case <-s.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	err := s.ObjectStore.Delete(ctx, name)
	close(s.deleted)
	return err
}

// TestL3EvictionDeleteNeverRemovesARewrite (issue 15, tiers4.2): an L3
// eviction's delete still in flight while the same object is stored and
// written again must not remove the new copy: the rewrite waits for the
// delete (counted as deferred), and afterwards every L3 placement the
// inventory announces is in the bucket, byte-exact. Seen failing before
// the fix: the second writer wrote A while A's delete was held, the delete
// then removed it, and the inventory announced an L3 copy of A the bucket
// lacked (the next read missed).
func TestL3EvictionDeleteNeverRemovesARewrite(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{24})
	l3, _ := openL3(t)
	a, b, c := r.newChunk(0, r.consecutiveN(0)), r.newChunk(1, r.consecutiveN(1)), r.newChunk(2, r.consecutiveN(2))
	gate := &gatedDeletes{ObjectStore: l3, name: NewL3Tier(l3, "test", nil).Name(keyOf(r, a, 0)),
		started: make(chan struct{}), deleted: make(chan struct{}), release: make(chan struct{})}
	cfg := engineConfig(t, dev, 0, 1)
	obj := tier.HeaderBytes(cfg.Rank.Instance) + uint64(len(a.packed[0]))
	cfg.L2Dir, cfg.L3, cfg.L3Writers, cfg.L3Bytes = t.TempDir(), gate, 2, 2*obj // two objects fit
	e := newEngine(t, cfg)
	t.Cleanup(func() {
		select {
		case <-gate.release:
		default:
			close(gate.release)
		}
	})
	r.register(e)
	for _, ch := range []chunk{a, b} {
		storeAll(t, e, r, "s", ch)
		if err := e.FlushL3(testCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	// c's write evicts a (least recently written); a's delete is held.
	storeAll(t, e, r, "c", c)
	select {
	case <-gate.started:
	case <-testCtx(t).Done():
		t.Fatalf("a was not evicted: %+v", e.L3Stats())
	}
	// a is stored again (deduplicated in L1, L3 lacks it): queued while
	// its delete is in flight. Wait until the other writer took it.
	if res := storeAll(t, e, r, "a-again", a); res.Objects[0].Status != Deduped {
		t.Fatalf("a stored again: %v, want deduped", res.Objects[0].Status)
	}
	for {
		st := e.L3Stats()
		if st.Written >= 4 || st.Deferred >= 1 {
			break
		}
		select {
		case <-testCtx(t).Done():
			t.Fatalf("the rewrite of a was neither written nor deferred: %+v", st)
		case <-time.After(2 * time.Millisecond):
		}
	}
	close(gate.release)
	<-gate.deleted
	if err := e.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	// a rewritten after c: b is the one evicted. The inventory and the
	// bucket agree, byte for byte.
	inv := map[dcp.Key]bool{}
	for _, p := range e.Inventory().Objects {
		if p.Tier == wire.L3 {
			inv[p.Key] = true
		}
	}
	for i, ch := range []chunk{a, b, c} {
		k := keyOf(r, ch, 0)
		err := l3Holds(t, l3, r, k, ch.packed[0])
		switch {
		case inv[k] && err != nil:
			t.Fatalf("chunk %d: the inventory announces an L3 copy, the bucket says %v", i, err)
		case !inv[k] && !errors.Is(err, ErrNotFound):
			t.Fatalf("chunk %d: no L3 placement, but the bucket read gave %v (want not found)", i, err)
		}
	}
	if st := e.L3Stats(); !inv[keyOf(r, a, 0)] || !inv[keyOf(r, c, 0)] || inv[keyOf(r, b, 0)] || st.Objects != 2 || st.Written != 4 {
		t.Fatalf("L3 placements %v, stats %+v: want a and c, 4 writes", inv, st)
	}
}

// vanishOnOpen deletes one object right after opening it, while armed:
// another rank deleting it (as corrupt) between this rank's open (a HEAD)
// and its read (the GET).
type vanishOnOpen struct {
	ObjectStore
	name  string
	armed atomic.Bool
}

func (s *vanishOnOpen) Open(ctx context.Context, name string, off, n int64) (io.ReadCloser, int64, error) {
	body, size, err := s.ObjectStore.Open(ctx, name, off, n)
	if err == nil && name == s.name && s.armed.CompareAndSwap(true, false) {
		if derr := s.ObjectStore.Delete(ctx, name); derr != nil {
			body.Close()
			return nil, 0, derr
		}
	}
	return body, size, err
}

// TestL3ObjectDeletedDuringReadIsGone (tiers4.2): an L3 object this rank
// wrote is deleted by someone else between the retrieve's open and its
// read. The chunk fails, and the rank drops its L3 copy and announces the
// removal. That copy is gone, not an I/O error, so the next store writes
// the object again. Seen failing before: the read failed as io, the rank
// kept listing the L3 copy, and the next store wrote nothing (the e2e
// TestL3RestoreAfterL1L2Wiped failed this way when another rank deleted
// the corrupted object first).
func TestL3ObjectDeletedDuringReadIsGone(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{24})
	l3, _ := openL3(t)
	c := r.newChunk(0, r.consecutiveN(0))
	vs := &vanishOnOpen{ObjectStore: l3, name: NewL3Tier(l3, "test", nil).Name(keyOf(r, c, 0))}
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.L3, cfg.L3Writers = root, vs, 1
	e1 := newEngine(t, cfg)
	r.register(e1)
	storeAll(t, e1, r, "s", c)
	if err := e1.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	closeEngine(t, e1)
	wipe(t, root)
	c2 := cfg
	c2.Registerer, c2.KeepEvents = newRegistry(), true
	e2 := newEngine(t, c2)
	recordEvents(t, e2)
	if err := e2.WaitL3Scan(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	r.register(e2)
	if st := e2.L3Stats(); st.Objects != 1 {
		t.Fatalf("after the restart: %+v, want the L3 copy found", st)
	}
	vs.armed.Store(true)
	rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{r.consecutiveN(2)}))
	if err != nil {
		t.Fatal(err)
	}
	if rr.ChunkOK(0) || rr.Items[0].Reason == ReasonIO {
		t.Fatalf("read of an object deleted after its open: %+v, want failed as gone, not io", rr.Items[0])
	}
	r.check("after the vanished read: nothing written")
	if st := e2.L3Stats(); st.Objects != 0 || tierCount(e2.Inventory(), wire.L3) != 0 {
		t.Fatalf("after the vanished read: %+v, L3 placements %d; want the copy dropped", st, tierCount(e2.Inventory(), wire.L3))
	}
	storeAll(t, e2, r, "again", c)
	if err := e2.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if st := e2.L3Stats(); st.Written != 1 || st.Objects != 1 {
		t.Fatalf("after the next store: %+v, want the object written again", st)
	}
	if err := l3Holds(t, l3, r, keyOf(r, c, 0), c.packed[0]); err != nil {
		t.Fatalf("the bucket after the healing store: %v", err)
	}
}
