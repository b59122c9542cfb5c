package enginesim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/wire"
)

// The daemon-path benchmark (--bench): R repetitions of store-then-restore
// of a whole prompt through the real rankds, each repetition with fresh
// content (seed Seed+r, so nothing is deduplicated), timed from the
// engine's requests to the rankds' replies (store) and from restore.begin
// to the COMPLETE verdict (restore). Content generation, page filling,
// wiping and the byte comparison happen outside the timed parts. In the
// same repetition a plain copy of the same bytes per rank in the same
// direction (cuda.PlainCopy: the copy engine on a GPU, memmove on the host
// backend), all ranks at once as their rankds run, gives the ceiling.

// BenchResult is the outcome of --bench, in Result.Bench.
type BenchResult struct {
	Reps int `json:"reps"`
	// Ranks is the number of TP ranks (rankds).
	Ranks int `json:"ranks"`
	// Device is the backend and device of the run.
	Device string `json:"device"`
	// ChunksPerStore is the number of chunks in one store request.
	ChunksPerStore int `json:"chunks_per_store"`
	// StoreBytes and RestoreBytes are the declared bytes each rank stores
	// and restores per repetition, by TP rank.
	StoreBytes   []uint64 `json:"store_bytes"`
	RestoreBytes []uint64 `json:"restore_bytes"`
	// Store, Restore: the daemon path; CeilingD2H, CeilingH2D: the plain
	// copies of the same bytes.
	Store      BenchStat `json:"store"`
	Restore    BenchStat `json:"restore"`
	CeilingD2H BenchStat `json:"ceiling_d2h"`
	CeilingH2D BenchStat `json:"ceiling_h2d"`
	// StoreRatio and RestoreRatio are the daemon path's median aggregate
	// GB/s over the ceiling's median aggregate GB/s.
	StoreRatio   float64 `json:"store_ratio"`
	RestoreRatio float64 `json:"restore_ratio"`
	// BenchTimelines: where the time of one store request and of the
	// restore went in the last repetition.
	BenchTimelines
	// Duplex is the both-directions phase of Config.BenchDuplex, when run
	// (duplex.go).
	Duplex *BenchDuplex `json:"duplex,omitempty"`
	// Traffic is the restore loop of Config.BenchTraffic, when run.
	Traffic *BenchTraffic `json:"traffic,omitempty"`
}

// BenchTraffic is the bench's restore loop (Config.BenchTraffic): the last
// repetition's prompt restored again and again, each verdict COMPLETE,
// the bytes not compared, so that kvtier's restores, and nothing of the
// bench's own work, run for the whole time (the interference
// measurement's traffic: python/examples/gpu_interference.py).
type BenchTraffic struct {
	Restores int     `json:"restores"`
	Seconds  float64 `json:"seconds"`
	// GBps is every rank's restored bytes over the loop's wall time.
	GBps float64 `json:"gbps"`
}

// BenchStat is one timed measure over the repetitions.
type BenchStat struct {
	// Seconds is the wall time of each repetition (all ranks).
	Seconds []float64 `json:"seconds"`
	// RankSeconds[r][t] is rank t's time in repetition r (from the start
	// to its own reply; the ceiling: to its copy's end).
	RankSeconds [][]float64 `json:"rank_seconds"`
	Median      float64     `json:"median_seconds"`
	Min         float64     `json:"min_seconds"`
	Max         float64     `json:"max_seconds"`
	// GBps is the aggregate rate (all ranks' bytes / Seconds) at the
	// median, the fastest and the slowest repetition (1 GB = 1e9 B).
	GBps    float64 `json:"gbps"`
	GBpsMin float64 `json:"gbps_min"`
	GBpsMax float64 `json:"gbps_max"`
	// RankGBps is each rank's median rate (its bytes / its RankSeconds).
	RankGBps []float64 `json:"rank_gbps"`
}

// add records one repetition.
func (b *BenchStat) add(total time.Duration, ranks []time.Duration) {
	b.Seconds = append(b.Seconds, total.Seconds())
	rs := make([]float64, len(ranks))
	for i, d := range ranks {
		rs[i] = d.Seconds()
	}
	b.RankSeconds = append(b.RankSeconds, rs)
}

