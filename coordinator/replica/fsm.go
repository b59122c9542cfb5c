package replica

import (
	"context"
	"io"

	"github.com/hashicorp/raft"
	"github.com/kvtier/kvtier/index"
	"go.uber.org/zap"
)

// fsm is raft's state machine: the index (see doc.go).
type fsm struct{ n *Node }

func (f fsm) Apply(l *raft.Log) any { return f.ApplyBatch([]*raft.Log{l})[0] }

// ApplyBatch queues every command entry into the index in log order and
// returns their index requests (*index.Pending) without waiting: the
// leader's acker waits on them. raft calls it on one goroutine, in order.
func (f fsm) ApplyBatch(logs []*raft.Log) []any {
	if f.n.beforeApply != nil {
		f.n.beforeApply()
	}
	out := make([]any, len(logs))
	ix := f.n.idx
	for i, l := range logs {
		if l.Type != raft.LogCommand {
			continue
		}
		op, err := decodeCommand(l.Data)
		if err != nil {
			// The leader encoded it: every replica refuses it alike.
			f.n.log.Error("raft entry does not decode; skipped on every replica", zap.Uint64("raft_index", l.Index), zap.Error(err))
			out[i] = err
			continue
		}
		op.RaftIndex = l.Index
		p, err := ix.ApplyReplicated(context.Background(), op)
		if err != nil {
			f.n.log.Error("raft entry not applied to the index; this replica diverges until it is rebuilt",
				zap.Uint64("raft_index", l.Index), zap.Error(err))
			out[i] = err
			continue
		}
		out[i] = p
	}
	if len(logs) > 0 {
		f.n.fsmLast.Store(logs[len(logs)-1].Index)
	}
	return out
}

func (f fsm) Snapshot() (raft.FSMSnapshot, error) {
	s, err := f.n.idx.Snapshot(context.Background())
	if err != nil {
		return nil, err
	}
	return snapshot{s}, nil
}

func (f fsm) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	ok, err := f.n.idx.Restore(context.Background(), rc)
	if err != nil {
		return err
	}
	if ok {
		f.n.met.restores.Inc()
	}
	if a := f.n.idx.AppliedIndex(); a > f.n.fsmLast.Load() {
		f.n.fsmLast.Store(a)
	}
	return nil
}

type snapshot struct{ s *index.Snapshot }

func (s snapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := s.s.WriteTo(sink); err != nil {
		_ = sink.Cancel()
		return err
	}
	return sink.Close()
}

func (s snapshot) Release() { s.s.Release() }
