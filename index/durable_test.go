package index_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// Durability of acknowledgements (issue 11.7). What these tests can see:
//
//   - commit before ack: the AfterCommit seam blocks the writer right after
//     bbolt's commit; no Apply may return while it is blocked. An index
//     that answered before its commit returns with the seam still blocked
//     and fails here;
//   - an acknowledged batch is in the file: right after each ack the bbolt
//     file is copied and opened by another process, from scratch, with no
//     resync; it must hold the rank at the acknowledged sequence;
//   - fsync on: the production open (DefaultConfig, and the coordinator's,
//     tested in coordinator) must not set NoSync or NoGrowSync.
//
// What they cannot see: whether the data reached the disk. The copy reads
// the page cache, which a process kill (and these tests) never lose; only a
// power cut does. TestPowerCutIndexIngest (ingest_powercut_test.go) runs
// the index on a FUSE file system that drops what was not fsynced; the
// option check here stays the guard for NoGrowSync, which that file system
// cannot see.

const durableChildEnv = "KVTIER_INDEX_DURABLE_CHILD" // path of the copied file

// TestDurableChild is the other process: it opens the copy and prints the
// rank's incarnation, last sequence and placement count.
func TestDurableChild(t *testing.T) {
	path := os.Getenv(durableChildEnv)
	if path == "" {
		t.Skip("durability-test child only")
	}
	cfg := index.DefaultConfig()
	cfg.Path = path
	cfg.Logger = zap.NewNop()
	ix, err := index.Open(cfg)
	if err != nil {
		fmt.Printf("OPEN-ERROR %v\n", err)
		return
	}
	defer ix.Close()
	ri, ok := ix.Rank(wire.Rank{Instance: "durable", TPRank: 0})
	fmt.Printf("RANK %v %d %d %d\n", ok, ri.Incarnation, ri.LastSeq, ri.L1Placements+ri.L2Placements)
}

func TestAckOnlyAfterCommitAndInFile(t *testing.T) {
	entered := make(chan struct{}, 1)
	releases := make(chan chan struct{}, 1) // the current release channel
	release := make(chan struct{})
	releases <- release
	stop := make(chan struct{}) // closed at the end: the seam never blocks Close
	hold := make(chan bool, 1)  // true: the next commit blocks in the seam
	hold <- false
	ix := openTest(t, "", func(c *index.Config) {
		c.AfterCommit = func() {
			h := <-hold
			hold <- h
			if !h {
				return
			}
			rel := <-releases
			releases <- rel
			select {
			case entered <- struct{}{}:
			default:
			}
			select {
			case <-rel:
			case <-stop:
			}
		}
	})
	t.Cleanup(func() { close(stop) }) // runs before the index's Close
	if d := ix.Durability(); d.NoSync || d.NoGrowSync {
		t.Fatalf("index opened from DefaultConfig with %+v: acknowledged writes could be lost", d)
	}
	s := indextest.NewRank(wire.Rank{Instance: "durable", TPRank: 0}, 9, indextest.Keys(testNS, 2, 64, 1, 1), 5)
	for i := range 5 {
		<-hold
		hold <- true
		b := s.Next(16)
		done := make(chan index.Outcome, 1)
		go func() {
			o, err := ix.Apply(ctx, b)
			if err != nil {
				t.Error(err)
			}
			done <- o
		}()
		select {
		case <-entered:
		case o := <-done:
			t.Fatalf("batch %d acknowledged (%+v) before its commit reached the seam", i, o)
		case <-time.After(10 * time.Second):
			t.Fatal("no commit")
		}
		select {
		case o := <-done:
			t.Fatalf("batch %d acknowledged (%+v) while its commit was held", i, o)
		default:
		}
		<-hold
		hold <- false
		close(release)
		o := <-done
		release = make(chan struct{})
		<-releases
		releases <- release
		if o.LastSeq != s.Seq {
			t.Fatalf("batch %d: acked through %d, want %d", i, o.LastSeq, s.Seq)
		}
		// Another process opens a copy of the file as it is now.
		got := childView(t, ix.path)
		want := fmt.Sprintf("RANK true 9 %d %d", s.Seq, len(s.Inventory().Objects))
		if got != want {
			t.Fatalf("after ack %d another process sees %q, want %q", i, got, want)
		}
	}
}

// childView copies the bbolt file and has a child process open the copy.
func childView(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	cp := filepath.Join(t.TempDir(), "copy.db")
	if err := os.WriteFile(cp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestDurableChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), durableChildEnv+"="+cp)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "RANK ") || strings.HasPrefix(l, "OPEN-ERROR ") {
			return l
		}
	}
	t.Fatalf("child printed no RANK line:\n%s", out)
	return ""
}
