package replica

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvtier/kvtier/internal/powercut"
)

// Power-cut test of the raft log store (issue 29.6): raft answers a vote
// or an append only after the store returned, so whatever StoreLogs,
// DeleteRange, Set and SetUint64 returned nil for must survive a power
// cut. The store runs on a powercut mount, which drops every write not
// fsynced (and every name whose directory was not fsynced); the power is
// cut at many points of a workload that creates the raft directory and
// the store (as Node.Start does), appends, overwrites a conflicting
// tail (DeleteRange, then entries of a new term at the same indexes),
// compacts a prefix and moves the term and vote. After each crash the store
// must hold exactly the state after its last acknowledged operation, or
// after the one in flight at the cut (which may or may not have landed).

// raftState is what the store holds: log entries by index, stable keys.
type raftState struct {
	logs   map[uint64]string // index -> "term/data"
	stable map[string]string
}

func (s raftState) clone() raftState {
	c := raftState{logs: map[uint64]string{}, stable: map[string]string{}}
	for k, v := range s.logs {
		c.logs[k] = v
	}
	for k, v := range s.stable {
		c.stable[k] = v
	}
	return c
}

func (s raftState) equal(o raftState) bool {
	if len(s.logs) != len(o.logs) || len(s.stable) != len(o.stable) {
		return false
	}
	for k, v := range s.logs {
		if o.logs[k] != v {
			return false
		}
	}
	for k, v := range s.stable {
		if o.stable[k] != v {
			return false
		}
	}
	return true
}

func (s raftState) String() string {
	var lo, hi uint64
	for k := range s.logs {
		if lo == 0 || k < lo {
			lo = k
		}
		hi = max(hi, k)
	}
	last, _, _ := strings.Cut(s.logs[hi], ";")
	return fmt.Sprintf("logs %d..%d (%d entries, last %q), term %x, vote %q", lo, hi, len(s.logs), last,
		s.stable["CurrentTerm"], s.stable["LastVoteCand"])
}

// raftOp is one store operation of the workload and its effect on the
// expected state.
type raftOp struct {
	name  string
	do    func(*LogStore) error
	apply func(*raftState)
}

func raftWorkload() []raftOp {
	var ops []raftOp
	next, term := uint64(1), uint64(1)
	entry := func(i, t uint64) *raft.Log {
		return &raft.Log{Index: i, Term: t, Type: raft.LogCommand,
			Data: bytes.Repeat([]byte(fmt.Sprintf("entry %d of term %d;", i, t)), 40)}
	}
	val := func(l *raft.Log) string { return fmt.Sprintf("%d/%s", l.Term, l.Data) }
	for round := range 12 {
		if round%4 == 3 { // a new term: vote, then the term
			term++
			cand, t := fmt.Sprintf("node-%d", term), term
			ops = append(ops,
				raftOp{fmt.Sprintf("vote %s", cand),
					func(s *LogStore) error { return s.Set([]byte("LastVoteCand"), []byte(cand)) },
					func(st *raftState) { st.stable["LastVoteCand"] = cand }},
				raftOp{fmt.Sprintf("term %d", t),
					func(s *LogStore) error { return s.SetUint64([]byte("CurrentTerm"), t) },
					func(st *raftState) {
						st.stable["CurrentTerm"] = string(binary.BigEndian.AppendUint64(nil, t))
					}})
		}
		if round%4 == 2 && next > 4 { // a conflicting tail: delete it, append the new term's entries there
			from, to := next-3, next-1
			ops = append(ops, raftOp{fmt.Sprintf("delete %d..%d", from, to),
				func(s *LogStore) error { return s.DeleteRange(from, to) },
				func(st *raftState) {
					for i := from; i <= to; i++ {
						delete(st.logs, i)
					}
				}})
			next = from
		}
		if round == 8 { // compaction after a snapshot
			ops = append(ops, raftOp{"compact 1..5",
				func(s *LogStore) error { return s.DeleteRange(1, 5) },
				func(st *raftState) {
					for i := uint64(1); i <= 5; i++ {
						delete(st.logs, i)
					}
				}})
		}
		batch := []*raft.Log{entry(next, term), entry(next+1, term), entry(next+2, term)}
		if round%3 == 1 {
			batch = batch[:1]
		}
		next += uint64(len(batch))
		ops = append(ops, raftOp{fmt.Sprintf("append %d..%d term %d", batch[0].Index, batch[len(batch)-1].Index, term),
			func(s *LogStore) error { return s.StoreLogs(batch) },
			func(st *raftState) {
				for _, l := range batch {
					st.logs[l.Index] = val(l)
				}
			}})
	}
	return ops
}

