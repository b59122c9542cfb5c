package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/coordinator/admin"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// MaxChunks bounds the chunk chain of one lookup or restore.
const MaxChunks = 1 << 16

// requestTimeout bounds the index work of one admin or registration
// request.
const requestTimeout = 30 * time.Second

// handleRegister answers coord.ns.register: a dcp.Spec is resolved and
// recorded durably as its namespace's spec.
func (c *Coordinator) handleRegister(m *nats.Msg) {
	var spec dcp.Spec
	if err := bus.Decode(m, &spec); err != nil {
		c.badRequest(m, "ns.register", err)
		return
	}
	if n := c.idx.Stats().Namespaces; n >= c.cfg.MaxNamespaces {
		if res, err := spec.Resolve(); err != nil || !c.namespaceKnown(res.Namespace) {
			c.met.refused.WithLabelValues("max_namespaces").Inc()
			c.badRequest(m, wire.CoordRegister, fmt.Errorf("the index holds %d namespaces, limit %d (MaxNamespaces): %w: %w",
				n, c.cfg.MaxNamespaces, errRefused, wire.ErrMalformed))
			return
		}
	}
	ctx, cancel := context.WithTimeout(c.ctx, requestTimeout)
	defer cancel()
	res, err := c.repl.registerNamespace(ctx, spec)
	switch {
	case err == nil:
	case errors.Is(err, dcp.ErrGeometry), errors.Is(err, dcp.ErrLayout):
		c.met.badRequests.WithLabelValues("ns.register").Inc()
		c.log.Warn("namespace spec rejected", zap.String("model", spec.Model), zap.Error(err))
		c.replyError(wire.CoordRegister, m, wire.CodeGeometry, err.Error())
		return
	case errors.Is(err, index.ErrInvalid), errors.Is(err, index.ErrNamespaceConflict):
		c.badRequest(m, "ns.register", err)
		return
	case errors.Is(err, index.ErrClosed), errors.Is(err, context.Canceled):
		c.replyError(wire.CoordRegister, m, wire.CodeUnavailable, "coordinator shutting down")
		return
	case errors.Is(err, errNotLeader):
		c.replyError(wire.CoordRegister, m, wire.CodeUnavailable, err.Error())
		return
	default:
		c.internalError(m, wire.CoordRegister, "register namespace", err, zap.String("model", spec.Model))
		return
	}
	c.reply(wire.CoordRegister, m, &wire.RegisterReply{Namespace: res.Namespace})
}

func (c *Coordinator) namespaceKnown(ns dcp.Namespace) bool {
	_, err := c.idx.ListNamespace(ns)
	return err == nil
}

// lookup runs the index lookup for instance, or, with no instance, for the
// instance with the longest prefix (ties: the first by name).
func (c *Coordinator) lookup(instance string, ns dcp.Namespace, chunks []dcp.ChunkHash) (index.LookupResult, error) {
	return c.lookupOpts(instance, ns, chunks, index.LookupOpts{})
}

// lookupOpts is lookup with opts (a StateAtEnd restore's).
func (c *Coordinator) lookupOpts(instance string, ns dcp.Namespace, chunks []dcp.ChunkHash, opts index.LookupOpts) (index.LookupResult, error) {
	var res index.LookupResult
	err := c.lookupInto(&res, instance, ns, chunks, opts)
	return res, err
}

// lookupScratch is what one coord.lookup decodes into, looks up into and
// encodes into, kept in lookupPool between requests so a lookup in the
// steady state allocates neither its chunk list nor its Sources (32 KiB
// for 128 chunks x 8 shards) nor its reply.
type lookupScratch struct {
	req   wire.LookupRequest
	res   index.LookupResult
	reply []byte
}

var lookupPool = sync.Pool{New: func() any { return new(lookupScratch) }}

