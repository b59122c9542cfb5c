package transfer

import (
	"context"
	"errors"
	"fmt"

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

// space is the registered pools of one namespace. A Store or Retrieve
// holds a reference from validation until the device has finished with the
// pools; a re-registration retires the old space, whose imports are
// released when its last reference is dropped.
type space struct {
	res   *dcp.Resolved
	pools [][]cuda.Mem // [group][layer]
	gen   uint64

	// guarded by Engine.mu
	refs    int
	retired bool
}

// retire marks sp replaced and releases its imports if nothing uses them.
// Called with Engine.mu held.
func (sp *space) retire() {
	sp.retired = true
	if sp.refs == 0 {
		sp.release()
	}
}

func (sp *space) release() {
	for _, layers := range sp.pools {
		for _, m := range layers {
			if m != nil {
				_ = m.Release()
			}
		}
	}
	sp.pools = nil
}

// acquireSpace returns the current space of ns with a reference held.
func (e *Engine) acquireSpace(ns dcp.Namespace) (*space, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closing {
		return nil, ErrClosed
	}
	sp := e.spaces[ns]
	if sp == nil {
		return nil, fmt.Errorf("namespace %s: %w", ns, ErrUnknownNamespace)
	}
	sp.refs++
	return sp, nil
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

// Register validates reg and imports its pools, replacing any earlier
// registration of the same namespace (an engine restart): work in flight
// keeps using the old pools, which are released once it has drained. It
// returns the resolved spec (whose Namespace names the pools in Store and
// Retrieve). Objects this rank wrote to L2 under the namespace are checked
// against its geometry; files of another fingerprint or length are
// quarantined.
func (e *Engine) Register(ctx context.Context, reg Registration) (*dcp.Resolved, error) {
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

	sp := &space{res: res, pools: make([][]cuda.Mem, len(res.Groups))}
	for gi := range res.Groups {
		sp.pools[gi] = make([]cuda.Mem, len(handles[gi]))
		for li, h := range handles[gi] {
			m, err := e.dev.ImportMem(*h)
			if err == nil && m.Size() < h.Size {
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

	e.mu.Lock()
	if e.closing {
		e.mu.Unlock()
		sp.release()
		return nil, ErrClosed
	}
	old := e.spaces[res.Namespace]
	if old != nil {
		sp.gen = old.gen + 1
		old.retire()
	}
	e.spaces[res.Namespace] = sp
	bad := e.checkL2Locked(res)
	e.mu.Unlock()

	for _, k := range bad {
		e.quarantineOwn(ctx, k.key, k.why)
	}
	e.log.Info("pools registered", zap.Stringer("namespace", res.Namespace), zap.String("model", res.Model),
		zap.Int("groups", len(res.Groups)), zap.Int("pools", len(reg.Pools)), zap.Uint64("generation", sp.gen),
		zap.Bool("replaced", old != nil))
	return res, nil
}

// Unregister retires the pools of ns (the engine is going away). Work in
// flight finishes on them; their imports are released after it. Objects
// stay in L1 and L2.
func (e *Engine) Unregister(ns dcp.Namespace) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	sp := e.spaces[ns]
	if sp == nil {
		return fmt.Errorf("unregister namespace %s: %w", ns, ErrUnknownNamespace)
	}
	delete(e.spaces, ns)
	sp.retire()
	return nil
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
		delete(e.cat.l2, key)
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
