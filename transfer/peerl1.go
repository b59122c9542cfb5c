package transfer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/transfer/hostl1"
	"github.com/kvtier/kvtier/wire"
)

// The engine's side of the host-shared L1 (package transfer/hostl1 is
// the segment and its slot protocol; it never takes Engine.mu). As holder, the engine publishes every
// committed L1 object in its segment's catalog and retires it the moment
// it is dropped; an object a peer holds a fresh lease on is not chosen for
// eviction. As reader, a retrieve looks for an object it does not hold in
// the segments of the other TP ranks of its instance (after its own L1,
// before L2) and scatters it straight from the peer's memory into the
// engine's pages, verifying the checksum of what it placed: the object is
// held once per host, whichever ranks read it. With Config.HostL1SharedWith
// it then looks in the segments the ranks of those share-group members
// keep in the same directory (issue 26.1): the same leases and checks.

// peerTable is this engine's view of its peers' segments.
type peerTable struct {
	dir string
	dev cuda.Device
	log *zap.Logger

	// dead counts the segments found left by a dead holder (Stats).
	dead *atomic.Uint64

	mu   sync.Mutex // guards the following
	segs map[wire.Rank]*peerMap
	// deadIno is, per peer rank, the inode of a segment found left by a
	// dead holder: not opened again until the file changes.
	deadIno map[wire.Rank]uint64
	done    bool
}

// peerMap is one mapped peer segment, registered as a host buffer, with
// the retrieves using it counted so that a replaced segment is unmapped
// only when the last one is done.
type peerMap struct {
	tp   int
	inst string // the holder's instance: this engine's, or a share-group member's
	ps   *hostl1.Peer
	buf  cuda.HostBuf
	refs int  // guarded by peerTable.mu
	gone bool // replaced or closed: unmap at refs 0
}

// get returns the current segment of peer r with a reference (release
// it with put), mapping it (again) when it is new or was replaced; nil
// when the peer has none.
func (t *peerTable) get(r wire.Rank) *peerMap {
	ino := hostl1.Inode(t.dir, r)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return nil
	}
	m := t.segs[r]
	if m != nil && (m.ps.Inode() != ino || m.ps.Closed()) {
		t.dropLocked(m)
		m = nil
	}
	if m != nil && !m.ps.HolderAlive() {
		t.deadLocked(r, m.ps)
		t.dropLocked(m)
		return nil
	}
	if m == nil {
		if ino == 0 || t.deadIno[r] == ino {
			return nil
		}
		ps, err := hostl1.OpenPeer(t.dir, r)
		if err != nil {
			t.log.Debug("host L1: peer segment not usable", zap.Stringer("peer", r), zap.Error(err))
			return nil
		}
		if ps.Closed() || !ps.HolderAlive() {
			if !ps.Closed() {
				t.deadLocked(r, ps)
			}
			ps.Unmap()
			return nil
		}
		buf, err := t.dev.RegisterHost(ps.Data(), true)
		if err != nil {
			ps.Unmap()
			t.log.Warn("host L1: register a peer's segment with the device failed; reading from L2", zap.Stringer("peer", r), zap.Error(err))
			return nil
		}
		m = &peerMap{tp: r.TPRank, inst: r.Instance, ps: ps, buf: buf}
		t.segs[r] = m
		t.log.Info("host L1: mapped a peer's segment", zap.Stringer("peer", r), zap.Uint64("incarnation", ps.Incarnation()),
			zap.Uint64("bytes", uint64(len(ps.Data()))))
	}
	m.refs++
	return m
}

// deadLocked records that ps was left by a holder that died without
// closing it (kill -9): its objects are never read, since the rank is
// (or is about to be) fenced and the index no longer lists them.
func (t *peerTable) deadLocked(r wire.Rank, ps *hostl1.Peer) {
	t.deadIno[r] = ps.Inode()
	t.dead.Add(1)
	t.log.Warn("host L1: a peer's segment was left by a holder that died; not read (its next start replaces it)",
		zap.Stringer("peer", r), zap.Uint64("incarnation", ps.Incarnation()), zap.Uint64("inode", ps.Inode()))
}

func (t *peerTable) put(m *peerMap) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m.refs--
	if m.gone && m.refs == 0 {
		t.unmapLocked(m)
	}
}

func (t *peerTable) dropLocked(m *peerMap) {
	delete(t.segs, wire.Rank{Instance: m.inst, TPRank: m.tp})
	m.gone = true
	if m.refs == 0 {
		t.unmapLocked(m)
	}
}

func (t *peerTable) unmapLocked(m *peerMap) {
	_ = m.buf.Release()
	m.ps.Unmap()
}