// appendLookupReply appends the JSON reply of a lookup without sources or
// readers not alive, exactly as json.Marshal writes okReply{OK:
// &wire.LookupReply{Instance: instance, Prefix: prefix}}, and reports
// whether it could: only for an instance of the characters
// wire.ValidInstance allows (no escaping needed).
func appendLookupReply(b []byte, instance string, prefix int) ([]byte, bool) {
	for i := 0; i < len(instance); i++ {
		if c := instance[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return b, false
		}
	}
	b = append(b, `{"ok":{`...)
	if instance != "" {
		b = append(b, `"instance":"`...)
		b = append(b, instance...)
		b = append(b, `",`...)
	}
	b = append(b, `"prefix":`...)
	b = strconv.AppendInt(b, int64(prefix), 10)
	return append(b, "}}"...), true
}

// lookupInto is lookup writing into res (index.LookupSharedInto): the
// reader instance's copies and the L2 copies of the other instances of
// its share group (share.go).
func (c *Coordinator) lookupInto(res *index.LookupResult, instance string, ns dcp.Namespace, chunks []dcp.ChunkHash,
	opts index.LookupOpts) error {
	if len(chunks) > MaxChunks {
		return fmt.Errorf("%d chunks, limit %d: %w", len(chunks), MaxChunks, errTooLarge)
	}
	t0 := time.Now()
	defer func() { c.met.lookupSeconds.Observe(time.Since(t0).Seconds()) }()
	if instance != "" {
		err := c.idx.LookupOptsInto(res, instance, c.share.shared(instance), ns, chunks, opts)
		c.countLookup(res.Prefix, len(chunks), err)
		return err
	}
	if err := c.idx.LookupInto(res, "", ns, chunks); err != nil { // checks the namespace
		c.countLookup(0, len(chunks), err)
		return err
	}
	var cand index.LookupResult
	for _, inst := range c.idx.Instances() { // sorted
		if err := c.idx.LookupOptsInto(&cand, inst, c.share.shared(inst), ns, chunks, opts); err != nil {
			*res = cand
			return err
		}
		if res.Instance == "" || cand.Prefix > res.Prefix {
			// Swap, so the loser's Sources are reused by the next candidate.
			*res, cand = cand, *res
		}
		if res.Prefix == len(chunks) {
			break
		}
	}
	c.countLookup(res.Prefix, len(chunks), nil)
	return nil
}

var errTooLarge = errors.New("request too large")

// decodeRequest decodes m into v: its binary form when isBinary says m's
// first bytes are one (wire's lookup, begin and report forms), else JSON.
// Either form is refused over bus.MaxRequestBytes: a NATS server whose
// payload limit an operator raised must not let a binary report allocate
// more than a JSON one may.
func decodeRequest(m *nats.Msg, v interface{ UnmarshalBinary([]byte) error }, isBinary func([]byte) bool) error {
	if len(m.Data) > bus.MaxRequestBytes {
		return fmt.Errorf("request of %d bytes exceeds %d: %w", len(m.Data), bus.MaxRequestBytes, wire.ErrMalformed)
	}
	if isBinary(m.Data) {
		return v.UnmarshalBinary(m.Data)
	}
	return bus.Decode(m, v)
}

// countLookupTokens counts an engine's lookup of n chunks that found res:
// token-weighted (a lookup of 2 chunks counts less than one of 2,000),
// whether it found shared copies, and admin.route's load term. Engine
// lookups only: coord.lookup and the begins that are one
// (RestoreBeginRequest.Lookup), not the begins that follow a lookup nor
// admin queries.
func (c *Coordinator) countLookupTokens(instance string, n int, res *index.LookupResult, stateAtEnd bool) {
	c.met.lookupTokens.Add(float64(n * res.ChunkTokens))
	c.met.lookupHits.Add(float64(res.Prefix * res.ChunkTokens))
	if res.SharedSources(res.Prefix, stateAtEnd) > 0 {
		c.share.met.lookups.Inc()
	}
	c.share.noteLookup(instance, time.Now()) // admin.route's load term
}

func (c *Coordinator) countLookup(prefix, n int, err error) {
	switch {
	case err != nil:
		return
	case prefix == n && n > 0:
		c.met.lookups.WithLabelValues("hit").Inc()
	case prefix > 0:
		c.met.lookups.WithLabelValues("partial").Inc()
	default:
		c.met.lookups.WithLabelValues("miss").Inc()
	}
}

