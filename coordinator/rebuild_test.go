package coordinator

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// damageIndex breaks one chunk record inside the bbolt file of dir.
func damageIndex(t *testing.T, dir string) {
	t.Helper()
	db, err := bolt.Open(filepath.Join(dir, IndexFile), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("chunks"))
		if b == nil {
			return errors.New("no chunks bucket")
		}
		k, _ := b.Cursor().First()
		if k == nil {
			return errors.New("no chunk record")
		}
		return b.Put(append([]byte(nil), k...), []byte{0xff, 0xff, 0xff})
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
}

func holdersOf(ix *index.Index, keys []dcp.Key) [][]index.Holder {
	out := make([][]index.Holder, len(keys))
	for i, k := range keys {
		out[i] = ix.Get(k)
		for j := range out[i] {
			out[i][j].Seq = 0 // the sequence that put it there differs: an inventory
		}
	}
	return out
}

// TestRebuildIndexFromInventories (issue 15.2): with RebuildIndex, a
// damaged index is renamed aside (its bytes kept), the coordinator starts
// empty and asks the rank that joins for its inventory, and the index
// then returns the same placements as before the damage. A healthy index
// is kept as it is.
func TestRebuildIndexFromInventories(t *testing.T) {
	dir := t.TempDir()
	r := wire.Rank{Instance: "eng", TPRank: 0}
	inc := cluster.NewIncarnation()
	c := startCoord(t, func(cfg *Config) { cfg.DataDir = dir })
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	chunks := chain(ns, 4, 1)
	l1 := storeBatch(r, inc, 0, ns, chunks, wire.L1)
	l2 := storeBatch(r, inc, 4, ns, chunks[:3], wire.L2)
	for _, b := range []*wire.Batch{l1, l2} {
		if _, werr := sendBatch(t, nc, c.subj, b); werr != nil {
			t.Fatal(werr)
		}
	}
	var keys []dcp.Key
	for _, e := range l1.Events {
		keys = append(keys, e.Key)
	}
	before := holdersOf(c.Index(), keys)
	if len(before[0]) != 2 || len(before[3]) != 1 {
		t.Fatalf("before: %+v", before)
	}
	nc.Close()
	c.Shutdown()
	damageIndex(t, dir)
	damaged, err := os.ReadFile(filepath.Join(dir, IndexFile))
	if err != nil {
		t.Fatal(err)
	}

	c2 := startCoord(t, func(cfg *Config) { cfg.DataDir = dir; cfg.RebuildIndex = true })
	aside, _ := filepath.Glob(filepath.Join(dir, IndexFile+".damaged-*"))
	if len(aside) != 1 {
		t.Fatalf("damaged files set aside: %q, want one", aside)
	}
	// It is the damaged file (the failed open may have rewritten bbolt's
	// pages, not the records): its damaged chunk record is still there.
	db, err := bolt.Open(aside[0], 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	_ = db.View(func(tx *bolt.Tx) error {
		if b := tx.Bucket([]byte("chunks")); b != nil {
			_, v := b.Cursor().First()
			found = bytes.Equal(v, []byte{0xff, 0xff, 0xff})
		}
		return nil
	})
	db.Close()
	if !found || len(damaged) == 0 {
		t.Fatal("the file set aside is not the damaged index")
	}
	if st := c2.Index().Stats(); st.Objects != 0 {
		t.Fatalf("the rebuilt index starts with %d objects, want 0", st.Objects)
	}
	if v := testutil.Metric(t, c2.reg, "kvtier_coord_index_rebuilds_total"); v != 1 {
		t.Fatalf("index_rebuilds_total = %v, want 1", v)
	}
	// The rank joins; the coordinator asks it for its inventory.
	inv := inventoryOf(r, inc, 7, append(slices.Clone(l1.Events), l2.Events...))
	requests := serveInventory(t, c2, r, inv)
	startRankMemberInc(t, c2, r, 1, inc)
	testutil.Eventually(t, 30*time.Second, "the index equals the inventory", func() bool {
		got := holdersOf(c2.Index(), keys)
		for i := range got {
			if !slices.Equal(got[i], before[i]) {
				return false
			}
		}
		return true
	})
	if requests.Load() == 0 {
		t.Fatal("no inventory was asked for")
	}
	if rep, err := c2.Index().Verify(tctx(t)); err != nil || !rep.OK() {
		t.Fatalf("verify after the rebuild: %+v %v", rep, err)
	}
	c2.Shutdown()

	// A healthy index is kept with the flag set.
	c3 := startCoord(t, func(cfg *Config) { cfg.DataDir = dir; cfg.RebuildIndex = true })
	if aside, _ := filepath.Glob(filepath.Join(dir, IndexFile+".damaged-*")); len(aside) != 1 {
		t.Fatalf("a healthy index was set aside: %q", aside)
	}
	if got := holdersOf(c3.Index(), keys); !slices.EqualFunc(got, before, slices.Equal) {
		t.Fatalf("after a restart with the flag on a healthy index: %+v, want %+v", got, before)
	}
}

// TestRebuildIndexRefusedWithRaft: RebuildIndex and replicated mode
// exclude each other at Validate. A replica that rebuilt its index from
// inventories would hold state the raft log never committed and diverge
// from the other replicas. Seen failing before the rule: Validate
// accepted the pair.
func TestRebuildIndexRefusedWithRaft(t *testing.T) {
	cfg := testConfig(t, t.TempDir())
	cfg.RebuildIndex = true
	if err := cfg.Validate(); err != nil {
		t.Fatalf("rebuild without raft: %v", err)
	}
	cfg.Raft.ID, cfg.Raft.Dir = "n1", t.TempDir()
	err := cfg.Validate()
	const want = "--rebuild-index is for a single coordinator: in replicated mode (raft id \"n1\") a replica rebuilt from the ranks' inventories would diverge from the raft log: invalid coordinator config"
	if !errors.Is(err, ErrConfig) || err.Error() != want {
		t.Fatalf("Validate = %v\nwant %s", err, want)
	}
	cfg.RebuildIndex = false
	if err := cfg.Validate(); err != nil {
		t.Fatalf("raft without rebuild: %v", err)
	}
}
