package transfer

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/wire"
)

// The L2 write-back path: objects L1 holds that L2 does not yet are queued
// (write-through at commit, write-back when L1 needs their room, flushes),
// taken by Config.L2Writers writers (first writes before retries), each
// written after room is reserved under the L2 bound (l2evict.go), and the
// L2's health is tracked from the outcomes (a failing L2 is degraded and
// probed, never blocking L1). Everything here runs under or takes Engine.mu
// as l1.go does; no file I/O holds it.

// l2DegradeAfter consecutive failed L2 writes mark the tier degraded;
// probes follow after l2MinBackoff, doubling up to l2MaxBackoff.
const (
	l2DegradeAfter = 3
	l2MinBackoff   = time.Second
	l2MaxBackoff   = 30 * time.Second
)

// queueWriteLocked hands o to the L2 writers, unless L2 is degraded
// (then only probes and flushes write: queueWriteForcedLocked).
func (e *Engine) queueWriteLocked(o *l1Obj) {
	if e.cat.degraded {
		return
	}
	e.queueWriteForcedLocked(o)
}

func (e *Engine) queueWriteForcedLocked(o *l1Obj) {
	if o.writing || e.l2 == nil {
		return
	}
	o.writing = true
	e.cat.writing++
	if o.wbFailed.IsZero() {
		e.cat.writeQ = append(e.cat.writeQ, o)
	} else {
		e.cat.retryQ = append(e.cat.retryQ, o)
	}
	kick(e.cat.writeKick)
}

// retryEvery: while both first writes and retries wait, one retry is
// taken after this many first writes, so neither starves.
const retryEvery = 8

// nextWriteLocked takes the next object to write to L2, or nil: first
// writes in order, before retries (one retry after every retryEvery first
// writes while both wait).
func (e *Engine) nextWriteLocked() *l1Obj {
	c := &e.cat
	take := func(q *[]*l1Obj) *l1Obj {
		o := (*q)[0]
		(*q)[0] = nil
		*q = (*q)[1:]
		return o
	}
	switch {
	case len(c.writeQ) > 0 && (len(c.retryQ) == 0 || c.retryRun < retryEvery):
		if len(c.retryQ) > 0 {
			c.retryRun++
		}
		return take(&c.writeQ)
	case len(c.retryQ) > 0:
		c.retryRun = 0
		return take(&c.retryQ)
	}
	return nil
}

// probeL2Locked tries one write to a degraded L2 once its backoff is over
// (an object only L1 holds): its success ends the degradation.
func (e *Engine) probeL2Locked() {
	c := &e.cat
	if !c.degraded || c.writing > 0 || e.cfg.Now().Before(c.probeAt) {
		return
	}
	for o := c.head; o != nil; o = o.next {
		if o.dirty && !o.writing && !o.doomed && o.state == stReady {
			c.probeAt = e.cfg.Now().Add(c.backoff) // until its outcome
			e.queueWriteForcedLocked(o)
			return
		}
	}
}

// retryWritesLocked queues again, under write-through, the objects whose
// L2 write failed at least writeBackRetry ago (a transient failure, or
// the directory removed and put back): L2 gets every object without a
// restart. While L2 is degraded the probe does this instead.
func (e *Engine) retryWritesLocked() {
	c := &e.cat
	if !c.retryWrite || c.degraded || e.cfg.L2Policy != WriteThrough {
		return
	}
	c.retryWrite = false
	now := e.cfg.Now()
	for o := c.head; o != nil; o = o.next {
		if !o.dirty || o.writing || o.doomed || o.state != stReady || o.wbFailed.IsZero() {
			continue
		}
		if now.Sub(o.wbFailed) < writeBackRetry {
			c.retryWrite = true // not yet: the next tick
			continue
		}
		e.queueWriteLocked(o)
	}
}