// finish computes the summary of the repetitions for bytes per rank.
func (b *BenchStat) finish(bytes []uint64) {
	if len(b.Seconds) == 0 {
		return
	}
	var total uint64
	for _, n := range bytes {
		total += n
	}
	b.Median, b.Min, b.Max = median(b.Seconds), slices.Min(b.Seconds), slices.Max(b.Seconds)
	b.GBps, b.GBpsMin, b.GBpsMax = gbps(total, b.Median), gbps(total, b.Max), gbps(total, b.Min)
	b.RankGBps = make([]float64, len(bytes))
	for t, n := range bytes {
		var secs []float64
		for _, rs := range b.RankSeconds {
			if t < len(rs) {
				secs = append(secs, rs[t])
			}
		}
		if len(secs) > 0 {
			b.RankGBps[t] = gbps(n, median(secs))
		}
	}
}

// median of v (the mean of the middle two for an even count).
func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func gbps(bytes uint64, secs float64) float64 {
	if secs <= 0 {
		return 0
	}
	return float64(bytes) / secs / 1e9
}

// benchBytes returns the declared bytes TP rank t stores and restores for
// one prompt of plan p: the groups it writes (StoreShard), and every group
// (each rank restores a shard of every group).
func benchBytes(p *Plan, t int) (store, restore uint64) {
	for gi := range p.R.Geometry {
		n := p.ChunkBytes(gi) * uint64(p.Scenario.Chunks)
		if _, ok := p.R.StoreShard(gi, t); ok {
			store += n
		}
		restore += n
	}
	return store, restore
}

