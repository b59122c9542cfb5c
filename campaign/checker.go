package campaign

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/wire"
)

// Outcome classifies one engine run (store, restore, byte compare).
type Outcome string

// Restore outcomes. WrongComplete and WrongUnnamed are correctness
// failures; the others are what a system under faults may legitimately do.
const (
	// Complete: verdict COMPLETE over the whole prompt, every byte exact.
	Complete Outcome = "complete"
	// CompletePartial: verdict COMPLETE over a planned prefix shorter than
	// the prompt (the rest is recomputed), every planned byte exact.
	CompletePartial Outcome = "complete_partial"
	// Failed: a failed verdict naming its chunks; every chunk it did not
	// name byte-exact.
	Failed Outcome = "failed"
	// Refused: the coordinator planned nothing (a reader rank not alive).
	Refused Outcome = "refused"
	// Pending: no final verdict in time; the engine trusts nothing.
	Pending Outcome = "pending"
	// NoVerdict: the run ended before a verdict (a store or a request
	// failed under a fault); nothing was claimed.
	NoVerdict Outcome = "no_verdict"
	// WrongComplete: COMPLETE although a byte differs, a byte outside the
	// block table changed, or a rank reported failure. Must never happen.
	WrongComplete Outcome = "WRONG_COMPLETE"
	// WrongUnnamed: a failed verdict, and a chunk it did not name differs
	// (or a rank's failed chunk is not named). Must never happen.
	WrongUnnamed Outcome = "WRONG_UNNAMED"
)

// Classify judges one engine run from its result (nil: the run did not
// get that far). It is pure; problem says what was wrong for the two wrong
// outcomes.
func Classify(res *enginesim.Result) (o Outcome, problem string) {
	if res == nil || res.Verdict == "" {
		return NoVerdict, ""
	}
	var bad []string
	rankFailed := map[int]bool{} // chunks some rank reported not placed
	for _, r := range res.Ranks {
		if r.Mismatch > 0 || r.Outside > 0 {
			bad = append(bad, fmt.Sprintf("rank %d: %s", r.Rank, r.Compare))
		}
		// A chunk the rank answered "not placed" must not be COMPLETE.
		// A retrieve whose reply the engine did not get in time (r.Error)
		// claims nothing: the rank may have placed and reported every
		// object, and the byte comparison judges what it left.
		for _, c := range r.FailedItem {
			rankFailed[c] = true
		}
	}
	switch res.Verdict {
	case wire.VerdictComplete:
		if len(rankFailed) > 0 {
			bad = append(bad, fmt.Sprintf("ranks reported chunks %v not placed", keys(rankFailed)))
		}
		if len(bad) > 0 {
			return WrongComplete, fmt.Sprintf("verdict COMPLETE for restore %s (%s, %d chunks): %s",
				res.RestoreID, res.Namespace, res.Chunks, strings.Join(bad, "; "))
		}
		if res.Prefix < res.Chunks {
			return CompletePartial, ""
		}
		return Complete, ""
	case wire.VerdictFailed:
		named := map[int]bool{}
		for _, c := range res.Failed {
			named[c] = true
		}
		for c := range rankFailed {
			if !named[c] && c < res.Prefix {
				bad = append(bad, fmt.Sprintf("chunk %d failed on a rank but the verdict does not name it", c))
			}
		}
		if len(res.Failed) == 0 {
			bad = append(bad, "failed verdict names no chunk")
		}
		if len(bad) > 0 {
			return WrongUnnamed, fmt.Sprintf("verdict FAILED %v for restore %s (%s): %s", res.Failed, res.RestoreID,
				res.Namespace, strings.Join(bad, "; "))
		}
		return Failed, ""
	case wire.VerdictRefused:
		if len(bad) > 0 {
			return WrongUnnamed, fmt.Sprintf("verdict REFUSED for restore %s, yet: %s", res.RestoreID, strings.Join(bad, "; "))
		}
		return Refused, ""
	}
	return Pending, ""
}

