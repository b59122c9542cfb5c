package transfer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// Registration is an engine's KV pools for one namespace. It has the same
// fields as wire.RegisterRequest, so the daemon converts with
// transfer.Registration(req).
type Registration struct {
	// Spec is resolved and validated (C2); its namespace is the one the
	// pools serve.
	Spec dcp.Spec
	// DeviceUUID is the device the engine's pools live on; it must be this
	// rank's device.
	DeviceUUID string
	// Pools has exactly one entry per (group, layer) of Spec. Each handle
	// is imported with Device.ImportMem; its Size is the pool size, which
	// must hold at least one page.
	Pools []wire.PoolRegistration
}

// space is the pools one session imported: one registration of an engine
// process. A Store or Retrieve holds a reference from validation until the
// device has finished with the pools; a superseding registration or a
// release retires the space, whose imports are released when its last
// reference is dropped. A space serves only requests that name its own
// session id: never those of another registration of its namespace.
type space struct {
	id    string // session id, wire.CheckSessionID form
	owner string // engine identity that registered it (see Register)
	res   *dcp.Resolved
	pools [][]cuda.Mem // [group][layer]
	// stateless marks the groups a store may leave out of a chunk
	// (statelessOK), decided once for the spec.
	stateless []bool
	gen       uint64
	// stop ends when sp is retired: its retrieves in flight stop
	// (cancelStop) and scatter nothing more into its pools.
	stop       context.Context
	cancelStop context.CancelFunc

	// guarded by Engine.mu
	refs    int
	retired bool
	// writers counts sp's retrieves in flight (they write its pools);
	// drained is closed once sp is retired and writers is 0.
	writers int
	drained chan struct{}
}

func newSpace(owner string, res *dcp.Resolved) *space {
	sp := &space{id: newSessionID(), owner: owner, res: res, pools: make([][]cuda.Mem, len(res.Groups)),
		stateless: statelessOK(res), drained: make(chan struct{})}
	sp.stop, sp.cancelStop = context.WithCancel(context.Background())
	return sp
}

// retire marks sp replaced, stops its retrieves in flight and releases its
// imports if nothing uses them. Called with Engine.mu held.
func (sp *space) retire() {
	sp.retired = true
	sp.cancelStop()
	if sp.writers == 0 {
		close(sp.drained)
	}
	if sp.refs == 0 {
		sp.release()
	}
}

func (sp *space) release() {
	sp.cancelStop()
	for _, layers := range sp.pools {
		for _, m := range layers {
			if m != nil {
				_ = m.Release()
			}
		}
	}
	sp.pools = nil
}

// maxStaleSessions bounds the retired session ids an engine remembers (so
// a late request of one is refused as stale rather than unknown); older
// ones are forgotten and then refused as unknown. 64 B each.
const maxStaleSessions = 4096

// sessionTable is the engine's sessions; guarded by Engine.mu.
type sessionTable struct {
	byNS map[dcp.Namespace]*space // the live session of each namespace
	byID map[string]*space        // live sessions by id
	// stale maps retired session ids to why they were retired; order is
	// their retirement order, for forgetting the oldest.
	stale map[string]string
	order []string
	// draining are the retired sessions whose retrieves still write their
	// pools (writers > 0): a registration of their namespace waits for
	// them (Register).
	draining map[*space]struct{}
}

func (t *sessionTable) init() {
	t.byNS = make(map[dcp.Namespace]*space)
	t.byID = make(map[string]*space)
	t.stale = make(map[string]string)
	t.draining = make(map[*space]struct{})
}

// drainingLocked returns the retired sessions of ns whose retrieves still
// write their pools.
func (t *sessionTable) drainingLocked(ns dcp.Namespace) []*space {
	var out []*space
	for sp := range t.draining {
		if sp.res.Namespace == ns {
			out = append(out, sp)
		}
	}
	return out
}