// handleLookup answers coord.lookup: a wire.LookupRequest as JSON or in
// its binary form; the reply is JSON either way.
func (c *Coordinator) handleLookup(m *nats.Msg) {
	sc := lookupPool.Get().(*lookupScratch)
	defer lookupPool.Put(sc)
	req := &sc.req
	*req = wire.LookupRequest{Chunks: req.Chunks[:0]} // decoders reuse its capacity
	if err := decodeRequest(m, req, wire.IsBinaryLookup); err != nil {
		c.badRequest(m, "lookup", err)
		return
	}
	if req.Instance != "" {
		if err := wire.ValidInstance(req.Instance); err != nil {
			c.badRequest(m, "lookup", err)
			return
		}
	}
	if !c.scope(m, wire.CoordLookup, "lookup", &req.Instance) {
		return
	}
	res := &sc.res
	err := c.lookupInto(res, req.Instance, req.Namespace, req.Chunks, index.LookupOpts{StateAtEnd: req.StateAtEnd})
	if err != nil {
		if errors.Is(err, errTooLarge) {
			c.met.badRequests.WithLabelValues("lookup").Inc()
			c.replyError(wire.CoordLookup, m, wire.CodeTooLarge, err.Error())
			return
		}
		c.lookupError(m, "lookup", req.Namespace, err)
		return
	}
	c.countLookupTokens(req.Instance, len(req.Chunks), res, req.StateAtEnd)
	var notAliveRanks []string
	var reason string
	if res.Instance != "" {
		// See "Reader liveness" in restore.go.
		notAliveRanks, reason = notAlive(res.Instance, c.readerStatuses(res.Instance, res.Expectations))
	}
	if !req.Detail && len(notAliveRanks) == 0 {
		var ok bool
		if sc.reply, ok = appendLookupReply(sc.reply[:0], res.Instance, res.Prefix); ok {
			c.sendEncoded(wire.CoordLookup, m, sc.reply) // a few dozen bytes: always fits
			return
		}
	}
	rep := &wire.LookupReply{Instance: res.Instance, Prefix: res.Prefix, NotAlive: notAliveRanks, Reason: reason}
	if req.Detail {
		for i := range res.Prefix {
			for j, e := range res.Expectations {
				if !res.Needed(i, j, res.Prefix, req.StateAtEnd) {
					continue // a state inside the prefix (StateAtEnd): maybe not stored, never read
				}
				src := res.Source(i, j)
				rep.Sources = append(rep.Sources, wire.ObjectInfo{
					Chunk:  i,
					Key:    dcp.Key{NS: req.Namespace, Chunk: req.Chunks[i], Shard: uint16(e.Shard), Group: uint16(e.Group)},
					Reader: wire.Rank{Instance: res.Instance, TPRank: e.Rank}.String(),
					// No Sum: checksums are for admin (admin.object) only (C9).
					Placements: []wire.ObjectPlacement{{Holder: res.Holder(i, j), Tier: src.Tier, Size: src.Size}},
				})
			}
		}
	}
	c.reply(wire.CoordLookup, m, rep)
}

// handleMembers answers admin.members.
func (c *Coordinator) handleMembers(m *nats.Msg) {
	if !c.decodeAdmin(m, wire.AdminMembers) {
		return
	}
	c.reply(wire.AdminMembers, m, admin.Members(c.member.Members()))
}

// handleRanks answers admin.ranks: the index's ranks joined with the
// rankd members.
func (c *Coordinator) handleRanks(m *nats.Msg) {
	if !c.decodeAdmin(m, wire.AdminRanks) {
		return
	}
	c.drainMu.Lock()
	resyncing := make(map[wire.Rank]bool, len(c.resyncing))
	for r := range c.resyncing {
		resyncing[r] = true
	}
	c.drainMu.Unlock()
	c.reply(wire.AdminRanks, m, admin.Ranks(c.idx.Ranks(), c.member.Members(), resyncing))
}