// close unmaps every peer segment (Close, after every retrieve ended).
func (t *peerTable) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.done = true
	for _, m := range t.segs {
		t.dropLocked(m)
	}
}

// openHostL1 creates this rank's segment and makes its data region L1.
func (e *Engine) openHostL1(nslabs int) error {
	geo := hostl1.NewGeometry(uint64(nslabs), e.cfg.L1SlabBytes)
	seg, col, err := hostl1.Create(e.cfg.HostL1Dir, e.cfg.Rank, geo, e.cfg.Incarnation)
	if err != nil {
		return fmt.Errorf("transfer: host L1: %w", hostL1Error(err))
	}
	if col.Replaced || col.Temps > 0 {
		n := uint64(col.Temps)
		if col.Replaced {
			n++
		}
		e.ctr.hostL1Collected.Add(n)
		log := e.log.Info
		if col.Replaced && !col.DeadHolder {
			log = e.log.Warn // a live process held it: another rankd of this rank?
		}
		log("host L1: collected the files an earlier run of this rank left", zap.Bool("segment_replaced", col.Replaced),
			zap.Bool("holder_dead", col.DeadHolder), zap.Int("temp_files", col.Temps))
	}
	if err := e.placeHostL1(seg.Data()); err != nil {
		seg.Close()
		return err
	}
	buf, err := e.dev.RegisterHost(seg.Data(), false)
	if err != nil {
		seg.Close()
		return fmt.Errorf("transfer: host L1: register %d B with the device: %w", len(seg.Data()), errors.Join(err, ErrDevice))
	}
	e.l1buf, e.l1mem = buf, seg.Data()
	e.cat.seg = seg
	e.cat.leaseTTL = int64(e.cfg.RetrieveTimeout)
	e.peers = &peerTable{dir: e.cfg.HostL1Dir, dev: e.dev, log: e.log, dead: &e.ctr.peerL1DeadHolders,
		segs: map[wire.Rank]*peerMap{}, deadIno: map[wire.Rank]uint64{}}
	return nil
}

// releaseL1 frees L1: the host buffer, then the host L1 segment.
func (e *Engine) releaseL1() {
	_ = e.l1buf.Release()
	e.unmapL1()
	e.closeHostL1()
}

// closeHostL1 ends the host L1 (Close, once no retrieve runs).
func (e *Engine) closeHostL1() {
	if e.peers != nil {
		e.peers.close()
	}
	if e.cat.seg != nil {
		e.cat.seg.Close()
		e.cat.seg = nil
	}
}

// peerPublishLocked enters a committed object in the segment's catalog.
func (e *Engine) peerPublishLocked(o *l1Obj) {
	c := &e.cat
	if c.seg == nil {
		return
	}
	s, err := c.seg.Publish(o.key, c.off(o), o.size, o.sum)
	if err != nil { // cannot happen: twice as many slots as slabs
		e.log.Error("BUG: host L1 catalog full; the object is served to this rank only", zap.Stringer("key", o.key), zap.Error(err))
		return
	}
	o.pslot = int64(s)
}

// peerRetireLocked removes a dropped object from the catalog.
func (e *Engine) peerRetireLocked(o *l1Obj) {
	if e.cat.seg == nil || o.pslot < 0 {
		return
	}
	e.cat.seg.Retire(uint64(o.pslot))
	o.pslot = -1
}

// peerLeased reports whether a peer holds a fresh lease on o.
func (c *catalog) peerLeased(o *l1Obj, now time.Time) bool {
	return c.seg != nil && o.pslot >= 0 && c.seg.Leased(uint64(o.pslot), now.UnixNano(), c.leaseTTL)
}

// peerItem is an item of a retrieve read from a peer's L1.
type peerItem struct {
	m      *peerMap
	v      hostl1.Slot
	leased bool
}