// l2WriteDoneLocked tracks the L2's health from one write's outcome.
func (e *Engine) l2WriteDoneLocked(ok bool) {
	c := &e.cat
	now := e.cfg.Now()
	if ok {
		c.failStreak = 0
		if c.degraded {
			c.degraded = false
			e.ctr.l2Degraded.Store(false)
			e.log.Info("L2 writes succeed again; the tier is no longer degraded")
			if e.cfg.L2Policy == WriteThrough {
				for o := c.head; o != nil; o = o.next {
					if o.dirty && !o.doomed {
						e.queueWriteLocked(o)
					}
				}
			}
		}
		return
	}
	c.failStreak++
	switch {
	case c.degraded:
		c.backoff = min(2*c.backoff, l2MaxBackoff)
		c.probeAt = now.Add(c.backoff)
	case c.failStreak >= l2DegradeAfter:
		c.degraded = true
		c.backoff = l2MinBackoff
		c.probeAt = now.Add(c.backoff)
		e.ctr.l2Degraded.Store(true)
		e.ctr.l2DegradedTotal.Add(1)
		e.log.Warn("L2 is failing: writes are skipped and objects only L1 holds are dropped when L1 needs room",
			zap.Int("consecutive_failures", c.failStreak), zap.Duration("probe_every", c.backoff))
	}
}

// l2WriteLoop writes queued objects to L2.
func (e *Engine) l2WriteLoop() {
	for {
		e.mu.Lock()
		o := e.nextWriteLocked()
		for o == nil {
			e.mu.Unlock()
			select {
			case <-e.cat.writeKick:
			case <-e.life.Done():
				return
			}
			e.mu.Lock()
			o = e.nextWriteLocked()
		}
		if len(e.cat.writeQ)+len(e.cat.retryQ) > 0 {
			kick(e.cat.writeKick) // let another writer take the next
		}
		// An eviction deleting o's key must be done before o's file is
		// renamed into place, or it could remove the new file.
		for e.cat.l2acct.deleting[o.key] != 0 {
			ch := e.cat.watchLocked()
			e.mu.Unlock()
			<-ch // l2Evict notifies once its deletes returned
			e.mu.Lock()
		}
		meta := L2Object{Key: o.key, Fingerprint: o.fp, Writer: e.cfg.Rank, Incarnation: e.cfg.Incarnation,
			Size: o.size, Sum: o.sum, Created: e.cfg.Now()}
		data := e.l1mem[e.cat.off(o) : e.cat.off(o)+o.size]
		need := e.cat.fileBytes(o.size)
		err := e.l2ReserveLocked(need, o.prompt) // pending until the write's outcome
		e.mu.Unlock()

		if err == nil {
			// Never write bytes that do not match their recorded checksum.
			err = verifyBytes(data, o.sum)
			if err == nil {
				err = e.l2.Put(e.life, meta, data)
			}
			e.mu.Lock()
			e.cat.l2acct.pending -= need
		} else {
			e.mu.Lock()
		}
		e.finishWriteLocked(o, err)
		e.mu.Unlock()
	}
}

