package transfer

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"slices"
	"sync"
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/objstore"
	"github.com/kvtier/kvtier/objstore/objstoretest"
	"github.com/kvtier/kvtier/wire"
)

// openL3 starts an in-process S3 server (gofakes3) and opens the real
// client (minio-go) on it.
func openL3(t testing.TB) (*objstore.Store, *objstoretest.Server) {
	t.Helper()
	srv := objstoretest.Start(t)
	st, err := objstore.Open(testCtx(t), srv.Config("kv/"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st, srv
}

// wipe removes every file of an L2 root (the directory stays).
func wipe(t *testing.T, root string) {
	t.Helper()
	ents, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range ents {
		if err := os.RemoveAll(root + "/" + d.Name()); err != nil {
			t.Fatal(err)
		}
	}
}

func tierCount(inv wire.Inventory, tier wire.Tier) int {
	n := 0
	for _, p := range inv.Objects {
		if p.Tier == tier {
			n++
		}
	}
	return n
}

// TestL3RestoreAfterL1L2Wiped (issue 15.3): every stored object is written
// behind to the S3 server and announced as an L3 placement; with L1 and L2
// gone (a restart on a wiped L2 root) the start-up scan finds this rank's
// objects again and a retrieve restores them byte-exact from L3; an
// object corrupted in the bucket fails its chunk (corrupt, nothing
// written into its pages), is deleted and announced removed, and the next
// store of it heals L3.
func TestL3RestoreAfterL1L2Wiped(t *testing.T) {
	dev := openDevice(t, "")
	const n = 6
	r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
	l3, _ := openL3(t)
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.L3 = root, l3
	e1 := newEngine(t, cfg)
	r.register(e1)
	var cs []chunk
	for i := range n {
		c := r.newChunk(i, r.consecutiveN(i))
		cs = append(cs, c)
		storeAll(t, e1, r, "s", c)
	}
	if err := e1.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if st := e1.L3Stats(); st.Written != n || st.Objects != n || st.Failed != 0 || st.Queued != 0 {
		t.Fatalf("after the stores: %+v, want %d written", st, n)
	}
	if got := tierCount(e1.Inventory(), wire.L3); got != n {
		t.Fatalf("inventory holds %d L3 placements, want %d", got, n)
	}
	if v := testutil.Metric(t, gatherer(t, e1), "kvtier_transfer_l3_bytes_total", "direction", "store"); v != float64(n*len(cs[0].packed[0])) {
		t.Fatalf("l3_bytes_total{store} = %v, want %d", v, n*len(cs[0].packed[0]))
	}
	closeEngine(t, e1)

	restart := func() (*Engine, *pubRecorder) {
		t.Helper()
		wipe(t, root)
		c := cfg
		c.Registerer, c.KeepEvents = newRegistry(), true
		e := newEngine(t, c)
		pub := recordEvents(t, e)
		if err := e.WaitL3Scan(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		r.register(e)
		return e, pub
	}
	e2, _ := restart()
	inv := e2.Inventory()
	if tierCount(inv, wire.L1) != 0 || tierCount(inv, wire.L2) != 0 || tierCount(inv, wire.L3) != n {
		t.Fatalf("after the restart on a wiped L2: inventory %+v, want %d L3 placements only", inv.Objects, n)
	}
	var tgts [][][]int64
	for i := range n {
		tgts = append(tgts, r.consecutiveN(n+1+i%2)) // other blocks than stored
	}
	for i := range n {
		rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, cs[i:i+1], tgts[i:i+1]))
		if err != nil {
			t.Fatal(err)
		}
		if !rr.ChunkOK(0) || rr.Items[0].From != wire.L3 {
			t.Fatalf("chunk %d: %+v, want restored from L3", i, rr.Items[0])
		}
		r.expectRestored(cs[i], tgts[i])
		r.check("restored from L3")
	}
	if st := e2.L3Stats(); st.RestoredFrom != n || st.BytesRead != uint64(n*len(cs[0].packed[0])) {
		t.Fatalf("L3 stats after the restores: %+v", st)
	}
	closeEngine(t, e2)

	// One payload byte flipped in the bucket while the rank is down.
	bad := keyOf(r, cs[2], 0)
	tier := NewL3Tier(l3, cfg.Rank.Instance, nil)
	body, _, err := l3.Open(testCtx(t), tier.Name(bad), 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	obj, err := io.ReadAll(body)
	body.Close()
	if err != nil {
		t.Fatal(err)
	}
	obj[len(obj)-3] ^= 0x10
	if err := l3.Put(testCtx(t), tier.Name(bad), bytes.NewReader(obj), int64(len(obj))); err != nil {
		t.Fatal(err)
	}
	e3, pub := restart()
	tg := [][][]int64{r.consecutiveN(n + 3)}
	rr, err := e3.Retrieve(testCtx(t), r.retrieveReq(0, cs[2:3], tg))
	if err != nil {
		t.Fatal(err)
	}
	if rr.ChunkOK(0) || rr.Items[0].Reason != ReasonCorrupt {
		t.Fatalf("corrupted L3 object: %+v, want failed as corrupt", rr.Items[0])
	}
	r.check("after the corrupted L3 object: nothing written") // pages untouched
	if st := e3.L3Stats(); st.Checksum != 1 || st.Objects != n-1 {
		t.Fatalf("after the corrupted read: %+v, want 1 checksum failure and %d objects", st, n-1)
	}
	if _, _, err := l3.Open(testCtx(t), tier.Name(bad), 0, 0); err == nil {
		t.Fatal("the corrupted object is still in the bucket")
	}
	waitPublished(t, e3)
	if !slices.ContainsFunc(pub.events(), func(ev wire.Event) bool {
		return ev.Kind == wire.Removed && ev.Tier == wire.L3 && ev.Key == bad
	}) {
		t.Fatal("no L3 removal announced for the corrupted object")
	}
	// The next store heals L3.
	storeAll(t, e3, r, "heal", cs[2])
	if err := e3.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	closeEngine(t, e3)
	e4, _ := restart()
	rr, err = e4.Retrieve(testCtx(t), r.retrieveReq(0, cs[2:3], tg))
	if err != nil {
		t.Fatal(err)
	}
	if !rr.ChunkOK(0) || rr.Items[0].From != wire.L3 {
		t.Fatalf("after the healing store: %+v, want restored from L3", rr.Items[0])
	}
	r.expectRestored(cs[2], tg[0])
	r.check("healed")
}

// slowStore holds every Put until released: a bucket that does not answer.
type slowStore struct {
	ObjectStore
	release chan struct{}
	once    sync.Once
}

func (s *slowStore) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	select {
	case <-s.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.ObjectStore.Put(ctx, name, r, size)
}

func (s *slowStore) unblock() { s.once.Do(func() { close(s.release) }) }

// TestL3SlowBucketNeverBlocksStores (issue 15.3): with the bucket holding
// every PUT, stores keep succeeding; the bounded queue takes what fits and
// counts the rest; once the bucket answers, the queued objects are written.
func TestL3SlowBucketNeverBlocksStores(t *testing.T) {
	dev := openDevice(t, "")
	const n = 8
	r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
	l3, _ := openL3(t)
	slow := &slowStore{ObjectStore: l3, release: make(chan struct{})}
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.L3 = t.TempDir(), slow
	cfg.L3Writers, cfg.L3QueueObjects = 1, 3
	e := newEngine(t, cfg)
	t.Cleanup(slow.unblock) // before the engine's Close, which drains the queue
	r.register(e)
	for i := range n {
		res := storeAll(t, e, r, "s", r.newChunk(i, r.consecutiveN(i)))
		if err := res.Err(); err != nil {
			t.Fatalf("store %d with the bucket stalled: %v", i, err)
		}
	}
	// One write is held in the bucket, three wait in the queue (or four
	// while the writer has not taken the first yet); the rest were
	// counted, not queued.
	st := e.L3Stats()
	if st.Queued+int64(st.QueueFull) != n || st.Queued < 3 || st.Queued > 4 || st.Written != 0 {
		t.Fatalf("with the bucket stalled: %+v, want %d stores split between queued (3..4) and queue-full", st, n)
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l3_queued"); v != float64(st.Queued) {
		t.Fatalf("l3_queued = %v, want %d", v, st.Queued)
	}
	slow.unblock()
	if err := e.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if st2 := e.L3Stats(); st2.Written != uint64(st.Queued) || st2.Queued != 0 || tierCount(e.Inventory(), wire.L3) != int(st.Queued) {
		t.Fatalf("after the bucket answered: %+v, want %d written", st2, st.Queued)
	}
}

// failingStore refuses every Put: a bucket that answers errors.
type failingStore struct{ ObjectStore }

func (failingStore) Put(context.Context, string, io.Reader, int64) error {
	return errors.New("503 slow down")
}

// TestL3FailingBucketCounted (issue 15.3): a bucket refusing every PUT
// fails no store; each failed write is counted (l3_write_failures_total),
// and nothing is announced in L3.
func TestL3FailingBucketCounted(t *testing.T) {
	dev := openDevice(t, "")
	const n = 3
	r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
	l3, _ := openL3(t)
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.L3 = t.TempDir(), failingStore{l3}
	e := newEngine(t, cfg)
	r.register(e)
	for i := range n {
		if err := storeAll(t, e, r, "s", r.newChunk(i, r.consecutiveN(i))).Err(); err != nil {
			t.Fatalf("store %d: %v", i, err)
		}
	}
	if err := e.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	st := e.L3Stats()
	if st.Failed != n || st.Written != 0 || st.Objects != 0 || tierCount(e.Inventory(), wire.L3) != 0 {
		t.Fatalf("with the bucket refusing: %+v, want %d failed writes and no L3 placement", st, n)
	}
	if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l3_write_failures_total"); v != n {
		t.Fatalf("l3_write_failures_total = %v, want %d", v, n)
	}
}
