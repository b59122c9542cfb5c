package campaign

import (
	"context"
	"fmt"
	"time"

	"github.com/kvtier/kvtier/wire"
)

// quiesceAndCheck waits until the index equals every rank's inventory
// (resyncs after the last faults finish), then runs the final checks.
func (r *runner) quiesceAndCheck(ctx context.Context) {
	deadline := time.Now().Add(r.cfg.Quiesce)
	var diffs []string
	var index, inv map[placementID]bool
	var incs map[string]uint64
	for {
		var err error
		index, inv, incs, diffs, err = r.compareIndex(ctx)
		if err == nil && len(diffs) == 0 {
			break
		}
		if err != nil {
			diffs = []string{err.Error()}
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Second)
	}
	r.rep.IndexEqualsInventory = len(diffs) == 0
	if len(diffs) > 20 {
		diffs = append(diffs[:20], fmt.Sprintf("... %d more", len(diffs)-20))
	}
	r.rep.InventoryDiffs = diffs
	if index != nil {
		lost, ex := r.led.judgePlacements(index, inv, incs)
		r.rep.LostAcked, r.rep.Explained = len(lost), ex
		if len(lost) > 50 {
			lost = lost[:50]
		}
		r.rep.Lost = lost
		r.led.mu.Lock()
		r.rep.AckedSeen = len(r.led.seen)
		r.led.mu.Unlock()
	} else {
		r.problem("no final index snapshot: the acknowledged placements were not judged")
	}
	// Verify is served by the raft leader alone: retried across an
	// election.
	var v *wire.AdminVerifyReply
	var err error
	for deadline := time.Now().Add(30 * time.Second); ; {
		v, err = adminCall[wire.AdminVerifyReply](ctx, r.c, wire.AdminVerify, struct{}{})
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(time.Second)
	}
	switch {
	case err != nil:
		r.rep.VerifyProblems = []string{err.Error()}
	default:
		r.rep.VerifyOK = v.OK
		r.rep.VerifyProblems = v.Mismatches
	}
}

// compareIndex takes the final index (every copy of every prompt's
// objects) and every rank's inventory and lists their differences.
func (r *runner) compareIndex(ctx context.Context) (index, inv map[placementID]bool, incs map[string]uint64, diffs []string, err error) {
	type val struct{ size, sum uint64 }
	idx := map[placementID]val{}
	r.mu.Lock()
	ps := append([]*prompt(nil), r.prompts...)
	r.mu.Unlock()
	done := map[string]bool{}
	for _, p := range ps {
		k := p.ns.String() + fmt.Sprint(p.hashes)
		if done[k] {
			continue
		}
		done[k] = true
		objs, err := r.objects(ctx, p)
		if err != nil {
			return nil, nil, nil, nil, fmt.Errorf("index objects: %w", err)
		}
		for _, o := range objs {
			for _, pl := range o.Placements {
				idx[placementID{Key: o.Key.String(), Holder: pl.Holder.String(), Tier: pl.Tier}] = val{pl.Size, pl.Sum}
			}
		}
	}
	ranks, err := adminCall[wire.AdminRanksReply](ctx, r.c, wire.AdminRanks, struct{}{})
	if err != nil {
		return nil, nil, nil, nil, fmt.Errorf("admin ranks: %w", err)
	}
	incs = map[string]uint64{}
	invs := map[placementID]val{}
	for t := range r.cfg.Ranks {
		in, err := r.c.inventory(ctx, t)
		if err != nil {
			return nil, nil, nil, nil, err
		}
		name := r.c.rank(t).String()
		incs[name] = in.Incarnation
		var n1, n2 int64
		for _, o := range in.Objects {
			invs[placementID{Key: o.Key.String(), Holder: name, Tier: o.Tier}] = val{o.Size, o.Sum}
			switch o.Tier {
			case wire.L1:
				n1++
			case wire.L2:
				n2++
			}
		}
		for _, ar := range ranks.Ranks {
			if ar.Rank.String() != name {
				continue
			}
			if ar.Incarnation != in.Incarnation || ar.L1Objects != n1 || ar.L2Objects != n2 {
				diffs = append(diffs, fmt.Sprintf("rank %s: index incarnation %d with %d L1 + %d L2 objects, inventory incarnation %d with %d + %d",
					name, ar.Incarnation, ar.L1Objects, ar.L2Objects, in.Incarnation, n1, n2))
			}
		}
	}
	for p, v := range idx {
		if w, ok := invs[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("index has %s on %s %s, the rank does not", p.Key, p.Holder, p.Tier))
		} else if w != v {
			diffs = append(diffs, fmt.Sprintf("%s on %s %s: index size %d sum %#x, rank %d %#x", p.Key, p.Holder, p.Tier, v.size, v.sum, w.size, w.sum))
		}
	}
	for p := range invs {
		if _, ok := idx[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("rank %s holds %s %s, the index does not", p.Holder, p.Key, p.Tier))
		}
	}
	index, inv = map[placementID]bool{}, map[placementID]bool{}
	for p := range idx {
		index[p] = true
	}
	for p := range invs {
		inv[p] = true
	}
	return index, inv, incs, diffs, nil
}
