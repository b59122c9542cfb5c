package index

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
	bolt "go.etcd.io/bbolt"
	"go.uber.org/zap/zaptest"
)

// The model test of sliced inventories: the same random script of
// requests, queued at once so the committer interleaves them with the
// slices as it likes, runs against an index that applies inventories in
// one piece and one that slices them (1 to 5 units a slice); every
// request's answer, every rank's state, Verify, and after Close every
// byte of the chunks and ranks buckets must be equal. The script mixes
// the resynced rank's own batches (in order, duplicates, gaps, a newer
// incarnation), other ranks' batches, FenceRank (sliced too), ResetRank,
// stale and second inventories, and Verify (which finishes the slices).

type scriptOp struct {
	kind  reqKind
	batch *wire.Batch
	inv   *wire.Inventory
	rank  wire.Rank
	upTo  uint64
}

type modelRank struct {
	r        wire.Rank
	inc, seq uint64
}

func modelKey(rng *rand.Rand) dcp.Key {
	return dcp.Key{NS: dcp.Namespace{byte(1 + rng.IntN(2))}, Chunk: dcp.ChunkHash{byte(rng.IntN(24))},
		Shard: uint16(rng.IntN(2)), Group: uint16(rng.IntN(2))}
}

func modelTier(rng *rand.Rand) wire.Tier { return wire.Tier(1 + rng.IntN(2)) }

// batch of 1-6 events continuing mr's sequence (sometimes with a gap or
// a duplicate).
func (mr *modelRank) batch(rng *rand.Rand) *wire.Batch {
	b := &wire.Batch{Rank: mr.r, Incarnation: mr.inc}
	start := mr.seq + 1
	switch rng.IntN(10) {
	case 0:
		start += 2 // a gap
	case 1:
		start = max(1, mr.seq-1) // a duplicate
	}
	n := 1 + rng.IntN(6)
	for i := range n {
		seq := start + uint64(i)
		e := wire.Event{Seq: seq, Kind: wire.Stored, Tier: modelTier(rng), Key: modelKey(rng), Size: 1 + rng.Uint64N(1000), Sum: 1 + rng.Uint64N(1<<40)}
		if rng.IntN(3) == 0 {
			e.Kind, e.Size, e.Sum = wire.Removed, 0, 0
		}
		b.Events = append(b.Events, e)
	}
	mr.seq = max(mr.seq, start+uint64(n)-1)
	return b
}

func (mr *modelRank) inventory(rng *rand.Rand) *wire.Inventory {
	inv := &wire.Inventory{Rank: mr.r, Incarnation: mr.inc, Seq: mr.seq}
	switch rng.IntN(8) {
	case 0:
		inv.Incarnation++ // the rank restarted
		mr.inc, mr.seq = inv.Incarnation, 0
		inv.Seq = 0
	case 1:
		inv.Seq = max(1, mr.seq) - 1 // stale unless the index is behind
	default:
		inv.Seq += uint64(rng.IntN(3))
		mr.seq = inv.Seq
	}
	seen := map[slotKey]bool{}
	for range rng.IntN(40) {
		k, tier := modelKey(rng), modelTier(rng)
		s := slotKey{chunkRef{k.NS, k.Chunk}, k.Shard, k.Group, tier}
		if seen[s] {
			continue
		}
		seen[s] = true
		inv.Objects = append(inv.Objects, wire.Placement{Key: k, Tier: tier, Size: 1 + rng.Uint64N(1000), Sum: 1 + rng.Uint64N(1<<40)})
	}
	return inv
}

func modelScript(seed uint64) []scriptOp {
	rng := rand.New(rand.NewPCG(seed, 77))
	ranks := []*modelRank{{r: wire.Rank{Instance: "m", TPRank: 0}, inc: 5}, {r: wire.Rank{Instance: "m", TPRank: 1}, inc: 5},
		{r: wire.Rank{Instance: "o", TPRank: 0}, inc: 2}}
	var ops []scriptOp
	for range 200 {
		mr := ranks[0]
		if rng.IntN(3) == 0 {
			mr = ranks[1+rng.IntN(2)]
		}
		switch x := rng.IntN(100); {
		case x < 60:
			ops = append(ops, scriptOp{kind: reqBatch, batch: mr.batch(rng)})
		case x < 80:
			ops = append(ops, scriptOp{kind: reqInventory, inv: mr.inventory(rng)})
		case x < 85:
			mr.inc++ // a restart: the next batch is a new incarnation
			mr.seq = 0
			ops = append(ops, scriptOp{kind: reqBatch, batch: mr.batch(rng)})
		case x < 92:
			upTo := mr.inc
			if rng.IntN(4) == 0 {
				upTo = math.MaxUint64
			}
			ops = append(ops, scriptOp{kind: reqFence, rank: mr.r, upTo: upTo})
		case x < 95:
			ops = append(ops, scriptOp{kind: reqReset, rank: mr.r})
			mr.seq = 0
		default:
			ops = append(ops, scriptOp{kind: reqVerify})
		}
	}
	return ops
}

