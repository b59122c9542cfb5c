package index_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

var t0 = time.Unix(1000, 0)

func TestRestoreVerdict(t *testing.T) {
	// Two chunks; ranks 0 and 1 each read shard = rank of group 0.
	exp := []index.Expect{
		{Chunk: 0, Rank: 0, Shard: 0, Group: 0, Sum: 10},
		{Chunk: 0, Rank: 1, Shard: 1, Group: 0, Sum: 11},
		{Chunk: 1, Rank: 0, Shard: 0, Group: 0, Sum: 20},
		{Chunk: 1, Rank: 1, Shard: 1, Group: 0, Sum: 21},
	}
	ok := func(c int, sum uint64) wire.ItemResult {
		return wire.ItemResult{Chunk: c, Group: 0, OK: true, Sum: sum}
	}
	newR := func() *index.Restore {
		r, err := index.NewRestore("r", dcp.Namespace{}, chunks(2), exp, t0.Add(time.Second))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	cases := []struct {
		name    string
		reports map[int][]wire.ItemResult
		expire  bool
		state   string
		failed  []int
	}{
		{"all confirmed", map[int][]wire.ItemResult{0: {ok(0, 10), ok(1, 20)}, 1: {ok(1, 21), ok(0, 11)}}, false, wire.VerdictComplete, nil},
		{"one rank missing", map[int][]wire.ItemResult{0: {ok(0, 10), ok(1, 20)}}, false, wire.VerdictPending, nil},
		{"one rank missing, expired", map[int][]wire.ItemResult{0: {ok(0, 10), ok(1, 20)}}, true, wire.VerdictFailed, []int{0, 1}},
		{"wrong checksum", map[int][]wire.ItemResult{0: {ok(0, 10), ok(1, 20)}, 1: {ok(0, 11), ok(1, 99)}}, false, wire.VerdictFailed, []int{1}},
		{"reported failure", map[int][]wire.ItemResult{0: {{Chunk: 0, OK: false, Reason: "corrupt"}, ok(1, 20)}, 1: {ok(0, 11), ok(1, 21)}}, false, wire.VerdictFailed, []int{0}},
		{"partial, expired", map[int][]wire.ItemResult{0: {ok(0, 10), ok(1, 20)}, 1: {ok(0, 11)}}, true, wire.VerdictFailed, []int{1}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newR()
			for rank, res := range c.reports {
				if _, err := r.Report(rank, res); err != nil {
					t.Fatal(err)
				}
			}
			v := r.Verdict()
			if c.expire {
				if early := r.Expire(t0); early.State != wire.VerdictPending && v.State == wire.VerdictPending {
					t.Fatalf("expired before the deadline: %+v", early)
				}
				v = r.Expire(t0.Add(time.Second))
			}
			if v.State != c.state || (v.Final() && !slices.Equal(v.Failed, c.failed)) {
				t.Fatalf("verdict %+v, want %s %v", v, c.state, c.failed)
			}
			if v.State == wire.VerdictFailed && len(v.Reasons) != len(v.Failed) {
				t.Fatalf("reasons %v for failed %v", v.Reasons, v.Failed)
			}
			wv := v.Wire("r", 2)
			if err := wv.Validate(); err != nil {
				t.Fatal(err)
			}
		})
	}

	// Duplicates are ignored and counted; the first result counts.
	r := newR()
	r.Report(0, []wire.ItemResult{ok(0, 10)})
	o, err := r.Report(0, []wire.ItemResult{{Chunk: 0, OK: false, Reason: "late retry"}, ok(1, 20)})
	if err != nil || o.Duplicates != 1 || o.Accepted != 1 {
		t.Fatalf("duplicate: %+v %v", o, err)
	}
	// Unexpected rank: rejected whole. Unexpected chunk: rejected alone.
	if _, err := r.Report(5, []wire.ItemResult{ok(0, 10)}); !errors.Is(err, index.ErrUnexpectedReport) {
		t.Fatalf("unexpected rank: %v", err)
	}
	o, err = r.Report(1, []wire.ItemResult{ok(7, 1), ok(0, 11), {Chunk: 0, Group: 3, OK: true}})
	if !errors.Is(err, index.ErrUnexpectedReport) || o.Rejected != 2 || o.Accepted != 1 {
		t.Fatalf("unexpected chunk: %+v %v", o, err)
	}
	o, _ = r.Report(1, []wire.ItemResult{ok(1, 21)})
	if o.State != wire.VerdictComplete {
		t.Fatalf("state %+v", o)
	}
	// After the verdict, reports are late and change nothing.
	o, _ = r.Report(1, []wire.ItemResult{{Chunk: 1, OK: false}})
	if o.Late != 1 || r.Verdict().State != wire.VerdictComplete {
		t.Fatalf("late report: %+v", o)
	}
	if v := r.Expire(t0.Add(time.Hour)); v.State != wire.VerdictComplete {
		t.Fatalf("expire after complete: %+v", v)
	}
	if d, l, rej := r.Counts(); d != 1 || l != 1 || rej != 3 {
		t.Fatalf("counts %d %d %d", d, l, rej)
	}

	// Invalid expectation sets.
	bad := [][]index.Expect{
		{{Chunk: 2, Rank: 0}},
		{{Chunk: 0, Rank: 0}, {Chunk: 0, Rank: 0, Shard: 1}},
		{{Chunk: 0, Rank: -1}},
		{{Chunk: 0, Rank: 0}}, // chunk 1 uncovered
	}
	// Two expectations of one (chunk, rank, group), with their sums set so
	// that nothing else is wrong: in a chunk of two (found by the scan) and
	// in a chunk of 21 (more than a scan looks through).
	wide := func(n, dupOf int) []index.Expect {
		var e []index.Expect
		for r := range n {
			e = append(e, index.Expect{Chunk: 0, Rank: r, Shard: r, Sum: uint64(r + 1)})
		}
		e = append(e, index.Expect{Chunk: 0, Rank: dupOf, Shard: dupOf, Sum: 99}, index.Expect{Chunk: 1, Rank: 0, Sum: 7})
		return e
	}
	bad = append(bad, wide(1, 0), wide(20, 13), wide(20, 0))
	for i, e := range bad {
		if _, err := index.NewRestore("b", dcp.Namespace{}, chunks(2), e, t0); !errors.Is(err, index.ErrRestore) {
			t.Fatalf("bad set %d: %v", i, err)
		}
	}
	if _, err := index.NewRestore("b", dcp.Namespace{}, chunks(2), exp, time.Time{}); !errors.Is(err, index.ErrRestore) {
		t.Fatal("no deadline accepted")
	}
}

