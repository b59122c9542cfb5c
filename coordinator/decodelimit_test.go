package coordinator

import (
	"errors"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// The binary lookup, begin and report are held to the JSON path's size
// limit: a report just over bus.MaxRequestBytes is refused as malformed
// before anything is allocated for its items, one just under it decodes.
// (The embedded NATS server's payload limit is 8 MiB too; an operator may
// raise it, or run an external server with a larger one.)
func TestBinaryRequestsHaveTheJSONSizeLimit(t *testing.T) {
	report := func(n int) []byte {
		rep := wire.RestoreReport{RestoreID: "r", Rank: wire.Rank{Instance: "eng", TPRank: 0}, Results: make([]wire.ItemResult, n)}
		for i := range rep.Results {
			rep.Results[i] = wire.ItemResult{Chunk: i, OK: true, Sum: 1}
		}
		b, err := rep.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	per := len(report(2)) - len(report(1))
	over := report(bus.MaxRequestBytes/per + 16)
	if len(over) <= bus.MaxRequestBytes {
		t.Fatalf("test report of %d B is not over the limit", len(over))
	}
	var got wire.RestoreReport
	err := decodeRequest(&nats.Msg{Subject: "x", Data: over}, &got, wire.IsBinaryReport)
	if !errors.Is(err, wire.ErrMalformed) || len(got.Results) != 0 {
		t.Fatalf("report of %d B: err %v, %d results decoded; want malformed, none", len(over), err, len(got.Results))
	}
	under := report((bus.MaxRequestBytes - 64) / per)
	if err := decodeRequest(&nats.Msg{Subject: "x", Data: under}, &got, wire.IsBinaryReport); err != nil {
		t.Fatalf("report of %d B under the limit: %v", len(under), err)
	}

	var ns dcp.Namespace
	begin := wire.RestoreBeginRequest{Instance: "eng", RestoreBegin: wire.RestoreBegin{Namespace: ns, Chunks: make([]dcp.ChunkHash, bus.MaxRequestBytes/16+16)}}
	b, err := begin.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var gb wire.RestoreBeginRequest
	if err := decodeRequest(&nats.Msg{Subject: "x", Data: b}, &gb, wire.IsBinaryBegin); !errors.Is(err, wire.ErrMalformed) || len(gb.Chunks) != 0 {
		t.Fatalf("begin of %d B: %v, %d chunks decoded; want malformed, none", len(b), err, len(gb.Chunks))
	}
}
