package e2e

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// (a) Cold store, wipe, restore from L1, byte-exact on every rank, for
// TP4/DCP4 and TP4/DCP1 with the seed geometries; store and retrieve
// requests binary, and as JSON (an engine from before the binary form);
// and with --state-at-end (the recurrent group's pages of the last chunk
// only, the inner chunks' left as the wipe: one object fewer per inner
// chunk on every rank).
func TestColdStoreWipeRestoreL1(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	items := map[int]int{} // tp4dcp1's objects restored per rank
	for _, name := range []string{"tp4dcp4", "tp4dcp1", "tp4dcp4/json-requests", "tp4dcp1/state-at-end"} {
		sc, form, _ := strings.Cut(name, "/")
		t.Run(name, func(t *testing.T) {
			args := []string{"--scenario", sc, "--phase", "all"}
			if form != "" {
				args = append(args, "--"+form, "--seed", "2")
			}
			res := c.mustSim(args...)
			if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks || len(res.Ranks) != 4 {
				t.Fatalf("result %+v", res)
			}
			if res.Stores < 4*res.Chunks {
				t.Fatalf("%d store requests for %d chunks on 4 ranks: the prompt must be stored incrementally", res.Stores, res.Chunks)
			}
			for _, r := range res.Ranks {
				if r.Placed != r.Items || r.Chunks != res.Chunks || r.Mismatch != 0 || r.Outside != 0 {
					t.Fatalf("rank %d: %+v", r.Rank, r)
				}
				// A rank's own objects come from its L1; at DCP1 the MLA
				// shard of rank 0 reaches ranks 1..3 through the shared L2.
				want := "L1"
				if sc == "tp4dcp1" && r.Rank > 0 {
					want = "L1+L2"
				}
				if r.Tier != want {
					t.Fatalf("rank %d restored from %s, want %s", r.Rank, r.Tier, want)
				}
				switch name {
				case "tp4dcp1":
					items[r.Rank] = r.Items
				case "tp4dcp1/state-at-end":
					if r.Items != items[r.Rank]-(res.Chunks-1) {
						t.Fatalf("rank %d restored %d objects with --state-at-end, %d without: want one fewer per inner chunk (%d)",
							r.Rank, r.Items, items[r.Rank], res.Chunks-1)
					}
				}
			}
		})
	}
	// --state-every 2 over 5 chunks: the recurrent group stored for chunks
	// 1 and 3 only (the others without a state, as vLLM keeps one where
	// its retention says); the restore covers 4 chunks, ending on chunk
	// 3's state, byte-exact, the inner state pages left as the wipe.
	t.Run("tp4dcp1/state-every-2", func(t *testing.T) {
		res := c.mustSim("--scenario", "tp4dcp1", "--phase", "all", "--state-at-end", "--state-every", "2",
			"--chunks", "5", "--seed", "3")
		if res.Verdict != wire.VerdictComplete || res.Chunks != 5 || res.Prefix != 4 {
			t.Fatalf("result %+v, want a complete restore of 4 of 5 chunks", res)
		}
		for _, r := range res.Ranks {
			if r.Placed != r.Items || r.Chunks != 4 || r.Mismatch != 0 || r.Outside != 0 {
				t.Fatalf("rank %d: %+v", r.Rank, r)
			}
		}
	})
	v, err := admin[wire.AdminVerifyReply](c, wire.AdminVerify, struct{}{})
	if err != nil || !v.OK {
		t.Fatalf("verify: %+v %v", v, err)
	}
}

// (b) Store, then restart the rankds, the coordinator and the engine: a new
// engine process restores from L2, byte-exact.
func TestRestartRestoreFromL2(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	for _, sc := range []string{"tp4dcp4", "tp4dcp1"} {
		c.mustSim("--scenario", sc, "--phase", "store")
	}
	c.stopRanks() // graceful: write-through finishes, events flushed
	c.coord.stop()
	c.startAll()
	for _, sc := range []string{"tp4dcp4", "tp4dcp1"} {
		t.Run(sc, func(t *testing.T) {
			res := c.mustSim("--scenario", sc, "--phase", "restore")
			if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
				t.Fatalf("result %+v", res)
			}
			for _, r := range res.Ranks {
				if r.Tier != "L2" || r.Placed != r.Items || r.Mismatch != 0 || r.Outside != 0 {
					t.Fatalf("rank %d: %+v (want everything from L2)", r.Rank, r)
				}
			}
		})
	}
}