// bench runs the benchmark on registered workers.
func (s *sim) bench(ctx context.Context) error {
	reps, per := s.cfg.BenchReps, s.cfg.BenchChunksPerStore
	br := &BenchResult{Reps: reps, Ranks: len(s.workers), ChunksPerStore: per}
	s.res.Bench = br
	info := s.workers[0].dev.Info()
	br.Device = fmt.Sprintf("%s %s %s", info.Backend, info.Name, info.UUID)
	for _, w := range s.workers {
		st, rs := benchBytes(s.plan, w.t)
		br.StoreBytes = append(br.StoreBytes, st)
		br.RestoreBytes = append(br.RestoreBytes, rs)
	}
	// The ceiling's buffers, one pair per rank on the rank's device.
	cbufs := make([]ceilBuf, len(s.workers))
	defer func() {
		for _, c := range cbufs {
			c.release()
		}
	}()
	if err := s.each(func(w *worker) error {
		n := max(br.StoreBytes[w.t], br.RestoreBytes[w.t], 1)
		c, err := newCeilBuf(w.dev, n)
		cbufs[w.t] = c
		return err
	}); err != nil {
		return fmt.Errorf("bench: ceiling buffers: %w", err)
	}
	// Warm-up, untimed: the first copy into fresh memory pays its page faults.
	for _, dir := range []bool{false, true} {
		if _, _, err := s.ceiling(ctx, cbufs, br.RestoreBytes, dir); err != nil {
			return err
		}
	}
	s.logf("bench: %d repetitions of store + restore, %d chunks per store request; per rank store %s, restore %s",
		reps, per, human(br.StoreBytes[0]), human(br.RestoreBytes[0]))

	base := s.cfg.Seed
	sc := s.plan.Scenario
	for r := range reps {
		if r > 0 {
			p, err := NewPlan(sc, base+uint64(r))
			if err != nil {
				return err
			}
			s.usePlan(p)
		}
		// Untimed: the engine's compute (the pages of the store table).
		if err := s.each(func(w *worker) error { return w.fillStore() }); err != nil {
			return err
		}
		tot, ranks, err := s.ceiling(ctx, cbufs, br.StoreBytes, false)
		if err != nil {
			return err
		}
		br.CeilingD2H.add(tot, ranks)

		reqID := fmt.Sprintf("bench-%d-%d", base, r)
		sr, err := s.benchStore(ctx, reqID, per, s.plan)
		if err != nil {
			return fmt.Errorf("bench repetition %d: %w", r, err)
		}
		br.Store.add(sr.total, sr.ranks)
		if prefix, err := s.waitPrefix(ctx, s.cfg.Timeout); err != nil || prefix != len(s.plan.Hashes) {
			return fmt.Errorf("bench repetition %d: index shows %d of %d chunks after the store: %v", r, prefix, len(s.plan.Hashes), err)
		}
		last := r == reps-1
		if last {
			s.storeTimelineOf(ctx, &br.BenchTimelines, reqID, sr) // untimed
		}

		if err := s.each(func(w *worker) error { return w.wipe() }); err != nil {
			return err
		}
		tot, ranks, err = s.ceiling(ctx, cbufs, br.RestoreBytes, true)
		if err != nil {
			return err
		}
		br.CeilingH2D.add(tot, ranks)

		s.quiet = r < reps-1 // the per-rank table of the last repetition only
		if err := s.restore(ctx); err != nil {
			return fmt.Errorf("bench repetition %d: %w", r, err)
		}
		rs := make([]time.Duration, len(s.res.Ranks))
		for i, row := range s.res.Ranks {
			rs[i] = time.Duration(row.Seconds * float64(time.Second))
			if row.Bytes != br.RestoreBytes[i] {
				return fmt.Errorf("bench repetition %d: rank %d restored %d B, expected %d B", r, i, row.Bytes, br.RestoreBytes[i])
			}
		}
		br.Restore.add(time.Duration(s.res.RestoreSeconds*float64(time.Second)), rs)
		if last {
			s.restoreTimelineOf(ctx, &br.BenchTimelines)
		}
		s.logf("bench repetition %d: store %.3fs, restore %.3fs (ceilings %.3fs / %.3fs)", r,
			br.Store.Seconds[r], br.Restore.Seconds[r], br.CeilingD2H.Seconds[r], br.CeilingH2D.Seconds[r])
	}
	if n := s.cfg.BenchDuplex; n > 0 {
		d, err := s.benchDuplex(ctx, br, cbufs, n)
		if err != nil {
			return err
		}
		br.Duplex = d
	}
	if d := s.cfg.BenchTraffic; d > 0 {
		t, err := s.benchTraffic(ctx, d, br.RestoreBytes)
		if err != nil {
			return err
		}
		br.Traffic = t
	}
	br.Store.finish(br.StoreBytes)
	br.Restore.finish(br.RestoreBytes)
	br.CeilingD2H.finish(br.StoreBytes)
	br.CeilingH2D.finish(br.RestoreBytes)
	if br.CeilingD2H.GBps > 0 {
		br.StoreRatio = br.Store.GBps / br.CeilingD2H.GBps
	}
	if br.CeilingH2D.GBps > 0 {
		br.RestoreRatio = br.Restore.GBps / br.CeilingH2D.GBps
	}
	if d := br.Duplex; d != nil {
		d.Single = max(br.CeilingD2H.GBps, br.CeilingH2D.GBps)
		if d.Single > 0 {
			d.Ratio, d.CeilingRatio = d.Both.GBps/d.Single, d.Ceiling.GBps/d.Single
		}
	}
	s.printBench(br)
	return nil
}

