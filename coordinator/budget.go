package coordinator

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
)

// Per-rank budgets (issue 28.3). One rankd credential could publish any
// number of invented placements of its own shard: 2 M in 12 s took a
// coordinator from 39 MB to 724 MB and its index file to 64 MB, for good.
// Now every rank has
//
//   - a placement budget: the placements the index may hold for it (every
//     tier) are at most min(MaxPlacementsPerRank, declared / smallest),
//     where declared is the capacity its heartbeats declare
//     (wire.Capacity: L1 + L2 + L3 bytes, on its own authenticated
//     subject) and smallest the smallest object of any registered
//     namespace (index.MinObjectSize). Without a declaration, or before any
//     namespace is registered, MaxPlacementsPerRank alone. A rank that
//     declares infinity gets MaxPlacementsPerRank;
//   - an event rate: a token bucket of EventRatePerRank events a second,
//     EventBurstPerRank deep (a batch takes one token per event).
//
// A batch that would take its rank over its budget is refused whole with
// code bad_request, naming the rank, the count and the budget: the rank's
// publisher drops it and does not send it again (the sequence gap then
// makes the coordinator ask for the rank's inventory, which is bounded by
// the same budget). Whether it would is decided without the committer:
// while none of the rank's batches is in flight, exactly, on the published
// state (index.BatchGrowth); while some are, against a bound that credits
// no removal until they are committed (inFlight): a batch the bound refuses
// is answered with code unavailable, and the rank sends it again once the
// batches before it are acknowledged, when the exact check decides. A
// batch over the rate, or of a rank an operator is resetting, is answered
// with code unavailable too (a retry hint with the rate's delay). After a
// refusal with code unavailable, the rank's later batches of the same
// incarnation are refused alike until that batch comes again (hold): the
// publisher sends again from the refused batch (go-back-N), so no later
// batch is applied past it, which would be a gap and cost a resync.
//
// Every refusal is counted in kvtier_coord_refused_total by rule
// (rank_budget, rank_budget_in_flight, rank_rate, rank_held,
// rank_resetting, inventory_budget) and logged at most once per
// refusalLogInterval per rank, with the count of those not logged.

// refusalLogInterval is how often a rank's refusals are logged at most.
const refusalLogInterval = 10 * time.Second

// errRetryLater: a batch was refused for now; the rank sends it again
// (code unavailable).
var errRetryLater = errors.New("refused for now; send it again")

// rankBudgets is the budget state of every rank that sent a batch (so at
// most MaxRanks plus those refused by the index itself).
type rankBudgets struct {
	mu sync.Mutex // guards m
	m  map[wire.Rank]*rankBudget
}

// rankBudget is one rank's budget state. Its batches are admitted by one
// ingest worker in arrival order; the acker ends them (done).
type rankBudget struct {
	// mu guards the following. The index's read paths (Rank,
	// BatchGrowth) are taken under it; nothing of the coordinator is.
	mu sync.Mutex
	// declared is the total capacity the rank's last heartbeat declared
	// (wire.Capacity.Total); 0: none.
	declared uint64
	// inFlight counts the rank's batches admitted and not yet committed
	// (or failed). While it is > 0, base is the rank's published
	// placement count when the first of them was admitted and grown an
	// upper bound of what they add: each adds the slots it stores that
	// the published state lacked when it was admitted; their removals are
	// not credited until inFlight is 0 again. Every placement the rank
	// holds once they are applied was either held at base or created by
	// one of them from a slot absent when it was admitted, so the rank
	// never holds more than base + grown.
	inFlight int
	base     int64
	grown    int64
	lim      *rate.Limiter
	// holdInc, holdFrom: batches of incarnation holdInc starting past
	// sequence holdFrom are refused (rule rank_held) until one starting at
	// or before it arrives; holdFrom 0: no hold.
	holdInc, holdFrom uint64
	holdWhy           string
	// resetting: an operator's reset of the rank is running.
	resetting bool
	// lastLog, quiet: when a refusal of the rank was last logged, and
	// how many were not logged since.
	lastLog time.Time
	quiet   int
}