// retireLocked retires sp (superseded or released) and remembers its id.
func (t *sessionTable) retireLocked(sp *space, why string) {
	if t.byNS[sp.res.Namespace] == sp {
		delete(t.byNS, sp.res.Namespace)
	}
	delete(t.byID, sp.id)
	sp.retire()
	if sp.writers > 0 {
		t.draining[sp] = struct{}{}
	}
	if len(t.order) >= maxStaleSessions {
		delete(t.stale, t.order[0])
		t.order = t.order[1:]
	}
	t.stale[sp.id] = why
	t.order = append(t.order, sp.id)
}

// lookupLocked returns the live session id of namespace ns, or the error a
// request naming it gets: ErrUnknownSession, ErrStaleSession, or
// ErrBadRequest when the session serves another namespace.
func (t *sessionTable) lookupLocked(ns dcp.Namespace, id string) (*space, error) {
	if id == "" {
		if t.byNS[ns] == nil {
			return nil, fmt.Errorf("namespace %s: %w", ns, ErrUnknownNamespace)
		}
		return nil, fmt.Errorf("namespace %s: the request names no session (register answers one): %w", ns, ErrUnknownSession)
	}
	sp := t.byID[id]
	if sp == nil {
		if why, ok := t.stale[id]; ok {
			return nil, fmt.Errorf("session %s of namespace %s was %s: %w", id, ns, why, ErrStaleSession)
		}
		if err := wire.CheckSessionID(id); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrUnknownSession, err)
		}
		return nil, fmt.Errorf("session %s (namespace %s) was never issued by this rank (or forgotten after %d newer retirements): %w",
			id, ns, maxStaleSessions, ErrUnknownSession)
	}
	if sp.res.Namespace != ns {
		return nil, fmt.Errorf("session %s serves namespace %s, the request names %s: %w", id, sp.res.Namespace, ns, ErrBadRequest)
	}
	return sp, nil
}

// newSessionID returns 128 random bits in hex.
func newSessionID() string {
	var b [wire.SessionIDBytes]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b[:])
}

// acquireSpace returns the live space of session id in namespace ns, after
// checking under the lock that finds it that caller is the identity that
// registered it (STYLE 32: authorization travels with the call), with a
// reference held: the pools that registration imported, never another's.
func (e *Engine) acquireSpace(ns dcp.Namespace, id, caller string) (*space, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closing {
		return nil, ErrClosed
	}
	sp, err := e.sess.lookupLocked(ns, id)
	if err != nil {
		return nil, err
	}
	if err := sp.authorize(ns, caller); err != nil {
		return nil, err
	}
	sp.refs++
	return sp, nil
}

// beginWriteLocked counts a retrieve that will write sp's pools; false
// when sp was retired since it was acquired (nothing may be written).
func (e *Engine) beginWriteLocked(sp *space) bool {
	if sp.retired {
		return false
	}
	sp.writers++
	return true
}

// endWriteLocked ends a retrieve counted by beginWriteLocked: the last one
// of a retired session closes its drained.
func (e *Engine) endWriteLocked(sp *space) {
	sp.writers--
	if sp.writers == 0 && sp.retired {
		delete(e.sess.draining, sp)
		close(sp.drained)
	}
}

func (e *Engine) releaseSpace(sp *space) {
	e.mu.Lock()
	sp.refs--
	done := sp.refs == 0 && sp.retired
	e.mu.Unlock()
	if done {
		sp.release()
	}
}

// Session is one accepted registration.
type Session struct {
	// ID names the session in every later Store, Retrieve and Release
	// (wire.CheckSessionID form: 128 random bits in hex).
	ID string
	// Resolved is the validated spec; its Namespace names the pools.
	Resolved *dcp.Resolved
	// Superseded is the session of the namespace this one replaced ("" if
	// none): its later requests are refused with ErrStaleSession, its work
	// in flight finishes on its own pools.
	Superseded string
}

