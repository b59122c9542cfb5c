package enginesim

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// The bench's both-directions phase (Config.BenchDuplex, issue 25.3): after
// the repetitions, each duplex repetition stores a fresh prompt while the
// prompt stored before it is restored, both through the rankds at once, so
// a store's device-to-host copies and a restore's host-to-device copies run
// on different copy engines. The timed figure runs from the first request
// of either to the later of the last store reply and the COMPLETE verdict;
// its rate counts the bytes of both. In the same repetition the plain
// copies of the same bytes in both directions at once give the duplex
// ceiling, and the single-direction ceilings of the repetitions the
// reference of issue 25's target (combined >= 1.45x one direction).
//
// The store reads the store table's pages while the restore writes the
// restore table's: the two must not share a block (consecutive tables,
// spec "block_order": "consecutive"), or the store would read pages the
// restore is writing. Every restored byte is compared after the timed
// part, and the last prompt stored is restored and compared at the end,
// so every byte stored under load is proven too.

// BenchDuplex is the outcome of the both-directions phase.
type BenchDuplex struct {
	Reps int `json:"reps"`
	// Bytes is each rank's bytes moved per repetition: stored plus
	// restored.
	Bytes []uint64 `json:"bytes"`
	// Both is the daemon path, store and restore at once; Ceiling the
	// plain copies of the same bytes, both directions at once.
	Both    BenchStat `json:"both"`
	Ceiling BenchStat `json:"ceiling"`
	// Single is the single-direction ceiling the ratios are taken
	// against: the faster of the repetitions' device-to-host and
	// host-to-device ceilings (median aggregate GB/s).
	Single float64 `json:"single_gbps"`
	// Ratio is Both's median GB/s over Single; CeilingRatio the duplex
	// ceiling's.
	Ratio        float64 `json:"ratio"`
	CeilingRatio float64 `json:"ceiling_ratio"`
	// BenchTimelines: the stages of the last repetition's store (one
	// request of it) and restore, each beside the other; against the
	// single-direction timelines they show whether the two wait on each
	// other in the rankd or on the device.
	BenchTimelines
}

// duplexDisjoint reports whether the store and restore tables of p share
// no block in any group.
func duplexDisjoint(p *Plan) error {
	for gi := range p.R.Geometry {
		seen := make(map[int64]bool, len(p.Tables[PhaseStoreTable][gi]))
		for _, b := range p.Tables[PhaseStoreTable][gi] {
			seen[b] = true
		}
		for _, b := range p.Tables[PhaseRestoreTable][gi] {
			if seen[b] {
				return fmt.Errorf("bench duplex: scenario %s: group %s stores from and restores into block %d; both directions at once need disjoint block tables (a spec with \"block_order\": \"consecutive\")",
					p.Scenario.Name, p.R.Groups[gi].Name, b)
			}
		}
	}
	return nil
}

// benchDuplex runs the both-directions phase after the repetitions: s.plan
// is the last prompt stored, restored and compared.
func (s *sim) benchDuplex(ctx context.Context, br *BenchResult, cbufs []ceilBuf, reps int) (*BenchDuplex, error) {
	if err := duplexDisjoint(s.plan); err != nil {
		return nil, err
	}
	bd := &BenchDuplex{Reps: reps}
	for t := range s.workers {
		bd.Bytes = append(bd.Bytes, br.StoreBytes[t]+br.RestoreBytes[t])
	}
	// The ceiling's other direction needs buffers of its own.
	back := make([]ceilBuf, len(s.workers))
	defer func() {
		for _, c := range back {
			c.release()
		}
	}()
	if err := s.each(func(w *worker) error {
		c, err := newCeilBuf(w.dev, max(br.StoreBytes[w.t], br.RestoreBytes[w.t], 1))
		back[w.t] = c
		return err
	}); err != nil {
		return nil, fmt.Errorf("bench duplex: ceiling buffers: %w", err)
	}
	if _, _, err := s.ceiling(ctx, back, br.StoreBytes, false); err != nil { // warm-up, untimed
		return nil, err
	}
	s.logf("bench duplex: %d repetitions of a store and a restore at once", reps)
	sc, base := s.plan.Scenario, s.cfg.Seed+uint64(s.cfg.BenchReps)
	for r := range reps {
		restored := s.plan // stored by the previous repetition
		stored, err := NewPlan(sc, base+uint64(r))
		if err != nil {
			return nil, err
		}
		// Untimed: every page wiped (the restore must write what is
		// compared), then the new prompt's store table written.
		if err := s.each(func(w *worker) error {
			if err := w.wipe(); err != nil {
				return err
			}
			return w.fillStoreOf(stored)
		}); err != nil {
			return nil, err
		}
		tot, ranks, err := s.duplexCeiling(ctx, cbufs, back, br)
		if err != nil {
			return nil, err
		}
		bd.Ceiling.add(tot, ranks)

		reqID := fmt.Sprintf("bench-duplex-%d-%d", base, r)
		tot, ranks, run, err := s.duplexOnce(ctx, stored, reqID)
		if err != nil {
			return nil, fmt.Errorf("bench duplex repetition %d: %w", r, err)
		}
		bd.Both.add(tot, ranks)
		if r == reps-1 { // untimed
			s.storeTimelineOf(ctx, &bd.BenchTimelines, reqID, run)
			s.restoreTimelineOf(ctx, &bd.BenchTimelines)
		}
		// Untimed: every restored byte compared (the store table's pages
		// wiped first: the comparison wants every page outside the
		// restore table as the wipe left it).
		if err := s.each(func(w *worker) error { return w.wipeStoreTable(stored) }); err != nil {
			return nil, err
		}
		if err := s.compareRestored(); err != nil {
			return nil, fmt.Errorf("bench duplex repetition %d: %w", r, err)
		}
		s.logf("bench duplex repetition %d: store of %s and restore of %s at once %.3fs (ceiling both ways %.3fs)",
			r, stored.Hashes[0], restored.Hashes[0], bd.Both.Seconds[r], bd.Ceiling.Seconds[r])
		s.usePlan(stored)
		if prefix, err := s.waitPrefix(ctx, s.cfg.Timeout); err != nil || prefix != len(stored.Hashes) {
			return nil, fmt.Errorf("bench duplex repetition %d: index shows %d of %d chunks after the store: %v", r, prefix, len(stored.Hashes), err)
		}
	}
	// The last prompt stored under load, restored alone and compared.
	if err := s.each(func(w *worker) error { return w.wipe() }); err != nil {
		return nil, err
	}
	if err := s.restore(ctx); err != nil {
		return nil, fmt.Errorf("bench duplex: restore of the last prompt stored: %w", err)
	}
	bd.Both.finish(bd.Bytes)
	bd.Ceiling.finish(bd.Bytes)
	return bd, nil
}

