package coordinator

import (
	"context"

	"github.com/kvtier/kvtier/coordinator/replica"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// replicator is the one seam between a single coordinator and a replicated
// one (issue 16): how the coordinator changes its index, and whether it
// decides. New picks the implementation once (c.repl, never nil):
//
//   - standalone (this file): one coordinator; every mutation is the
//     index's own call, it always decides, and there is no gate.
//   - replicated (replicated.go): every mutation is a raft entry proposed
//     through a replica.Node; only the raft leader decides, and the
//     leader-only handlers are subscribed while it leads.
//
// Every index mutation of the coordinator goes through it; nothing else
// writes the index.
type replicator interface {
	// start runs once the index is open and the cluster joined:
	// leaderOnly are the handlers that only a leader subscribes (none in
	// standalone mode, which subscribed everything already).
	start(leaderOnly []leaderHandler) error
	// applyBatch queues a validated event batch; the acker waits on the
	// result, which is the index's commit (standalone) or raft's commit on
	// a quorum and then the leader's index commit (replicated).
	applyBatch(b *wire.Batch) (batchResult, error)
	// applyInventory applies an inventory requested under the rank's fence
	// generation gen (index.ApplyInventoryAt).
	applyInventory(ctx context.Context, inv wire.Inventory, gen uint64) (index.InventoryOutcome, error)
	// queueInventoryStep queues one step of a streamed inventory
	// (index.ApplyInventoryStepAsync; steps queued one after another are
	// applied in that order) and returns what waits for its outcome.
	// Replicated it is one raft entry per step, applied before it returns.
	queueInventoryStep(ctx context.Context, s index.InventoryStep) (stepWait, error)
	fenceRank(ctx context.Context, r wire.Rank, upTo uint64) (int, error)
	registerNamespace(ctx context.Context, spec dcp.Spec) (*dcp.Resolved, error)
	resetRank(ctx context.Context, r wire.Rank) (int, error)
	// decides reports whether this coordinator acts on membership news
	// and sweeps absent ranks: always standalone, the leader replicated.
	decides() bool
	// term is a context that ends when this coordinator stops deciding:
	// standalone when it stops (c.ctx); replicated when the leadership
	// term ends (already ended while it follows). Work begun for a term,
	// a resync, ends with it.
	term() context.Context
	// confirmComplete is called before a COMPLETE verdict leaves:
	// standalone nil at once; replicated raft's leadership check.
	confirmComplete() error
	// health is /healthz's raft line ("" standalone) and whether it is
	// well.
	health() (line string, ok bool)
	// closeGate stops subscribing leader handlers (Shutdown) and returns
	// the leader subscriptions to drain.
	closeGate() []*nats.Subscription
	// shutdown stops replication (after the subscriptions drained, before
	// the index closes).
	shutdown()
}

// batchResult is an event batch on its way into the index.
type batchResult interface {
	Wait() (index.Outcome, error)
}

// errNotLeader: this coordinator is not (or no longer) the raft leader,
// or raft has not started, so it cannot commit: the request was not
// applied by it (code unavailable; the sender retries and reaches the new
// leader).
var errNotLeader = replica.ErrNotLeader

// standalone is a single coordinator: the index is written directly.
type standalone struct{ c *Coordinator }

func (s standalone) start([]leaderHandler) error { return nil }

func (s standalone) applyBatch(b *wire.Batch) (batchResult, error) {
	// Not c.ctx: a batch being applied while Shutdown drains must commit
	// and be acknowledged; Shutdown closes the index only after this.
	return s.c.idx.ApplyAsync(context.Background(), *b)
}

func (s standalone) applyInventory(ctx context.Context, inv wire.Inventory, gen uint64) (index.InventoryOutcome, error) {
	return s.c.idx.ApplyInventoryAt(ctx, inv, gen)
}

func (s standalone) queueInventoryStep(ctx context.Context, st index.InventoryStep) (stepWait, error) {
	p, err := s.c.idx.ApplyInventoryStepAsync(ctx, st)
	if err != nil {
		return nil, err
	}
	return func() (index.InventoryOutcome, error) {
		res := p.Result(s.c.idx)
		return res.Inventory, res.Err
	}, nil
}

func (s standalone) fenceRank(ctx context.Context, r wire.Rank, upTo uint64) (int, error) {
	return s.c.idx.FenceRank(ctx, r, upTo)
}

func (s standalone) registerNamespace(ctx context.Context, spec dcp.Spec) (*dcp.Resolved, error) {
	return s.c.idx.RegisterNamespace(ctx, spec)
}

func (s standalone) resetRank(ctx context.Context, r wire.Rank) (int, error) {
	return s.c.idx.ResetRank(ctx, r)
}

func (standalone) decides() bool                   { return true }
func (s standalone) term() context.Context         { return s.c.ctx }
func (standalone) confirmComplete() error          { return nil }
func (standalone) health() (string, bool)          { return "", true }
func (standalone) closeGate() []*nats.Subscription { return nil }
func (standalone) shutdown()                       {}