// Register validates reg, imports its pools and opens a new session for
// them. owner is the engine identity of the caller, as the connection layer
// authenticated it ("" when it cannot tell); only that identity may use or
// release the session.
//
// A namespace has one live session. A registration of a namespace with a
// live session of the same owner supersedes it (an engine restart, or a
// second engine process of the instance): every later request naming the
// old session is refused with ErrStaleSession; its stores in flight finish
// on the old pools, which are released once they have drained. Its
// retrieves in flight are stopped (their items not yet scattered fail)
// and the registration is answered only once none of them can write the
// old pools any more: the new pools may be the same memory (the same
// engine registering again), which belongs to the new session from the
// answer on. The same holds for a released session's retrieves. If they
// have not drained within RetrieveTimeout, the registration is refused
// with ErrTimeout (the old session stays retired; a later registration
// waits again). A registration by another owner while a session is live is
// refused with ErrUnauthorized.
//
// Objects this rank wrote to L2 under the namespace are checked against
// its geometry; files of another fingerprint or length are quarantined.
func (e *Engine) Register(ctx context.Context, reg Registration, owner string) (*Session, error) {
	res, err := reg.Spec.Resolve()
	if err != nil {
		return nil, fmt.Errorf("register: %w: %w", ErrRegistration, err)
	}
	if res.Layout.TP != e.cfg.TPSize {
		return nil, fmt.Errorf("register: layout TP size %d, this rank belongs to TP size %d: %w",
			res.Layout.TP, e.cfg.TPSize, ErrRegistration)
	}
	uuid := e.dev.Info().UUID
	if reg.DeviceUUID != uuid {
		return nil, fmt.Errorf("register: pools on device %q, this rank's device is %q: %w",
			reg.DeviceUUID, uuid, ErrWrongDevice)
	}
	want := 0
	for _, g := range res.Groups {
		want += g.Layers
	}
	if len(reg.Pools) != want {
		return nil, fmt.Errorf("register: %d pools, the spec has %d (one per layer of every group): %w",
			len(reg.Pools), want, ErrRegistration)
	}
	handles := make([][]*cuda.MemHandle, len(res.Groups))
	for gi, g := range res.Groups {
		handles[gi] = make([]*cuda.MemHandle, g.Layers)
	}
	for i := range reg.Pools {
		p := &reg.Pools[i]
		switch {
		case p.Group < 0 || p.Group >= len(res.Groups):
			return nil, fmt.Errorf("register: pool %d: group %d outside 0..%d: %w", i, p.Group, len(res.Groups)-1, ErrRegistration)
		case p.Layer < 0 || p.Layer >= res.Groups[p.Group].Layers:
			return nil, fmt.Errorf("register: pool %d: layer %d outside 0..%d of group %d: %w",
				i, p.Layer, res.Groups[p.Group].Layers-1, p.Group, ErrRegistration)
		case handles[p.Group][p.Layer] != nil:
			return nil, fmt.Errorf("register: pool %d: group %d layer %d registered twice: %w", i, p.Group, p.Layer, ErrRegistration)
		case p.Handle.Device != uuid:
			return nil, fmt.Errorf("register: pool of group %d layer %d is on device %q, this rank's device is %q: %w",
				p.Group, p.Layer, p.Handle.Device, uuid, ErrWrongDevice)
		}
		if pg := res.Geometry[p.Group]; p.Handle.Size < pg.PageBytes {
			return nil, fmt.Errorf("register: pool of group %d layer %d is %d B, smaller than one %d B page: %w",
				p.Group, p.Layer, p.Handle.Size, pg.PageBytes, ErrRegistration)
		}
		handles[p.Group][p.Layer] = &p.Handle
	}
	// Refuse another owner before importing anything (checked again below).
	e.mu.Lock()
	err = e.checkOwnerLocked(res.Namespace, owner)
	e.mu.Unlock()
	if err != nil {
		return nil, err
	}

	sp := newSpace(owner, res)
	for gi := range res.Groups {
		sp.pools[gi] = make([]cuda.Mem, len(handles[gi]))
		for li, h := range handles[gi] {
			m, err := e.dev.ImportMem(*h)
			if err == nil && m.Size() != h.Size {
				_ = m.Release()
				err = fmt.Errorf("imported view is %d B, the handle says %d B", m.Size(), h.Size)
			}
			if err != nil {
				sp.release()
				if errors.Is(err, cuda.ErrBadHandle) {
					return nil, fmt.Errorf("register: import pool of group %d layer %d: %w: %w", gi, li, ErrRegistration, err)
				}
				return nil, fmt.Errorf("register: import pool of group %d layer %d: %w: %w", gi, li, ErrDevice, err)
			}
			sp.pools[gi][li] = m
		}
	}

	out := &Session{ID: sp.id, Resolved: res}
	var old *space
	drainStart := time.Now()
	drainUntil := drainStart.Add(e.cfg.RetrieveTimeout)
	waited := 0
	e.mu.Lock()
	for {
		if e.closing {
			e.mu.Unlock()
			sp.release()
			return nil, ErrClosed
		}
		if err := e.checkOwnerLocked(res.Namespace, owner); err != nil {
			e.mu.Unlock()
			sp.release()
			return nil, err
		}
		if live := e.sess.byNS[res.Namespace]; live != nil {
			old = live
			sp.gen = old.gen + 1
			out.Superseded = old.id
			e.sess.retireLocked(old, "superseded by session "+sp.id)
		}
		draining := e.sess.drainingLocked(res.Namespace)
		if len(draining) == 0 {
			break
		}
		e.mu.Unlock()
		waited++
		if err := e.waitDrained(ctx, draining, drainUntil); err != nil {
			sp.release()
			e.ctr.sessionDrainsRefused.Add(1)
			e.log.Warn("registration refused: a retired session's retrieves still write its pools",
				zap.Stringer("namespace", res.Namespace), zap.String("owner", owner), zap.Error(err))
			return nil, fmt.Errorf("register: %w", err)
		}
		e.mu.Lock()
	}
	e.sess.byNS[res.Namespace] = sp
	e.sess.byID[sp.id] = sp
	bad := e.checkL2Locked(res)
	e.mu.Unlock()

	if waited > 0 {
		e.ctr.sessionDrains.Add(1)
		e.log.Info("a retired session's retrieves drained before the registration was answered",
			zap.Stringer("namespace", res.Namespace), zap.String("session", sp.id), zap.Duration("drained", time.Since(drainStart)))
	}
	for _, k := range bad {
		e.quarantineOwn(ctx, k.key, k.why)
	}
	if old != nil {
		e.log.Warn("a registration superseded the live session of its namespace; the old session's work in flight drains on its own pools, its later requests are refused",
			zap.Stringer("namespace", res.Namespace), zap.String("session", sp.id), zap.String("superseded", old.id),
			zap.String("owner", owner), zap.Uint64("generation", sp.gen))
	}
	e.log.Info("pools registered", zap.Stringer("namespace", res.Namespace), zap.String("model", res.Model),
		zap.String("session", sp.id), zap.String("owner", owner),
		zap.Int("groups", len(res.Groups)), zap.Int("pools", len(reg.Pools)), zap.Uint64("generation", sp.gen),
		zap.Bool("replaced", old != nil))
	return out, nil
}

