package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// (g) kill -9 the coordinator again and again during heavy ingest: every
// restart opens the index, passes verify, and once the ranks have resent
// what was not acknowledged (and resynced where needed) the index agrees
// exactly with every rank's inventory.
func TestCoordinatorKill9DuringIngest(t *testing.T) { coordKillCampaign(t, 5, 30*time.Second) }

// TestSoakCoordinatorKillCampaign is the long version (make soak).
func TestSoakCoordinatorKillCampaign(t *testing.T) {
	if os.Getenv("KVTIER_SOAK") != "1" {
		t.Skip("soak: set KVTIER_SOAK=1 (make soak)")
	}
	coordKillCampaign(t, 30, 180*time.Second)
}

func coordKillCampaign(t *testing.T, kills int, window time.Duration) {
	c := newKV(t, 4)
	c.l1 = "48MiB" // small: stores keep evicting, so Removed events flow too
	c.startAll()

	// Load: two simulators storing new prompts back to back (different
	// seeds, both scenarios), each prompt in many incremental stores.
	var (
		stop   atomic.Bool
		stores atomic.Int64
		failed atomic.Int64
		wg     sync.WaitGroup
		seq    atomic.Int64
	)
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				seed := 1000*(w+1) + i
				sc := []string{"tp4dcp4", "tp4dcp1"}[i%2]
				n := seq.Add(1)
				logf, err := os.Create(filepath.Join(c.logD, fmt.Sprintf("load%03d.log", n)))
				if err != nil {
					return
				}
				cmd := exec.Command(bin.enginesim, append([]string{"--nats", c.natsURL(), "--device", "host", "--host-dir", c.hostD,
					"--instance", "engine0", "--scenario", sc, "--phase", "store", "--seed", strconv.Itoa(seed),
					"--chunks", "6", "--compute", "1ms", "--timeout", "15s"}, c.credsArgs()...)...)
				cmd.Stdout, cmd.Stderr = logf, logf
				if cmd.Run() == nil {
					stores.Add(1)
				} else {
					failed.Add(1) // expected while the coordinator is down
					time.Sleep(200 * time.Millisecond)
				}
				logf.Close()
			}
		}()
	}
	defer func() {
		stop.Store(true)
		wg.Wait()
	}()

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	start := time.Now()
	gap := window / time.Duration(kills)
	for k := range kills {
		time.Sleep(gap/2 + time.Duration(rng.Int64N(int64(gap/2))))
		if err := c.coord.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		<-c.coord.done
		time.Sleep(time.Duration(rng.Int64N(int64(300 * time.Millisecond))))
		c.startCoordinator()
		v, err := admin[wire.AdminVerifyReply](c, wire.AdminVerify, struct{}{})
		if err != nil || !v.OK {
			t.Fatalf("verify after kill %d: %+v %v", k+1, v, err)
		}
		t.Logf("kill -9 #%d at %.1fs: restarted, verify ok (%d placements checked)", k+1, time.Since(start).Seconds(), v.Placements)
	}
	time.Sleep(2 * time.Second)
	stop.Store(true)
	wg.Wait()
	t.Logf("%d prompts stored, %d store runs cut short by the kills", stores.Load(), failed.Load())
	if stores.Load() == 0 {
		t.Fatal("no prompt was stored at all")
	}

	// The ranks rejoin the restarted coordinator; then the index agrees
	// exactly with their inventories.
	for r := range c.tp {
		c.waitRank(r)
	}
	var last error
	c.eventually(60*time.Second, "index agrees with the inventories", func() error {
		last = c.agree()
		return last
	})
	v, err := admin[wire.AdminVerifyReply](c, wire.AdminVerify, struct{}{})
	if err != nil || !v.OK {
		t.Fatalf("final verify: %+v %v", v, err)
	}
	t.Logf("index agrees with all %d inventories; verify ok (%d placements)", c.tp, v.Placements)
}

// agree compares the coordinator's index with every rank's inventory:
// incarnation, sequence, per-tier counts and bytes, and every object's
// placement (tier, size, checksum).
func (c *kv) agree() error {
	ranks, err := admin[wire.AdminRanksReply](c, wire.AdminRanks, struct{}{})
	if err != nil {
		return err
	}
	for r := range c.tp {
		rank := wire.Rank{Instance: "engine0", TPRank: r}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		inv, err := bus.FetchInventory(ctx, c.connFor(c.subj.Inventory(rank)), c.subj.Inventory(rank), 0, 0)
		cancel()
		if err != nil {
			return fmt.Errorf("inventory of %s: %w", rank, err)
		}
		var ar *wire.AdminRank
		for i := range ranks.Ranks {
			if ranks.Ranks[i].Rank == rank && ranks.Ranks[i].Incarnation == inv.Incarnation {
				ar = &ranks.Ranks[i]
			}
		}
		if ar == nil {
			return fmt.Errorf("%s incarnation %d not in the index", rank, inv.Incarnation)
		}
		var l1, l2 int64
		var l1b, l2b uint64
		for _, o := range inv.Objects {
			switch o.Tier {
			case wire.L1:
				l1, l1b = l1+1, l1b+o.Size
			case wire.L2:
				l2, l2b = l2+1, l2b+o.Size
			}
		}
		if ar.LastSeq != inv.Seq || ar.L1Objects != l1 || ar.L2Objects != l2 || ar.L1Bytes != l1b || ar.L2Bytes != l2b {
			return fmt.Errorf("%s: index seq %d L1 %d/%d B L2 %d/%d B; inventory seq %d L1 %d/%d B L2 %d/%d B",
				rank, ar.LastSeq, ar.L1Objects, ar.L1Bytes, ar.L2Objects, ar.L2Bytes, inv.Seq, l1, l1b, l2, l2b)
		}
		for _, o := range inv.Objects {
			rep, err := admin[wire.AdminObjectReply](c, wire.AdminObject, wire.AdminObjectRequest{Key: o.Key.String()})
			if err != nil {
				return fmt.Errorf("object %s: %w", o.Key, err)
			}
			found := false
			for _, ob := range rep.Objects {
				for _, p := range ob.Placements {
					if p.Holder == rank && p.Tier == o.Tier && p.Size == o.Size && p.Sum == o.Sum && p.Incarnation == inv.Incarnation {
						found = true
					}
				}
			}
			if !found {
				return fmt.Errorf("%s holds %s in %s (sum %x); the index does not have that placement: %+v", rank, o.Key, o.Tier, o.Sum, rep.Objects)
			}
		}
	}
	return nil
}
