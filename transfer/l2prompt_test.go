package transfer

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer/tier"
	"github.com/kvtier/kvtier/wire"
)

// l2Keys returns the keys of e's L2 inventory.
func l2Keys(e *Engine) map[dcp.Key]bool {
	out := map[dcp.Key]bool{}
	for _, p := range e.Inventory().Objects {
		if p.Tier == wire.L2 {
			out[p.Key] = true
		}
	}
	return out
}

// TestL2BoundKeepsThePromptsPrefix (issue 29.3 i): MLA at TP 2 with a
// shared L2 root: rank 0 stores the objects both ranks read, rank 1 reads
// them only from L2. Rank 0's L2 bound holds 3 of the 6 objects of one
// prompt, stored chunk by chunk under one request id as an engine does.
// The prompt's later objects do not evict its earlier ones: L2 keeps the
// first 3 (the others stay in L1 only, counted), so rank 1 restores the
// prompt's prefix. Seen red before the fix: each write evicted the least
// recently written object of the same prompt, L2 ended with chunks 3..5
// and rank 1 could restore no prefix at all (chunk 0 missing).
func TestL2BoundKeepsThePromptsPrefix(t *testing.T) {
	dev := openDevice(t, "")
	spec := c1Spec()
	spec.Layout = dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}
	const n, k = 6, 3
	r0 := newRig(t, dev, spec, []int64{2*n + 4})
	r1 := newRig(t, dev, spec, []int64{2*n + 4})
	root := t.TempDir()
	cfg0 := engineConfig(t, dev, 0, 2)
	obj := r0.res.ObjectSize(0) + tier.HeaderBytes(cfg0.Rank.Instance)
	cfg0.L2Dir, cfg0.L2Bytes, cfg0.L2Writers = root, k*obj+obj/2, 1
	cfg1 := engineConfig(t, dev, 1, 2)
	cfg1.L2Dir = root
	e0, e1 := newEngine(t, cfg0), newEngine(t, cfg1)
	r0.register(e0)
	r1.register(e1)
	var cs []chunk
	for i := range n {
		c := r0.newChunk(i, r0.consecutiveN(i))
		cs = append(cs, c)
		storeAll(t, e0, r0, "prompt", c)
	}
	if err := e0.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if used, _ := diskUse(t, root); used > cfg0.L2Bytes {
		t.Fatalf("%d B of files under L2, bound %d B", used, cfg0.L2Bytes)
	}
	inL2 := l2Keys(e0)
	for i, c := range cs {
		if got, want := inL2[keyOf(r0, c, 0)], i < k; got != want {
			t.Fatalf("rank 0's L2 holds chunk %d: %v, want %v (the prompt's first %d chunks): %v", i, got, want, k, inL2)
		}
	}
	if got := testutil.Metric(t, gatherer(t, e0), "kvtier_transfer_l2_bound_skipped_total"); got != n-k {
		t.Fatalf("l2_bound_skipped_total = %v, want %d", got, n-k)
	}
	for i := range k {
		tgt := r1.consecutiveN(n + i%2)
		rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, cs[i:i+1], [][][]int64{tgt}))
		if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L2 {
			t.Fatalf("rank 1 retrieve of chunk %d: %+v %v; want it from L2", i, rr, err)
		}
		r1.expectRestored(cs[i], tgt)
		r1.check(fmt.Sprintf("rank 1 after restoring chunk %d", i))
	}
	// Another prompt's writes evict this one's objects (least recently
	// used first): the protection is only against the prompt itself.
	c := r0.newChunk(n, r0.consecutiveN(n))
	storeAll(t, e0, r0, "next-prompt", c)
	if err := e0.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if inL2 := l2Keys(e0); !inL2[keyOf(r0, c, 0)] || inL2[keyOf(r0, cs[0], 0)] {
		t.Fatalf("after the next prompt: L2 %v, want its chunk in and the first prompt's least recent out", inL2)
	}
}