func keys(m map[int]bool) []int {
	out := make([]int, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Ints(out)
	return out
}

// placementID names one copy of one object in the index.
type placementID struct {
	Key    string
	Holder string
	Tier   wire.Tier
}

type seenPlacement struct {
	inc  uint64
	at   time.Time
	size uint64
	sum  uint64
}

// ledger records what the checker saw: placements the coordinator
// exposed (acknowledged: the index serves only what bbolt committed),
// removals the ranks published, and the faults that may explain a loss.
type ledger struct {
	// mu guards the following.
	mu       sync.Mutex
	seen     map[placementID]seenPlacement
	removed  map[placementID]time.Time // last Removed event seen
	l2Hit    map[string]time.Time      // L2 file faults by object key
	l3Hit    map[string]time.Time      // L3 object faults by object key
	rankHits map[string][]time.Time    // faults that may fence or resync a rank's placements
	coordHit []time.Time               // coordinator kills and stops
}

func newLedger() *ledger {
	return &ledger{seen: map[placementID]seenPlacement{}, removed: map[placementID]time.Time{},
		l2Hit: map[string]time.Time{}, l3Hit: map[string]time.Time{}, rankHits: map[string][]time.Time{}}
}

func (l *ledger) see(p placementID, inc, size, sum uint64, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.seen[p]; !ok {
		l.seen[p] = seenPlacement{inc: inc, at: at, size: size, sum: sum}
	}
}

func (l *ledger) remove(p placementID, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.removed[p] = at
}

func (l *ledger) hitL2(key string, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.l2Hit[key] = at
}

func (l *ledger) hitL3(key string, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.l3Hit[key] = at
}

func (l *ledger) hitRank(rank string, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.rankHits[rank] = append(l.rankHits[rank], at)
}

func (l *ledger) hitCoordinator(at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.coordHit = append(l.coordHit, at)
}

// Explanation says why an acknowledged placement is gone, "" if nothing
// recorded explains it.
func (l *ledger) explain(p placementID, s seenPlacement, curInc uint64) string {
	if t, ok := l.removed[p]; ok && !t.Before(s.at.Add(-time.Minute)) {
		return "removed_event"
	}
	switch p.Tier {
	case wire.L2:
		if _, ok := l.l2Hit[p.Key]; ok {
			return "l2_fault"
		}
		return ""
	case wire.L3:
		if _, ok := l.l3Hit[p.Key]; ok {
			return "l3_fault"
		}
		return ""
	}
	// L1: gone with its incarnation (fenced at the restart), or fenced
	// while the rank was unreachable (stopped, partitioned, its events
	// dropped: a dead member's L1 is fenced, a gap resyncs).
	if curInc != s.inc {
		return "fenced_restart"
	}
	for _, t := range l.rankHits[p.Holder] {
		if t.After(s.at.Add(-5 * time.Second)) {
			return "fenced_or_resynced"
		}
	}
	return ""
}

// Lost is one acknowledged placement the checker could not account for.
type Lost struct {
	Key    string `json:"key"`
	Holder string `json:"holder"`
	Tier   string `json:"tier"`
	Why    string `json:"why"`
}

// judgePlacements compares every placement seen with the final index and
// the final inventories: present, or gone from the rank too and explained.
// index and inv map holder -> placementID -> present; incs is each rank's
// final incarnation.
func (l *ledger) judgePlacements(index, inv map[placementID]bool, incs map[string]uint64) (lost []Lost, explained map[string]int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	explained = map[string]int{}
	ids := make([]placementID, 0, len(l.seen))
	for p := range l.seen {
		ids = append(ids, p)
	}
	sort.Slice(ids, func(i, j int) bool {
		if ids[i].Key != ids[j].Key {
			return ids[i].Key < ids[j].Key
		}
		if ids[i].Holder != ids[j].Holder {
			return ids[i].Holder < ids[j].Holder
		}
		return ids[i].Tier < ids[j].Tier
	})
	for _, p := range ids {
		s := l.seen[p]
		if index[p] {
			explained["present"]++
			continue
		}
		if inv[p] {
			lost = append(lost, Lost{Key: p.Key, Holder: p.Holder, Tier: p.Tier.String(),
				Why: "the rank still holds it but the index does not"})
			continue
		}
		if why := l.explain(p, s, incs[p.Holder]); why != "" {
			explained[why]++
			continue
		}
		lost = append(lost, Lost{Key: p.Key, Holder: p.Holder, Tier: p.Tier.String(),
			Why: fmt.Sprintf("gone from index and rank; seen at incarnation %d, no removal event, fence or fault recorded", s.inc)})
	}
	return lost, explained
}
