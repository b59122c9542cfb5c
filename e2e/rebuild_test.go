package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// placementsByKey returns, for every object any rank's inventory lists,
// the index's placements of it (sequence numbers cleared: a resync
// assigns the inventory's), as sorted strings.
func (c *kv) placementsByKey() (map[string][]string, error) {
	out := map[string][]string{}
	for r := range c.tp {
		rank := wire.Rank{Instance: "engine0", TPRank: r}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		inv, err := bus.FetchInventory(ctx, c.connFor(c.subj.Inventory(rank)), c.subj.Inventory(rank), 0, 0)
		cancel()
		if err != nil {
			return nil, err
		}
		for _, o := range inv.Objects {
			k := o.Key.String()
			if _, done := out[k]; done {
				continue
			}
			rep, err := admin[wire.AdminObjectReply](c, wire.AdminObject, wire.AdminObjectRequest{Key: k})
			if err != nil {
				return nil, err
			}
			var ps []string
			for _, ob := range rep.Objects {
				for _, p := range ob.Placements {
					ps = append(ps, fmt.Sprintf("%s %s %d %x %d", p.Holder, p.Tier, p.Size, p.Sum, p.Incarnation))
				}
			}
			slices.Sort(ps)
			out[k] = ps
		}
	}
	return out, nil
}

// TestIndexRebuildFromRanks (issue 15.2): the coordinator's index file is
// damaged while it is down; a plain restart refuses it; 'serve
// --rebuild-index' sets it aside (renamed, kept), starts empty and
// refills the index from the four ranks' inventories: every object has the
// same placements as before, the index agrees with every inventory, and
// the prompt restores COMPLETE.
func TestIndexRebuildFromRanks(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	c.mustSim("--scenario", "tp4dcp1", "--phase", "store")
	c.waitL2([]int64{16, 8, 8, 8})
	c.eventually(60*time.Second, "index agrees with the inventories", c.agree)
	before, err := c.placementsByKey()
	if err != nil {
		t.Fatal(err)
	}

	c.coord.stop()
	// Damage both bbolt meta pages: the file no longer opens.
	path := filepath.Join(c.dir, "index", "index.db")
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	junk := []byte(strings.Repeat("damaged!", 1024))
	for _, off := range []int64{0, 4096} {
		if _, err := f.WriteAt(junk[:4096], off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()

	// A plain start refuses the damaged index.
	args := []string{bin.coordinator, "serve", "--data-dir", filepath.Join(c.dir, "index"),
		"--nats-host", c.natsHost, "--nats-port", fmt.Sprint(c.natsPort), "--bind", c.gossip, "--http", "127.0.0.1:0"}
	refused := startProc(t, "coordinator-refused", filepath.Join(c.logD, "coordinator-refused.log"), append(args, c.credsArgs()...)...)
	if err := refused.wait(30 * time.Second); err == nil || !strings.Contains(refused.output(), "refusing to start") {
		t.Fatalf("a plain start on the damaged index: %v\n%s", err, tail(refused.output(), 10))
	}

	c.coordArgs = append(c.coordArgs, "--rebuild-index")
	c.startCoordinator()
	aside, _ := filepath.Glob(path + ".damaged-*")
	if len(aside) != 1 {
		t.Fatalf("damaged index files set aside: %q, want one", aside)
	}
	var after map[string][]string
	c.eventually(60*time.Second, "the rebuilt index has every placement of before", func() error {
		if err := c.agree(); err != nil {
			return err
		}
		var err error
		if after, err = c.placementsByKey(); err != nil {
			return err
		}
		for k, ps := range before {
			if !slices.Equal(after[k], ps) {
				return fmt.Errorf("object %s: placements %q, before the damage %q", k, after[k], ps)
			}
		}
		return nil
	})
	if len(after) != len(before) {
		t.Fatalf("%d objects after the rebuild, %d before", len(after), len(before))
	}
	// The rebuilt index has a new id: each rankd that sees it in gossip
	// offers its inventory again, and a rank is hidden while its inventory
	// streams (a restore begun then plans none of its chunks, as in
	// TestIndexLostRebuiltFromRanks). So the restore is retried until that
	// wave has passed; it must then be complete.
	c.eventually(30*time.Second, "the stored prompt restores COMPLETE from the rebuilt index", func() error {
		r, out, err := c.sim("--scenario", "tp4dcp1", "--phase", "restore")
		if err != nil || r == nil {
			return fmt.Errorf("enginesim restore: %v\n%s", err, tail(out, 5))
		}
		if r.Verdict != wire.VerdictComplete || r.Prefix != r.Chunks {
			return fmt.Errorf("restore after the rebuild: verdict %s, prefix %d of %d chunks", r.Verdict, r.Prefix, r.Chunks)
		}
		return nil
	})
	v, err := admin[wire.AdminVerifyReply](c, wire.AdminVerify, struct{}{})
	if err != nil || !v.OK {
		t.Fatalf("verify after the rebuild: %+v %v", v, err)
	}
}
