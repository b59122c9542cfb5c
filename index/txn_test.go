package index

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// op is one request for the txn model test.
type op struct {
	batch *wire.Batch
	inv   *wire.Inventory
	fence *wire.Rank
}

func (o op) apply(t *txn) string {
	switch {
	case o.batch != nil:
		return fmt.Sprintf("%+v", t.applyBatch(o.batch))
	case o.inv != nil:
		return fmt.Sprintf("%+v", t.applyInventory(o.inv, 0, false))
	default:
		return fmt.Sprint(t.fenceRank(*o.fence, math.MaxUint64))
	}
}

// randomOps makes a stream of batches (with duplicates, gaps, old and new
// incarnations), inventories and fences over a few ranks and keys.
func randomOps(rng *rand.Rand, n int) []op {
	ranks := []wire.Rank{{Instance: "a", TPRank: 0}, {Instance: "a", TPRank: 1}, {Instance: "b", TPRank: 0}}
	inc := map[wire.Rank]uint64{}
	seq := map[wire.Rank]uint64{}
	key := func() dcp.Key {
		return dcp.Key{NS: dcp.Namespace{byte(rng.IntN(2))}, Chunk: dcp.ChunkHash{byte(rng.IntN(6))},
			Shard: uint16(rng.IntN(2)), Group: uint16(rng.IntN(2))}
	}
	var ops []op
	for range n {
		r := ranks[rng.IntN(len(ranks))]
		if inc[r] == 0 {
			inc[r] = 1
		}
		switch x := rng.IntN(100); {
		case x < 5:
			inc[r]++
			seq[r] = 0
		case x < 9:
			ops = append(ops, op{fence: &r})
		case x < 14:
			inv := &wire.Inventory{Rank: r, Incarnation: inc[r] - uint64(rng.IntN(2)), Seq: seq[r] + uint64(rng.IntN(3))}
			for range rng.IntN(6) {
				k := key()
				tier := wire.Tier(1 + rng.IntN(2))
				if !slices.ContainsFunc(inv.Objects, func(p wire.Placement) bool { return p.Key == k && p.Tier == tier }) {
					inv.Objects = append(inv.Objects, wire.Placement{Key: k, Tier: tier, Size: rng.Uint64N(100), Sum: rng.Uint64()})
				}
			}
			ops = append(ops, op{inv: inv})
		default:
			b := &wire.Batch{Rank: r, Incarnation: inc[r]}
			start := seq[r] + 1
			if rng.IntN(6) == 0 && start > 2 {
				start -= 2 // duplicates
			}
			if rng.IntN(8) == 0 {
				start += 2 // a gap
			}
			for i := range uint64(1 + rng.IntN(6)) {
				kind := wire.Stored
				if rng.IntN(4) == 0 {
					kind = wire.Removed
				}
				b.Events = append(b.Events, wire.Event{Seq: start + i, Kind: kind, Tier: wire.Tier(1 + rng.IntN(2)),
					Key: key(), Size: rng.Uint64N(100), Sum: rng.Uint64()})
			}
			seq[r] = max(seq[r], start+uint64(len(b.Events))-1)
			if rng.IntN(10) == 0 {
				b.Incarnation-- // a stale incarnation now and then
			}
			ops = append(ops, op{batch: b})
		}
	}
	return ops
}

// TestPipelinedTxnsMatchSequential: staging a group on top of a parent
// txn that is not yet published (the committer's pipeline) gives the same
// outcomes and the same state as applying every request one by one.
func TestPipelinedTxnsMatchSequential(t *testing.T) {
	defer func(s int) { compactSlack = s }(compactSlack)
	for seed := range uint64(300) {
		compactSlack = int(seed % 3) // compact the rank chunk lists early and often
		pipelinedVsSequential(t, seed, nil)
	}
}

// pipelinedVsSequential applies seed's random ops (changed by mod, when
// given) one by one to one state and in pipelined txns to another, and
// fails t unless outcomes and states agree and both pass their checks.
func pipelinedVsSequential(t *testing.T, seed uint64, mod func([]op)) (seqSt, pipeSt *state) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 11))
	ops := randomOps(rng, 60)
	if mod != nil {
		mod(ops)
	}

	seqSt = newState()
	var want []string
	for _, o := range ops {
		var enc opEncoder
		enc.reset()
		tx := newTxn(seqSt, &enc)
		want = append(want, o.apply(tx))
		seqSt.publishRanks(tx)
		seqSt.publishChunks(tx, 0, len(tx.staged))
	}

	pipeSt = newState()
	var got []string
	var encs [2]opEncoder
	var parent *txn
	for i := 0; i < len(ops); {
		k := 1 + rng.IntN(5)
		enc := &encs[i%2]
		enc.reset()
		tx := newTxn(pipeSt, enc)
		tx.parent = parent
		for ; k > 0 && i < len(ops); k, i = k-1, i+1 {
			if tx.parent != nil && rng.IntN(3) == 0 { // the parent lands mid-staging
				pipeSt.publishRanks(parent)
				pipeSt.publishChunks(parent, 0, len(parent.staged))
				tx.detach()
			}
			got = append(got, ops[i].apply(tx))
		}
		if tx.parent != nil { // the parent lands after its child was staged
			pipeSt.publishRanks(parent)
			pipeSt.publishChunks(parent, 0, len(parent.staged))
			tx.detach()
		}
		parent = tx
	}
	pipeSt.publishRanks(parent)
	pipeSt.publishChunks(parent, 0, len(parent.staged))

	if !slices.Equal(got, want) {
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("seed %d op %d: pipelined outcome %s, sequential %s", seed, i, got[i], want[i])
			}
		}
	}
	var pr problems
	compareStates(&pr, pipeSt, seqSt)
	checkInvariants(&pr, pipeSt)
	checkRankChunks(&pr, pipeSt)
	checkRankChunks(&pr, seqSt)
	if len(pr.list) > 0 {
		t.Fatalf("seed %d: %v", seed, pr.list)
	}
	return seqSt, pipeSt
}
