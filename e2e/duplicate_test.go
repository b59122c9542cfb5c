package e2e

import (
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// Issue 18.3: a second rankd for a live rank is refused at start, exits
// non-zero naming the live rank and member, and is counted at the
// coordinator; the surviving rank keeps ingesting (the next prompt is
// restorable); a real replacement, started right after the old one is
// killed, waits for its death and takes over. On f044f94 the duplicate ran
// beside the first and the rank's next prompts never became restorable.
func TestDuplicateRankdRefused(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	if res := c.mustSim("--scenario", "tp4dcp1", "--phase", "all", "--seed", "1"); res.Verdict != wire.VerdictComplete {
		t.Fatalf("before the duplicate: %+v", res)
	}

	dupArgs := append([]string{bin.rankd, "--instance", "engine0", "--tp-rank", "2", "--tp-size", "4",
		"--device", "host", "--host-dir", c.hostD, "--l1-bytes", c.l1, "--l2-dir", c.l2D, "--l2-free-floor", "0",
		"--join", c.gossip, "--bind", "127.0.0.1:" + strconv.Itoa(testutil.FreePort(t)), "--http", "127.0.0.1:0", "--log-level", "info"},
		c.credsArgs()...)
	dup := startProc(t, "rankd2-duplicate", filepath.Join(c.logD, "rankd2-duplicate.log"), dupArgs...)
	err := dup.wait(60 * time.Second)
	if err == nil {
		t.Fatalf("the duplicate rankd exited 0:\n%s", tail(dup.output(), 20))
	}
	if !strings.Contains(dup.output(), "rank engine0/2 is served by live member") {
		t.Fatalf("the duplicate's exit (%v) does not name the live rank:\n%s", err, tail(dup.output(), 20))
	}
	t.Logf("duplicate refused: %v: %s", err, lineWith(dup.output(), "served by live member"))
	if n := testutil.Metric(t, c.coordMetrics(), "kvtier_coord_duplicate_rank_members_total"); n < 1 {
		t.Fatalf("duplicates counted at the coordinator: %v, want >= 1", n)
	}

	// The live rank keeps ingesting: a new prompt is restorable.
	if res := c.mustSim("--scenario", "tp4dcp1", "--phase", "all", "--seed", "2"); res.Verdict != wire.VerdictComplete {
		t.Fatalf("after the refused duplicate: %+v", res)
	}

	// A real replacement: the old rank 2 dies; a new one started at once
	// waits for the death and takes over.
	c.ranks[2].kill()
	c.startRank(2)
	if res := c.mustSim("--scenario", "tp4dcp1", "--phase", "all", "--seed", "3"); res.Verdict != wire.VerdictComplete {
		t.Fatalf("after the replacement: %+v", res)
	}
}

func lineWith(out, s string) string {
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	return ""
}
