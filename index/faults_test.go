package index_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestFaultyTransport drives simulated ranks through a transport that
// drops, duplicates and reorders batches, with restarts and false deaths
// (FenceRank of a live rank) mixed in. The coordinator side resyncs with an
// inventory whenever an outcome asks for one; at the end every rank
// retransmits what the index has not acknowledged (as rankd does), and the
// index must agree exactly with every rank's own inventory, and Verify
// must pass.
func TestFaultyTransport(t *testing.T) {
	faults := map[string]indextest.Faults{
		"clean":     {},
		"drop":      {Drop: 0.15},
		"duplicate": {Duplicate: 0.3},
		"reorder":   {Reorder: 0.3},
		"all":       {Drop: 0.1, Duplicate: 0.2, Reorder: 0.2},
	}
	var mu sync.Mutex
	total := map[string]int{}
	for name, f := range faults {
		for seed := range uint64(3) {
			t.Run(fmt.Sprintf("%s/seed%d", name, seed), func(t *testing.T) {
				c := runScenario(t, seed, f)
				mu.Lock()
				for k, v := range c {
					total[k] += v
				}
				mu.Unlock()
			})
		}
	}
	t.Logf("outcomes over all scenarios: %v", total)
	// The faults must have exercised every rule.
	for _, k := range []string{"duplicate", "gap", "stale_incarnation", "fenced_rank", "new_incarnation", "inventory", "fenced"} {
		if total[k] == 0 {
			t.Errorf("no scenario produced %q", k)
		}
	}
}

func runScenario(t *testing.T, seed uint64, f indextest.Faults) map[string]int {
	ix := openTest(t, "", func(c *index.Config) {
		c.CheckpointBytes = 16 << 10 // fold often: replay and snapshot both in play
		c.NoSync = true
		c.FenceSliceChunks = 8 // fences of most ranks in slices (index/fence.go)
	})
	rng := rand.New(rand.NewPCG(seed, 42))
	keys := indextest.Keys(testNS, seed, 96, 2, 2) // shared: chunks get several holders
	var sims []*indextest.Rank
	byRank := map[wire.Rank]*indextest.Rank{}
	for i, inst := range []string{"a", "a", "b", "b"} {
		r := wire.Rank{Instance: inst, TPRank: i % 2}
		s := indextest.NewRank(r, 1, keys, seed*10+uint64(i))
		sims = append(sims, s)
		byRank[r] = s
	}
	tr := indextest.NewTransport(f, seed)
	counts := map[string]int{}
	deliver := func(b wire.Batch) {
		t.Helper()
		o := mustApply(t, ix.Index, b)
		counts["applied"] += o.Applied
		counts["duplicate"] += o.Duplicates
		if o.Dropped > 0 {
			counts[string(o.Reason)]++
		}
		if o.NewIncarnation {
			counts["new_incarnation"]++
		}
		counts["fenced"] += o.Fenced
		if o.Resync {
			io := mustInventory(t, ix.Index, byRank[b.Rank].Inventory())
			if !io.Applied {
				t.Fatalf("resync inventory of %s dropped: %+v", b.Rank, io)
			}
			counts["inventory"]++
		}
	}
	deferred := map[*indextest.Rank]bool{} // restarted ranks whose rescan inventory is late
	for step := range 400 {
		s := sims[rng.IntN(len(sims))]
		switch x := rng.IntN(100); {
		case x < 3:
			s.Restart()
			if rng.IntN(2) == 0 {
				mustInventory(t, ix.Index, s.Inventory())
			} else {
				deferred[s] = true // its new events may arrive first
			}
		case x < 5:
			if _, err := ix.FenceRank(ctx, s.Rank, math.MaxUint64); err != nil {
				t.Fatal(err)
			}
		case x < 8 && deferred[s]:
			// The rescan finished: the rank sends its inventory as of now.
			mustInventory(t, ix.Index, s.Inventory())
			delete(deferred, s)
		default:
			for _, b := range tr.Send(s.Next(1 + rng.IntN(24))) {
				deliver(b)
			}
		}
		if step%100 == 99 {
			mustVerify(t, ix.Index)
		}
	}
	for _, b := range tr.Flush() {
		deliver(b)
	}
	for s := range deferred {
		mustInventory(t, ix.Index, s.Inventory())
	}
	// Retransmit whatever the index has not acknowledged.
	for _, s := range sims {
		from := uint64(0)
		if info, err := ix.ListRank(s.Rank); err == nil && info.Incarnation == s.Incarnation {
			from = info.LastSeq
		}
		deliver(s.Since(from))
	}
	agree(t, ix.Index, sims...)
	// And again after a reopen.
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	ix2 := openTest(t, dirOf(ix.path), nil)
	agree(t, ix2.Index, sims...)
	return counts
}