// of returns rank r's budget state, creating it when create is set; nil
// otherwise for a rank never seen.
func (b *rankBudgets) of(r wire.Rank, create bool, cfg *Config) *rankBudget {
	b.mu.Lock()
	defer b.mu.Unlock()
	rb := b.m[r]
	if rb == nil && create {
		if b.m == nil {
			b.m = make(map[wire.Rank]*rankBudget)
		}
		rb = &rankBudget{lim: rate.NewLimiter(rate.Limit(cfg.EventRatePerRank), cfg.EventBurstPerRank)}
		b.m[r] = rb
	}
	return rb
}

// forget drops rank r's state (a reset).
func (b *rankBudgets) forget(r wire.Rank) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.m, r)
}

// budgetOf returns rank r's placement budget and what it was taken from.
// Called with rb.mu held.
func (c *Coordinator) budgetOf(rb *rankBudget) (budget int64, from string) {
	budget, from = int64(c.cfg.MaxPlacementsPerRank), "MaxPlacementsPerRank"
	if rb == nil || rb.declared == 0 {
		return budget, from
	}
	if smallest := c.idx.MinObjectSize(); smallest > 0 {
		if d := rb.declared / smallest; d < uint64(budget) {
			return int64(d), fmt.Sprintf("declared capacity %d B / smallest object %d B", rb.declared, smallest)
		}
	}
	return budget, from
}