// runScript queues every op at once and returns, per op, its answer.
// counts false leaves out the placement counts of fences and inventories:
// with sliced fences they depend on how far a fence got before an
// inventory or a new incarnation ended it (index/fence.go).
func runScript(t *testing.T, ix *Index, ops []scriptOp, counts bool) []string {
	t.Helper()
	reqs := make([]*request, len(ops))
	for i, op := range ops {
		r := &request{kind: op.kind, batch: op.batch, inv: op.inv, rank: op.rank, upTo: op.upTo, n: 1}
		if op.batch != nil {
			r.n = len(op.batch.Events)
		}
		if op.inv != nil {
			r.n = len(op.inv.Objects) + 1
		}
		if err := ix.enqueue(context.Background(), r); err != nil {
			t.Fatal(err)
		}
		reqs[i] = r
	}
	out := make([]string, len(ops))
	for i, r := range reqs {
		<-r.done
		o := r.out
		o.RemovedUnknown = 0 // a harmless count that depends on when a removal meets the slices
		io := r.invOut
		if !counts {
			r.fenced, io.Replaced, io.Fenced, o.Fenced = 0, 0, 0, 0
		}
		rep := ""
		if r.kind == reqVerify {
			rep = fmt.Sprint(r.report.Problems)
		}
		out[i] = fmt.Sprintf("%+v %+v fenced %d err %v %s", o, io, r.fenced, r.err, rep)
	}
	return out
}

func buckets(t *testing.T, path string) map[string]string {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	out := map[string]string{}
	err = db.View(func(tx *bolt.Tx) error {
		for _, name := range [][]byte{bucketSnap, bucketRanks, bucketLog} {
			var buf bytes.Buffer
			_ = tx.Bucket(name).ForEach(func(k, v []byte) error {
				fmt.Fprintf(&buf, "%x=%x\n", k, v)
				return nil
			})
			out[string(name)] = buf.String()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestSlicedInventoryModel(t *testing.T) {
	for seed := range uint64(80) {
		ops := modelScript(seed)
		// Even seeds fence and reset in one piece and compare every
		// count; odd ones also slice the second index's fences and resets
		// (3 chunks a slice), the first one fencing and resetting in one
		// piece.
		fenceSlice, counts := 1<<20, seed%2 == 0
		if !counts {
			fenceSlice = 3
		}
		var answers [2][]string
		var ranks [2][]RankInfo
		var disk [2]map[string]string
		for k, slice := range []int{math.MaxInt32, 1 + int(seed%5)} {
			cfg := DefaultConfig()
			cfg.Path = filepath.Join(t.TempDir(), "index.db")
			cfg.Logger = zaptest.NewLogger(t)
			cfg.NoSync = true
			cfg.InventorySlice = slice
			cfg.FenceSliceChunks = fenceSlice
			if k == 0 {
				cfg.FenceSliceChunks = 1 << 20
			}
			ix, err := Open(cfg)
			if err != nil {
				t.Fatal(err)
			}
			answers[k] = runScript(t, ix, ops, counts)
			if rep, err := ix.Verify(context.Background()); err != nil {
				t.Fatalf("seed %d slice %d: %v %v", seed, slice, err, rep.Problems)
			}
			for _, ri := range ix.Ranks() {
				full, err := ix.ListRank(ri.Rank)
				if err != nil {
					t.Fatal(err)
				}
				ranks[k] = append(ranks[k], full)
			}
			if err := ix.Close(); err != nil {
				t.Fatal(err)
			}
			disk[k] = buckets(t, cfg.Path)
		}
		for i := range ops {
			if answers[0][i] != answers[1][i] {
				t.Fatalf("seed %d op %d (%v): one-shot answered\n%s\nsliced answered\n%s", seed, i, ops[i].kind, answers[0][i], answers[1][i])
			}
		}
		if !reflect.DeepEqual(ranks[0], ranks[1]) {
			t.Fatalf("seed %d: ranks differ:\none-shot %+v\nsliced   %+v", seed, ranks[0], ranks[1])
		}
		for name, v := range disk[0] {
			if disk[1][name] != v {
				t.Fatalf("seed %d: bucket %s differs:\none-shot\n%s\nsliced\n%s", seed, name, v, disk[1][name])
			}
		}
	}
}