// waitDrained waits until every session of draining has no retrieve left
// writing its pools, until the deadline, ctx's end or Close.
func (e *Engine) waitDrained(ctx context.Context, draining []*space, until time.Time) error {
	dctx, cancel := context.WithDeadline(ctx, until)
	defer cancel()
	for _, sp := range draining {
		select {
		case <-sp.drained:
			continue
		case <-dctx.Done():
		case <-e.life.Done():
			return ErrClosed
		}
		if ctx.Err() != nil {
			return fmt.Errorf("waiting for retired session %s's retrieves to drain: %w", sp.id, ctx.Err())
		}
		e.mu.Lock()
		n := sp.writers
		e.mu.Unlock()
		if n > 0 {
			return fmt.Errorf("retired session %s of namespace %s still has %d retrieves writing its pools after %v (the engine's retrieve timeout); not answered, so they cannot write into the new registration's memory: %w",
				sp.id, sp.res.Namespace, n, e.cfg.RetrieveTimeout, ErrTimeout)
		}
	}
	return nil
}

// checkOwnerLocked refuses a registration of ns by owner while another
// identity holds its live session.
func (e *Engine) checkOwnerLocked(ns dcp.Namespace, owner string) error {
	if old := e.sess.byNS[ns]; old != nil && old.owner != owner {
		return fmt.Errorf("register: namespace %s has a live session %s of engine %q, the caller is %q: %w",
			ns, old.id, old.owner, owner, ErrUnauthorized)
	}
	return nil
}