// (c) SIGKILL one rankd just before the retrieve: the verdict fails with
// that rank's chunks and nothing is reported complete; after the rankd
// restarts (new incarnation) a new restore succeeds from its L2.
func TestKillRankdBeforeRetrieve(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	c.mustSim("--scenario", "tp4dcp4", "--phase", "store")
	c.waitL2([]int64{16, 16, 16, 16})

	hold := filepath.Join(c.dir, "go")
	p, result := c.startSim("--scenario", "tp4dcp4", "--phase", "restore", "--expect-fail",
		"--hold-before-retrieve", hold, "--restore-deadline", "5s")
	c.eventually(60*time.Second, "simulator holds before the retrieve", func() error {
		if !strings.Contains(p.output(), "HOLD before retrieve") {
			if !p.alive() {
				t.Fatalf("simulator exited: %v\n%s", p.err, p.output())
			}
			return os.ErrNotExist
		}
		return nil
	})
	oldInc, err := c.rankInfo(2)
	if err != nil {
		t.Fatal(err)
	}
	c.ranks[2].kill()
	if err := os.WriteFile(hold, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := p.wait(2 * time.Minute); err != nil {
		t.Fatalf("simulator (expect-fail): %v\n%s", err, tail(p.output(), 40))
	}
	res := readResult(t, result)
	t.Logf("restore with rankd 2 killed:\n%s", tableOf(p.output()))
	if res.Verdict != wire.VerdictFailed || !equalInts(res.Failed, []int{0, 1, 2, 3}) {
		t.Fatalf("verdict %s failed %v, want failed [0 1 2 3] (rank 2 reads every chunk)", res.Verdict, res.Failed)
	}
	if res.Ranks[2].Error == "" || res.Ranks[2].Placed != 0 {
		t.Fatalf("rank 2 row %+v: its retrieve must have failed", res.Ranks[2])
	}
	rs, err := admin[wire.AdminRestoresReply](c, wire.AdminRestores, struct{}{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs.Restores {
		if r.RestoreID == res.RestoreID && r.State != wire.VerdictFailed {
			t.Fatalf("coordinator recorded %s as %s", r.RestoreID, r.State)
		}
	}

	c.startRank(2)
	newInc, err := c.rankInfo(2)
	if err != nil {
		t.Fatal(err)
	}
	if newInc.Incarnation <= oldInc.Incarnation {
		t.Fatalf("restarted rank 2 has incarnation %d, the killed one had %d", newInc.Incarnation, oldInc.Incarnation)
	}
	res = c.mustSim("--scenario", "tp4dcp4", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete || res.Ranks[2].Tier != "L2" || res.Ranks[0].Tier != "L1" {
		t.Fatalf("after the restart: verdict %s, rank 2 from %s, rank 0 from %s", res.Verdict, res.Ranks[2].Tier, res.Ranks[0].Tier)
	}
}

// (d) Corrupt one L2 object file on disk: the verdict fails naming that
// chunk, every other chunk is restored byte-exact.
func TestCorruptL2Object(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	c.mustSim("--scenario", "tp4dcp4", "--phase", "store")
	c.stopRanks()
	for r := range c.tp {
		c.startRank(r) // L1 is empty now; the background L2 rescan (headers) announces the objects, restores verify every byte
	}

	sc, err := enginesim.LookupScenario("tp4dcp4")
	if err != nil {
		t.Fatal(err)
	}
	plan, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		t.Fatal(err)
	}
	tier, err := transfer.OpenFileTier(c.l2D, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Chunk 1 of the 561-byte-row MLA group, shard 0: read by rank 0 only.
	key := dcp.Key{NS: plan.R.Namespace, Chunk: plan.Hashes[1], Shard: 0, Group: 0}
	path := tier.Path(key)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("L2 file of %s: %v", key, err)
	}
	data[len(data)-1000] ^= 0x40 // one bit of the payload
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}

	res, out, err := c.sim("--scenario", "tp4dcp4", "--phase", "restore", "--expect-fail")
	t.Logf("restore with a corrupt L2 object:\n%s", tableOf(out))
	if err != nil || res == nil || !res.OK {
		t.Fatalf("simulator: %v\n%s", err, tail(out, 40))
	}
	if res.Verdict != wire.VerdictFailed || !equalInts(res.Failed, []int{1}) {
		t.Fatalf("verdict %s failed %v, want failed [1]", res.Verdict, res.Failed)
	}
	for _, r := range res.Ranks {
		if r.Mismatch != 0 || r.Outside != 0 {
			t.Fatalf("rank %d: %s (chunks 0, 2, 3 must be byte-exact)", r.Rank, r.Compare)
		}
	}
	// Rank 0 reports every item of chunk 1 failed: one is corrupt, and
	// nothing of a chunk with a failed item is placed.
	if fi := res.Ranks[0].FailedItem; len(fi) == 0 || slices.Max(fi) != 1 || slices.Min(fi) != 1 {
		t.Fatalf("rank 0 failed items %v, want only chunk 1", fi)
	}
	for _, r := range res.Ranks[1:] {
		if len(r.FailedItem) != 0 || r.Placed != r.Items {
			t.Fatalf("rank %d: %+v (only rank 0 reads the corrupt object)", r.Rank, r)
		}
	}
	if !strings.Contains(out, "chunk 1 group 0 not placed: corrupt") {
		t.Fatalf("no corrupt reason for chunk 1 group 0 in the output:\n%s", tail(out, 40))
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("the corrupt file is still served at %s (want it quarantined): %v", path, err)
	}
}

// A coordinator restarted on another NATS port: the rankds, which found
// NATS through the coordinator's member metadata, follow it there, and what
// they stored before is still restorable.
func TestCoordinatorMovesNATS(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	c.mustSim("--scenario", "tp4dcp4", "--phase", "store")
	c.coord.stop()
	c.nc.Close()
	c.nc = nil
	c.natsPort = testutil.FreePort(t)
	c.startCoordinator()
	for r := range c.tp {
		c.waitRank(r) // answers on the new NATS
	}
	res := c.mustSim("--scenario", "tp4dcp4", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete {
		t.Fatalf("restore after the coordinator moved: %+v", res)
	}
}