// readRaftState reads everything the store holds.
func readRaftState(t *testing.T, s *LogStore) raftState {
	t.Helper()
	st := raftState{logs: map[uint64]string{}, stable: map[string]string{}}
	first, err := s.FirstIndex()
	if err != nil {
		t.Fatal(err)
	}
	last, err := s.LastIndex()
	if err != nil {
		t.Fatal(err)
	}
	for i := first; i <= last && last > 0; i++ {
		var l raft.Log
		if err := s.GetLog(i, &l); err != nil {
			if errors.Is(err, raft.ErrLogNotFound) {
				continue
			}
			t.Fatalf("read raft log %d after crash: %v", i, err)
		}
		st.logs[i] = fmt.Sprintf("%d/%s", l.Term, l.Data)
	}
	for _, k := range []string{"LastVoteCand", "CurrentTerm"} {
		v, err := s.Get([]byte(k))
		if err == nil {
			st.stable[k] = string(v)
		}
	}
	return st
}

func TestPowerCutRaftLogStore(t *testing.T) {
	fs := powercut.Mount(t)
	ops := raftWorkload()
	// run opens a store in a new directory and runs the workload until an
	// operation fails; it returns the states after 0..acked operations
	// and the store path.
	run := func(name string, cutAfter int64) (states []raftState, path string) {
		parent := filepath.Join(fs.Dir(), name)
		if err := os.Mkdir(parent, 0o700); err != nil {
			t.Fatal(err)
		}
		powercut.SyncDir(t, fs.Dir())
		powercut.SyncDir(t, parent)
		if cutAfter >= 0 {
			fs.CutAfter(cutAfter)
		}
		dir := filepath.Join(parent, "raft") // created as Node.Start does
		path = filepath.Join(dir, "raft.db")
		st := raftState{logs: map[uint64]string{}, stable: map[string]string{}}
		states = []raftState{st.clone()}
		err := PrivateDir(dir)
		var s *LogStore
		if err == nil {
			s, err = OpenLogStore(path)
		}
		if err != nil {
			if cutAfter < 0 {
				t.Fatal(err)
			}
			return states, path
		}
		defer s.Close()
		for _, op := range ops {
			if err := op.do(s); err != nil {
				if cutAfter < 0 {
					t.Fatalf("%s: %v", op.name, err)
				}
				break
			}
			op.apply(&st)
			states = append(states, st.clone())
		}
		return states, path
	}
	before := fs.Ops()
	full, _ := run("uncut", -1)
	total := fs.Ops() - before
	if len(full) != len(ops)+1 {
		t.Fatalf("uncut run acknowledged %d of %d operations", len(full)-1, len(ops))
	}
	const points = 40
	seen := make([]int, len(ops)+1) // crash points by operations acknowledged
	defer func() { t.Logf("%d mutations; crash points by operations acknowledged: %v", total, seen) }()
	for p := range points {
		cut := total * int64(p) / points
		states, path := run(fmt.Sprintf("cut-%d", cut), cut)
		acked := len(states) - 1
		seen[acked]++
		fs.Crash()
		want := full[acked]
		var inFlight *raftState
		if acked < len(ops) {
			inFlight = &full[acked+1]
		}
		err := PrivateDir(filepath.Dir(path))
		var s *LogStore
		if err == nil {
			s, err = OpenLogStore(path)
		}
		if err != nil {
			t.Fatalf("power cut after %d of %d mutations (%d store operations acknowledged): reopen: %v", cut, total, acked, err)
		}
		got := readRaftState(t, s)
		s.Close()
		if !got.equal(want) && (inFlight == nil || !got.equal(*inFlight)) {
			t.Fatalf("power cut after %d of %d mutations, %d store operations acknowledged (last %q):\n got  %v\n want %v",
				cut, total, acked, lastOpName(ops, acked), got, want)
		}
	}
}

func lastOpName(ops []raftOp, acked int) string {
	if acked == 0 {
		return "none"
	}
	return ops[acked-1].name
}
