package index

import (
	"encoding/binary"
	"fmt"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"
	"go.uber.org/zap"
)

// The committer goroutine (run) and the writer goroutine (writer): how a
// request is staged into a group commit, handed to bbolt, published into
// the in-memory state and answered (doc.go, "Driving it"). The committer
// owns every field of Index documented as its own; the writer reads only
// the flight it is handed.

// publishSlice is how many staged chunks are published per hold of the
// write lock, so a large group never stalls lookups for long.
const publishSlice = 64

// flight is a txn handed to the writer goroutine.
type flight struct {
	t       *txn // a group commit (nil: a fold slice alone)
	slice   *foldSlice
	idx     int
	pending []*request
	start   time.Time
	wrote   time.Duration // the writer's bbolt transaction, set before done
	done    chan error
}

// slowCommit is how long a commit (launch to landing) may take before the
// committer logs it, with what it carried.
const slowCommit = 500 * time.Millisecond

// logSlow logs f if it took longer than slowCommit: every request it
// answers waited that long.
func (ix *Index) logSlow(f *flight) {
	took := time.Since(f.start)
	if took < slowCommit {
		return
	}
	fields := []zap.Field{zap.Duration("took", took), zap.Duration("bbolt", f.wrote), zap.Int("requests", len(f.pending))}
	if f.t != nil {
		fields = append(fields, zap.Int("events", f.t.events), zap.Int("chunks", len(f.t.staged)))
	}
	if f.slice != nil {
		fields = append(fields, zap.Int("fold_chunks", f.slice.to-f.slice.from), zap.Bool("fold_last", f.slice.below != 0))
	}
	ix.log.Warn("slow commit", fields...)
}

// run is the committer goroutine. It stages requests into a txn while the
// writer goroutine commits the previous one (pipelining: the CPU work of a
// group overlaps the fsync of the one before), lands each commit
// (publish, then answer) and hands the next txn to the writer as soon as
// the previous one has landed.
func (ix *Index) run() {
	defer close(ix.writes)
	var timer *time.Timer
	for {
		if (len(ix.fences) > 0 || len(ix.invs) > 0) && ix.cur == nil && ix.failed == nil {
			ix.staging() // the next slice of a sliced fence or inventory
		}
		if ix.folding != nil && ix.folding.ready() && ix.flight == nil && len(ix.pending) == 0 && ix.failed == nil {
			// No group waits: the next slice of the fold, alone.
			ix.flight = &flight{slice: ix.nextSlice(), start: time.Now(), done: make(chan error, 1)}
			ix.writes <- ix.flight
		}
		if ix.flight == nil && ix.cur != nil && len(ix.pending) > 0 {
			// Take in some of what queued up meanwhile, up to twice what
			// was staged while the last commit ran: when the committer is
			// the bottleneck, groups grow (bigger groups cost less per
			// event); when one producer waits for its acknowledgements,
			// they stay small enough for staging and writing to overlap.
			limit := min(ix.cfg.MaxGroupEvents, 3*ix.curN)
		drain:
			for ix.curN < limit && ix.flight == nil && ix.cur != nil {
				select {
				case r := <-ix.reqs:
					ix.stage(r)
				default:
					break drain
				}
			}
			if ix.cur == nil || len(ix.pending) == 0 {
				continue // a verify or a failure emptied it
			}
			wait := ix.cfg.MaxGroupDelay - time.Since(ix.curStart)
			if ix.curN >= ix.cfg.MaxGroupEvents || wait <= 0 {
				ix.launch()
				continue
			}
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
			}
		}
		var landed <-chan error
		if ix.flight != nil {
			landed = ix.flight.done
		}
		reqs := ix.reqs
		if ix.curN >= ix.cfg.MaxGroupEvents {
			reqs = nil // group full: wait for the writer
		}
		var tick <-chan time.Time
		if timer != nil && ix.flight == nil && len(ix.pending) > 0 {
			tick = timer.C
		}
		var sorted <-chan struct{} // a fold's list being sorted: wake when it is
		if ix.folding != nil && !ix.folding.ready() {
			sorted = ix.folding.sorted
		}
		select {
		case r := <-reqs:
			ix.stage(r)
		case err := <-landed:
			ix.land(err)
		case <-tick:
		case <-sorted:
		case <-ix.stop:
			for {
				select {
				case r := <-ix.reqs:
					ix.stage(r)
					continue
				default:
				}
				break
			}
			ix.finishFences()
			ix.barrier()
			ix.finish()
			if timer != nil {
				timer.Stop()
			}
			return
		}
	}
}