// rankIncarnation returns the index's current incarnation of rank r.
func (c *Coordinator) rankIncarnation(r wire.Rank) (uint64, bool) {
	ri, ok := c.idx.Rank(r)
	return ri.Incarnation, ok
}

// handleObject answers admin.object: one object by key text, or every
// object of a chunk chain with the chain's restorable prefix.
func (c *Coordinator) handleObject(m *nats.Msg) {
	var req wire.AdminObjectRequest
	if err := bus.Decode(m, &req); err != nil {
		c.badRequest(m, wire.AdminObject, err)
		return
	}
	if req.Key != "" {
		k, err := dcp.ParseKey(req.Key)
		if err != nil {
			c.badRequest(m, wire.AdminObject, err)
			return
		}
		c.reply(wire.AdminObject, m, &wire.AdminObjectReply{Prefix: -1, Objects: []wire.ObjectInfo{c.objectInfo(-1, k)}})
		return
	}
	if len(req.Chunks) == 0 {
		c.badRequest(m, wire.AdminObject, fmt.Errorf("need a key, or a namespace and chunks: %w", wire.ErrMalformed))
		return
	}
	res, err := c.lookup(req.Instance, req.Namespace, req.Chunks)
	if err != nil {
		if errors.Is(err, errTooLarge) {
			c.replyError(wire.AdminObject, m, wire.CodeTooLarge, err.Error())
			return
		}
		c.lookupError(m, wire.AdminObject, req.Namespace, err)
		return
	}
	ni, err := c.idx.ListNamespace(req.Namespace)
	if err != nil || ni.Spec == nil {
		c.lookupError(m, wire.AdminObject, req.Namespace, index.ErrUnknownNamespace)
		return
	}
	rep := &wire.AdminObjectReply{Instance: res.Instance, Prefix: res.Prefix, Objects: []wire.ObjectInfo{}}
	for i, ch := range req.Chunks {
		for _, k := range ni.Spec.ObjectKeys(ch) {
			rep.Objects = append(rep.Objects, c.objectInfo(i, k))
		}
	}
	c.reply(wire.AdminObject, m, rep)
}

func (c *Coordinator) objectInfo(chunk int, k dcp.Key) wire.ObjectInfo {
	return admin.Object(chunk, k, c.idx.Get(k))
}

// handleNamespaces answers admin.namespaces.
func (c *Coordinator) handleNamespaces(m *nats.Msg) {
	if !c.decodeAdmin(m, wire.AdminNamespaces) {
		return
	}
	c.reply(wire.AdminNamespaces, m, admin.Namespaces(c.idx.Namespaces()))
}

// handleVerify answers admin.verify: the index re-derives its state from
// bbolt and compares it with the live one.
func (c *Coordinator) handleVerify(m *nats.Msg) {
	if !c.decodeAdmin(m, wire.AdminVerify) {
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, 5*time.Minute)
	defer cancel()
	rep, err := c.idx.Verify(ctx)
	if err != nil && !errors.Is(err, index.ErrInconsistent) {
		if errors.Is(err, index.ErrClosed) || errors.Is(err, context.Canceled) {
			c.replyError(wire.AdminVerify, m, wire.CodeUnavailable, "coordinator shutting down")
			return
		}
		c.internalError(m, wire.AdminVerify, "verify index", err)
		return
	}
	if !rep.OK() {
		c.met.internal.Inc()
		c.log.Error("index verification found problems", zap.Int("problems", len(rep.Problems)),
			zap.Strings("first", firstN(rep.Problems, 8)))
	} else {
		c.log.Info("index verified on request", zap.Int64("placements", rep.Placements))
	}
	c.reply(wire.AdminVerify, m, admin.Verify(rep))
}

// decodeAdmin accepts an empty body or an empty JSON object.
func (c *Coordinator) decodeAdmin(m *nats.Msg, op string) bool {
	if len(m.Data) == 0 {
		return true
	}
	var empty struct{}
	if err := bus.Decode(m, &empty); err != nil {
		c.badRequest(m, op, err)
		return false
	}
	return true
}
