package coordinator

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// Limits for a hostile or broken sender (C9, issue 10.5). Every message
// that would make the coordinator hold more state is checked against a
// Config cap first; a refusal names the cap and the numbers and is
// counted in kvtier_coord_refused_total by rule. The caps:
//
//   - incarnations: a batch, inventory or heartbeat whose incarnation is
//     further ahead of this coordinator's clock than MaxIncarnationSkew is
//     refused (incarnations are start times in Unix nanoseconds, so 2^64-1
//     is refused and cannot lock a rank out); with RequireMemberIncarnation,
//     a batch that would introduce a new incarnation of a rank is refused
//     with code unavailable (the rankd retries) until memberlist shows that
//     incarnation alive. `coordinator rank reset` undoes a bad incarnation
//     that got in anyway;
//   - ranks, instances and namespaces the index may hold: MaxRanks,
//     MaxInstances, MaxNamespaces;
//   - event sizes: a Stored event of a registered namespace must name a
//     group of its spec, a shard that group has, and the size the geometry
//     gives (dcp.Resolved.ObjectSize);
//   - inventories: MaxInventoryPages, MaxInventoryObjects;
//   - heartbeats: only ranks the index knows are tracked (so the table is
//     bounded by MaxRanks, and a heartbeat of an invented rank starts
//     nothing); resyncs running at once: MaxConcurrentResyncs (one more is
//     dropped and counted; the rank's next batch or heartbeat asks again),
//     and how fast they start: ResyncRate, ResyncBurst;
//   - restores: MaxActiveRestoresPerInstance (so one instance's flood
//     leaves MaxActiveRestores - MaxActiveRestoresPerInstance for the
//     others), parked waiters: MaxWaitersPerRestore, MaxWaitersPerInstance
//     (so one instance's flood of waits leaves the others room) and
//     MaxWaiters;
//     deadlines are clamped to MaxRestoreDeadline before any arithmetic.

// errRefused: a message broke a limit. The coordinator answers it with
// code bad_request (or unavailable where a retry may succeed).
var errRefused = errors.New("limit for a hostile or broken sender")

// checkIncarnation refuses an incarnation implausibly far in the future.
func (c *Coordinator) checkIncarnation(what string, r wire.Rank, inc uint64, now time.Time) error {
	limit := uint64(now.UnixNano()) + uint64(c.cfg.MaxIncarnationSkew)
	if inc > limit {
		c.met.refused.WithLabelValues("incarnation_skew").Inc()
		return fmt.Errorf("%s of %s: incarnation %d is a start time %v ahead of this coordinator's clock, limit %v (MaxIncarnationSkew): %w: %w",
			what, r, inc, time.Duration(inc-uint64(now.UnixNano())).Round(time.Second), c.cfg.MaxIncarnationSkew, errRefused, wire.ErrMalformed)
	}
	return nil
}

// errNotMember: a new incarnation is not (yet) alive in memberlist.
var errNotMember = errors.New("incarnation not alive in the cluster")

// checkBatchLimits applies the caps to a batch before the index sees it:
// incarnation plausibility and membership, rank, instance and namespace
// caps, event geometry.
func (c *Coordinator) checkBatchLimits(b *wire.Batch, now time.Time) error {
	if err := c.checkIncarnation("batch", b.Rank, b.Incarnation, now); err != nil {
		return err
	}
	ri, known := c.idx.Rank(b.Rank)
	if !known || b.Incarnation > ri.Incarnation {
		if c.cfg.RequireMemberIncarnation && !c.live.aliveInc(b.Rank, b.Incarnation) {
			c.met.refused.WithLabelValues("not_member").Inc()
			return fmt.Errorf("batch of %s introduces incarnation %d, which memberlist does not show alive (yet; retry): %w",
				b.Rank, b.Incarnation, errNotMember)
		}
	}
	if !known {
		st := c.idx.Stats()
		if st.Ranks >= c.cfg.MaxRanks {
			c.met.refused.WithLabelValues("max_ranks").Inc()
			return fmt.Errorf("batch of a new rank %s: the index holds %d ranks, limit %d (MaxRanks): %w: %w",
				b.Rank, st.Ranks, c.cfg.MaxRanks, errRefused, wire.ErrMalformed)
		}
		if !c.instanceKnown(b.Rank.Instance) {
			if n := c.instanceCount(); n >= c.cfg.MaxInstances {
				c.met.refused.WithLabelValues("max_instances").Inc()
				return fmt.Errorf("batch of %s names a new instance: the index holds %d instances, limit %d (MaxInstances): %w: %w",
					b.Rank, n, c.cfg.MaxInstances, errRefused, wire.ErrMalformed)
			}
		}
	}
	return c.checkEventGeometry(b)
}