// benchTraffic restores the stored prompt again and again for d (or
// until ctx ends): every verdict must be COMPLETE with the whole prompt
// planned; the bytes are not compared (the repetitions did that).
func (s *sim) benchTraffic(ctx context.Context, d time.Duration, perRank []uint64) (*BenchTraffic, error) {
	var per uint64
	for _, n := range perRank {
		per += n
	}
	s.quiet, s.trafficOnly = true, true
	defer func() { s.trafficOnly = false }()
	s.logf("bench traffic: restoring the prompt (%s) again and again for %v", human(per), d)
	t := &BenchTraffic{}
	start := time.Now()
	rate := func() {
		t.Seconds = time.Since(start).Seconds()
		if t.Seconds > 0 {
			t.GBps = float64(per) * float64(t.Restores) / t.Seconds / 1e9
		}
	}
	// A progress line every trafficEvery: an interference run stops the
	// loop with a signal, and its last line is then the traffic's rate.
	next := start.Add(trafficEvery)
	for time.Since(start) < d && ctx.Err() == nil {
		if err := s.restore(ctx); err != nil {
			if ctx.Err() != nil {
				break // stopped (a signal): the restore cut short is not a failure
			}
			return nil, fmt.Errorf("bench traffic, restore %d: %w", t.Restores, err)
		}
		t.Restores++
		if time.Now().After(next) {
			rate()
			s.logf("bench traffic: %d restores in %.1f s, %.2f GB/s so far", t.Restores, t.Seconds, t.GBps)
			next = next.Add(trafficEvery)
		}
	}
	rate()
	s.logf("bench traffic: %d restores in %.1f s, %.2f GB/s", t.Restores, t.Seconds, t.GBps)
	return t, nil
}

// trafficEvery is how often benchTraffic reports its progress.
const trafficEvery = 5 * time.Second

// ceilBuf is one rank's device memory and host buffer for the ceiling.
type ceilBuf struct {
	m  cuda.Mem
	hb cuda.HostBuf
	s  cuda.Stream
}

func newCeilBuf(dev cuda.Device, n uint64) (ceilBuf, error) {
	var c ceilBuf
	var err error
	if c.m, err = dev.Alloc(n); err != nil {
		return c, err
	}
	if c.hb, err = dev.AllocHost(n); err != nil {
		return c, err
	}
	c.s, err = dev.NewStream()
	return c, err
}

func (c ceilBuf) release() {
	if c.s != nil {
		_ = c.s.Close()
	}
	if c.hb != nil {
		_ = c.hb.Release()
	}
	if c.m != nil {
		_ = c.m.Release()
	}
}

// ceiling runs one plain copy of bytes[t] per rank, all ranks at once, and
// returns the wall time of all and of each.
func (s *sim) ceiling(ctx context.Context, cbufs []ceilBuf, bytes []uint64, toDevice bool) (time.Duration, []time.Duration, error) {
	ranks := make([]time.Duration, len(s.workers))
	start := time.Now()
	err := s.each(func(w *worker) error {
		c := cbufs[w.t]
		if err := cuda.PlainCopy(ctx, c.s, c.m, c.hb, bytes[w.t], toDevice); err != nil {
			return fmt.Errorf("rank %d: ceiling copy: %w", w.t, err)
		}
		ranks[w.t] = time.Since(start)
		return nil
	})
	return time.Since(start), ranks, err
}

// benchStoreRun is one timed store of the whole prompt: the requests were
// sent at start; total is the time to the last reply, ranks each rank's
// time to its last reply, requests the number each rank sent.
type benchStoreRun struct {
	start    time.Time
	total    time.Duration
	ranks    []time.Duration
	requests []int
}