// TestRestoreVerdictProperty: random expectation sets and random report
// streams (correct, wrong sums, failures, missing, duplicates, unexpected,
// out of order, with or without expiry at a random point). The verdict is
// complete iff every expectation was first reported OK with its recorded
// sum, and the failed chunks are exactly those with a bad first report or,
// after expiry, no report.
func TestRestoreVerdictProperty(t *testing.T) {
	for seed := range uint64(3000) {
		rng := rand.New(rand.NewPCG(seed, 7))
		nChunks := 1 + rng.IntN(6)
		nRanks := 1 + rng.IntN(4)
		nGroups := 1 + rng.IntN(2)
		if seed%4 == 0 {
			nGroups = 3 + rng.IntN(6) // up to 32 expectations a chunk: past the scan's 16
		}
		var exp []index.Expect
		for c := range nChunks {
			for r := range nRanks {
				for g := range nGroups {
					if rng.IntN(5) == 0 && !(r == 0 && g == 0) {
						continue // sparse sets; (c, 0, 0) keeps every chunk covered
					}
					exp = append(exp, index.Expect{Chunk: c, Rank: r, Shard: r % 2, Group: g, Sum: rng.Uint64()})
				}
			}
		}
		rs, err := index.NewRestore(fmt.Sprint(seed), dcp.Namespace{}, chunks(nChunks), exp, t0)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		type result struct {
			rank int
			res  wire.ItemResult
		}
		var stream []result
		for _, e := range exp {
			switch rng.IntN(8) {
			case 0: // missing
				continue
			case 1:
				stream = append(stream, result{e.Rank, wire.ItemResult{Chunk: e.Chunk, Group: e.Group, OK: true, Sum: e.Sum ^ (1 << rng.IntN(64))}})
			case 2:
				stream = append(stream, result{e.Rank, wire.ItemResult{Chunk: e.Chunk, Group: e.Group, OK: false, Reason: "corrupt"}})
			default:
				stream = append(stream, result{e.Rank, wire.ItemResult{Chunk: e.Chunk, Group: e.Group, OK: true, Sum: e.Sum}})
			}
			if rng.IntN(4) == 0 { // a duplicate, possibly with another result
				stream = append(stream, result{e.Rank, wire.ItemResult{Chunk: e.Chunk, Group: e.Group, OK: rng.IntN(2) == 0, Sum: e.Sum}})
			}
		}
		for range rng.IntN(3) { // unexpected results
			g := []int{5, 99, rng.IntN(nGroups + 1)}[rng.IntN(3)] // 5 is expected where nGroups > 5
			stream = append(stream, result{rng.IntN(nRanks + 2), wire.ItemResult{Chunk: rng.IntN(nChunks + 2), Group: g, OK: true}})
		}
		rng.Shuffle(len(stream), func(i, j int) { stream[i], stream[j] = stream[j], stream[i] })
		expireAt := -1
		if rng.IntN(2) == 0 {
			expireAt = rng.IntN(len(stream) + 1)
		}

		// Model: the first result per expectation counts, until the
		// verdict is final.
		type slot struct{ c, r, g int }
		want := map[slot]index.Expect{}
		for _, e := range exp {
			want[slot{e.Chunk, e.Rank, e.Group}] = e
		}
		first := map[slot]bool{} // true: confirmed
		expired := false
		final := func() bool { return expired || len(first) == len(exp) }
		for i := 0; i <= len(stream); i++ {
			if i == expireAt {
				rs.Expire(t0.Add(-time.Nanosecond)) // before the deadline: no effect
				rs.Expire(t0)
				if !final() {
					expired = true
				}
			}
			if i == len(stream) {
				break
			}
			s := stream[i]
			rs.Report(s.rank, []wire.ItemResult{s.res})
			k := slot{s.res.Chunk, s.rank, s.res.Group}
			e, ok := want[k]
			if !ok || final() {
				continue
			}
			if _, seen := first[k]; !seen {
				first[k] = s.res.OK && s.res.Sum == e.Sum
			}
		}
		var failed []int
		allOK := true
		for _, e := range exp {
			k := slot{e.Chunk, e.Rank, e.Group}
			conf, seen := first[k]
			if !conf {
				allOK = false
			}
			if (seen && !conf) || (!seen && expired) {
				if !slices.Contains(failed, e.Chunk) {
					failed = append(failed, e.Chunk)
				}
			}
		}
		slices.Sort(failed)
		v := rs.Verdict()
		switch {
		case allOK:
			if v.State != wire.VerdictComplete || len(v.Failed) != 0 {
				t.Fatalf("seed %d: all confirmed, verdict %+v", seed, v)
			}
		case final():
			if v.State != wire.VerdictFailed || !slices.Equal(v.Failed, failed) {
				t.Fatalf("seed %d: verdict %s %v, want failed %v", seed, v.State, v.Failed, failed)
			}
		default:
			if v.State != wire.VerdictPending || !slices.Equal(v.Failed, failed) {
				t.Fatalf("seed %d: verdict %s %v, want pending with %v failed so far", seed, v.State, v.Failed, failed)
			}
		}
		if v.State == wire.VerdictComplete && v.Confirmed != len(exp) {
			t.Fatalf("seed %d: complete with %d of %d confirmed", seed, v.Confirmed, len(exp))
		}
	}
}

