package coordinator

import (
	"cmp"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
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
	if n := (len(req.Stages) + 1) * len(req.Chunks); len(req.Stages) > 0 && len(req.Stages) <= wire.MaxRouteStages && n > MaxChunks {
		// Each member costs a lookup of every stage's chain.
		c.met.badRequests.WithLabelValues(op).Inc()
		c.replyError(op, m, wire.CodeTooLarge, fmt.Sprintf("%d stages of %d chunks: %d chunks, limit %d", len(req.Stages)+1, len(req.Chunks), n, MaxChunks))
		return
	}
	members := append([]string{inst}, c.share.shared(inst)...)
	stages := []wire.RouteStage{{Namespace: req.Namespace, Chunks: req.Chunks}}
	if len(req.Stages) > 0 {
		if err := checkRouteStages(members, req); err != nil {
			c.badRequest(m, op, err)
			return
		}
		stages = append(stages, req.Stages...)
	}
	rep, err := c.route(members, stages)
	if err != nil {
		c.lookupError(m, op, req.Namespace, err)
		return
	}
	rep.Group = c.share.groupOf[inst]
	c.reply(op, m, rep)
}

// checkRouteStages checks a request with Stages: every member is stage 0
// of an engine ("<engine>-pp0") and every stage's chain is as long as
// stage 0's, within the bounds.
func checkRouteStages(members []string, req *wire.RouteRequest) error {
	if len(req.Stages) > wire.MaxRouteStages {
		return fmt.Errorf("%d stages, limit %d: %w", len(req.Stages)+1, wire.MaxRouteStages+1, wire.ErrMalformed)
	}
	for i, st := range req.Stages {
		if len(st.Chunks) != len(req.Chunks) {
			return fmt.Errorf("stage %d: %d chunks, stage 0 %d (every stage chains the same tokens): %w",
				i+1, len(st.Chunks), len(req.Chunks), wire.ErrMalformed)
		}
	}
	for _, m := range members {
		if _, ok := stageEngine(m); !ok {
			return fmt.Errorf("%q is not stage 0 of a pipeline-parallel engine (<engine>-pp0): a request with stages names stage 0's group or instance: %w",
				m, wire.ErrMalformed)
		}
	}
	return nil
}

// stageEngine is the engine whose stage 0 instance inst is.
func stageEngine(inst string) (string, bool) {
	eng, ok := strings.CutSuffix(inst, "-pp0")
	return eng, ok && eng != ""
}

// route builds the reply for members, over stages (stage 0's namespace
// and chain, then any other stages').
func (c *Coordinator) route(members []string, stages []wire.RouteStage) (*wire.RouteReply, error) {
	hosts := c.rankHosts()
	now := time.Now()
	rep := &wire.RouteReply{Instances: make([]wire.RouteInstance, 0, len(members))}
	res := make([]index.LookupResult, len(stages))
	for _, inst := range members {
		eng, _ := stageEngine(inst)
		upTo := -1 // the chunks every stage could restore
		for s, st := range stages {
			si := stageOf(inst, eng, len(stages), s)
			// StateAtEnd: what an engine restores (a hybrid's connector
			// restores up to a chunk with its state); no effect elsewhere.
			if err := c.idx.LookupOptsInto(&res[s], si, c.share.shared(si), st.Namespace, st.Chunks,
				index.LookupOpts{StateAtEnd: true}); err != nil {
				return nil, err
			}
			if upTo < 0 || res[s].Prefix < upTo {
				upTo = res[s].Prefix
			}
		}
		var ri wire.RouteInstance
		for s := range stages {
			si := stageOf(inst, eng, len(stages), s)
			one := routeOf(&res[s], upTo)
			one.Hosts = hosts[si]
			if upTo > 0 {
				one.NotAlive, _ = notAlive(si, c.readerStatuses(si, res[s].Expectations))
			}
			if s == 0 {
				ri = one
				ri.Load = c.share.loadOf(inst, now)
				continue
			}
			mergeStage(&ri, &one)
		}
		if len(stages) > 1 {
			ri.Engine = eng
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

// stageOf is member inst's instance of stage s of n: inst itself without
// stages.
func stageOf(inst, eng string, n, s int) string {
	if n == 1 {
		return inst
	}
	return wire.StageInstance(eng, n, s)
}

// mergeStage folds another stage's answer (summarized over the same common
// prefix) into an engine's: the prefixes every stage has, and everything
// the stages' restores would read together.
func mergeStage(ri, st *wire.RouteInstance) {
	ri.L1Prefix, ri.OwnPrefix = min(ri.L1Prefix, st.L1Prefix), min(ri.OwnPrefix, st.OwnPrefix)
	for t, n := range st.Objects {
		if ri.Objects == nil {
			ri.Objects = make(map[string]int, len(st.Objects))
		}
		ri.Objects[t] += n
	}
	ri.Shared += st.Shared
	for _, h := range st.Hosts {
		if !slices.Contains(ri.Hosts, h) {
			ri.Hosts = append(ri.Hosts, h)
		}
	}
	slices.Sort(ri.Hosts)
	ri.NotAlive = append(ri.NotAlive, st.NotAlive...)
}

// routeOf summarizes one instance's lookup over its first upTo chunks (at
// most its prefix): a pure function of it. The lookup is a StateAtEnd one:
// a hybrid's states inside its prefix are not counted (not restored); cut
// short by another stage (upTo), the state of the last chunk counted may
// be missing from the counts.
func routeOf(res *index.LookupResult, upTo int) wire.RouteInstance {
	ri := wire.RouteInstance{Instance: res.Instance, Prefix: min(res.Prefix, upTo)}
	ne := len(res.Expectations)
	l1, own := true, true
	for i := range ri.Prefix {
		for j := range ne {
			if !res.Needed(i, j, res.Prefix, true) {
				continue // a hybrid's state inside the prefix: not restored
			}
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