// benchStore stores the whole prompt of p from every rank at once, per
// chunks per request. The pages are already written; each request's producer
// event is recorded behind them before the clock starts.
func (s *sim) benchStore(ctx context.Context, reqID string, per int, p *Plan) (benchStoreRun, error) {
	type prepared struct {
		req   wire.StoreRequest
		body  any // req as sent: binary, or JSON with Config.JSONRequests
		ev    cuda.Event
		freed *nats.Subscription
	}
	all := make([][]prepared, len(s.workers))
	defer func() {
		for _, ps := range all {
			for _, pr := range ps {
				_ = pr.ev.Release()
				_ = pr.freed.Unsubscribe()
			}
		}
	}()
	for _, w := range s.workers {
		for c0 := 0; c0 < p.Scenario.Chunks; c0 += per {
			req := wire.StoreRequest{RequestID: reqID, Namespace: p.R.Namespace, Session: w.session}
			for c := c0; c < min(c0+per, p.Scenario.Chunks); c++ {
				cb := wire.ChunkBlocks{Chunk: p.Hashes[c], Blocks: make([][]int64, len(p.R.Geometry)), Pos: uint32(c)}
				stores := false
				for gi := range p.R.Geometry {
					cb.Blocks[gi] = []int64{}
					if _, ok := p.R.StoreShard(gi, w.t); ok {
						cb.Blocks[gi], stores = p.ChunkBlocks(PhaseStoreTable, gi, c), true
					}
				}
				if stores {
					req.Chunks = append(req.Chunks, cb)
				}
			}
			if len(req.Chunks) == 0 {
				continue
			}
			ev, err := w.dev.NewEvent(true)
			if err != nil {
				return benchStoreRun{}, fmt.Errorf("rank %d: new event: %w", w.t, err)
			}
			pr := prepared{req: req, ev: ev}
			if err := w.stream.Record(ev); err != nil {
				_ = ev.Release()
				return benchStoreRun{}, fmt.Errorf("rank %d: record: %w", w.t, err)
			}
			if pr.req.Event, err = w.dev.ExportEvent(ev); err != nil {
				_ = ev.Release()
				return benchStoreRun{}, fmt.Errorf("rank %d: export event: %w", w.t, err)
			}
			// Encoded before the clock starts, as the engine's own work.
			if pr.body, err = w.body(&pr.req); err != nil {
				_ = ev.Release()
				return benchStoreRun{}, err
			}
			// Subscribed before the request, so a BlocksFreed cannot be missed.
			if pr.freed, err = w.nc.SubscribeSync(w.subj.Freed(w.rank)); err != nil {
				_ = ev.Release()
				return benchStoreRun{}, err
			}
			all[w.t] = append(all[w.t], pr)
		}
		if err := w.stream.Synchronize(ctx); err != nil {
			return benchStoreRun{}, fmt.Errorf("rank %d: stream: %w", w.t, err)
		}
	}

	ranks := make([]time.Duration, len(s.workers))
	replies := make([][]*wire.StoreReply, len(s.workers))
	start := time.Now()
	err := s.each(func(w *worker) error {
		ps := all[w.t]
		replies[w.t] = make([]*wire.StoreReply, len(ps))
		errs := make([]error, len(ps))
		var wg sync.WaitGroup
		for i := range ps {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cctx, cancel := s.callCtx(ctx)
				defer cancel()
				rep, err := bus.CallRetry[wire.StoreReply](cctx, w.nc, w.subj.Engine(w.rank, "store"), withDeadline(cctx, ps[i].body), bus.NoResponders())
				replies[w.t][i], errs[i] = rep, sessionErr(w, "store", err)
			}()
		}
		wg.Wait()
		ranks[w.t] = time.Since(start)
		return errors.Join(errs...)
	})
	total := time.Since(start)
	if err != nil {
		return benchStoreRun{}, fmt.Errorf("store: %w", err)
	}
	stored := 0
	for t, reps := range replies {
		s.res.Stores += len(reps)
		for i, rep := range reps {
			if len(rep.Failed) > 0 {
				return benchStoreRun{}, fmt.Errorf("rank %d: store failed objects: %v", t, rep.Failed)
			}
			if rep.Deduped > 0 {
				return benchStoreRun{}, fmt.Errorf("rank %d: store deduplicated %d objects: the benchmark must move every byte", t, rep.Deduped)
			}
			stored += rep.Stored
			if rep.BlocksInUse {
				// C10: the blocks stay untouched until freed (outside the timed part).
				for _, c := range all[t][i].req.Chunks {
					cctx, cancel := s.callCtx(ctx)
					err := waitFreed(cctx, all[t][i].freed, reqID, c.Chunk)
					cancel()
					if err != nil {
						return benchStoreRun{}, err
					}
				}
			}
		}
	}
	s.res.Stored += stored
	run := benchStoreRun{start: start, total: total, ranks: ranks, requests: make([]int, len(all))}
	for t, ps := range all {
		run.requests[t] = len(ps)
	}
	return run, nil
}

// fillStore writes every page of the store table of the prompt: the
// engine's forward passes, outside the timed part of a benchmark.
func (w *worker) fillStore() error { return w.fillStoreOf(w.plan) }