// storeAt stores c under reqID as the chunk at position pos of its
// prompt (wire.ChunkBlocks.Pos), as an engine's concurrent stores of one
// prompt do.
func storeAt(t *testing.T, e *Engine, r *rig, reqID string, pos uint32, c chunk) {
	t.Helper()
	r.write(c, c.blocks, 0)
	_, h := r.record()
	req := r.storeReq(reqID, h, c)
	req.Chunks[0].Pos = pos
	f, err := e.Store(testCtx(t), req)
	if err != nil {
		t.Fatalf("Store: %v", err)
	}
	if res, err := f.Wait(testCtx(t)); err != nil || res.Err() != nil {
		t.Fatalf("store at position %d: %v %v", pos, err, res.Err())
	}
}

// TestL2BoundKeepsTheLowestPositions (issue 29.3 i): an engine stores a
// prompt's chunks in concurrent requests under one request id, so they
// reach L2 in any order. With the chunks' positions, a bound of 2 objects
// keeps the prompt's positions 0 and 1 whatever the order: a write evicts
// the prompt's objects at later positions (the highest first) and never
// those at earlier ones. Another prompt's objects are evicted before the
// prompt's own later ones. Without positions (all 0) the first-written
// objects stay, as before positions. Seen red with positions ignored (the
// l2MakeRoomLocked rule back to "the prompt's objects are never
// evicted"): L2 held chunks 5 and 4 after the reverse order; and with the
// prompt's later positions evicted before another prompt's objects: the
// other prompt's chunk stayed and position 1 was evicted.
func TestL2BoundKeepsTheLowestPositions(t *testing.T) {
	type store struct {
		req string
		pos uint32
		c   int // chunk index in cs
	}
	const n = 6
	prompt := func(order ...int) []store {
		var out []store
		for _, c := range order {
			out = append(out, store{"prompt", uint32(c), c})
		}
		return out
	}
	for _, tc := range []struct {
		name    string
		stores  []store
		want    []int // chunks L2 holds at the end
		skipped float64
	}{
		{"reverse", prompt(5, 4, 3, 2, 1, 0), []int{0, 1}, 0},
		{"shuffled", prompt(3, 0, 5, 1, 4, 2), []int{0, 1}, 3},
		// Chunk 6 is another prompt's, the least recently used: the
		// prompt's position 0 evicts it rather than its own position 1.
		{"another prompt first", append([]store{{"other", 0, 6}}, prompt(1, 0)...), []int{0, 1}, 0},
		// An engine that sends no positions: every object of the prompt
		// is at 0, the first written stay and the others are skipped.
		{"no positions", []store{{"prompt", 0, 5}, {"prompt", 0, 4}, {"prompt", 0, 3}, {"prompt", 0, 0}}, []int{5, 4}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dev := openDevice(t, "")
			r := newRig(t, dev, c1Spec(), []int64{2*n + 6})
			root := t.TempDir()
			cfg := engineConfig(t, dev, 0, 1)
			obj := r.res.ObjectSize(0) + tier.HeaderBytes(cfg.Rank.Instance)
			cfg.L2Dir, cfg.L2Bytes, cfg.L2Writers = root, 2*obj+obj/2, 1
			e := newEngine(t, cfg)
			r.register(e)
			var cs []chunk
			for i := range n + 1 {
				cs = append(cs, r.newChunk(i, r.consecutiveN(i)))
			}
			for _, s := range tc.stores {
				storeAt(t, e, r, s.req, s.pos, cs[s.c])
				// One write at a time, in this order (write-through is
				// asynchronous).
				if err := e.Flush(testCtx(t)); err != nil {
					t.Fatal(err)
				}
			}
			inL2 := l2Keys(e)
			var got []int
			for i, c := range cs {
				if inL2[keyOf(r, c, 0)] {
					got = append(got, i)
				}
			}
			slices.Sort(got)
			want := slices.Sorted(slices.Values(tc.want))
			if !slices.Equal(got, want) {
				t.Fatalf("L2 holds chunks %v, want %v", got, want)
			}
			if got := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l2_bound_skipped_total"); got != tc.skipped {
				t.Fatalf("l2_bound_skipped_total = %v, want %v", got, tc.skipped)
			}
		})
	}
}