// findPeers looks for items idx (none of which this rank holds) in the
// peers' catalogs and leases the ones it finds with the expected size and
// checksum; it returns the items not found.
func (r *retrieval) findPeers(idx []int) (missed []int) {
	e := r.e
	if e.peers == nil || len(idx) == 0 {
		return idx
	}
	res := r.sp.res
	var maps []*peerMap
	for tp := range e.cfg.TPSize {
		if tp == e.cfg.Rank.TPRank {
			continue
		}
		if m := e.peers.get(wire.Rank{Instance: e.cfg.Rank.Instance, TPRank: tp}); m != nil {
			maps = append(maps, m)
		}
	}
	// Then the share-group members' ranks on this host, after every rank
	// of this instance: a member's namespace is this one, so its ranks
	// are as many (a member with fewer has no segment for the others).
	for _, inst := range e.cfg.HostL1SharedWith {
		for tp := range e.cfg.TPSize {
			if m := e.peers.get(wire.Rank{Instance: inst, TPRank: tp}); m != nil {
				maps = append(maps, m)
			}
		}
	}
	now := e.cfg.Now().UnixNano()
	for _, i := range idx {
		it := r.req.Items[i]
		found := false
		for _, m := range maps {
			v, miss := m.ps.Find(it.Key)
			if miss != hostl1.Hit {
				continue
			}
			if v.Size != res.ObjectSize(it.Group) || (it.Sum != 0 && v.Sum != it.Sum) {
				e.ctr.peerL1Failures.Add(1)
				e.log.Warn("host L1: a peer holds the object with another size or checksum than expected; not used",
					zap.Stringer("key", it.Key), zap.Stringer("peer", wire.Rank{Instance: m.inst, TPRank: m.tp}), zap.Uint64("size", v.Size), zap.Uint64("sum", v.Sum),
					zap.Uint64("want_size", res.ObjectSize(it.Group)), zap.Uint64("want_sum", it.Sum))
				continue
			}
			if !m.ps.Lease(v, now) {
				e.ctr.peerL1Stale.Add(1)
				continue // evicted or replaced between finding and leasing
			}
			e.peers.mu.Lock()
			m.refs++
			e.peers.mu.Unlock()
			r.peer[i] = &peerItem{m: m, v: v, leased: true}
			r.res.Items[i].From = wire.L1
			found = true
			break
		}
		if !found {
			missed = append(missed, i)
		}
	}
	for _, m := range maps {
		e.peers.put(m) // the items found hold their own references
	}
	return missed
}

// releasePeer gives back item i's lease and map reference.
func (r *retrieval) releasePeer(i int) {
	p := r.peer[i]
	if p == nil {
		return
	}
	r.peer[i] = nil
	if p.leased {
		p.m.ps.Unlease(p.v)
	}
	r.e.peers.put(p.m)
}

// scatterPeers places the items read from peers (grouped by peer: one
// scatter per peer buffer) and verifies each against the checksum it was
// published with, which equals the recorded one when the restore gave it:
// bytes the holder changed during the read (an eviction racing it) fail
// the item, never pass.
func (r *retrieval) scatterPeers(ctx context.Context, items []int) {
	e := r.e
	byMap := map[*peerMap][]int{}
	var order []*peerMap
	for _, i := range items {
		m := r.peer[i].m
		if _, ok := byMap[m]; !ok {
			order = append(order, m)
		}
		byMap[m] = append(byMap[m], i)
	}
	for _, i := range items {
		if e.hooks.peerLeased != nil {
			e.hooks.peerLeased(r.req.Items[i].Key)
		}
	}
	for _, m := range order {
		idx := byMap[m]
		objs := make([]cuda.Object, len(idx))
		for k, i := range idx {
			objs[k] = cuda.Object{HostOff: r.peer[i].v.Off, Spans: r.spans[i]}
		}
		sums, ok := r.scatterFrom(ctx, m.buf, idx, objs)
		if !ok {
			for _, i := range idx {
				e.ctr.peerL1Failures.Add(1)
				r.releasePeer(i)
			}
			continue
		}
		for k, i := range idx {
			p := r.peer[i]
			ir := &r.res.Items[i]
			ir.Sum = sums[k]
			if sums[k] != p.v.Sum {
				r.fail(i, fmt.Errorf("the scatter of %s from the L1 of TP rank %d read kvsum64 %016x, recorded %016x (evicted during the read): %w",
					r.req.Items[i].Key, m.tp, sums[k], p.v.Sum, ErrCorrupt))
				e.ctr.peerL1Failures.Add(1)
			} else {
				ir.OK = true
				e.ctr.peerL1Reads.Add(1)
				e.ctr.peerL1Bytes.Add(p.v.Size)
				e.ctr.objectsRestored.Add(1)
			}
			r.releasePeer(i)
		}
	}
}

// hostL1Error makes an error of transfer/hostl1 also match this package's
// sentinel of the same meaning (its text unchanged), so callers keep
// testing errors.Is(err, transfer.ErrConfig) and the like.
func hostL1Error(err error) error {
	for _, m := range [...]struct{ leaf, ours error }{
		{hostl1.ErrConfig, ErrConfig}, {hostl1.ErrCorrupt, ErrCorrupt}, {hostl1.ErrIO, ErrIO},
		{hostl1.ErrNotFound, ErrNotFound}, {hostl1.ErrFull, ErrL1Full},
	} {
		if errors.Is(err, m.leaf) {
			return &leafError{err: err, ours: m.ours}
		}
	}
	return err
}

// leafError is an error of a leaf package that also matches ours.
type leafError struct{ err, ours error }

func (e *leafError) Error() string   { return e.err.Error() }
func (e *leafError) Unwrap() []error { return []error{e.err, e.ours} }
