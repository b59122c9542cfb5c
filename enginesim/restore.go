package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

func (s *sim) restore(ctx context.Context) error {
	p := s.plan
	if s.cfg.WaitPrefix > 0 {
		prefix, err := s.waitPrefix(ctx, s.cfg.WaitPrefix)
		if err != nil {
			s.logf("lookup before the restore: %v", err)
		}
		s.logf("coordinator lookup: %d of %d chunks restorable", prefix, len(p.Hashes))
	}
	start := time.Now()
	s.rc = restoreClock{begun: start, sent: make([]time.Time, len(s.workers)), replied: make([]time.Time, len(s.workers))}
	cctx, cancel := s.callCtx(ctx)
	plan, err := beginRestore(cctx, s.nc, s.subj.EngineCoord(s.cfg.Instance, wire.CoordRestoreBegin), s.resend(0), wire.RestoreBeginRequest{
		Instance: s.cfg.Instance, PlanEncoding: wire.PlanEncodingBinary, RestoreBegin: wire.RestoreBegin{
			Namespace: p.R.Namespace, Chunks: p.Hashes, DeadlineMS: int(s.cfg.RestoreDeadline / time.Millisecond)},
		StateAtEnd: s.cfg.StateAtEnd}, s.cfg.JSONRequests)
	cancel()
	if err != nil {
		if s.cfg.FailOpen {
			s.res.CacheProblems = append(s.res.CacheProblems, "restore.begin: "+err.Error())
			s.logf("restore.begin failed, recomputing the prompt (fail-open): %v", err)
			return s.recomputeAll(ctx)
		}
		return fmt.Errorf("restore.begin: %w", err)
	}
	s.rc.planned = time.Now()
	s.res.RestoreID, s.res.Prefix = plan.RestoreID, plan.Prefix
	s.logf("restore %s: plan covers %d of %d chunks on %d ranks", plan.RestoreID, plan.Prefix, len(p.Hashes), len(plan.Ranks))

	if err := s.hold(ctx, "retrieve", s.cfg.HoldBeforeRetrieve); err != nil {
		return err
	}

	// The wait goes out beside the retrieves: the coordinator parks it
	// until every rank has reported, so the verdict arrives as soon as it
	// is decided rather than a round trip after the last reply. Sent
	// after the hold (a test's pause may outlast the call's timeout).
	type waited struct {
		v   *wire.RestoreVerdict
		err error
	}
	wctx, wcancel := s.callCtx(ctx)
	defer wcancel()
	waitc := make(chan waited, 1)
	go func() {
		v, err := bus.CallRetry[wire.RestoreVerdict](wctx, s.nc, s.subj.EngineCoord(s.cfg.Instance, wire.CoordRestoreWait), wire.RestoreWait{RestoreID: plan.RestoreID}, s.resend(s.cfg.RestoreDeadline))
		waitc <- waited{v, err}
	}()

	rows := make([]RankResult, len(s.workers))
	_ = s.each(func(w *worker) error {
		row := &rows[w.t]
		row.Rank = w.t
		items := plan.Ranks[w.rank.String()]
		tiers := map[wire.Tier]bool{}
		chunks := map[int]bool{}
		for _, it := range items {
			tiers[it.Source.Tier] = true
			chunks[it.Chunk] = true
			row.Bytes += p.ChunkBytes(it.Group)
		}
		row.Items, row.Chunks, row.Tier, row.ChunkList = len(items), len(chunks), tierString(tiers), sortedKeys(chunks)
		if len(items) == 0 {
			return nil
		}
		cctx, cancel := s.callCtx(ctx)
		defer cancel()
		s.rc.sent[w.t] = time.Now()
		rep, err := w.retrieve(cctx, plan.RestoreID, items)
		s.rc.replied[w.t] = time.Now()
		row.Seconds = s.rc.replied[w.t].Sub(start).Seconds()
		if err != nil {
			row.Error = err.Error()
			s.logf("rank %d: retrieve failed: %v", w.t, err)
			return nil
		}
		for _, r := range rep.Results {
			if r.OK {
				row.Placed++
			} else {
				row.FailedItem = append(row.FailedItem, r.Chunk)
				s.logf("rank %d: chunk %d group %d not placed: %s", w.t, r.Chunk, r.Group, r.Reason)
			}
		}
		s.logf("rank %d: placed %d of %d objects", w.t, row.Placed, len(items))
		return nil
	})

	s.rc.verdictFrom = time.Now()
	got := <-waitc
	wcancel()
	v, err := got.v, got.err
	if err != nil {
		if !s.cfg.FailOpen {
			return fmt.Errorf("restore.wait: %w", err)
		}
		// No verdict: nothing the rankds wrote is trusted.
		s.res.CacheProblems = append(s.res.CacheProblems, "restore.wait: "+err.Error())
		s.logf("no verdict, recomputing the prompt (fail-open): %v", err)
		return s.recomputeAll(ctx)
	}
	s.rc.ended = time.Now()
	s.res.Verdict, s.res.Failed, s.res.Reasons = v.State, v.Failed, v.FailedReasons()
	s.res.RestoreSeconds = s.rc.ended.Sub(start).Seconds()
	s.logf("verdict %s for restore %s: prefix %d, failed chunks %v %v (%.3fs)", v.State, v.RestoreID, v.Prefix, v.Failed, v.FailedReasons(), s.res.RestoreSeconds)
	if s.trafficOnly { // the bench's restore loop: the verdict decides, the bytes are not compared
		s.res.Ranks = rows
		if v.State != wire.VerdictComplete || plan.Prefix != s.wantPrefix() {
			return fmt.Errorf("verdict %s, plan %d of %d chunks, failed chunks %v (%v)", v.State, plan.Prefix, len(p.Hashes), v.Failed, v.FailedReasons())
		}
		return nil
	}

	// Chunks the engine must recompute: failed ones and those beyond the
	// planned prefix. Everything else must be byte-exact.
	skip := map[int]bool{}
	for _, c := range v.Failed {
		skip[c] = true
	}
	for c := plan.Prefix; c < len(p.Hashes); c++ {
		skip[c] = true
	}
	if v.State != wire.VerdictComplete {
		// Nothing of a failed restore is trusted beyond what the verdict
		// lists as good; still, what it does not list must be exact.
		s.logf("chunks to recompute: %v", sortedKeys(skip))
	}
	var problems []string
	left := func(gi int) map[int]bool { return nil }
	if s.cfg.StateAtEnd {
		left = s.statesLeft(plan.Prefix)
	}
	for _, w := range s.workers {
		row := &rows[w.t]
		m, err := w.verify(skip, left)
		if err != nil {
			return err
		}
		for _, n := range m.Chunks {
			row.Mismatch += n
		}
		row.Outside = m.Outside
		if row.Mismatch == 0 && row.Outside == 0 {
			row.Compare = fmt.Sprintf("ok (%d B)", m.Bytes)
		} else {
			row.Compare = fmt.Sprintf("MISMATCH %d B in chunks %v, %d B outside", row.Mismatch, mismatchChunks(m), row.Outside)
			problems = append(problems, fmt.Sprintf("rank %d: %s", w.t, m.First))
			s.logf("rank %d: %s", w.t, m.First)
		}
	}
	s.res.Ranks = rows
	if !s.quiet {
		s.printTable(v)
	}

	if err := v.Validate(); err != nil {
		problems = append(problems, err.Error())
	}
	switch {
	case s.cfg.FailOpen && len(problems) == 0:
		// The confirmed chunks were exact; the engine computes the rest.
		if len(skip) > 0 {
			s.res.CacheProblems = append(s.res.CacheProblems, fmt.Sprintf("verdict %s, plan %d of %d chunks",
				v.State, plan.Prefix, len(p.Hashes)))
			if err := s.recompute(sortedKeys(skip)); err != nil {
				return err
			}
		}
	case s.cfg.ExpectFail && v.State == wire.VerdictComplete && plan.Prefix == len(p.Hashes):
		problems = append(problems, "expected a failed verdict or a partial plan, got a complete restore of every chunk")
	case !s.cfg.ExpectFail && v.State != wire.VerdictComplete:
		problems = append(problems, fmt.Sprintf("verdict %s, failed chunks %v (%v)", v.State, v.Failed, v.FailedReasons()))
	case !s.cfg.ExpectFail && plan.Prefix != s.wantPrefix():
		problems = append(problems, fmt.Sprintf("plan covers %d of %d chunks, want %d", plan.Prefix, len(p.Hashes), s.wantPrefix()))
	}
	ok := len(problems) == 0
	s.logf("RESULT scenario=%s phase=%s verdict=%s failed=%s compare=%s ok=%v",
		p.Scenario.Name, s.cfg.Phase, v.State, intList(v.Failed), compareWord(rows), ok)
	if !ok {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

func (s *sim) printTable(v *wire.RestoreVerdict) {
	s.outMu.Lock()
	defer s.outMu.Unlock()
	fmt.Fprintf(s.cfg.Out, "\n%s  restore %s  verdict %s\n", s.plan.Scenario.Name, v.RestoreID, strings.ToUpper(v.State))
	tw := tabwriter.NewWriter(s.cfg.Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "RANK\tCHUNKS\tOBJECTS\tBYTES\tTIER\tPLACED\tVERDICT\tBYTE-COMPARE")
	failed := map[int]bool{}
	for _, c := range v.Failed {
		failed[c] = true
	}
	for _, r := range s.res.Ranks {
		verdict := v.State
		if v.State != wire.VerdictComplete {
			bad := map[int]bool{}
			for _, c := range r.ChunkList {
				if failed[c] {
					bad[c] = true
				}
			}
			for _, c := range r.FailedItem {
				bad[c] = true
			}
			switch {
			case r.Error != "":
				verdict = "failed: no reply " + intList(sortedKeys(bad))
			case len(bad) > 0:
				verdict = "failed " + intList(sortedKeys(bad))
			default:
				verdict = "ok (others failed)"
			}
		}
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%s\t%d/%d\t%s\t%s\n", r.Rank, r.Chunks, r.Items, human(r.Bytes), r.Tier,
			r.Placed, r.Items, verdict, r.Compare)
	}
	tw.Flush()
	fmt.Fprintln(s.cfg.Out)
}

func tierString(t map[wire.Tier]bool) string {
	var parts []string
	for _, tier := range []wire.Tier{wire.L1, wire.L2, wire.L3} {
		if t[tier] {
			parts = append(parts, tier.String())
		}
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, "+")
}

func human(n uint64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func intList(v []int) string {
	parts := make([]string, len(v))
	for i, x := range v {
		parts[i] = fmt.Sprint(x)
	}
	return "[" + strings.Join(parts, ",") + "]"
}

func sortedKeys(m map[int]bool) []int {
	out := make([]int, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Ints(out)
	return out
}

func mismatchChunks(m Mismatch) []int {
	out := make([]int, 0, len(m.Chunks))
	for c := range m.Chunks {
		out = append(out, c)
	}
	sort.Ints(out)
	return out
}

func compareWord(rows []RankResult) string {
	for _, r := range rows {
		if r.Mismatch != 0 || r.Outside != 0 {
			return "MISMATCH"
		}
	}
	return "ok"
}

// beginRestore asks for a restore plan. With PlanEncodingBinary the plan
// comes back in the compact binary form (wire/plan.go), which refers to
// req.Chunks by index; an error reply is JSON either way. The request goes
// in its binary form (wire/beginreport.go) unless jsonRequest.
func beginRestore(ctx context.Context, nc *nats.Conn, subject string, retry bus.Retry, req wire.RestoreBeginRequest,
	jsonRequest bool) (*wire.RestorePlan, error) {
	if req.PlanEncoding != wire.PlanEncodingBinary {
		return bus.CallRetry[wire.RestorePlan](ctx, nc, subject, req, retry)
	}
	var data []byte
	var err error
	if jsonRequest {
		data, err = json.Marshal(req)
	} else {
		data, err = req.MarshalBinary()
	}
	if err != nil {
		return nil, fmt.Errorf("encode request for %s: %w", subject, err)
	}
	var msg *nats.Msg
	if err := retry.Do(ctx, func(ctx context.Context) error {
		msg, err = nc.RequestWithContext(ctx, subject, data)
		return err
	}); err != nil {
		return nil, fmt.Errorf("request %s: %w", subject, err)
	}
	if wire.IsBinaryPlan(msg.Data) {
		return wire.DecodePlanBinary(msg.Data, req.Chunks)
	}
	var rep wire.Reply[wire.RestorePlan]
	if err := json.Unmarshal(msg.Data, &rep); err != nil {
		return nil, fmt.Errorf("decode reply from %s: %w", subject, errors.Join(err, wire.ErrMalformed))
	}
	if rep.Error != nil {
		return nil, rep.Error
	}
	return nil, fmt.Errorf("reply from %s is neither a binary plan nor an error: %w", subject, wire.ErrMalformed)
}

// retryPause is the pause between two tries of callRetrying when the
// answer carries no retry hint.
const retryPause = 100 * time.Millisecond

// callRetrying is bus.Call sent again while the answer is retryable
// (wire.Error.Retryable: code unavailable, as from a coordinator still
// opening its index, or internal), after the answer's retry hint
// (wire.Error.RetryAfter, else retryPause), until ctx ends. Any other
// answer, success or error, is returned as it came.
func callRetrying[T any](ctx context.Context, nc *nats.Conn, subject string, req any, r bus.Retry) (*T, error) {
	for {
		rep, err := bus.CallRetry[T](ctx, nc, subject, req, r)
		var we *wire.Error
		if err == nil || !errors.As(err, &we) || !we.Retryable() {
			return rep, err
		}
		t := time.NewTimer(we.RetryAfter(retryPause))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("%s still answering %w when the call ended: %w", subject, err, ctx.Err())
		case <-t.C:
		}
	}
}

// statesLeft returns, for Config.StateAtEnd, the chunks of group gi that a
// restore of prefix chunks does not write: a recurrent group's chunks
// before the last, in a spec that also has other groups (the coordinator's
// rule, index.LookupResult.Needed); nil for every other group.
func (s *sim) statesLeft(prefix int) func(gi int) map[int]bool {
	groups := s.plan.R.Groups
	return func(gi int) map[int]bool {
		if !statesMixed(groups) || groups[gi].Kind != dcp.Recurrent {
			return nil
		}
		out := map[int]bool{}
		for c := range prefix - 1 {
			out[c] = true
		}
		return out
	}
}

// statesMixed reports whether a spec has recurrent groups beside others
// (where StateAtEnd and stores without a state apply).
func statesMixed(groups []dcp.Group) bool {
	states := 0
	for _, g := range groups {
		if g.Kind == dcp.Recurrent {
			states++
		}
	}
	return states > 0 && states < len(groups)
}

// wantPrefix is the prefix a restore of the stored prompt must cover: every
// chunk, or with Config.StateEvery up to the last chunk stored with its
// state.
func (s *sim) wantPrefix() int {
	n, k := len(s.plan.Hashes), s.cfg.StateEvery
	if k <= 0 || !statesMixed(s.plan.R.Groups) {
		return n
	}
	return n / k * k
}