// writer commits txns to bbolt, one at a time, for the committer.
func (ix *Index) writer() {
	for f := range ix.writes {
		err := ix.db.Update(func(tx *bolt.Tx) error {
			if f.t != nil {
				if err := ix.write(tx, f.t); err != nil {
					return err
				}
			}
			if f.slice != nil {
				return writeSlice(tx, f.slice)
			}
			return nil
		})
		if err == nil && f.t != nil && ix.cfg.AfterCommit != nil {
			ix.cfg.AfterCommit()
		}
		f.wrote = time.Since(f.start)
		f.done <- err
	}
}

// stage applies one request to the current txn. Verify and Checkpoint
// first wait until everything before them is committed and published.
func (ix *Index) stage(r *request) {
	if err := r.ctx.Err(); err != nil {
		r.err = err
		close(r.done)
		return
	}
	if ix.failed != nil && r.kind != reqVerify { // reads stay available for diagnosis
		r.err = fmt.Errorf("%w: %w", ErrFailed, ix.failed)
		close(r.done)
		return
	}
	switch r.kind {
	case reqVerify, reqCheckpoint, reqSnapshot, reqRestore, reqDump, reqSync:
		ix.finishFences()
		ix.barrier()
		switch r.kind {
		case reqVerify:
			ix.startVerify(r) // answers r itself, off the committer
			return
		case reqDump:
			ix.startDump(r) // likewise
			return
		case reqSnapshot:
			ix.takeSnapshot(r)
		case reqRestore:
			ix.restore(r)
		case reqSync: // the barrier is all it asks
		default:
			if err := ix.checkpoint(); err != nil {
				r.err = err
			}
		}
		close(r.done)
		return
	}
	if r.raftIndex != 0 && !ix.stageReplicated(r) {
		return
	}
	t := ix.staging()
	switch r.kind {
	case reqBatch:
		ix.finishResetOf(t, r.batch.Rank)
		j := ix.invOfRank(t, r.batch.Rank)
		if j != nil && r.batch.Incarnation > j.inv.Incarnation {
			ix.finishInventory(t, j) // a newer incarnation sees the inventory whole
			j = nil
		}
		if j != nil {
			j.touch(t, r.batch)
		}
		r.out = t.applyBatch(r.batch)
		if r.out.NewIncarnation {
			ix.endFence(t, r.batch.Rank)
		}
	case reqInventory:
		ix.finishResetOf(t, r.inv.Rank)
		if !ix.finishInventoryOf(t, r.inv.Rank) && ix.startInventory(t, r) {
			return // answered with the inventory's last slice
		}
		r.invOut = t.applyInventory(r.inv, r.fenceGen, r.genChecked)
		if r.invOut.Applied {
			ix.endFence(t, r.inv.Rank)
			ix.unhidePartial(t, r.inv.Rank)
		}
	case reqFence:
		if ix.fenceDuringReset(t, r) {
			break
		}
		if !ix.finishInventoryOf(t, r.rank) && ix.startFence(t, r) {
			return // answered with the fence's last slice
		}
		r.fenced = t.fenceRank(r.rank, r.upTo)
	case reqReset:
		if !ix.finishInventoryOf(t, r.rank) && ix.startReset(t, r) {
			return // answered with the reset's last slice
		}
		r.fenced = t.resetRank(r.rank)
		if r.fenced >= 0 {
			ix.endFence(t, r.rank)
			ix.unhidePartial(t, r.rank)
		}
	case reqRegister:
		r.err = t.register(r.spec, r.json)
	case reqInvStep:
		if ix.stageStep(t, r) {
			return // a Begin answered with its drop's last slice
		}
	}
	ix.pending = append(ix.pending, r)
	ix.curN += r.n
}