// rankBudget returns rank r's placement budget (for an inventory).
func (c *Coordinator) rankBudget(r wire.Rank) (int64, string) {
	rb := c.budgets.of(r, false, &c.cfg)
	if rb == nil {
		return c.budgetOf(nil)
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return c.budgetOf(rb)
}

// declareCapacity records the capacity rank r's heartbeat declared. Only
// for ranks the index knows (the heartbeat handler checks), so the table
// stays bounded.
func (c *Coordinator) declareCapacity(r wire.Rank, capacity *wire.Capacity) {
	if capacity == nil {
		return
	}
	rb := c.budgets.of(r, true, &c.cfg)
	rb.mu.Lock()
	rb.declared = capacity.Total()
	rb.mu.Unlock()
}

// admitBatch applies rank b.Rank's event rate and placement budget to b
// (see the top of this file). On success the batch is in flight until
// batchDone. A refusal wraps errRefused (code bad_request: over budget,
// for good) or errRetryLater (code unavailable; retryMS, when > 0, is
// when to try again), is counted and logged (at most once per interval).
func (c *Coordinator) admitBatch(b *wire.Batch, now time.Time) (retryMS int, err error) {
	rb := c.budgets.of(b.Rank, true, &c.cfg)
	rb.mu.Lock()
	defer rb.mu.Unlock()
	rule, retryMS, err := c.admitLocked(rb, b, now)
	if err != nil {
		c.met.refused.WithLabelValues(rule).Inc()
		if errors.Is(err, errRetryLater) && len(b.Events) > 0 && rule != "rank_held" {
			rb.holdInc, rb.holdFrom, rb.holdWhy = b.Incarnation, b.Events[0].Seq, rule
		}
		if now.Sub(rb.lastLog) >= refusalLogInterval {
			c.log.Warn("batch refused", zap.Stringer("rank", b.Rank), zap.String("rule", rule),
				zap.Int("not_logged_since", rb.quiet), zap.Error(err))
			rb.lastLog, rb.quiet = now, 0
		} else {
			rb.quiet++
		}
	}
	return retryMS, err
}

// admitLocked is admitBatch's decision, with rb.mu held: the rule that
// refused (for the metric) and the error, or nil with the batch counted
// in flight.
func (c *Coordinator) admitLocked(rb *rankBudget, b *wire.Batch, now time.Time) (rule string, retryMS int, err error) {
	if rb.resetting {
		return "rank_resetting", 0, fmt.Errorf("batch of %s: an operator is resetting the rank: %w", b.Rank, errRetryLater)
	}
	if rb.holdFrom != 0 {
		if len(b.Events) > 0 && b.Incarnation == rb.holdInc && b.Events[0].Seq > rb.holdFrom {
			return "rank_held", 0, fmt.Errorf("batch of %s from seq %d: the batch from seq %d was refused (%s) and must come first: %w",
				b.Rank, b.Events[0].Seq, rb.holdFrom, rb.holdWhy, errRetryLater)
		}
		rb.holdInc, rb.holdFrom, rb.holdWhy = 0, 0, ""
	}
	n := max(1, len(b.Events))
	if !rb.lim.AllowN(now, n) {
		r := rb.lim.ReserveN(now, n)
		wait := r.DelayFrom(now)
		r.CancelAt(now)
		return "rank_rate", int(wait.Milliseconds()) + 1, fmt.Errorf("batch of %s: %d events over the rank's event rate, %.0f/s with bursts of %d (EventRatePerRank, EventBurstPerRank); retry in %v: %w",
			b.Rank, len(b.Events), c.cfg.EventRatePerRank, c.cfg.EventBurstPerRank, wait.Round(time.Millisecond), errRetryLater)
	}
	budget, from := c.budgetOf(rb)
	if rb.inFlight == 0 {
		ri, _ := c.idx.Rank(b.Rank)
		rb.base, rb.grown = ri.L1Placements+ri.L2Placements+ri.L3Placements, 0
	}
	stored := int64(0)
	for i := range b.Events {
		if b.Events[i].Kind == wire.Stored {
			stored++
		}
	}
	if rb.base+rb.grown+stored <= budget {
		rb.grown += stored
		rb.inFlight++
		return "", 0, nil
	}
	// A batch that adds no placement on balance is taken even over the
	// budget (a budget lowered by a declaration or the config): refusing
	// it would only cost the rank a resync whose inventory is refused too.
	held, added, removed := c.idx.BatchGrowth(b)
	if rb.inFlight == 0 {
		after := held + int64(added) - int64(removed)
		if after > budget && added > removed {
			return "rank_budget", 0, fmt.Errorf("batch of %s incarnation %d (%d events from seq %d): the rank holds %d placements and would hold %d, over its budget of %d (%s): %w: %w",
				b.Rank, b.Incarnation, len(b.Events), firstSeq(b), held, after, budget, from, errRefused, wire.ErrMalformed)
		}
		rb.base, rb.grown = held, int64(added)-int64(removed)
		rb.inFlight++
		return "", 0, nil
	}
	if added > 0 && rb.base+rb.grown+int64(added) > budget {
		return "rank_budget_in_flight", 0, fmt.Errorf("batch of %s incarnation %d (%d events from seq %d): with %d batches in flight the rank may hold %d placements, over its budget of %d (%s); send it again once they are acknowledged: %w",
			b.Rank, b.Incarnation, len(b.Events), firstSeq(b), rb.inFlight, rb.base+rb.grown+int64(added), budget, from, errRetryLater)
	}
	rb.grown += int64(added)
	rb.inFlight++
	return "", 0, nil
}

func firstSeq(b *wire.Batch) uint64 {
	if len(b.Events) == 0 {
		return 0
	}
	return b.Events[0].Seq
}

// batchDone ends an admitted batch of rank r: committed (and published)
// or failed.
func (c *Coordinator) batchDone(r wire.Rank) {
	rb := c.budgets.of(r, false, &c.cfg)
	if rb == nil {
		return // reset meanwhile
	}
	rb.mu.Lock()
	if rb.inFlight > 0 {
		rb.inFlight--
	}
	rb.mu.Unlock()
}

// setResetting marks rank r as being reset by an operator (its batches
// are refused for now and no resync starts), or no longer: then its budget
// state is dropped.
func (c *Coordinator) setResetting(r wire.Rank, on bool) {
	if !on {
		c.budgets.forget(r)
		return
	}
	rb := c.budgets.of(r, true, &c.cfg)
	rb.mu.Lock()
	rb.resetting = true
	rb.mu.Unlock()
}

// resetting reports whether an operator's reset of rank r is running.
func (c *Coordinator) resetting(r wire.Rank) bool {
	rb := c.budgets.of(r, false, &c.cfg)
	if rb == nil {
		return false
	}
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return rb.resetting
}
