package index_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// TestRestoreVerdictNamesEveryGroup is issue 27's verdict: with several KV
// cache groups, a chunk that failed in two groups for two different
// reasons names both, and a group whose first failure was only a missing
// object but whose other reader found wrong bytes is reported (and
// counted) as wrong bytes. A verdict whose chunks each failed in one group
// keeps the message older engines read.
func TestRestoreVerdictNamesEveryGroup(t *testing.T) {
	// Two chunks, three groups; ranks 0 and 1 read shard 0 of every group
	// (MLA-like: both ranks confirm the same object).
	var exp []index.Expect
	for c := range 2 {
		for g := range 3 {
			for rank := range 2 {
				exp = append(exp, index.Expect{Chunk: c, Rank: rank, Shard: 0, Group: g, Sum: uint64(100*c + 10*g + 1)})
			}
		}
	}
	ok := func(c, g int) wire.ItemResult {
		return wire.ItemResult{Chunk: c, Group: g, OK: true, Sum: uint64(100*c + 10*g + 1)}
	}
	bad := func(c, g int, reason string) wire.ItemResult {
		return wire.ItemResult{Chunk: c, Group: g, Reason: reason}
	}
	r, err := index.NewRestore("r", dcp.Namespace{}, chunks(2), exp, t0.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	// Chunk 0: group 0 confirmed, group 1 corrupt on rank 0, group 2
	// missing on rank 0 (rank 1 confirms both). Chunk 1: group 0 missing on
	// rank 0 and then corrupt on rank 1; groups 1 and 2 confirmed.
	reports := []struct {
		rank int
		res  []wire.ItemResult
	}{
		{0, []wire.ItemResult{ok(0, 0), bad(0, 1, index.ReasonCorrupt), bad(0, 2, "missing"), bad(1, 0, "missing"), ok(1, 1), ok(1, 2)}},
		{1, []wire.ItemResult{ok(0, 0), ok(0, 1), ok(0, 2), bad(1, 0, index.ReasonCorrupt), ok(1, 1), ok(1, 2)}},
	}
	for _, rep := range reports {
		if _, err := r.Report(rep.rank, rep.res); err != nil {
			t.Fatal(err)
		}
	}
	v := r.Verdict()
	if v.State != wire.VerdictFailed || !slices.Equal(v.Failed, []int{0, 1}) {
		t.Fatalf("verdict %s failed %v, want failed [0 1]", v.State, v.Failed)
	}
	// Reasons keep their meaning: the chunk's first failed expectation.
	wantFirst := []string{"chunk 0: rank 0 group 1 shard 0: corrupt", "chunk 1: rank 0 group 0 shard 0: missing"}
	if !slices.Equal(v.Reasons, wantFirst) {
		t.Errorf("reasons %q, want %q", v.Reasons, wantFirst)
	}
	wantGroups := [][]string{
		{"rank 0 group 1 shard 0: corrupt", "rank 0 group 2 shard 0: missing"},
		// Group 0's missing copy came first, but rank 1 found wrong bytes:
		// that is the reason an operator and the engine's count need.
		{"rank 1 group 0 shard 0: corrupt"},
	}
	if !slices.EqualFunc(v.GroupReasons, wantGroups, slices.Equal) {
		t.Errorf("group reasons %q, want %q", v.GroupReasons, wantGroups)
	}
	if v.BytesWrong != 2 {
		t.Errorf("bytes wrong %d, want 2 (both chunks had a corrupt object)", v.BytesWrong)
	}

	// On the wire: the new field is added, the old ones are unchanged, and
	// ChunkReasons reads either form.
	wv := v.Wire("r", 2)
	if err := wv.Validate(); err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(&wv)
	if err != nil {
		t.Fatal(err)
	}
	var back wire.RestoreVerdict
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	for i, want := range wantGroups {
		if got := back.ChunkReasons(i); !slices.Equal(got, want) {
			t.Errorf("decoded ChunkReasons(%d) = %q, want %q (message %s)", i, got, want, data)
		}
	}
	old := wire.RestoreVerdict{RestoreID: "r", State: wire.VerdictFailed, Prefix: 2, Failed: back.Failed, Reasons: back.Reasons}
	if got := old.ChunkReasons(1); !slices.Equal(got, []string{"rank 0 group 0 shard 0: missing"}) {
		t.Errorf("ChunkReasons of a verdict without group reasons = %q, want the chunk's one reason", got)
	}
	wv.GroupReasons = wv.GroupReasons[:1]
	if err := wv.Validate(); err == nil {
		t.Error("a verdict with group reasons for 1 of 2 failed chunks validated")
	}
}

// TestRestoreVerdictOneGroupEach: chunks that each failed in a single
// group (here after a deadline) leave GroupReasons out, so the verdict is
// the message engines before issue 27 decoded.
func TestRestoreVerdictOneGroupEach(t *testing.T) {
	exp := []index.Expect{
		{Chunk: 0, Rank: 0, Shard: 0, Group: 0, Sum: 1}, {Chunk: 0, Rank: 0, Shard: 0, Group: 1, Sum: 2},
		{Chunk: 1, Rank: 0, Shard: 0, Group: 0, Sum: 3}, {Chunk: 1, Rank: 0, Shard: 0, Group: 1, Sum: 4},
	}
	r, err := index.NewRestore("r", dcp.Namespace{}, chunks(2), exp, t0.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Report(0, []wire.ItemResult{{Chunk: 0, Group: 0, OK: true, Sum: 1}, {Chunk: 0, Group: 1, OK: true, Sum: 2},
		{Chunk: 1, Group: 0, OK: true, Sum: 3}}); err != nil {
		t.Fatal(err)
	}
	v := r.Expire(t0.Add(time.Second))
	if !slices.Equal(v.Failed, []int{1}) || v.GroupReasons != nil || v.BytesWrong != 0 {
		t.Fatalf("failed %v group reasons %q bytes wrong %d, want [1], none, 0", v.Failed, v.GroupReasons, v.BytesWrong)
	}
	if want := []string{"chunk 1: rank 0 group 1 shard 0: no report by the deadline"}; !slices.Equal(v.Reasons, want) {
		t.Errorf("reasons %q, want %q", v.Reasons, want)
	}
}

// TestRestoreExpireNamesEachSource: the deadline's reasons name the rank,
// group and shard of each unreported expectation, per chunk and group,
// though Expire formats each distinct source once.
func TestRestoreExpireNamesEachSource(t *testing.T) {
	var exp []index.Expect
	sum := uint64(0)
	for c := range 3 {
		for rk := range 2 {
			for g := range 2 {
				sum++
				exp = append(exp, index.Expect{Chunk: c, Rank: rk, Shard: rk + 2*g, Group: g, Sum: sum})
			}
		}
	}
	r, err := index.NewRestore("r", dcp.Namespace{}, chunks(3), exp, t0.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	// Rank 0 reports everything; rank 1 only chunk 1's group 0.
	var rep0 []wire.ItemResult
	for _, e := range exp {
		if e.Rank == 0 {
			rep0 = append(rep0, wire.ItemResult{Chunk: e.Chunk, Group: e.Group, OK: true, Sum: e.Sum})
		}
	}
	if _, err := r.Report(0, rep0); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Report(1, []wire.ItemResult{{Chunk: 1, Group: 0, OK: true, Sum: exp[6].Sum}}); err != nil {
		t.Fatal(err)
	}
	v := r.Expire(t0.Add(time.Second))
	if v.State != wire.VerdictFailed || !slices.Equal(v.Failed, []int{0, 1, 2}) {
		t.Fatalf("verdict %s, failed %v; want failed, [0 1 2]", v.State, v.Failed)
	}
	late := func(g int) string {
		return fmt.Sprintf("rank 1 group %d shard %d: no report by the deadline", g, 1+2*g)
	}
	want := [][]string{{late(0), late(1)}, {late(1)}, {late(0), late(1)}}
	for j, c := range v.Failed {
		var got []string
		if v.GroupReasons != nil {
			got = v.GroupReasons[j]
		}
		if c == 1 && got == nil { // a chunk that failed in one group only: its reason alone
			got = []string{strings.TrimPrefix(v.Reasons[j], "chunk 1: ")}
		}
		if !slices.Equal(got, want[c]) {
			t.Errorf("chunk %d: reasons %q, want %q", c, got, want[c])
		}
	}
}