// duplexCeiling runs the plain copies of a duplex repetition: every rank's
// store bytes device-to-host and its restore bytes host-to-device, all at
// once; a rank's time is its later copy's end.
func (s *sim) duplexCeiling(ctx context.Context, cbufs, back []ceilBuf, br *BenchResult) (time.Duration, []time.Duration, error) {
	type dir struct {
		ranks []time.Duration
		err   error
	}
	done := make(chan dir, 1)
	start := time.Now()
	go func() {
		_, ranks, err := s.ceiling(ctx, back, br.StoreBytes, false)
		done <- dir{ranks, err}
	}()
	_, ranks, err := s.ceiling(ctx, cbufs, br.RestoreBytes, true)
	other := <-done
	tot := time.Since(start)
	if err != nil || other.err != nil {
		return 0, nil, fmt.Errorf("bench duplex ceiling: %w", errors.Join(err, other.err))
	}
	for t := range ranks {
		ranks[t] = max(ranks[t], other.ranks[t])
	}
	return tot, ranks, nil
}

// duplexOnce stores stored's prompt (its pages already written) while
// restoring s.plan's, and returns the wall time from the first request to
// the later of the last store reply and the verdict, and each rank's
// (to the later of its last store reply and its retrieve reply).
func (s *sim) duplexOnce(ctx context.Context, stored *Plan, reqID string) (time.Duration, []time.Duration, benchStoreRun, error) {
	type storeDone struct {
		run benchStoreRun
		err error
	}
	done := make(chan storeDone, 1)
	s.quiet, s.trafficOnly = true, true // the verdict decides here; the bytes are compared after
	defer func() { s.trafficOnly = false }()
	start := time.Now()
	go func() {
		run, err := s.benchStore(ctx, reqID, s.cfg.BenchChunksPerStore, stored)
		done <- storeDone{run, err}
	}()
	rerr := s.restore(ctx)
	st := <-done
	if rerr != nil || st.err != nil {
		return 0, nil, st.run, errors.Join(rerr, st.err)
	}
	later := func(a, b time.Time) time.Duration { return max(a.Sub(start), b.Sub(start)) }
	ranks := make([]time.Duration, len(s.workers))
	for t := range ranks {
		ranks[t] = later(st.run.start.Add(st.run.ranks[t]), s.rc.replied[t])
	}
	return later(s.rc.ended, st.run.start.Add(st.run.total)), ranks, st.run, nil
}

// compareRestored compares every page of the restore table with s.plan's
// content, as a restore outside the bench does.
func (s *sim) compareRestored() error {
	for _, w := range s.workers {
		m, err := w.verify(map[int]bool{}, nil)
		if err != nil {
			return err
		}
		var wrong uint64
		for _, n := range m.Chunks {
			wrong += n
		}
		if wrong != 0 || m.Outside != 0 {
			return fmt.Errorf("rank %d: restored bytes wrong: %d B in chunks, %d B outside: %s", w.t, wrong, m.Outside, m.First)
		}
	}
	return nil
}

// wipeStoreTable wipes the pages of p's store table, as wipe does every
// page.
func (w *worker) wipeStoreTable(p *Plan) error {
	for gi, g := range p.R.Geometry {
		buf := make([]byte, g.PageBytes)
		for c := range p.Scenario.Chunks {
			for l := range g.Layers {
				for _, b := range p.ChunkBlocks(PhaseStoreTable, gi, c) {
					if err := w.wipePage(gi, p.PageOffset(gi, l, b), buf); err != nil {
						return fmt.Errorf("rank %d: wipe the store table of group %d: %w", w.t, gi, err)
					}
				}
			}
		}
	}
	return nil
}

// usePlan makes p the plan of the simulation and of every worker.
func (s *sim) usePlan(p *Plan) {
	s.plan = p
	for _, w := range s.workers {
		w.plan = p
	}
}
