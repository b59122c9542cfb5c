package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/objstore"
	"github.com/kvtier/kvtier/objstore/objstoretest"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// tierCounts fetches rank r's inventory and counts its placements by tier.
func (c *kv) tierCounts(r int) (map[wire.Tier]int, error) {
	rank := wire.Rank{Instance: "engine0", TPRank: r}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	inv, err := bus.FetchInventory(ctx, c.connFor(c.subj.Inventory(rank)), c.subj.Inventory(rank), 0, 0)
	if err != nil {
		return nil, fmt.Errorf("inventory of %s: %w", rank, err)
	}
	n := map[wire.Tier]int{}
	for _, o := range inv.Objects {
		n[o.Tier]++
	}
	return n, nil
}

// wipeL2 removes everything under the shared L2 directory (the ranks are
// down).
func (c *kv) wipeL2() {
	c.t.Helper()
	ents, err := os.ReadDir(c.l2D)
	if err != nil {
		c.t.Fatal(err)
	}
	for _, d := range ents {
		if err := os.RemoveAll(filepath.Join(c.l2D, d.Name())); err != nil {
			c.t.Fatal(err)
		}
	}
}

// TestL3RestoreAfterL1L2Wiped (issue 15.3): TP4/DCP1 with an L3 bucket on
// an in-process S3 server (gofakes3; the rankds talk to it over HTTP with
// minio-go). Every stored object is written behind to the bucket and
// announced as an L3 placement. With L1 and L2 gone (rankds restarted on
// a wiped L2 directory), the rankds find their L3 objects again and the
// restore is COMPLETE and byte-exact from L3. A payload byte flipped in
// one S3 object (rank 0's MLA object of chunk 1, read by all four ranks)
// fails exactly chunk 1; the next store heals it, and after another wipe
// the restore is COMPLETE again.
func TestL3RestoreAfterL1L2Wiped(t *testing.T) {
	srv := objstoretest.Start(t)
	c := newKV(t, 4)
	c.rankArgs = []string{"--l3-endpoint", srv.Endpoint, "--l3-bucket", srv.Bucket, "--l3-prefix", "kv/",
		"--l3-credentials", srv.CredentialsFile, "--l3-insecure"}
	c.startAll()
	c.mustSim("--scenario", "tp4dcp1", "--phase", "store")

	// Write-through and write-behind settle: every rank's L3 copies equal
	// its L2 copies, and the index agrees with every inventory.
	want := make([]int, c.tp)
	c.eventually(60*time.Second, "L3 write-behind finished and reported", func() error {
		for r := range c.tp {
			n, err := c.tierCounts(r)
			if err != nil {
				return err
			}
			if n[wire.L2] == 0 || n[wire.L3] != n[wire.L2] {
				return fmt.Errorf("rank %d: %d L2, %d L3 placements", r, n[wire.L2], n[wire.L3])
			}
			want[r] = n[wire.L3]
		}
		return c.agree()
	})
	restartWiped := func(what string) {
		t.Helper()
		c.stopRanks()
		c.wipeL2()
		for r := range c.tp {
			c.startRank(r)
		}
		c.eventually(60*time.Second, what+": the L3 scan found every object and the index has them", func() error {
			for r := range c.tp {
				n, err := c.tierCounts(r)
				if err != nil {
					return err
				}
				if n[wire.L1] != 0 || n[wire.L2] != 0 || n[wire.L3] != want[r] {
					return fmt.Errorf("rank %d: inventory %v, want %d L3 placements only", r, n, want[r])
				}
			}
			return c.agree()
		})
	}
	restartWiped("first restart")
	res := c.mustSim("--scenario", "tp4dcp1", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("restore from L3: %+v", res)
	}
	for _, r := range res.Ranks {
		if r.Placed != r.Items || r.Mismatch != 0 || r.Outside != 0 {
			t.Fatalf("restore from L3: rank %d: %+v", r.Rank, r)
		}
	}

	// Flip a payload byte of rank 0's MLA object of chunk 1 in the bucket.
	sc, err := enginesim.LookupScenario("tp4dcp1")
	if err != nil {
		t.Fatal(err)
	}
	plan, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		t.Fatal(err)
	}
	store, err := objstore.Open(context.Background(), srv.Config("kv/"))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	name := transfer.NewL3Tier(store, "engine0", nil).Name(dcp.Key{NS: plan.R.Namespace, Chunk: plan.Hashes[1], Shard: 0, Group: 0})
	body, _, err := store.Open(context.Background(), name, 0, 0)
	if err != nil {
		t.Fatalf("the MLA object of chunk 1 is not in the bucket: %v", err)
	}
	obj, err := io.ReadAll(body)
	body.Close()
	if err != nil {
		t.Fatal(err)
	}
	obj[len(obj)-100] ^= 0x01
	if err := store.Put(context.Background(), name, bytes.NewReader(obj), int64(len(obj))); err != nil {
		t.Fatal(err)
	}
	restartWiped("after the corruption") // L1 holds the restored objects: empty it
	res, out, err := c.sim("--scenario", "tp4dcp1", "--phase", "restore", "--expect-fail")
	if err != nil || res == nil || !res.OK || res.Verdict != wire.VerdictFailed || !equalInts(res.Failed, []int{1}) {
		t.Fatalf("restore with chunk 1's MLA object corrupted in the bucket: %+v %v\n%s", res, err, tail(out, 40))
	}
	if _, _, err := store.Open(context.Background(), name, 0, 0); err == nil {
		t.Fatal("the corrupted object is still in the bucket")
	}

	// The engine recomputes and stores again: the store heals L3.
	c.mustSim("--scenario", "tp4dcp1", "--phase", "store")
	c.eventually(60*time.Second, "chunk 1's MLA object back in the bucket", func() error {
		_, _, err := store.Open(context.Background(), name, 0, 0)
		return err
	})
	c.eventually(60*time.Second, "L3 write-behind after the healing store", func() error {
		n, err := c.tierCounts(0)
		if err != nil {
			return err
		}
		if n[wire.L3] != want[0] {
			return fmt.Errorf("rank 0: %d L3 placements, want %d", n[wire.L3], want[0])
		}
		return nil
	})
	restartWiped("after the healing store")
	res = c.mustSim("--scenario", "tp4dcp1", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("restore from L3 after the healing store: %+v", res)
	}
}