// fillStoreOf writes the store table's pages with p's content.
func (w *worker) fillStoreOf(p *Plan) error {
	for gi, g := range p.R.Geometry {
		buf := make([]byte, g.PageBytes)
		for c := range p.Scenario.Chunks {
			blocks := p.ChunkBlocks(PhaseStoreTable, gi, c)
			for l := range g.Layers {
				for k, b := range blocks {
					p.Page(w.t, gi, l, c*p.BPC[gi]+k, buf)
					if err := w.dev.Write(w.allocs[gi], p.PageOffset(gi, l, b), buf); err != nil {
						return fmt.Errorf("rank %d: fill chunk %d group %d: %w", w.t, c, gi, err)
					}
				}
			}
		}
	}
	return nil
}

func (s *sim) printBench(br *BenchResult) {
	s.outMu.Lock()
	defer s.outMu.Unlock()
	out := s.cfg.Out
	fmt.Fprintf(out, "\nbench %s: %d rankd(s) on %s, %d repetitions (median [min-max]), %d chunks per store request\n",
		s.plan.Scenario.Name, br.Ranks, br.Device, br.Reps, br.ChunksPerStore)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PATH\tBYTES/RANK\tSECONDS\tAGGREGATE GB/s\tPER-RANK GB/s\tCEILING GB/s\tRATIO")
	row := func(name string, bytes []uint64, st, ceil BenchStat, ratio float64) {
		per := ""
		for i, g := range st.RankGBps {
			if i > 0 {
				per += " "
			}
			per += fmt.Sprintf("%.2f", g)
		}
		fmt.Fprintf(tw, "%s\t%s\t%.4f [%.4f-%.4f]\t%.2f [%.2f-%.2f]\t%s\t%.2f [%.2f-%.2f]\t%.3f\n", name, human(bytes[0]),
			st.Median, st.Min, st.Max, st.GBps, st.GBpsMin, st.GBpsMax, per, ceil.GBps, ceil.GBpsMin, ceil.GBpsMax, ratio)
	}
	row("store (request -> reply)", br.StoreBytes, br.Store, br.CeilingD2H, br.StoreRatio)
	row("restore (begin -> COMPLETE)", br.RestoreBytes, br.Restore, br.CeilingH2D, br.RestoreRatio)
	tw.Flush()
	fmt.Fprintln(out, "ceiling: one plain copy per rank, all ranks at once (store: device->host, restore: host->device)")
	if d := br.Duplex; d != nil {
		fmt.Fprintf(out, "both directions at once (%d repetitions; a fresh prompt stored while the one before is restored):\n", d.Reps)
		fmt.Fprintf(out, "  store + restore %.4f s [%.4f-%.4f], %.2f GB/s [%.2f-%.2f] = %.3fx the single-direction ceiling (%.2f GB/s)\n",
			d.Both.Median, d.Both.Min, d.Both.Max, d.Both.GBps, d.Both.GBpsMin, d.Both.GBpsMax, d.Ratio, d.Single)
		fmt.Fprintf(out, "  plain copies both ways %.4f s, %.2f GB/s = %.3fx; kvtier at %.3f of the duplex ceiling\n",
			d.Ceiling.Median, d.Ceiling.GBps, d.CeilingRatio, d.Both.GBps/max(d.Ceiling.GBps, 1e-9))
	}
	if d := br.Duplex; d != nil {
		d.print(out, " beside a restore (duplex)", " beside a store (duplex)")
	}
	br.BenchTimelines.print(out, "", "")
	fmt.Fprintln(out)
}

// BenchChunks returns the number of chunks of sc for which the rank
// storing the most stores at least gb GB.
func BenchChunks(sc Scenario, gb float64) (int, error) {
	one := sc
	one.Chunks = 1
	p, err := NewPlan(one, 1)
	if err != nil {
		return 0, err
	}
	var most uint64
	for t := range p.R.Layout.TP {
		st, _ := benchBytes(p, t)
		most = max(most, st)
	}
	if most == 0 {
		return 0, fmt.Errorf("bench: scenario %s stores nothing", sc.Name)
	}
	n := int((gb*1e9 + float64(most) - 1) / float64(most))
	return max(n, 1), nil
}
