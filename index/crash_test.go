package index_test

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
)

// The crash test re-executes the test binary as a child that ingests
// heavily (four ranks applying batches concurrently, checkpoints every
// megabyte) and reports on stdout each batch Apply acknowledged. The parent
// SIGKILLs it at a random moment, reopens the index and checks: Verify
// passes; every acknowledged batch is there; each rank's placements are
// exactly its simulated state at the rank's last applied sequence (no torn
// batch); and a resync from the rank's inventory makes the index agree.

const (
	crashChildEnv = "KVTIER_INDEX_CRASH_CHILD" // index directory
	crashIterEnv  = "KVTIER_INDEX_CRASH_ITER"
	crashRanks    = 4
	crashBatch    = 128
)

func crashNS(iter int) dcp.Namespace { return dcp.Namespace{0xc0, byte(iter)} }

func crashSim(iter, tp int) *indextest.Rank {
	keys := indextest.Keys(crashNS(iter), uint64(iter), 1024, crashRanks, 1)
	return indextest.NewRank(wire.Rank{Instance: fmt.Sprintf("crash%d", iter), TPRank: tp}, 1, keys, uint64(iter*100+tp))
}

func crashConfig(dir string) index.Config {
	cfg := index.DefaultConfig()
	cfg.Path = filepath.Join(dir, "index.db")
	cfg.CheckpointBytes = 1 << 20
	cfg.FoldSliceChunks = 64 // kills land in the middle of folds too
	return cfg
}

// TestCrashChild is the child's body; it does nothing in a normal run.
func TestCrashChild(t *testing.T) {
	dir := os.Getenv(crashChildEnv)
	if dir == "" {
		t.Skip("crash-test child only")
	}
	iter, _ := strconv.Atoi(os.Getenv(crashIterEnv))
	cfg := crashConfig(dir)
	cfg.Logger = zap.NewNop()
	ix, err := index.Open(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child open:", err)
		os.Exit(3)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	stop := time.Now().Add(30 * time.Second) // never outlive a dead parent
	for tp := range crashRanks {
		wg.Add(1)
		go func(s *indextest.Rank) {
			defer wg.Done()
			for time.Now().Before(stop) {
				b := s.Next(crashBatch)
				o, err := ix.Apply(ctx, b)
				if err != nil || o.Applied != len(b.Events) {
					fmt.Fprintf(os.Stderr, "child apply %s: %+v %v\n", s.Rank, o, err)
					os.Exit(4)
				}
				mu.Lock()
				fmt.Fprintf(os.Stdout, "ack %d %d\n", s.Rank.TPRank, o.LastSeq) // one write(2): the pipe keeps it
				mu.Unlock()
			}
		}(crashSim(iter, tp))
	}
	wg.Wait()
	_ = ix.Close()
}

func TestCrashSafety(t *testing.T) {
	if testing.Short() {
		t.Skip("kills child processes; skipped with -short")
	}
	dir := t.TempDir()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	const iterations = 7
	start := time.Now()
	var done [][]*indextest.Rank // resynced ranks of earlier iterations
	for iter := range iterations {
		acked := runCrashChild(t, dir, iter, time.Duration(100+rng.IntN(900))*time.Millisecond)

		ix := openTest(t, dir, func(c *index.Config) { *c = crashConfig(dir); c.Logger = zap.NewNop() })
		rep := mustVerify(t, ix.Index)
		var sims []*indextest.Rank
		total := 0
		for tp := range crashRanks {
			s := crashSim(iter, tp)
			var last uint64
			if info, err := ix.ListRank(s.Rank); err == nil {
				last = info.LastSeq
			} else if acked[tp] > 0 {
				t.Fatalf("iteration %d: rank %s acknowledged seq %d but is unknown after the crash", iter, s.Rank, acked[tp])
			}
			if last < acked[tp] {
				t.Fatalf("iteration %d: rank %s acknowledged seq %d, index has %d after the crash", iter, s.Rank, acked[tp], last)
			}
			for s.Seq < last {
				s.Next(crashBatch)
			}
			if s.Seq != last {
				t.Fatalf("iteration %d: rank %s at seq %d: not a batch boundary (torn batch)", iter, s.Rank, last)
			}
			if last > 0 {
				agreeRanks(t, ix.Index, s) // exactly the state at the last applied batch
			}
			total += int(last)
			// The rank carried on past what the index saw; resync.
			s.Next(crashBatch)
			s.Next(crashBatch)
			mustInventory(t, ix.Index, s.Inventory())
			sims = append(sims, s)
		}
		for _, old := range done {
			agreeRanks(t, ix.Index, old...)
		}
		agree(t, ix.Index, sims...)
		done = append(done, sims)
		t.Logf("iteration %d: acked %v, %d events recovered, %d log records replayed", iter, acked, total, rep.LogRecords)
		if err := ix.Close(); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d kills in %v", iterations, time.Since(start).Round(time.Millisecond))
}

// runCrashChild starts the child, lets it ingest for about d after its
// first acknowledgement, SIGKILLs it and returns the highest acknowledged
// sequence per TP rank.
func runCrashChild(t *testing.T, dir string, iter int, d time.Duration) [crashRanks]uint64 {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashChildEnv+"="+dir, crashIterEnv+"="+strconv.Itoa(iter))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var acked [crashRanks]uint64
	first := make(chan struct{})
	read := make(chan struct{})
	go func() {
		defer close(read)
		sc := bufio.NewScanner(out)
		once := sync.Once{}
		for sc.Scan() {
			var tp int
			var seq uint64
			if n, _ := fmt.Sscanf(sc.Text(), "ack %d %d", &tp, &seq); n == 2 && tp < crashRanks {
				acked[tp] = max(acked[tp], seq)
				once.Do(func() { close(first) })
			}
		}
	}()
	select {
	case <-first:
	case <-read:
	case <-time.After(20 * time.Second):
	}
	time.Sleep(d)
	_ = cmd.Process.Kill()
	<-read
	err = cmd.Wait()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
		t.Fatalf("iteration %d: child did not die by the kill: %v\n%s", iter, err, stderr.String())
	}
	return acked
}
