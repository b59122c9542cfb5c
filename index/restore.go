package index

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// The restore verdict (C5) as a pure state machine: no goroutines, no I/O,
// no clock. The coordinator owns the timer and calls Expire; it also owns
// the locking (a Restore is not safe for concurrent use).
//
// A restore is complete only when every expected (chunk, rank, shard,
// group) has been confirmed by its rank with the checksum recorded at store
// time. It fails, with the sorted union of the failed chunks, as soon as
// every expectation has been reported (or the deadline has passed) and at
// least one did not confirm: the rank reported a failure, reported a sum
// other than the recorded one or no sum (0), or had not reported by the
// deadline. A recorded sum of 0 is refused at NewRestore. A
// verdict, once complete or failed, never changes.

// Expect is one object a restore needs confirmed.
type Expect struct {
	Chunk int    // index into the restore's chunks
	Rank  int    // TP rank that reads the object and must confirm it
	Shard int    // object's shard
	Group int    // object's group
	Sum   uint64 // kvsum64 recorded at store time
}

// ExpectFromLookup returns the expectations of restoring chunks [0, n) of a
// lookup's prefix (n <= res.Prefix), with the checksums of the sources the
// lookup chose; with stateAtEnd, a recurrent group's for the last chunk
// only (LookupResult.Needed).
func ExpectFromLookup(res *LookupResult, n int, stateAtEnd bool) []Expect {
	n = min(n, res.Prefix)
	out := make([]Expect, 0, n*len(res.Expectations))
	for i := range n {
		for j, e := range res.Expectations {
			if res.Needed(i, j, n, stateAtEnd) {
				out = append(out, Expect{Chunk: i, Rank: e.Rank, Shard: e.Shard, Group: e.Group, Sum: res.Source(i, j).Sum})
			}
		}
	}
	return out
}

// Verdict is a restore's state. Failed and Reasons are final only when
// State is not wire.VerdictPending; while pending they list the chunks
// already known to have failed.
type Verdict struct {
	State string // wire.VerdictPending, wire.VerdictComplete or wire.VerdictFailed
	// Failed lists the failed chunk indexes, sorted; Reasons[i] says why
	// Failed[i] failed (its first failed expectation).
	Failed    []int
	Reasons   []string
	Expected  int // expectations
	Confirmed int // expectations confirmed with the recorded checksum
	Reported  int // expectations reported (confirmed or not)
	// BytesWrong counts the failed chunks with an object whose bytes were
	// wrong: a rank reported it ReasonCorrupt (its verification failed),
	// or confirmed it with a checksum other than the recorded one (or 0).
	// The engine recomputes them; an operator looks for a bad disk, bad
	// memory or a bug. The other failed chunks were missing, late, ...
	BytesWrong int
	// GroupReasons[i] names the reason of every group of chunk Failed[i]
	// that failed, by group (wire.RestoreVerdict.GroupReasons); nil when
	// no chunk failed in more than one group.
	GroupReasons [][]string
}

// ReasonCorrupt is the wire.ItemResult reason of an object whose bytes
// failed their checksum at the rank (transfer.ReasonCorrupt).
const ReasonCorrupt = "corrupt"

// Final reports whether the verdict can no longer change.
func (v Verdict) Final() bool { return v.State != wire.VerdictPending }

// ReportOutcome is what Report did with one rank's report.
type ReportOutcome struct {
	Accepted   int // results recorded
	Duplicates int // results for expectations already reported: ignored
	Late       int // results after the verdict was final: ignored
	Rejected   int // results for expectations that do not exist
	State      string
}

type restoreSlot struct {
	chunk, rank, group int
}

// groupCause is why one group of a chunk failed: its first failed
// expectation, or its first one whose bytes were wrong once there is one.
type groupCause struct {
	group  int
	reason string
	wrong  bool
}

type expectState struct {
	Expect
	reported bool
	ok       bool
	// No reason: the chunk's and its groups' keep it (fail). Without a
	// pointer the slice is not scanned by the collector, and a 1,024-chunk
	// restore of 4 ranks fills 48 bytes an expectation instead of 64.
}

