package index_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
)

// The model of TestLookupsConcurrentModel: every rank a/r of a TP4 GQA
// namespace holds shard r of the chain's chunks, in L1 and/or L2; each
// rank's operations run in sequence on its own goroutine, so its
// placements go through a linear history of states. A lookup running
// from clock t0 to t1 may see, for each (rank, chunk), the chunk as it is
// in any state of that rank alive in [t0, t1]: state m is alive from the
// start of the operation that made it (or, for a fence, no later than
// the moment Rank reports the rank fenced) until the end of the next one.

type copyVer struct {
	size, sum uint64
	ok        bool
}

type rankSnap struct {
	l1, l2 []copyVer // by chunk
}

type modelState struct {
	snap  rankSnap
	start int64 // clock when the operation that made it began
	end   int64 // clock when it was acknowledged
	// fence: the state has the rank's L1 copies fenced (a FenceRank, or a
	// new incarnation's fence of the old ones). A lookup that may have
	// loaded its view while such a state was alive may apply that fence to
	// chunks it reads later, after the fence was lifted (conservative).
	fence bool
}

type rankModel struct {
	mu     sync.Mutex
	states []modelState
}

// begin records the state an operation is about to make, before the
// operation starts.
func (m *rankModel) begin(s rankSnap, fence bool, clock *atomic.Int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.states = append(m.states, modelState{snap: s, start: clock.Add(1), end: math.MaxInt64, fence: fence})
}

// beginIncarnation is begin for an operation that starts a new
// incarnation: lookups may see its fence of the old L1 copies before its
// chunks (the fence is in the lookup view, published first), so the
// state before it with every L1 copy gone (mid) is a state too.
func (m *rankModel) beginIncarnation(mid, s rankSnap, clock *atomic.Int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	start := clock.Add(1)
	m.states = append(m.states, modelState{snap: mid, start: start, end: math.MaxInt64, fence: true},
		modelState{snap: s, start: start, end: math.MaxInt64})
}

// settled reports whether the last state begun is in force (finish).
func (m *rankModel) settled() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.states[len(m.states)-1].end != math.MaxInt64
}

// finish records when the states begun last are in force for every lookup.
func (m *rankModel) finish(clock *atomic.Int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	end := clock.Add(1)
	for i := len(m.states) - 1; i > 0 && m.states[i].end == math.MaxInt64; i-- {
		m.states[i].end = end
	}
}

// alive returns the snapshots a lookup from t0 to t1 may see: those of
// the states alive in [t0, t1], and, when one of them fences the rank's
// L1 copies, each of them without its L1 copies too.
func (m *rankModel) alive(t0, t1 int64) []rankSnap {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []rankSnap
	fence := false
	for i, s := range m.states {
		if s.start > t1 {
			break
		}
		if i+1 < len(m.states) && m.states[i+1].end < t0 {
			continue // replaced and acknowledged before the lookup began
		}
		out = append(out, s.snap)
		fence = fence || s.fence
	}
	if fence {
		for _, s := range out[:len(out):len(out)] {
			st := s.clone()
			clear(st.l1)
			out = append(out, st)
		}
	}
	return out
}

// source is what the reader of shard r reads of chunk c in s: its own L1,
// else its own L2 (only rank r holds shard r), else nothing.
func (s *rankSnap) source(tp, c int) (index.Source, bool) {
	if v := s.l1[c]; v.ok {
		return index.Source{Size: v.size, Sum: v.sum, HolderTP: int32(tp), Tier: wire.L1}, true
	}
	if v := s.l2[c]; v.ok {
		return index.Source{Size: v.size, Sum: v.sum, HolderTP: int32(tp), Tier: wire.L2}, true
	}
	return index.Source{}, false
}

func (s rankSnap) clone() rankSnap {
	return rankSnap{l1: append([]copyVer(nil), s.l1...), l2: append([]copyVer(nil), s.l2...)}
}