// staging returns the txn being staged, starting one on top of the txn in
// flight if there is none.
func (ix *Index) staging() *txn {
	if ix.cur != nil {
		return ix.cur
	}
	var parent *txn
	i := 0
	if ix.flight != nil {
		parent, i = ix.flight.t, 1-ix.flight.idx
	}
	enc := &ix.encs[i]
	enc.reset()
	if ix.txns[i] == nil {
		ix.txns[i] = newTxn(ix.st, enc)
		ix.txns[i].parent = parent
	} else {
		ix.txns[i].reset(ix.st, parent, enc)
	}
	ix.cur, ix.curIdx, ix.curN, ix.curStart = ix.txns[i], i, 0, time.Now()
	ix.cur.invLive = ix.invLive
	if len(ix.fences) > 0 && ix.failed == nil {
		ix.fenceSlice(ix.cur, ix.fences[0], ix.fences[0].slice(&ix.cfg))
	}
	if len(ix.invs) > 0 && ix.failed == nil {
		ix.invSlice(ix.cur, ix.invs[0], ix.cfg.InventorySlice)
	}
	return ix.cur
}

// launch hands the current txn to the writer, or answers its requests at
// once when it changes nothing (or the index has failed). Only with no
// txn in flight: the current one was staged on top of it.
func (ix *Index) launch() {
	t, pending := ix.cur, ix.pending
	ix.cur, ix.pending, ix.curN = nil, nil, 0
	if ix.failed != nil {
		ix.fail(pending, ix.failed)
		return
	}
	if !t.changed() {
		ix.answer(pending)
		return
	}
	ix.flight = &flight{t: t, idx: ix.curIdx, pending: pending, start: time.Now(), done: make(chan error, 1)}
	if ix.folding != nil && ix.folding.ready() {
		ix.flight.slice = ix.nextSlice()
	}
	ix.writes <- ix.flight
}

// land finishes the txn in flight: on success it publishes it and answers
// its requests; on failure the index fails, with the requests of the txn
// staged on top of it.
func (ix *Index) land(err error) {
	f := ix.flight
	ix.flight = nil
	defer ix.logSlow(f)
	if f.t == nil { // a fold slice alone
		if err := ix.landSlice(f.slice, err); err != nil && ix.cur != nil {
			ix.fail(ix.pending, err)
			ix.cur, ix.pending, ix.curN = nil, nil, 0
		}
		return
	}
	if ix.cur != nil {
		ix.cur.detach()
	}
	if err != nil {
		ix.setFailed(err)
		ix.log.Error("commit failed; the index refuses writes until reopened",
			zap.Int("requests", len(f.pending)), zap.Int("events", f.t.events), zap.Error(err))
		ix.fail(f.pending, err)
		if ix.cur != nil {
			ix.fail(ix.pending, err)
			ix.cur, ix.pending, ix.curN = nil, nil, 0
		}
		return
	}
	ix.met.commits.Inc()
	ix.met.commitSecs.Observe(time.Since(f.start).Seconds())
	ix.met.groupEvents.Observe(float64(f.t.events))
	ix.publish(f.t)
	ix.answer(f.pending)
	if f.slice != nil {
		_ = ix.landSlice(f.slice, nil)
	}
	if ix.folding == nil && ix.logBytes >= ix.cfg.CheckpointBytes && ix.fencing == 0 {
		// Cut a fold; its slices ride along with the next commits once a
		// goroutine of its own has sorted its chunk list: the cut itself
		// only swaps the list (O(1) on the committer, which a fold of a
		// few million chunks held for seconds when it sorted the list and
		// collected every chunk here).
		gen, dirty, logBytes := ix.cutDirty()
		j := &foldJob{f: &fold{gen: gen, logBytes: logBytes}, below: ix.nextLog, start: time.Now(), sorted: make(chan struct{})}
		ix.folding, ix.st.folding = j, gen
		sort := func() {
			defer close(j.sorted)
			if h := testHookFoldSort; h != nil {
				h()
			}
			j.f.refs, j.f.prevs = sortDirty(dirty.flat())
		}
		if !ix.goroutines.Go("fold-sort", sort) {
			sort() // closing: Close's final checkpoint waits for it anyway
		}
	}
}

// barrier commits and publishes everything staged so far.
func (ix *Index) barrier() {
	for ix.flight != nil || (ix.cur != nil && len(ix.pending) > 0) {
		if ix.flight != nil {
			ix.land(<-ix.flight.done)
			continue
		}
		ix.launch()
	}
	ix.cur = nil
}

func (ix *Index) answer(pending []*request) {
	for _, r := range pending {
		if r.slice {
			ix.fencing--
		}
		if r.err == nil {
			ix.account(r)
		}
		close(r.done)
	}
}

