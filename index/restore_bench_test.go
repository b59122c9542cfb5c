package index_test

import (
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// BenchmarkNewRestore1024x4: the coordinator's bookkeeping of one restore
// of 1,024 chunks on four ranks (a 16k-token prompt in 16-token chunks on
// TP4): NewRestore, every rank's report, the verdict. Issue 25.4 asks a
// restore's fixed cost under 2 ms; this is the part of it that grows with
// the chunks.
func BenchmarkNewRestore1024x4(b *testing.B) {
	const nChunks, nRanks = 1024, 4
	cs := chunks(nChunks)
	var exp []index.Expect
	reports := make([][]wire.ItemResult, nRanks)
	for c := range nChunks {
		for r := range nRanks {
			sum := uint64(c*nRanks + r + 1)
			exp = append(exp, index.Expect{Chunk: c, Rank: r, Shard: r, Sum: sum})
			reports[r] = append(reports[r], wire.ItemResult{Chunk: c, OK: true, Sum: sum})
		}
	}
	for b.Loop() {
		rs, err := index.NewRestore("b", dcp.Namespace{}, cs, exp, t0)
		if err != nil {
			b.Fatal(err)
		}
		for r, res := range reports {
			if _, err := rs.Report(r, res); err != nil {
				b.Fatal(err)
			}
		}
		if v := rs.Verdict(); v.State != wire.VerdictComplete {
			b.Fatalf("verdict %+v", v)
		}
	}
}

// BenchmarkExpireAbandoned1024x4: the coordinator's expiry of an abandoned
// restore (1,024 chunks on 4 ranks, no report came): NewRestore, Expire at
// the deadline, the failed verdict.
func BenchmarkExpireAbandoned1024x4(b *testing.B) {
	const nChunks, nRanks = 1024, 4
	cs := chunks(nChunks)
	var exp []index.Expect
	for c := range nChunks {
		for r := range nRanks {
			exp = append(exp, index.Expect{Chunk: c, Rank: r, Shard: r, Sum: uint64(c*nRanks + r + 1)})
		}
	}
	for b.Loop() {
		rs, err := index.NewRestore("b", dcp.Namespace{}, cs, exp, t0)
		if err != nil {
			b.Fatal(err)
		}
		if v := rs.Expire(t0); v.State != wire.VerdictFailed || len(v.Failed) != nChunks {
			b.Fatalf("verdict %s, %d failed", v.State, len(v.Failed))
		}
	}
}