// TestLookupsConcurrentModel: lookups run while four ranks ingest (each
// batch replaces L1 copies with a remove and a store of the same object,
// so a chunk without its L1 copy is a state that never existed), fence
// themselves in slices (FenceSliceChunks 4 of 32 chunks; the writer holds
// its next commit once the first slice is out, until a few lookups have
// run with the fence half done), resync with an inventory and restart as
// new incarnations; every answer is checked byte for byte against the
// model (prefix and every source). A fence may reach a lookup ahead of
// the chunks (the lookup view) and may outlast, for a lookup that loaded
// the view while it held, its lifting: the model allows those states with
// the L1 copies gone, never one with a fenced copy. Seen failing (4/4
// runs each) with the reader's fence ignored in LookupInto ("chunk 2
// reader 2: got {Size:52 ... Tier:L1}, none of 2 alive states has it") and
// with setChunk publishing each chunk in two steps, first without its
// first placement ("prefix 4, but chunk 4 has every copy in every alive
// state"); 0/10 failures as it stands. A lookup whose view predates a
// rank's first batch reads that rank's later chunks without its own L1
// copies (its reader is unknown: it takes the L2 copy). The model missed
// that state until stop 64: about 1 run in 140 failed under -race with
// "chunk 1 reader 3: got {Size:51 ... Tier:L2}", and 5/5 did with a 3 ms
// pause after the view's load while a rank was unknown; 0/5 with the
// pause since the first state counts as a fence.
func TestLookupsConcurrentModel(t *testing.T) {
	const nranks, nchunks, rounds = 4, 32, 60
	// Every chunk shard's slab compacted as soon as its garbage outgrows
	// its live placements: lookups read across compactions.
	defer index.SetSlabCompactMin(index.SetSlabCompactMin(1))
	var clock atomic.Int64
	// armed: 1 + the TP rank of a rank about to fence itself (0: none).
	// The writer, after the first commit it finds that rank fenced at
	// (the fence's first slice is published: the rest is not), waits for
	// a few more lookups, so that lookups run while the fence is half done.
	var armed atomic.Int32
	models := make([]*rankModel, nranks)
	for r := range models {
		models[r] = &rankModel{}
		// The state before the rank's first batch counts as a fence: a
		// lookup whose view was loaded then does not know the rank, so its
		// reader has no L1 copies of its own even in chunks it reads after
		// the rank's later batches (it takes their L2 copies instead).
		models[r].states = []modelState{{snap: rankSnap{l1: make([]copyVer, nchunks), l2: make([]copyVer, nchunks)}, fence: true}}
	}

	var looked, paused, midFence atomic.Int64
	var holding atomic.Bool // the writer waits in a half-done fence
	var ixp atomic.Pointer[index.Index]
	ix := openTest(t, "", func(c *index.Config) {
		c.FenceSliceChunks = 4
		c.NoSync = true // durability is not what this test checks
		c.AfterCommit = func() {
			a := armed.Load()
			if a == 0 || ixp.Load() == nil {
				return
			}
			if ri, _ := ixp.Load().Rank(wire.Rank{Instance: "a", TPRank: int(a - 1)}); !ri.Fenced {
				return
			}
			armed.Store(0)
			paused.Add(1)
			// Once the rank's goroutine has seen the fence (the model's
			// fence state is in force from then on), a few more lookups.
			m := models[a-1]
			deadline := time.Now().Add(2 * time.Second)
			for !m.settled() && time.Now().Before(deadline) {
				time.Sleep(50 * time.Microsecond)
			}
			holding.Store(true)
			want := looked.Load() + 4
			for looked.Load() < want && time.Now().Before(deadline) {
				time.Sleep(50 * time.Microsecond)
			}
			holding.Store(false)
		}
	})
	ixp.Store(ix.Index)
	res, err := ix.RegisterNamespace(ctx, benchGQA(nranks))
	if err != nil {
		t.Fatal(err)
	}
	ns := res.Namespace
	chain := make([]dcp.ChunkHash, nchunks)
	for i := range chain {
		chain[i] = indextest.Chunk(11, uint64(i))
	}
	var failed atomic.Bool
	var wg sync.WaitGroup
	done := make(chan struct{})
	errs := make(chan error, nranks+2)
	for r := range nranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := runModelRank(ix.Index, ns, chain, r, rounds, &clock, models[r], &failed, &armed); err != nil {
				failed.Store(true)
				errs <- err
			}
		}()
	}
	var lwg sync.WaitGroup
	for range 2 {
		lwg.Add(1)
		go func() {
			defer lwg.Done()
			var lr index.LookupResult
			for {
				select {
				case <-done:
					return
				default:
				}
				mid := holding.Load()
				t0 := clock.Load()
				err := ix.LookupInto(&lr, "a", ns, chain)
				t1 := clock.Load()
				if mid && holding.Load() {
					midFence.Add(1)
				}
				if err == nil {
					err = checkLookup(&lr, models, t0, t1)
				}
				if err != nil {
					failed.Store(true)
					errs <- err
					return
				}
				looked.Add(1)
			}
		}()
	}
	wg.Wait()
	close(done)
	lwg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	// Quiet now: one more lookup sees exactly the last states.
	var lr index.LookupResult
	if err := ix.LookupInto(&lr, "a", ns, chain); err != nil {
		t.Fatal(err)
	}
	c := clock.Load()
	if err := checkLookup(&lr, models, c, c); err != nil {
		t.Fatal(err)
	}
	if looked.Load() == 0 {
		t.Fatal("no lookup ran during the ingest")
	}
	t.Logf("%d lookups checked, %d of them during %d half-done fences", looked.Load(), midFence.Load(), paused.Load())
	mustVerify(t, ix.Index)
}