// instanceKnown reports whether the index has a rank of instance.
func (c *Coordinator) instanceKnown(instance string) bool {
	for _, r := range c.idx.Ranks() {
		if r.Rank.Instance == instance {
			return true
		}
	}
	return false
}

func (c *Coordinator) instanceCount() int {
	seen := map[string]bool{}
	for _, r := range c.idx.Ranks() {
		seen[r.Rank.Instance] = true
	}
	return len(seen)
}

// nsGeometry is what event checks need of a registered namespace.
type nsGeometry struct {
	sizes  []uint64 // object size per group
	shards []int    // shards per group
}

// geometries caches the geometry of registered namespaces (specs never
// change once registered).
type geometries struct {
	mu sync.Mutex // guards m
	m  map[dcp.Namespace]*nsGeometry
}

// geometry returns ns's geometry, nil while it is unregistered; known
// reports whether the index has the namespace at all.
func (c *Coordinator) geometry(ns dcp.Namespace) (g *nsGeometry, known bool) {
	c.geo.mu.Lock()
	g = c.geo.m[ns]
	c.geo.mu.Unlock()
	if g != nil {
		return g, true
	}
	ni, err := c.idx.ListNamespace(ns)
	if err != nil {
		return nil, false
	}
	if ni.Spec == nil {
		return nil, true
	}
	g = &nsGeometry{}
	for gi := range ni.Spec.Groups {
		g.sizes = append(g.sizes, ni.Spec.ObjectSize(gi))
		g.shards = append(g.shards, len(ni.Spec.Shards(gi)))
	}
	c.geo.mu.Lock()
	if c.geo.m == nil {
		c.geo.m = make(map[dcp.Namespace]*nsGeometry)
	}
	c.geo.m[ns] = g
	c.geo.mu.Unlock()
	return g, true
}

// checkEventGeometry checks every Stored event of a registered namespace
// against its geometry, and refuses events of a namespace the index does
// not have once it holds MaxNamespaces.
func (c *Coordinator) checkEventGeometry(b *wire.Batch) error {
	var lastNS dcp.Namespace
	var g *nsGeometry
	have := false
	for i := range b.Events {
		e := &b.Events[i]
		if !have || e.Key.NS != lastNS {
			var known bool
			g, known = c.geometry(e.Key.NS)
			lastNS, have = e.Key.NS, true
			if !known && e.Kind == wire.Stored {
				if n := c.idx.Stats().Namespaces; n >= c.cfg.MaxNamespaces {
					c.met.refused.WithLabelValues("max_namespaces").Inc()
					return fmt.Errorf("batch of %s: event %d (seq %d) stores into a new namespace %s: the index holds %d namespaces, limit %d (MaxNamespaces): %w: %w",
						b.Rank, i, e.Seq, e.Key.NS, n, c.cfg.MaxNamespaces, errRefused, wire.ErrMalformed)
				}
			}
		}
		if g == nil || e.Kind != wire.Stored {
			continue
		}
		gi := int(e.Key.Group)
		switch {
		case gi >= len(g.sizes):
			c.met.refused.WithLabelValues("geometry").Inc()
			return fmt.Errorf("batch of %s: event %d (seq %d) stores %s: group %d, the namespace has %d groups: %w: %w",
				b.Rank, i, e.Seq, e.Key, gi, len(g.sizes), errRefused, wire.ErrMalformed)
		case int(e.Key.Shard) >= g.shards[gi]:
			c.met.refused.WithLabelValues("geometry").Inc()
			return fmt.Errorf("batch of %s: event %d (seq %d) stores %s: shard %d, group %d has %d shards: %w: %w",
				b.Rank, i, e.Seq, e.Key, e.Key.Shard, gi, g.shards[gi], errRefused, wire.ErrMalformed)
		case e.Size != g.sizes[gi]:
			c.met.refused.WithLabelValues("geometry").Inc()
			return fmt.Errorf("batch of %s: event %d (seq %d) stores %s with size %d B, the geometry says %d B: %w: %w",
				b.Rank, i, e.Seq, e.Key, e.Size, g.sizes[gi], errRefused, wire.ErrMalformed)
		}
	}
	return nil
}