func (ix *Index) fail(pending []*request, err error) {
	ix.failFences(err)
	for _, r := range pending {
		if r.slice {
			ix.fencing--
		}
		r.err = fmt.Errorf("%w: %w", ErrFailed, err)
		close(r.done)
	}
}

// write puts a txn's change into bbolt: one change-log record, the ranks
// whose state changed, and new namespace specs.
func (ix *Index) write(tx *bolt.Tx, t *txn) error {
	if t.raftIndex != 0 {
		if err := tx.Bucket(bucketMeta).Put(keyApplied, binary.BigEndian.AppendUint64(nil, t.raftIndex)); err != nil {
			return fmt.Errorf("record raft index %d: %w: %w", t.raftIndex, ErrStore, err)
		}
	}
	if !t.enc.empty() {
		var k [8]byte
		binary.BigEndian.PutUint64(k[:], ix.nextLog)
		// Sealed in a copy (the encoder's buffer is the committer's), in a
		// buffer of the writer's reused from one commit to the next: bbolt
		// needs the value only until the commit, and a fresh copy per group
		// was 4 % of the bytes the index allocated while ingesting (75 of
		// 1,800 MB in BenchmarkLookup128x8's setup; issue 12.3).
		rec := seal(append(ix.logBuf[:0], t.enc.buf...), 0)
		ix.logBuf = rec[:0]
		lb, err := tx.Bucket(bucketLog).CreateBucket(k[:])
		if err == nil {
			err = lb.Put(logValueKey, rec)
		}
		if err != nil {
			return fmt.Errorf("append log record %d: %w: %w", ix.nextLog, ErrStore, err)
		}
	}
	rb := tx.Bucket(bucketRanks)
	arena := ix.arena[:0]
	ids := make([]uint32, 0, len(t.metas))
	for id := range t.metas {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		ks := len(arena)
		arena = appendRankKey(arena, id)
		vs := len(arena)
		arena = appendRank(arena, t.rankName(id), t.metas[id])
		if err := rb.Put(arena[ks:vs:vs], arena[vs:len(arena):len(arena)]); err != nil {
			return fmt.Errorf("write rank %d: %w: %w", id, ErrStore, err)
		}
	}
	nb := tx.Bucket(bucketNS)
	for _, g := range t.regs {
		if err := nb.Put(append([]byte(nil), g.ns[:]...), g.json); err != nil {
			return fmt.Errorf("write namespace %s: %w: %w", g.ns, ErrStore, err)
		}
	}
	ix.arena = arena[:0]
	return nil
}

// publish installs a committed txn into the live state.
func (ix *Index) publish(t *txn) {
	if !t.enc.empty() {
		ix.logBytes += int64(len(t.enc.buf))
		ix.nextLog++
	}
	if t.raftIndex != 0 {
		ix.appliedPub.Store(t.raftIndex)
	}
	ix.mu.Lock()
	viewed := ix.st.publishRanks(t)
	if viewed {
		// Restrictions first, merged with the view lookups hold, so that
		// nothing is lifted before the chunks are in (chunkmap.go); under
		// mu, so a lookup that starts after Rank reports a rank fenced
		// applies the fence.
		ix.view.Store(ix.st.buildView(ix.view.Load()))
	}
	ix.mu.Unlock()
	step := publishSlice * max(1, ix.st.fan) // as long a hold with fan goroutines installing
	for from := 0; from < len(t.staged); from += step {
		to := min(from+step, len(t.staged))
		ix.mu.Lock()
		ix.st.publishChunks(t, from, to)
		ix.mu.Unlock()
	}
	if len(t.unhide) > 0 {
		ix.mu.Lock()
		ix.st.publishUnhide(t)
		ix.mu.Unlock()
	}
	if viewed || len(t.unhide) > 0 {
		ix.mu.Lock()
		ix.view.Store(ix.st.buildView(nil)) // exact: may lift a fence
		ix.mu.Unlock()
	}
	ix.gauges()
}

// setFailed makes err the sticky failure; committer only.
func (ix *Index) setFailed(err error) {
	ix.failed = err
	ix.failFences(err) // they can no longer finish
	werr := fmt.Errorf("%w: %w", ErrFailed, err)
	ix.sticky.Store(&werr)
}