// checkLookup compares a lookup's answer with every model state alive in
// [t0, t1].
func checkLookup(lr *index.LookupResult, models []*rankModel, t0, t1 int64) error {
	ne := len(lr.Expectations)
	alive := make([][]rankSnap, ne)
	for j, e := range lr.Expectations {
		if e.Shard != e.Rank {
			return fmt.Errorf("expectation %d: %+v, want each rank reading its own shard", j, e)
		}
		alive[j] = models[e.Rank].alive(t0, t1)
	}
	n := len(alive[0][0].l1)
	if lr.Prefix > n || len(lr.Sources) != lr.Prefix*ne {
		return fmt.Errorf("prefix %d of %d chunks with %d sources for %d expectations", lr.Prefix, n, len(lr.Sources), ne)
	}
	for c := range lr.Prefix {
		for j, e := range lr.Expectations {
			got := lr.Source(c, j)
			match := false
			for i := range alive[j] {
				if want, ok := alive[j][i].source(e.Rank, c); ok && want == got {
					match = true
					break
				}
			}
			if !match {
				var wants []string
				for i := range alive[j] {
					w, ok := alive[j][i].source(e.Rank, c)
					wants = append(wants, fmt.Sprintf("%+v/%v", w, ok))
				}
				return fmt.Errorf("lookup [%d, %d] chunk %d reader %d: got %+v, none of %d alive states has it: %v",
					t0, t1, c, e.Rank, got, len(alive[j]), wants)
			}
		}
	}
	if lr.Prefix == n {
		return nil
	}
	// The chunk that ended the prefix lacks a copy in some alive state.
	c := lr.Prefix
	for j, e := range lr.Expectations {
		for i := range alive[j] {
			if _, ok := alive[j][i].source(e.Rank, c); !ok {
				return nil
			}
		}
	}
	return fmt.Errorf("lookup [%d, %d]: prefix %d, but chunk %d has every copy in every alive state", t0, t1, lr.Prefix, c)
}