// TestGroupCommit: concurrent callers' batches share transactions, and
// each caller's view afterwards is exactly its rank's.
func TestGroupCommit(t *testing.T) {
	ix := openTest(t, "", func(c *index.Config) { c.MaxGroupDelay = 500e3 }) // 0.5 ms
	const ranks, batches = 8, 60
	keys := indextest.Keys(testNS, 9, 256, 8, 1)
	sims := make([]*indextest.Rank, ranks)
	var wg sync.WaitGroup
	errs := make(chan error, ranks)
	for i := range sims {
		sims[i] = indextest.NewRank(wire.Rank{Instance: "g", TPRank: i}, 1, keys, uint64(i))
		wg.Add(1)
		go func(s *indextest.Rank) {
			defer wg.Done()
			for range batches {
				o, err := ix.Apply(ctx, s.Next(32))
				if err != nil || o.Applied != 32 {
					errs <- fmt.Errorf("%s: %+v %v", s.Rank, o, err)
					return
				}
			}
		}(sims[i])
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	commits := testutil.Metric(t, ix.reg, "kvtier_index_commits_total")
	if commits >= ranks*batches {
		t.Fatalf("%v commits for %d batches: no group commit", commits, ranks*batches)
	}
	t.Logf("%d batches in %v commits", ranks*batches, commits)
	agree(t, ix.Index, sims...)
}

// TestApplyAsyncOrder: one producer with many batches in flight; they are
// applied in the order queued, so no gap ever appears.
func TestApplyAsyncOrder(t *testing.T) {
	ix := openTest(t, "", nil)
	s := indextest.NewRank(wire.Rank{Instance: "async", TPRank: 0}, 1, indextest.Keys(testNS, 5, 512, 1, 1), 5)
	var ps []*index.Pending
	for range 200 {
		p, err := ix.ApplyAsync(ctx, s.Next(16))
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	for i, p := range ps {
		<-p.Done()
		o, err := p.Wait()
		if err != nil || o.Applied != 16 || o.LastSeq != uint64(16*(i+1)) {
			t.Fatalf("batch %d: %+v %v", i, o, err)
		}
	}
	if _, err := ix.ApplyAsync(ctx, wire.Batch{Rank: wire.Rank{}}); !errors.Is(err, index.ErrInvalid) {
		t.Fatalf("invalid async batch: %v", err)
	}
	agree(t, ix.Index, s)
}

// TestConcurrentRanks: ranks driven concurrently, each through its own
// faulty transport, with restarts, false deaths and resyncs, so groups mix
// every kind of request and the committer's pipeline stages fences and
// inventories on top of commits in flight. The index must agree exactly
// with every rank at the end.
func TestConcurrentRanks(t *testing.T) {
	ix := openTest(t, "", func(c *index.Config) {
		c.CheckpointBytes = 64 << 10
		c.FenceSliceChunks = 8 // fences in slices, racing the ranks' batches
	})
	keys := indextest.Keys(testNS, 77, 128, 2, 1)
	const nRanks = 6
	sims := make([]*indextest.Rank, nRanks)
	var wg sync.WaitGroup
	errs := make(chan error, nRanks)
	for i := range sims {
		s := indextest.NewRank(wire.Rank{Instance: []string{"p", "q"}[i%2], TPRank: i / 2}, 1, keys, uint64(100+i))
		sims[i] = s
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 9))
			tr := indextest.NewTransport(indextest.Faults{Drop: 0.05, Duplicate: 0.1, Reorder: 0.1}, uint64(i))
			deliver := func(b wire.Batch) error {
				o, err := ix.Apply(ctx, b)
				if err != nil {
					return err
				}
				if o.Resync {
					if _, err := ix.ApplyInventory(ctx, s.Inventory()); err != nil {
						return err
					}
				}
				return nil
			}
			for range 150 {
				var err error
				switch x := rng.IntN(100); {
				case x < 3:
					s.Restart()
					_, err = ix.ApplyInventory(ctx, s.Inventory())
				case x < 6:
					_, err = ix.FenceRank(ctx, s.Rank, math.MaxUint64)
				default:
					for _, b := range tr.Send(s.Next(1 + rng.IntN(16))) {
						if err = deliver(b); err != nil {
							break
						}
					}
				}
				if err != nil {
					errs <- err
					return
				}
			}
			for _, b := range tr.Flush() {
				if err := deliver(b); err != nil {
					errs <- err
					return
				}
			}
			from := uint64(0)
			if info, err := ix.ListRank(s.Rank); err == nil && info.Incarnation == s.Incarnation {
				from = info.LastSeq
			}
			if err := deliver(s.Since(from)); err != nil {
				errs <- err
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	agree(t, ix.Index, sims...)
}