// Restore tracks one restore's reports.
type Restore struct {
	id       string
	ns       dcp.Namespace
	chunks   []dcp.ChunkHash
	deadline time.Time

	exp []expectState
	// byChunk[start[c]:start[c+1]] are the indexes into exp of chunk c's
	// expectations, in the order given: slot finds one by a scan (a chunk
	// has one a rank and group, a handful), where a map of every
	// expectation cost NewRestore most of its time (issue 25.4: 4,096 of
	// them at every 1,024-chunk restore of 4 ranks). many holds the slots
	// of the chunks with more than scanMax.
	start   []int
	byChunk []int
	many    map[restoreSlot]int
	ranks   map[int]bool

	state      string
	reported   int
	confirmed  int
	chunkFail  []string // per chunk: first failure reason, "" if none
	chunkWrong []bool   // per chunk: an object of it had wrong bytes (see Verdict.BytesWrong)
	duplicates int
	rejected   int
	late       int

	// chunkCauses, per chunk: one reason per failed group, by group; nil
	// until a group of the chunk fails.
	chunkCauses [][]groupCause
}

// NewRestore starts tracking a restore of chunks (the prefix being
// restored) in namespace ns. expect lists every (chunk, rank, shard,
// group) that must be confirmed, with its recorded checksum; each rank
// reads one shard per group, so (chunk, rank, group) must be unique, and
// every chunk needs at least one expectation. deadline is when Expire
// turns missing reports into failures.
func NewRestore(id string, ns dcp.Namespace, chunks []dcp.ChunkHash, expect []Expect, deadline time.Time) (*Restore, error) {
	switch {
	case len(chunks) == 0:
		return nil, fmt.Errorf("restore %q: no chunks: %w", id, ErrRestore)
	case deadline.IsZero():
		return nil, fmt.Errorf("restore %q: no deadline: %w", id, ErrRestore)
	}
	r := &Restore{
		id: id, ns: ns, chunks: slices.Clone(chunks), deadline: deadline,
		exp:        make([]expectState, len(expect)),
		start:      make([]int, len(chunks)+1),
		byChunk:    make([]int, len(expect)),
		ranks:      make(map[int]bool),
		state:      wire.VerdictPending,
		chunkFail:  make([]string, len(chunks)),
		chunkWrong: make([]bool, len(chunks)),

		chunkCauses: make([][]groupCause, len(chunks)),
	}
	for i, e := range expect {
		switch {
		case e.Chunk < 0 || e.Chunk >= len(chunks):
			return nil, fmt.Errorf("restore %q: expectation %d names chunk %d of %d: %w", id, i, e.Chunk, len(chunks), ErrRestore)
		case e.Rank < 0 || e.Rank > dcp.MaxTP:
			return nil, fmt.Errorf("restore %q: expectation %d names TP rank %d, want 0..%d: %w", id, i, e.Rank, dcp.MaxTP, ErrRestore)
		case e.Shard < 0 || e.Shard > 0xffff || e.Group < 0 || e.Group > 0xffff:
			return nil, fmt.Errorf("restore %q: expectation %d has shard %d group %d, want 0..65535: %w",
				id, i, e.Shard, e.Group, ErrRestore)
		case e.Sum == 0:
			// 0 is what an unset sum looks like: nothing could confirm it.
			return nil, fmt.Errorf("restore %q: expectation %d (chunk %d rank %d group %d) has recorded sum 0, which no placed bytes can be checked against: %w",
				id, i, e.Chunk, e.Rank, e.Group, ErrRestore)
		}
		r.exp[i] = expectState{Expect: e}
		r.ranks[e.Rank] = true
		r.start[e.Chunk+1]++
	}
	for c := range chunks {
		if r.start[c+1] == 0 {
			return nil, fmt.Errorf("restore %q: chunk %d has no expectation: %w", id, c, ErrRestore)
		}
		r.start[c+1] += r.start[c]
	}
	next := slices.Clone(r.start[:len(chunks)])
	for i, e := range expect {
		r.byChunk[next[e.Chunk]] = i
		next[e.Chunk]++
	}
	for c := range chunks {
		if err := r.indexChunk(c); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// scanMax is the most expectations of a chunk that slot finds by a scan.
const scanMax = 16

// indexChunk checks that no two of chunk c's expectations name the same
// rank and group, and puts the slots of a chunk of more than scanMax
// expectations in r.many.
func (r *Restore) indexChunk(c int) error {
	idx := r.byChunk[r.start[c]:r.start[c+1]]
	dup := func(j, i int) error {
		e := r.exp[i]
		return fmt.Errorf("restore %q: expectations %d and %d both name chunk %d rank %d group %d: %w",
			r.id, j, i, e.Chunk, e.Rank, e.Group, ErrRestore)
	}
	if len(idx) > scanMax {
		if r.many == nil {
			r.many = make(map[restoreSlot]int)
		}
		for _, i := range idx {
			e := &r.exp[i]
			s := restoreSlot{c, e.Rank, e.Group}
			if j, ok := r.many[s]; ok {
				return dup(j, i)
			}
			r.many[s] = i
		}
		return nil
	}
	for b, i := range idx {
		for _, j := range idx[:b] {
			if r.exp[j].Rank == r.exp[i].Rank && r.exp[j].Group == r.exp[i].Group {
				return dup(j, i)
			}
		}
	}
	return nil
}

// slot returns the index into r.exp of the expectation of (chunk, rank,
// group), if there is one.
func (r *Restore) slot(chunk, rank, group int) (int, bool) {
	if chunk < 0 || chunk >= len(r.chunks) {
		return 0, false
	}
	idx := r.byChunk[r.start[chunk]:r.start[chunk+1]]
	if len(idx) > scanMax {
		i, ok := r.many[restoreSlot{chunk, rank, group}]
		return i, ok
	}
	for _, i := range idx {
		if e := &r.exp[i]; e.Rank == rank && e.Group == group {
			return i, true
		}
	}
	return 0, false
}

// ID returns the restore's id.
func (r *Restore) ID() string { return r.id }

// Namespace returns the restore's namespace.
func (r *Restore) Namespace() dcp.Namespace { return r.ns }

// Chunks returns the number of chunks being restored.
func (r *Restore) Chunks() int { return len(r.chunks) }

// Deadline returns the restore's deadline.
func (r *Restore) Deadline() time.Time { return r.deadline }

// Counts returns the results ignored so far: duplicates, results after the
// verdict was final, and results rejected as unexpected.
func (r *Restore) Counts() (duplicates, late, rejected int) { return r.duplicates, r.late, r.rejected }

// Report records one rank's results; rank is the reporter's TP rank (the
// caller has checked the reporter belongs to the restoring instance). Each
// result names a chunk index and a group; the rank's expectation for that (chunk, group) is confirmed when
// the result is OK with the recorded checksum and failed otherwise. The
// first result for an expectation counts; later ones are duplicates and
// ignored. A report from a rank with no expectation is rejected whole;
// results naming an unexpected (chunk, group) are rejected one by one,
// the others still count. Both give an error wrapping ErrUnexpectedReport.
func (r *Restore) Report(rank int, results []wire.ItemResult) (ReportOutcome, error) {
	var o ReportOutcome
	if r.state != wire.VerdictPending {
		o.Late, o.State = len(results), r.state
		r.late += o.Late
		return o, nil
	}
	if !r.ranks[rank] {
		o.Rejected, o.State = len(results), r.state
		r.rejected += o.Rejected
		return o, fmt.Errorf("restore %q: rank %d is not expected to report: %w", r.id, rank, ErrUnexpectedReport)
	}
	var bad []string
	for _, res := range results {
		i, ok := r.slot(res.Chunk, rank, res.Group)
		if !ok {
			o.Rejected++
			if len(bad) < 5 {
				bad = append(bad, fmt.Sprintf("chunk %d group %d", res.Chunk, res.Group))
			}
			continue
		}
		e := &r.exp[i]
		if e.reported {
			o.Duplicates++
			continue
		}
		o.Accepted++
		e.reported = true
		r.reported++
		switch {
		case !res.OK:
			reason := res.Reason
			if reason == "" {
				reason = "failed"
			}
			r.fail(e, fmt.Sprintf("rank %d group %d shard %d: %s", rank, e.Group, e.Shard, reason), reason == ReasonCorrupt)
		case res.Sum == 0:
			// A confirmation without a sum confirms nothing (issue 11.8).
			r.fail(e, fmt.Sprintf("rank %d group %d shard %d: confirmed with sum 0 (no sum computed), recorded %#016x",
				rank, e.Group, e.Shard, e.Sum), true)
		case res.Sum != e.Sum:
			r.fail(e, fmt.Sprintf("rank %d group %d shard %d: checksum mismatch: placed %#016x, recorded %#016x",
				rank, e.Group, e.Shard, res.Sum, e.Sum), true)
		default:
			e.ok = true
			r.confirmed++
		}
	}
	r.duplicates += o.Duplicates
	r.rejected += o.Rejected
	if r.reported == len(r.exp) {
		r.finish()
	}
	o.State = r.state
	if o.Rejected > 0 {
		return o, fmt.Errorf("restore %q: rank %d reported %d unexpected results (%v): %w",
			r.id, rank, o.Rejected, bad, ErrUnexpectedReport)
	}
	return o, nil
}

// fail records e's failure; wrong says its bytes were wrong (see
// Verdict.BytesWrong). The chunk keeps its first reason, and each of its
// groups keeps its own: the first, or the first with wrong bytes, which an
// operator must see and the engine counts (issue 27: a second group's
// corrupt object was hidden behind the first group's missing one).
func (r *Restore) fail(e *expectState, reason string, wrong bool) {
	c := e.Chunk
	if r.chunkFail[c] == "" {
		r.chunkFail[c] = reason
	}
	r.chunkWrong[c] = r.chunkWrong[c] || wrong
	causes := r.chunkCauses[c]
	i, found := slices.BinarySearchFunc(causes, e.Group, func(x groupCause, g int) int { return x.group - g })
	switch {
	case !found:
		r.chunkCauses[c] = slices.Insert(causes, i, groupCause{group: e.Group, reason: reason, wrong: wrong})
	case wrong && !causes[i].wrong:
		causes[i] = groupCause{group: e.Group, reason: reason, wrong: true}
	}
}

// Expire is the deadline check: at or after the deadline, every
// expectation not yet reported fails ("no report by the deadline") and the
// verdict becomes final. Before the deadline, and after a final verdict,
// it changes nothing. It returns the verdict.
func (r *Restore) Expire(now time.Time) Verdict {
	if r.state == wire.VerdictPending && !now.Before(r.deadline) {
		// One reason string per (rank, group, shard), not per expectation:
		// an abandoned restore of 1,024 chunks on 4 ranks has 4 of them
		// and 4,096 expectations, and the coordinator expires every
		// abandoned begin.
		type source struct{ rank, group, shard int }
		var reasons map[source]string
		for i := range r.exp {
			e := &r.exp[i]
			if e.reported {
				continue
			}
			k := source{e.Rank, e.Group, e.Shard}
			why, ok := reasons[k]
			if !ok {
				why = fmt.Sprintf("rank %d group %d shard %d: no report by the deadline", e.Rank, e.Group, e.Shard)
				if reasons == nil {
					reasons = make(map[source]string, 4)
				}
				reasons[k] = why
			}
			r.fail(e, why, false)
		}
		r.finish()
	}
	return r.Verdict()
}

func (r *Restore) finish() {
	if r.confirmed == len(r.exp) {
		r.state = wire.VerdictComplete
		return
	}
	r.state = wire.VerdictFailed
}

// Verdict returns the restore's current verdict.
func (r *Restore) Verdict() Verdict {
	v := Verdict{State: r.state, Expected: len(r.exp), Confirmed: r.confirmed, Reported: r.reported}
	several := false
	for i, reason := range r.chunkFail {
		if reason != "" {
			if r.chunkWrong[i] {
				v.BytesWrong++
			}
			v.Failed = append(v.Failed, i)
			v.Reasons = append(v.Reasons, fmt.Sprintf("chunk %d: %s", i, reason))
			several = several || len(r.chunkCauses[i]) > 1
		}
	}
	if several {
		// Only then: a verdict whose chunks each failed in one group says
		// everything in Reasons and stays the bytes older engines read.
		v.GroupReasons = make([][]string, len(v.Failed))
		for j, c := range v.Failed {
			for _, gc := range r.chunkCauses[c] {
				v.GroupReasons[j] = append(v.GroupReasons[j], gc.reason)
			}
		}
	}
	return v
}

// Wire returns the verdict as the restore protocol's message.
func (v Verdict) Wire(id string, prefix int) wire.RestoreVerdict {
	return wire.RestoreVerdict{RestoreID: id, State: v.State, Prefix: prefix, Failed: v.Failed, Reasons: v.Reasons,
		GroupReasons: v.GroupReasons}
}