// runModelRank drives rank a/tp through rounds of batches, with now and
// then a sliced fence followed by an inventory, or a new incarnation,
// recording each state in m.
func runModelRank(ix *index.Index, ns dcp.Namespace, chain []dcp.ChunkHash, tp, rounds int, clock *atomic.Int64, m *rankModel,
	failed *atomic.Bool, armed *atomic.Int32) error {
	withL2 := len(chain) * 3 / 4
	rng := rand.New(rand.NewPCG(uint64(tp), 7))
	rank := wire.Rank{Instance: "a", TPRank: tp}
	cur := m.states[0].snap.clone()
	inc, seq, ver := uint64(1), uint64(0), uint64(0)
	inc0 := inc // the incarnation of the last batch applied
	key := func(c int) dcp.Key { return dcp.Key{NS: ns, Chunk: chain[c], Shard: uint16(tp)} }
	newVer := func(c int) copyVer {
		ver++
		return copyVer{size: ver, sum: uint64(tp)<<56 | uint64(c)<<40 | ver, ok: true}
	}
	apply := func(b wire.Batch, next rankSnap) error {
		if b.Incarnation != inc0 {
			mid := cur.clone()
			clear(mid.l1)
			m.beginIncarnation(mid, next, clock)
			inc0 = b.Incarnation
		} else {
			m.begin(next, false, clock)
		}
		o, err := ix.Apply(ctx, b)
		if err != nil {
			return fmt.Errorf("rank %d: apply: %w", tp, err)
		}
		if o.Applied != len(b.Events) {
			return fmt.Errorf("rank %d: batch of %d events: %+v", tp, len(b.Events), o)
		}
		m.finish(clock)
		cur = next
		return nil
	}
	// The first withL2 chunks always have an L2 copy, so lookups go on
	// past chunks whose L1 copy a fence has just dropped, into the chunks
	// it has not reached yet; the others come and go, and end prefixes.
	first := cur.clone()
	b := wire.Batch{Rank: rank, Incarnation: inc}
	for c := range withL2 {
		v := newVer(c)
		first.l2[c] = v
		seq++
		b.Events = append(b.Events, stored(seq, wire.L2, key(c), v.size, v.sum))
	}
	if err := apply(b, first); err != nil {
		return err
	}
	for round := range rounds {
		if failed.Load() {
			return nil
		}
		switch {
		case round > 0 && round%20 == 0: // a new incarnation: its old L1 copies go
			inc++
			seq = 0
			next := cur.clone()
			clear(next.l1)
			b := wire.Batch{Rank: rank, Incarnation: inc}
			for c := range chain {
				if rng.IntN(2) == 0 {
					v := newVer(c)
					next.l1[c] = v
					seq++
					b.Events = append(b.Events, stored(seq, wire.L1, key(c), v.size, v.sum))
				}
			}
			if err := apply(b, next); err != nil {
				return err
			}
		case round%9 == 8: // dies: a sliced fence, then a resync
			next := cur.clone()
			clear(next.l1)
			m.begin(next, true, clock)
			armed.CompareAndSwap(0, int32(tp+1))
			fdone := make(chan error, 1)
			go func() {
				_, err := ix.FenceRank(ctx, rank, math.MaxUint64)
				fdone <- err
			}()
			// The fence is in force for every lookup that starts once Rank
			// reports the rank fenced (its first slice is published).
			var ferr error
			for seen := false; !seen; {
				select {
				case ferr = <-fdone:
					seen = true
					fdone <- ferr
				default:
					ri, _ := ix.Rank(rank)
					seen = ri.Fenced
				}
			}
			m.finish(clock)
			if ferr = <-fdone; ferr != nil {
				return fmt.Errorf("rank %d: fence: %w", tp, ferr)
			}
			cur = next
			// Resync: the L2 copies and new L1 copies of some chunks.
			next = cur.clone()
			seq++
			inv := wire.Inventory{Rank: rank, Incarnation: inc, Seq: seq}
			for c := range chain {
				if rng.IntN(3) == 0 {
					next.l1[c] = newVer(c)
				}
				for tier, v := range map[wire.Tier]copyVer{wire.L1: next.l1[c], wire.L2: next.l2[c]} {
					if v.ok {
						inv.Objects = append(inv.Objects, wire.Placement{Key: key(c), Tier: tier, Size: v.size, Sum: v.sum})
					}
				}
			}
			m.begin(next, false, clock)
			o, err := ix.ApplyInventory(ctx, inv)
			if err != nil || !o.Applied {
				return fmt.Errorf("rank %d: inventory: %+v, %v", tp, o, err)
			}
			m.finish(clock)
			cur = next
		default: // replace L1 copies in place (remove and store in one batch), add and drop L2 copies
			next := cur.clone()
			b := wire.Batch{Rank: rank, Incarnation: inc}
			for c := range chain {
				switch x := rng.IntN(6); {
				case x < 3:
					if next.l1[c].ok {
						seq++
						b.Events = append(b.Events, removed(seq, wire.L1, key(c)))
					}
					v := newVer(c)
					next.l1[c] = v
					seq++
					b.Events = append(b.Events, stored(seq, wire.L1, key(c), v.size, v.sum))
				case x == 3 && c < withL2:
					v := newVer(c)
					next.l2[c] = v
					seq++
					b.Events = append(b.Events, stored(seq, wire.L2, key(c), v.size, v.sum))
				case x == 4 && c >= withL2 && next.l2[c].ok:
					next.l2[c] = copyVer{}
					seq++
					b.Events = append(b.Events, removed(seq, wire.L2, key(c)))
				case x == 4 && c >= withL2:
					v := newVer(c)
					next.l2[c] = v
					seq++
					b.Events = append(b.Events, stored(seq, wire.L2, key(c), v.size, v.sum))
				}
			}
			if len(b.Events) == 0 {
				continue
			}
			if err := apply(b, next); err != nil {
				return err
			}
		}
	}
	return nil
}