// TestL2MakeRoomForAPromptsEarlierChunk (issue 29.3 i): the decision of
// l2MakeRoomLocked with deletes in flight. L2 holds a prompt's positions 1
// (4 units) and 2 (2 units) under a bound of 9 units while another
// writer's victim of 3 units is being deleted. A write of the prompt's
// position 0 that the delete makes room for evicts nothing (its writer
// waits); one that needs more evicts position 2 only, not position 1.
// Seen red with the prompt's later objects evicted for room the deletes
// in flight make: concurrent writers of a prompt (enginesim with its
// positions reversed) each evicted its objects for the same room, and the
// first write here evicted both positions.
func TestL2MakeRoomForAPromptsEarlierChunk(t *testing.T) {
	dev := openDevice(t, "")
	cfg := engineConfig(t, dev, 0, 1)
	const u = 1 << 16
	cfg.L2Dir, cfg.L2Bytes = t.TempDir(), 9*u
	e := newEngine(t, cfg)
	<-e.rescanDone
	e.mu.Lock()
	defer e.mu.Unlock()
	c, a := &e.cat, &e.cat.l2acct
	key := func(i int) dcp.Key { return dcp.Key{Chunk: chunkHash(i)} }
	prompt := func(pos uint32) promptPos { return promptPos{tag: promptTag("prompt"), pos: pos} }
	c.l2Set(key(1), l2Entry{size: 4*u - a.hdr, prompt: prompt(1)}, 0)
	c.l2Set(key(2), l2Entry{size: 2*u - a.hdr, prompt: prompt(2)}, 0)
	a.pending += 3 * u // another writer's victim, its delete running
	a.deleting[key(9)] += 3 * u
	positions := func(vs []l2Victim) (out []uint32) {
		for _, v := range vs {
			out = append(out, v.ent.prompt.pos)
		}
		return out
	}
	victims, fits, _, err := e.l2MakeRoomLocked(3*u, prompt(0))
	if err != nil || len(victims) != 0 || fits {
		t.Fatalf("room the delete in flight makes: evicted positions %v, fits %v, %v; want none and not yet (wait)", positions(victims), fits, err)
	}
	victims, fits, _, err = e.l2MakeRoomLocked(5*u, prompt(0))
	if err != nil || len(victims) != 1 || victims[0].key != key(2) || fits {
		t.Fatalf("room beyond the delete in flight: evicted positions %v, fits %v, %v; want position 2 alone, then wait", positions(victims), fits, err)
	}
	e.l2EvictedLocked(victims, make([]error, len(victims)))
	a.pending -= 3 * u
	delete(a.deleting, key(9))
	if victims, fits, _, err = e.l2MakeRoomLocked(5*u, prompt(0)); err != nil || len(victims) != 0 || !fits {
		t.Fatalf("after the deletes: evicted positions %v, fits %v, %v; want none and room", positions(victims), fits, err)
	}
	if _, ok := c.l2[key(1)]; !ok {
		t.Fatal("position 1 was evicted")
	}
}

// TestReStoreRewritesAnEvictedL2Copy (issue 29.3 ii): an object L2 evicted
// to stay under its bound while L1 kept it is written to L2 again when it
// is stored again (deduplicated against L1), so a restart still finds it.
// Seen red before the fix: the re-store answered deduplicated and wrote
// nothing ("0 objects committed, 64 already held"), and after a restart
// the object was gone.
func TestReStoreRewritesAnEvictedL2Copy(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	obj := r.res.ObjectSize(0) + tier.HeaderBytes(cfg.Rank.Instance)
	cfg.L2Dir, cfg.L2Bytes, cfg.L2Writers = root, obj+obj/2, 1
	e := newEngine(t, cfg)
	r.register(e)
	a, b := r.newChunk(0, r.consecutiveN(0)), r.newChunk(1, r.consecutiveN(1))
	storeAll(t, e, r, "a", a)
	storeAll(t, e, r, "b", b) // evicts a from L2; L1 keeps it
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if inL2 := l2Keys(e); inL2[keyOf(r, a, 0)] || !inL2[keyOf(r, b, 0)] {
		t.Fatalf("L2 after b: %v, want b only", inL2)
	}
	res := storeAll(t, e, r, "a-again", a)
	if res.Objects[0].Status != Deduped {
		t.Fatalf("re-store of a: %+v, want deduplicated against L1", res.Objects[0])
	}
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if inL2 := l2Keys(e); !inL2[keyOf(r, a, 0)] {
		t.Fatalf("L2 after the re-store of a: %v, want a written again", inL2)
	}
	closeEngine(t, e)
	cfg.Incarnation, cfg.Registerer = 0, newRegistry()
	e2 := newEngine(t, cfg)
	r.register(e2)
	tgt := r.consecutiveN(2)
	rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{a}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L2 {
		t.Fatalf("retrieve of a after the restart: %+v %v; want it from L2", rr, err)
	}
	r.expectRestored(a, tgt)
	r.check("after the restart")
}

