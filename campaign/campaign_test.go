package campaign

import (
	"context"
	"os"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
)

// TestTinyCampaign runs a real campaign of 30 faults at 3 faults/s
// (network namespaces and a tmpfs L2 when root, loopback otherwise) and
// requires the checker to pass: no wrong COMPLETE, no unnamed failed
// chunk, no lost acknowledged placement, verify clean, index equal to
// every inventory, no panic or crash, memory bounded.
func TestTinyCampaign(t *testing.T) {
	if testing.Short() {
		t.Skip("real cluster campaign: skipped in -short mode")
	}
	cfg := DefaultConfig()
	cfg.Seed, cfg.Faults, cfg.Rate = 17, 30, 3
	cfg.SourceDir = ".."
	cfg.WorkDir = t.TempDir()
	cfg.Quiesce = 40 * time.Second
	cfg.FinalRuns = 2
	cfg.Log = zaptest.NewLogger(t)
	cfg.Out = os.Stderr
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Injected+sum(rep.Skipped) != 30 {
		t.Errorf("%d faults injected and %d skipped, want 30 in all", rep.Injected, sum(rep.Skipped))
	}
	if !rep.OK {
		t.Fatalf("campaign seed %d failed: wrong COMPLETE %d, wrong unnamed %d, lost acked %d, verify %v %v, index=inventory %v %v, panics %v, crashes %v, rss %v, problems %v",
			cfg.Seed, rep.WrongComplete, rep.WrongUnnamed, rep.LostAcked, rep.VerifyOK, rep.VerifyProblems,
			rep.IndexEqualsInventory, rep.InventoryDiffs, rep.Panics, rep.Crashes, rep.RSSOver, rep.Problems)
	}
}

func sum(m map[Kind]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestSoakCampaign (make soak, KVTIER_SOAK=1): a few-minute campaign, 600
// faults at 4 faults/s against three coordinators replicated through raft
// (the leader among the kill -9 / SIGSTOP targets) and an L3 tier,
// judged as TestTinyCampaign.
func TestSoakCampaign(t *testing.T) {
	if os.Getenv("KVTIER_SOAK") == "" {
		t.Skip("soak: set KVTIER_SOAK=1 (make soak)")
	}
	cfg := DefaultConfig()
	cfg.Seed, cfg.Faults, cfg.Rate, cfg.Coordinators = 23, 600, 4, 3
	cfg.SourceDir = ".."
	cfg.WorkDir = t.TempDir()
	cfg.Log = zaptest.NewLogger(t)
	cfg.Out = os.Stderr
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK {
		t.Fatalf("soak campaign seed %d failed: wrong COMPLETE %d, wrong unnamed %d, lost acked %d, verify %v %v, index=inventory %v %v, panics %v, crashes %v, rss %v, problems %v",
			cfg.Seed, rep.WrongComplete, rep.WrongUnnamed, rep.LostAcked, rep.VerifyOK, rep.VerifyProblems,
			rep.IndexEqualsInventory, rep.InventoryDiffs, rep.Panics, rep.Crashes, rep.RSSOver, rep.Problems)
	}
}