// checkInventoryLimits applies the caps to an inventory.
func (c *Coordinator) checkInventoryLimits(inv *wire.Inventory, now time.Time) error {
	if err := c.checkIncarnation("inventory", inv.Rank, inv.Incarnation, now); err != nil {
		return err
	}
	if len(inv.Objects) > c.cfg.MaxInventoryObjects {
		c.met.refused.WithLabelValues("inventory_objects").Inc()
		return fmt.Errorf("inventory of %s holds %d objects, limit %d (MaxInventoryObjects): %w: %w",
			inv.Rank, len(inv.Objects), c.cfg.MaxInventoryObjects, errRefused, wire.ErrMalformed)
	}
	if budget, from := c.rankBudget(inv.Rank); int64(len(inv.Objects)) > budget {
		c.met.refused.WithLabelValues("inventory_budget").Inc()
		return fmt.Errorf("inventory of %s holds %d objects, over the rank's budget of %d placements (%s): %w: %w",
			inv.Rank, len(inv.Objects), budget, from, errRefused, wire.ErrMalformed)
	}
	return nil
}

// handleRankReset answers admin.rank.reset: the rank's placements are
// dropped and its incarnation forgotten (index.ResetRank), the restores
// expecting it fail at once, its heartbeat record and fence gate are
// dropped. Its real incarnation's next batch starts a resync.
func (c *Coordinator) handleRankReset(m *nats.Msg) {
	var req wire.AdminRankResetRequest
	if err := bus.Decode(m, &req); err != nil {
		c.badRequest(m, wire.AdminRankReset, err)
		return
	}
	r, err := wire.ParseRank(req.Rank)
	if err == nil {
		err = wire.ValidInstance(r.Instance)
	}
	if err != nil {
		c.badRequest(m, wire.AdminRankReset, err)
		return
	}
	prev, known := c.rankIncarnation(r)
	if !known {
		c.replyError(wire.AdminRankReset, m, wire.CodeNotFound, fmt.Sprintf("rank %s is not known to the index", r))
		return
	}
	failed := c.rs.failRank(r, math.MaxUint64, "reset", fmt.Sprintf("rank %s reset by an operator", r))
	// Until the reset returns, the rank's batches are refused (code
	// unavailable: it sends them again) and no resync of it starts: the
	// index resets a large rank in slices (index.ResetRank), and a batch
	// or inventory of the rank arriving meanwhile would make it drop the
	// rest in one piece, the memory spike slicing avoids (issue 28.3).
	c.setResetting(r, true)
	defer c.setResetting(r, false)
	ctx, cancel := context.WithTimeout(c.ctx, requestTimeout)
	defer cancel()
	// A reset moves the rank's fence generation (index.ResetRank): an
	// inventory requested before it is not applied after it.
	n, err := c.repl.resetRank(ctx, r)
	if err != nil {
		if errors.Is(err, index.ErrClosed) || errors.Is(err, context.Canceled) {
			c.replyError(wire.AdminRankReset, m, wire.CodeUnavailable, "coordinator shutting down")
			return
		}
		if errors.Is(err, errNotLeader) {
			c.replyError(wire.AdminRankReset, m, wire.CodeUnavailable, err.Error())
			return
		}
		c.internalError(m, wire.AdminRankReset, "reset rank", err, zap.Stringer("rank", r))
		return
	}
	c.hb.forget(r)
	c.kvRankChanged(r, nil)
	c.setResetting(r, false) // before the reply: a batch sent on its receipt is not refused as resetting
	c.log.Warn("rank reset by an operator", zap.Stringer("rank", r), zap.Uint64("previous_incarnation", prev),
		zap.Int("placements", n), zap.Int("restores_failed", failed))
	c.reply(wire.AdminRankReset, m, &wire.AdminRankResetReply{Rank: r.String(), PreviousIncarnation: prev, Placements: n,
		Restores: failed})
}