// orderedTier records the keys of L2 writes in the order they reach the
// tier, fails the first failPuts of them, and holds the write of hold
// until release is closed.
type orderedTier struct {
	L2Tier
	mu       sync.Mutex
	order    []dcp.Key
	failPuts int
	hold     dcp.Key
	held     chan struct{}
	release  chan struct{}
}

func (o *orderedTier) Put(ctx context.Context, obj L2Object, p []byte) error {
	o.mu.Lock()
	o.order = append(o.order, obj.Key)
	fail := o.failPuts > 0
	if fail {
		o.failPuts--
	}
	o.mu.Unlock()
	if fail {
		return fmt.Errorf("put %s: no space left on device: %w", obj.Key, ErrIO)
	}
	if obj.Key == o.hold {
		close(o.held)
		<-o.release
	}
	return o.L2Tier.Put(ctx, obj, p)
}

func (o *orderedTier) written() []dcp.Key {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.order)
}

// TestL2NewWritesBeforeRetries (issue 29.3 iii): writes that failed wait
// in a retry backlog; a new prompt's write queued while they wait goes to
// L2 before them, so room the tier frees serves new prompts first. Seen
// red before the fix: the writer took the retries first.
func TestL2NewWritesBeforeRetries(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{16})
	ft, err := OpenFileTier(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	// Two failures: a third in a row would mark L2 degraded (then only a
	// probe writes).
	old := []chunk{r.newChunk(0, r.consecutiveN(0)), r.newChunk(1, r.consecutiveN(1))}
	z, d := r.newChunk(3, r.consecutiveN(3)), r.newChunk(4, r.consecutiveN(4))
	ot := &orderedTier{L2Tier: ft, failPuts: len(old), hold: keyOf(r, z, 0), held: make(chan struct{}), release: make(chan struct{})}
	var skew sync.Mutex
	var ahead time.Duration
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2, cfg.L2Writers = ot, 1
	cfg.Now = func() time.Time {
		skew.Lock()
		defer skew.Unlock()
		return time.Now().Add(ahead)
	}
	e := newEngine(t, cfg)
	t.Cleanup(func() { // before the engine's Close, which waits for the held write
		select {
		case <-ot.release:
		default:
			close(ot.release)
		}
	})
	r.register(e)
	for i, c := range old {
		storeAll(t, e, r, fmt.Sprintf("old-%d", i), c)
	}
	testutil.Eventually(t, 10*time.Second, "the old writes to fail", func() bool { return e.Stats().L2WriteErrors == uint64(len(old)) })
	storeAll(t, e, r, "z", z) // the writer holds z's write
	select {
	case <-ot.held:
	case <-time.After(10 * time.Second):
		t.Fatal("z's write never reached the tier")
	}
	skew.Lock()
	ahead = time.Minute // the retries are due
	skew.Unlock()
	testutil.Eventually(t, 10*time.Second, "the retries to be queued", func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		return e.cat.writing == 1+len(old) // z, being written, and the retries
	})
	storeAll(t, e, r, "new-prompt", d)
	close(ot.release)
	if err := e.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	w := ot.written()
	at := slices.Index(w, keyOf(r, z, 0))
	if at < 0 || len(w) != at+2+len(old) {
		t.Fatalf("writes %v: want z, then the new prompt's and the %d retries", w, len(old))
	}
	if w[at+1] != keyOf(r, d, 0) {
		t.Fatalf("after z the writer took %s, want the new prompt's %s before the retries (writes %v)", w[at+1], keyOf(r, d, 0), w)
	}
	if st := e.Stats(); st.L2Objects != int64(2+len(old)) {
		t.Fatalf("%d L2 objects, want %d", st.L2Objects, 2+len(old))
	}
}
