package coordinator

import (
	"cmp"
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// Routing hints (issue 26.4, docs/sharing.md): admin.route, a read-only
// admin operation (a router holds the admin identity), answers for a
// chunk chain what each instance of a share group could restore now: its
// lookup's prefix, how much of it from L1 on its own hosts, how much from
// its own copies, its tiers, and its load (its engines' recent lookups,
// routeload.go). Each instance costs one lookup. Nothing is planned or
// recorded.

// handleAdminRoute answers admin.route for a named group, or for an
// instance (and its group, if any).
func (c *Coordinator) handleAdminRoute(m *nats.Msg) {
	var req wire.RouteRequest
	if err := bus.Decode(m, &req); err != nil {
		c.badRequest(m, wire.AdminRoute, err)
		return
	}
	inst := req.Instance
	switch {
	case inst != "":
		if err := wire.ValidInstance(inst); err != nil {
			c.badRequest(m, wire.AdminRoute, err)
			return
		}
		if req.Group != "" && req.Group != c.share.groupOf[inst] {
			c.badRequest(m, wire.AdminRoute, fmt.Errorf("instance %q is not in share group %q: %w", inst, req.Group, wire.ErrMalformed))
			return
		}
	case req.Group != "":
		g, ok := c.share.groups[req.Group]
		if !ok {
			c.replyError(wire.AdminRoute, m, wire.CodeNotFound, fmt.Sprintf("no share group %q is configured", req.Group))
			return
		}
		inst = g[0]
	default:
		c.badRequest(m, wire.AdminRoute, fmt.Errorf("name a share group or an instance: %w", wire.ErrMalformed))
		return
	}
	c.answerRoute(m, wire.AdminRoute, inst, &req)
}

// answerRoute looks the chain up for inst and the other members of its
// group and replies.
func (c *Coordinator) answerRoute(m *nats.Msg, op, inst string, req *wire.RouteRequest) {
	if len(req.Chunks) > MaxChunks {
		c.met.badRequests.WithLabelValues(op).Inc()
		c.replyError(op, m, wire.CodeTooLarge, fmt.Sprintf("%d chunks, limit %d", len(req.Chunks), MaxChunks))
		return
	}
	members := append([]string{inst}, c.share.shared(inst)...)
	rep, err := c.route(members, req.Namespace, req.Chunks)
	if err != nil {
		c.lookupError(m, op, req.Namespace, err)
		return
	}
	rep.Group = c.share.groupOf[inst]
	c.reply(op, m, rep)
}

// route builds the reply for members.
func (c *Coordinator) route(members []string, ns dcp.Namespace, chunks []dcp.ChunkHash) (*wire.RouteReply, error) {
	hosts := c.rankHosts()
	now := time.Now()
	rep := &wire.RouteReply{Instances: make([]wire.RouteInstance, 0, len(members))}
	var res index.LookupResult
	for _, inst := range members {
		if err := c.idx.LookupSharedInto(&res, inst, c.share.shared(inst), ns, chunks); err != nil {
			return nil, err
		}
		ri := routeOf(&res)
		ri.Hosts = hosts[inst]
		ri.Load = c.share.loadOf(inst, now)
		if res.Prefix > 0 {
			ri.NotAlive, _ = notAlive(inst, c.readerStatuses(inst, res.Expectations))
		}
		rep.Instances = append(rep.Instances, ri)
	}
	// Prefix, DRAM, then load before own copies (routeload.go).
	slices.SortFunc(rep.Instances, func(a, b wire.RouteInstance) int {
		return cmp.Or(-cmp.Compare(a.Prefix, b.Prefix), -cmp.Compare(a.L1Prefix, b.L1Prefix),
			cmp.Compare(loadLevel(a.Load), loadLevel(b.Load)), -cmp.Compare(a.OwnPrefix, b.OwnPrefix),
			cmp.Compare(a.Load, b.Load), cmp.Compare(a.Instance, b.Instance))
	})
	return rep, nil
}

// routeOf summarizes one instance's lookup: a pure function of it.
func routeOf(res *index.LookupResult) wire.RouteInstance {
	ri := wire.RouteInstance{Instance: res.Instance, Prefix: res.Prefix}
	ne := len(res.Expectations)
	l1, own := true, true
	for i := range res.Prefix {
		for j := range ne {
			s := res.Source(i, j)
			if ri.Objects == nil {
				ri.Objects = make(map[string]int, 3)
			}
			ri.Objects[s.Tier.String()]++
			shared := res.FromShared(i, j)
			if shared {
				ri.Shared++
			}
			l1 = l1 && s.Tier == wire.L1
			own = own && !shared
		}
		if l1 {
			ri.L1Prefix++
		}
		if own {
			ri.OwnPrefix++
		}
	}
	return ri
}

// rankHosts returns the hosts of the live rankd members, by instance,
// sorted.
func (c *Coordinator) rankHosts() map[string][]string {
	out := make(map[string][]string)
	if c.member == nil {
		return out
	}
	for _, mb := range c.member.Members() {
		if mb.Meta.Role != cluster.RoleRankd || mb.State != cluster.StateAlive {
			continue
		}
		h, _, err := net.SplitHostPort(mb.Addr)
		if err != nil {
			h = mb.Addr
		}
		if !slices.Contains(out[mb.Meta.Engine], h) {
			out[mb.Meta.Engine] = append(out[mb.Meta.Engine], h)
		}
	}
	for _, hs := range out {
		slices.Sort(hs)
	}
	return out
}
