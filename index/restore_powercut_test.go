package index_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/powercut"
	"github.com/kvtier/kvtier/wire"
)

// Power-cut test of the snapshot install (issue 29.6). A raft follower
// that installed a snapshot tells raft so, and raft then drops the log
// the snapshot covers: the installed snapshot must survive a power cut.
// Restore writes the stream to a temporary file, fsyncs it, renames it
// over the index file and fsyncs the directory; here the index runs on a
// powercut mount and the power is cut at many points of: replicated
// entries, a snapshot install, an entry, a second (larger) install. After
// each crash the reopened index must hold, byte for byte (Dump), the
// state after the last acknowledged step, or after the step in flight.

// snapshotStream returns a snapshot of src as Restore reads it.
func snapshotStream(t *testing.T, src *index.Index) []byte {
	t.Helper()
	snap, err := src.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Release()
	var b bytes.Buffer
	if _, err := snap.WriteTo(&b); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func TestPowerCutSnapshotInstall(t *testing.T) {
	// The leader's index, on an ordinary disk: two snapshots of it.
	src := openTest(t, "", nil)
	ops := replicatedOps()
	applyOps(t, src.Index, ops, 1)
	snap1 := snapshotStream(t, src.Index)
	sim := indextest.NewRank(wire.Rank{Instance: "snap", TPRank: 0}, 1,
		indextest.Keys(dcp.Namespace{0x9c, 0x02}, 3, 512, 1, 1), 5)
	var more []index.Op
	for range 12 {
		b := sim.Next(64)
		more = append(more, index.Op{Batch: &b})
	}
	applyOps(t, src.Index, more, uint64(len(ops))+1)
	snap2 := snapshotStream(t, src.Index)

	type step struct {
		name string
		do   func(*index.Index) error
	}
	replicated := func(op index.Op, raftIndex uint64) func(*index.Index) error {
		return func(ix *index.Index) error {
			op.RaftIndex = raftIndex
			p, err := ix.ApplyReplicated(ctx, op)
			if err != nil {
				return err
			}
			return p.Result(ix).Err
		}
	}
	install := func(stream []byte) func(*index.Index) error {
		return func(ix *index.Index) error {
			ok, err := ix.Restore(ctx, bytes.NewReader(stream))
			if err == nil && !ok {
				return fmt.Errorf("snapshot not installed")
			}
			return err
		}
	}
	steps := []step{
		{"entry 1", replicated(ops[0], 1)},
		{"entry 2", replicated(ops[1], 2)},
		{"install snapshot 1", install(snap1)},
		{fmt.Sprintf("entry %d", len(ops)+1), replicated(more[0], uint64(len(ops))+1)},
		{"install snapshot 2", install(snap2)},
	}

	fs := powercut.Mount(t)
	// run opens an index in a new directory (made durable first) and runs
	// the steps until one fails; it returns how many were acknowledged and
	// (uncut) the Dump after each.
	run := func(name string, cut int64) (acked int, dumps []index.Dump, dir string) {
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
			return 0, nil, dir
		}
		defer ix.Close()
		if cut < 0 {
			dumps = append(dumps, mustDump(t, ix))
		}
		for _, s := range steps {
			if err := s.do(ix); err != nil {
				if cut < 0 {
					t.Fatalf("%s: %v", s.name, err)
				}
				break
			}
			acked++
			if cut < 0 {
				dumps = append(dumps, mustDump(t, ix))
			}
		}
		if cut >= 0 {
			fs.Crash() // before Close
		}
		return acked, dumps, dir
	}
	before := fs.Ops()
	_, want, _ := run("uncut", -1)
	total := fs.Ops() - before
	seen := make([]int, len(steps)+1) // crash points by steps acknowledged
	defer func() { t.Logf("%d mutations; crash points by steps acknowledged: %v", total, seen) }()
	for cut := range total + 1 { // at every mutation (~60)
		acked, _, dir := run(fmt.Sprintf("cut-%d", cut), cut)
		seen[acked]++
		where := fmt.Sprintf("power cut after %d of %d mutations, %d of %d steps acknowledged", cut, total, acked, len(steps))
		if acked > 0 {
			where += " (last: " + steps[acked-1].name + ")"
		}
		ix, err := index.Open(powercutConfig(dir))
		if err != nil {
			t.Fatalf("%s: open: %v", where, err)
		}
		got, err := ix.Dump(ctx)
		if err == nil {
			_, err = ix.Verify(ctx)
		}
		ix.Close()
		if err != nil {
			t.Fatalf("%s: %v", where, err)
		}
		same := func(d index.Dump) bool { return d.RaftIndex == got.RaftIndex && bytes.Equal(d.Bytes, got.Bytes) }
		if !same(want[acked]) && (acked == len(steps) || !same(want[acked+1])) {
			t.Fatalf("%s: the reopened index is at raft index %d (%d B of state), want %d (%d B)",
				where, got.RaftIndex, len(got.Bytes), want[acked].RaftIndex, len(want[acked].Bytes))
		}
	}
}