// authorize refuses caller unless it is the identity that registered sp
// (Store, Retrieve and Release check it under the lock that found sp).
func (sp *space) authorize(ns dcp.Namespace, caller string) error {
	if sp.owner != caller {
		return fmt.Errorf("session %s of namespace %s belongs to engine %q, the caller is %q: %w", sp.id, ns, sp.owner, caller, ErrUnauthorized)
	}
	return nil
}

// Release retires session id of namespace ns (the engine is going away):
// work in flight finishes on its pools, whose imports are released after
// it; later requests naming it are refused with ErrStaleSession. Objects
// stay in L1 and L2. Only the session's owner may release it.
func (e *Engine) Release(ns dcp.Namespace, id, caller string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	sp, err := e.sess.lookupLocked(ns, id)
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	if err := sp.authorize(ns, caller); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	e.sess.retireLocked(sp, "released")
	return nil
}

// Sessions returns the number of live sessions.
func (e *Engine) Sessions() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.sess.byID)
}

type badKey struct {
	key dcp.Key
	why string
}

// checkL2Locked returns this rank's L2 objects of res's namespace that do
// not fit its geometry.
func (e *Engine) checkL2Locked(res *dcp.Resolved) []badKey {
	var bad []badKey
	for k, ent := range e.cat.l2 {
		if k.NS != res.Namespace {
			continue
		}
		switch {
		case ent.fp != res.Fingerprint:
			bad = append(bad, badKey{k, fmt.Sprintf("layout fingerprint %x, the namespace has %x", ent.fp[:8], res.Fingerprint[:8])})
		case int(k.Group) >= len(res.Groups):
			bad = append(bad, badKey{k, fmt.Sprintf("object group %d, the namespace has %d groups", k.Group, len(res.Groups))})
		case ent.size != res.ObjectSize(int(k.Group)):
			bad = append(bad, badKey{k, fmt.Sprintf("payload %d B, the geometry says %d B", ent.size, res.ObjectSize(int(k.Group)))})
		}
	}
	return bad
}

// quarantineOwn moves one of this rank's L2 objects aside and announces it.
func (e *Engine) quarantineOwn(ctx context.Context, key dcp.Key, why string) {
	err := e.l2.Quarantine(ctx, key, why)
	e.mu.Lock()
	ent, ok := e.cat.l2[key]
	if ok {
		e.cat.l2Del(key)
		e.ctr.l2Objects.Store(int64(len(e.cat.l2)))
		e.emitLocked(wire.Removed, wire.L2, key, ent.size, ent.sum)
	}
	e.mu.Unlock()
	if err != nil && !errors.Is(err, ErrNotFound) {
		e.log.Error("could not quarantine a bad L2 object; it is no longer served", zap.Stringer("key", key), zap.String("why", why), zap.Error(err))
		return
	}
	e.ctr.quarantined.Add(1)
	e.log.Warn("quarantined an L2 object", zap.Stringer("key", key), zap.String("why", why))
}