func (e *Engine) finishWriteLocked(o *l1Obj, err error) {
	c := &e.cat
	o.writing = false
	c.writing--
	evict := o.evictAfterWrite
	o.evictAfterWrite = false
	switch {
	case err == nil:
		o.dirty = false
		o.wbFailed = time.Time{}
		c.l2Set(o.key, l2Entry{size: o.size, sum: o.sum, fp: o.fp, prompt: o.prompt}, 0)
		e.ctr.l2Objects.Store(int64(len(c.l2)))
		e.ctr.bytesWrittenL2.Add(o.size)
		e.emitLocked(wire.Stored, wire.L2, o.key, o.size, o.sum)
		e.log.Debug("written to L2", zap.Stringer("key", o.key), zap.Uint64("size", o.size))
		if evict && o.pins == 0 && !o.doomed {
			e.ctr.writeBacks.Add(1)
			e.evictLocked(o)
		}
	case errors.Is(err, errL2PromptFull):
		// The bound is full of this prompt's objects at the same or
		// earlier positions: they stay (the prompt's prefix stays
		// readable from L2) and this one is kept in L1 only, as a store
		// past the bound's room.
		o.dirty = false
		o.wbFailed = time.Time{}
		if n := e.ctr.l2BoundSkipped.Add(1); n&(n-1) == 0 { // log at powers of two
			e.log.Warn("L2 bound full of the same prompt's objects at the same or earlier positions; later objects of the prompt are kept in L1 only",
				zap.Stringer("key", o.key), zap.Uint64("l2_bytes_bound", e.cfg.L2Bytes), zap.Uint64("skipped", n))
		}
		e.maybeFreeLocked(o)
		c.notifyLocked()
		kick(e.cat.evictKick)
		return
	case errors.Is(err, errL2TooLarge):
		// Never written; the store succeeded on L1 and it stays there
		// until L1 evicts it.
		o.dirty = false
		e.ctr.l2Skipped.Add(1)
		e.log.Warn("object larger than the L2 bound is kept in L1 only", zap.Stringer("key", o.key), zap.Error(err))
		e.maybeFreeLocked(o)
		c.notifyLocked()
		kick(e.cat.evictKick)
		return
	case isCorrupt(err):
		// L1's copy no longer matches its checksum: it is lost.
		e.ctr.checksumL1.Add(1)
		e.log.Error("L1 object failed its checksum before its L2 write; dropped", zap.Stringer("key", o.key), zap.Error(err))
		o.dirty = false
		e.dropLocked(o)
	default:
		o.wbFailed = e.cfg.Now()
		c.retryWrite = true
		e.ctr.l2WriteErrors.Add(1)
		e.log.Warn("L2 write failed; the object stays in L1 and is retried", zap.Stringer("key", o.key), zap.Error(err))
	}
	e.l2WriteDoneLocked(err == nil || isCorrupt(err))
	e.maybeFreeLocked(o)
	c.notifyLocked()
	kick(e.cat.evictKick)
}

// flushL2 writes every object only L1 holds to L2 and waits for all
// queued writes (Flush, Close). Objects whose write failed are tried again
// while a pass makes progress.
func (e *Engine) flushL2(ctx context.Context) error {
	prev := -1
	e.mu.Lock()
	total := e.cat.countDirty()
	e.mu.Unlock()
	if total > 0 {
		e.log.Info("flushing objects only L1 holds to L2", zap.Int("objects", total))
	}
	start, lastLog := time.Now(), time.Now()
	defer func() {
		if total == 0 {
			return
		}
		e.mu.Lock()
		left := e.cat.countDirty()
		e.mu.Unlock()
		e.log.Info("flush to L2 done", zap.Int("flushed", total-left), zap.Int("unflushed", left), zap.Duration("took", time.Since(start)))
	}()
	for {
		e.mu.Lock()
		for _, o := range e.cat.objs {
			if o.dirty && !o.writing && o.state == stReady && !o.doomed {
				e.queueWriteForcedLocked(o) // also onto a degraded L2: its last chance
			}
		}
		e.mu.Unlock()
		for {
			e.mu.Lock()
			n, ch := e.cat.writing, e.cat.watchLocked()
			e.mu.Unlock()
			if n == 0 {
				break
			}
			if total > 0 && time.Since(lastLog) >= time.Second {
				lastLog = time.Now()
				e.mu.Lock()
				left := e.cat.countDirty()
				e.mu.Unlock()
				e.log.Info("flushing to L2", zap.Int("flushed", total-left), zap.Int("of", total))
			}
			select {
			case <-ch:
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Second): // progress
			}
		}
		e.mu.Lock()
		dirty := e.cat.countDirty()
		e.mu.Unlock()
		if dirty == 0 || (prev >= 0 && dirty >= prev) {
			return nil
		}
		prev = dirty
	}
}
