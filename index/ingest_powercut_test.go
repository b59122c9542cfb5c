package index_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/powercut"
	"github.com/kvtier/kvtier/wire"
)

// Power-cut test of the index (issue 29.6). durable_test.go can see an
// acknowledgement before the commit, not a commit that never reached the
// disk; here the index runs on a powercut mount, which drops every write
// not fsynced (and every name whose directory was not fsynced), and the
// power is cut at many points of an ingest: batches of two ranks, a
// restart answered by an inventory, checkpoints folding the log (small
// CheckpointBytes). After each crash the index must open and verify, and
// every rank must be exactly where the last acknowledged operation left
// it, or where the one in flight at the cut would have (it may or may not
// have landed): nothing acknowledged lost, no torn batch.

const powercutRanks = 2

// powercutStep is one index operation of the workload.
type powercutStep struct {
	name string
	do   func(*index.Index) error
}

// powercutWorkload returns the steps and, for each prefix of them, what
// each rank holds (its inventory) once that prefix is acknowledged.
func powercutWorkload() (steps []powercutStep, after [][]wire.Inventory) {
	ns := dcp.Namespace{0x9c, 0x01}
	sims := make([]*indextest.Rank, powercutRanks)
	for tp := range sims {
		keys := indextest.Keys(ns, 7, 256, powercutRanks, 1)
		sims[tp] = indextest.NewRank(wire.Rank{Instance: "powercut", TPRank: tp}, 1, keys, uint64(40+tp))
	}
	snapshot := func() []wire.Inventory {
		out := make([]wire.Inventory, len(sims))
		for i, s := range sims {
			out[i] = s.Inventory()
		}
		return out
	}
	after = append(after, snapshot())
	for i := range 24 {
		s := sims[i%powercutRanks]
		if i == 13 { // a rankd restart: its inventory replaces what it held
			s.Restart()
			s.Next(16)
			inv := s.Inventory()
			steps = append(steps, powercutStep{fmt.Sprintf("inventory %s inc %d seq %d", s.Rank, inv.Incarnation, inv.Seq),
				func(ix *index.Index) error { _, err := ix.ApplyInventory(ctx, inv); return err }})
		} else {
			b := s.Next(48)
			steps = append(steps, powercutStep{fmt.Sprintf("batch %s inc %d seq %d..%d", s.Rank, b.Incarnation,
				b.Events[0].Seq, b.Events[len(b.Events)-1].Seq),
				func(ix *index.Index) error {
					o, err := ix.Apply(ctx, b)
					if err == nil && o.Applied != len(b.Events) {
						return fmt.Errorf("applied %d of %d events: %+v", o.Applied, len(b.Events), o)
					}
					return err
				}})
		}
		after = append(after, snapshot())
	}
	return steps, after
}

func powercutConfig(dir string) index.Config {
	cfg := index.DefaultConfig() // the production durability options
	cfg.Path = filepath.Join(dir, "index.db")
	cfg.CheckpointBytes = 64 << 10 // folds within the workload
	cfg.FoldSliceChunks = 32
	return cfg
}

// matches reports whether ix holds, for every rank, exactly inv.
func powercutMatches(ix *index.Index, invs []wire.Inventory) error {
	for _, inv := range invs {
		info, err := ix.ListRank(inv.Rank)
		if err != nil {
			if inv.Seq == 0 && inv.Incarnation == 1 {
				continue // never acknowledged: unknown is right
			}
			return fmt.Errorf("rank %s: %w", inv.Rank, err)
		}
		if info.Incarnation != inv.Incarnation || info.LastSeq != inv.Seq || info.Fenced {
			return fmt.Errorf("rank %s at incarnation %d seq %d fenced %v, want incarnation %d seq %d",
				inv.Rank, info.Incarnation, info.LastSeq, info.Fenced, inv.Incarnation, inv.Seq)
		}
		if !slices.Equal(info.Placements, inv.Objects) {
			return fmt.Errorf("rank %s holds %d placements, want %d; first difference: %s",
				inv.Rank, len(info.Placements), len(inv.Objects), firstDiff(info.Placements, inv.Objects))
		}
	}
	return nil
}

func TestPowerCutIndexIngest(t *testing.T) {
	fs := powercut.Mount(t)
	steps, after := powercutWorkload()
	// run opens an index in a new directory (made durable first) and runs
	// the steps until one fails; it returns how many were acknowledged.
	run := func(name string, cut int64) (acked int, dir string) {
		dir = filepath.Join(fs.Dir(), name)
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		powercut.SyncDir(t, fs.Dir())
		if cut >= 0 {
			fs.CutAfter(cut)
		}
		ix, err := index.Open(powercutConfig(dir))
		if err != nil {
			if cut < 0 {
				t.Fatal(err)
			}
			fs.Crash()
			return 0, dir
		}
		defer ix.Close()
		for _, s := range steps {
			if err := s.do(ix); err != nil {
				if cut < 0 {
					t.Fatalf("%s: %v", s.name, err)
				}
				break
			}
			acked++
		}
		if cut >= 0 {
			fs.Crash() // before Close: closing must not get to make anything durable
		}
		return acked, dir
	}
	before := fs.Ops()
	run("uncut", -1)
	total := fs.Ops() - before
	const points = 30
	seen := make([]int, len(steps)+1) // crash points by steps acknowledged
	defer func() { t.Logf("%d mutations; crash points by steps acknowledged: %v", total, seen) }()
	for p := range points {
		cut := total * int64(p) / points
		acked, dir := run(fmt.Sprintf("cut-%d", cut), cut)
		seen[acked]++
		ix, err := index.Open(powercutConfig(dir))
		if err != nil {
			t.Fatalf("power cut after %d of %d mutations, %d of %d steps acknowledged: open: %v", cut, total, acked, len(steps), err)
		}
		if _, err := ix.Verify(ctx); err != nil {
			ix.Close()
			t.Fatalf("power cut after %d of %d mutations, %d steps acknowledged: verify: %v", cut, total, acked, err)
		}
		err = powercutMatches(ix, after[acked])
		if err != nil && acked < len(steps) && powercutMatches(ix, after[acked+1]) == nil {
			err = nil // the step in flight at the cut landed
		}
		ix.Close()
		if err != nil {
			last := "none"
			if acked > 0 {
				last = steps[acked-1].name
			}
			t.Fatalf("power cut after %d of %d mutations, %d of %d steps acknowledged (last: %s): %v",
				cut, total, acked, len(steps), last, err)
		}
	}
}