// TestRestoreZeroSum (issue 11.8): a recorded sum of 0 cannot be checked,
// so a restore expecting it is refused at NewRestore; a rank confirming
// with sum 0 fails that expectation by name, even if 0 were recorded. On
// f044f94 both were accepted (a 0 recorded and a 0 reported gave
// complete).
func TestRestoreZeroSum(t *testing.T) {
	exp := []index.Expect{{Chunk: 0, Rank: 0, Shard: 0, Group: 0, Sum: 0}}
	_, err := index.NewRestore("z", dcp.Namespace{}, chunks(1), exp, t0.Add(time.Second))
	if !errors.Is(err, index.ErrRestore) || err.Error() != `restore "z": expectation 0 (chunk 0 rank 0 group 0) has recorded sum 0, which no placed bytes can be checked against: invalid restore` {
		t.Fatalf("NewRestore with a recorded sum of 0: %v", err)
	}
	exp[0].Sum = 42
	r, err := index.NewRestore("z", dcp.Namespace{}, chunks(1), exp, t0.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	out, err := r.Report(0, []wire.ItemResult{{Chunk: 0, Group: 0, OK: true, Sum: 0}})
	if err != nil || out.Accepted != 1 {
		t.Fatalf("report: %+v %v", out, err)
	}
	v := r.Verdict()
	if v.State != wire.VerdictFailed || !slices.Equal(v.Reasons, []string{"chunk 0: rank 0 group 0 shard 0: confirmed with sum 0 (no sum computed), recorded 0x000000000000002a"}) {
		t.Fatalf("verdict %+v", v)
	}
}
