package wire

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

// Golden vectors of the compact binary encodings (lookup.go, plan.go), in
// testdata/compact, beside (not in) the golden set of golden_test.go so
// that the Python client adopts them when it implements them:
//
//	lookup_request.bin  the golden lookup_request.json value, binary
//	restore_plan.bin    the binary plan of restore_plan.json, which
//	                    answers a restore.begin for chunks.json
//	restore_plan_last.bin  the binary plan (KVP2) of restore_plan_last.json,
//	                    a restore.begin with StateAtEnd for chunks.json
//	store_request.bin   the golden store_request.json value, binary
//	                    (block ids of 8 B: one is 2^40; KVS1: no positions)
//	store_request_pos.bin  the golden store_request_pos.json value,
//	                    binary (KVS2: chunk positions; block ids of 4 B)
//	retrieve_request.bin  the golden retrieve_request.json value, binary
//	                    (block ids of 4 B)
//	retrieve_request_skip.bin  the golden retrieve_request_skip.json
//	                    value, binary (KVR2: a skip per item)
//
//	restore_begin_request.bin  a restore.begin with every flag (KVG1)
//	restore_begin_request.json the same value as JSON
//
//	go test ./wire -run CompactGolden -update    rewrites the files
const compactDir = "testdata/compact"

// goldenBinaryPlan is a plan of the regular shape the binary encoding
// carries: 2 chunks; reader engine0/0 restores groups 0 and 1 of shard 0
// (one object from engine0/1's L2), engine0/1 group 0 of shard 1. blocks:
// empty Blocks slices (for JSON), else nil (as decoded from binary).
func goldenBinaryPlan(blocks bool) *RestorePlan {
	item := func(chunk, group int, shard uint16, holder int, tier Tier) RetrieveItem {
		it := RetrieveItem{Chunk: chunk, Group: group, Key: goldenKey(byte(chunk), shard, uint16(group)),
			Sum: 0x0123456789abcdef + uint64(chunk*16+group), Source: Source{Holder: Rank{Instance: "engine0", TPRank: holder}, Tier: tier}}
		if blocks {
			it.Blocks = []int64{}
		}
		return it
	}
	return &RestorePlan{RestoreID: "r-00000002", Prefix: 2, Ranks: map[string][]RetrieveItem{
		"engine0/0": {item(0, 0, 0, 0, L1), item(0, 1, 0, 0, L1), item(1, 0, 0, 1, L2), item(1, 1, 0, 0, L2)},
		"engine0/1": {item(0, 0, 1, 1, L1), item(1, 0, 1, 1, L1)},
	}}
}

// goldenBinaryPlanLast is a plan of a restore.begin with StateAtEnd (the
// KVP2 shape): 2 chunks of a namespace whose group 0 is recurrent; each
// reader restores group 1 of both chunks and group 0 of the last only.
func goldenBinaryPlanLast(blocks bool) *RestorePlan {
	p := goldenBinaryPlan(blocks)
	item := func(chunk, group int, shard uint16, holder int, tier Tier) RetrieveItem {
		it := p.Ranks["engine0/0"][0]
		it.Chunk, it.Group, it.Key = chunk, group, goldenKey(byte(chunk), shard, uint16(group))
		it.Sum = 0x0fedcba987654321 + uint64(chunk*16+group)
		it.Source = Source{Holder: Rank{Instance: "engine0", TPRank: holder}, Tier: tier}
		return it
	}
	p.RestoreID = "r-00000003"
	p.Ranks = map[string][]RetrieveItem{
		"engine0/0": {item(0, 1, 0, 0, L1), item(1, 0, 0, 0, L1), item(1, 1, 0, 1, L2)},
		"engine0/1": {item(0, 1, 1, 1, L1), item(1, 0, 1, 1, L2), item(1, 1, 1, 1, L1)},
	}
	return p
}

func TestCompactGolden(t *testing.T) {
	chunks := []dcp.ChunkHash{goldenChunk(0), goldenChunk(1)}
	lr := &LookupRequest{Namespace: goldenNS(), Chunks: chunks, Instance: "engine0", Detail: true}
	files := map[string][]byte{}
	var err error
	if files["lookup_request.bin"], err = lr.MarshalBinary(); err != nil {
		t.Fatal(err)
	}
	store := goldenValue(t, "store_request").(*StoreRequest)
	if files["store_request.bin"], err = store.MarshalBinary(); err != nil {
		t.Fatal(err)
	}
	storePos := goldenValue(t, "store_request_pos").(*StoreRequest)
	if files["store_request_pos.bin"], err = storePos.MarshalBinary(); err != nil {
		t.Fatal(err)
	}
	retrieve := goldenValue(t, "retrieve_request").(*RetrieveRequest)
	if files["retrieve_request.bin"], err = retrieve.MarshalBinary(); err != nil {
		t.Fatal(err)
	}
	retrieveSkip := goldenValue(t, "retrieve_request_skip").(*RetrieveRequest)
	if files["retrieve_request_skip.bin"], err = retrieveSkip.MarshalBinary(); err != nil {
		t.Fatal(err)
	}
	if files["restore_plan.bin"], err = AppendPlanBinary(nil, goldenBinaryPlan(false), goldenNS()); err != nil {
		t.Fatal(err)
	}
	if files["restore_plan.json"], err = json.Marshal(goldenBinaryPlan(true)); err != nil {
		t.Fatal(err)
	}
	if files["restore_plan_last.bin"], err = AppendPlanBinary(nil, goldenBinaryPlanLast(false), goldenNS()); err != nil {
		t.Fatal(err)
	}
	if files["restore_plan_last.json"], err = json.Marshal(goldenBinaryPlanLast(true)); err != nil {
		t.Fatal(err)
	}
	if files["chunks.json"], err = json.Marshal(chunks); err != nil {
		t.Fatal(err)
	}
	begin := &RestoreBeginRequest{RestoreBegin: RestoreBegin{Namespace: goldenNS(), Chunks: chunks, DeadlineMS: 10000},
		Instance: "engine0", PlanEncoding: PlanEncodingBinary, StateAtEnd: true, Lookup: true}
	if files["restore_begin_request.bin"], err = begin.MarshalBinary(); err != nil {
		t.Fatal(err)
	}
	if files["restore_begin_request.json"], err = json.Marshal(begin); err != nil {
		t.Fatal(err)
	}
	if *updateGolden {
		if err := os.MkdirAll(compactDir, 0o755); err != nil {
			t.Fatal(err)
		}
		for n, b := range files {
			if err := os.WriteFile(filepath.Join(compactDir, n), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for n, want := range files {
		got, err := os.ReadFile(filepath.Join(compactDir, n))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s: file differs from what Go encodes now (%v); run go test ./wire -run CompactGolden -update", n, err)
		}
	}
	var back LookupRequest
	if err := back.UnmarshalBinary(files["lookup_request.bin"]); err != nil || !reflect.DeepEqual(&back, lr) {
		t.Errorf("lookup_request.bin decodes to %+v, %v", back, err)
	}
	var backBegin RestoreBeginRequest
	if err := backBegin.UnmarshalBinary(files["restore_begin_request.bin"]); err != nil || !reflect.DeepEqual(&backBegin, begin) {
		t.Errorf("restore_begin_request.bin decodes to %+v, %v", backBegin, err)
	}
	lim := RequestLimits{MaxChunks: 2, MaxItems: 2, MaxBlocks: 4}
	if back, err := DecodeStoreBinary(files["store_request.bin"], lim); err != nil || !reflect.DeepEqual(back, store) {
		t.Errorf("store_request.bin decodes to %+v, %v", back, err)
	}
	if back, err := DecodeStoreBinary(files["store_request_pos.bin"], RequestLimits{MaxChunks: 3, MaxBlocks: 4}); err != nil || !reflect.DeepEqual(back, storePos) {
		t.Errorf("store_request_pos.bin decodes to %+v, %v", back, err)
	}
	if back, err := DecodeRetrieveBinary(files["retrieve_request.bin"], lim); err != nil || !reflect.DeepEqual(back, retrieve) {
		t.Errorf("retrieve_request.bin decodes to %+v, %v", back, err)
	}
	if back, err := DecodeRetrieveBinary(files["retrieve_request_skip.bin"], lim); err != nil || !reflect.DeepEqual(back, retrieveSkip) {
		t.Errorf("retrieve_request_skip.bin decodes to %+v, %v", back, err)
	}
	if b := files["retrieve_request_skip.bin"]; string(b[:4]) != "KVR2" || string(files["retrieve_request.bin"][:4]) != "KVR1" {
		t.Errorf("magics %q and %q, want KVR2 with a skip and KVR1 without", b[:4], files["retrieve_request.bin"][:4])
	}
	plan, err := DecodePlanBinary(files["restore_plan.bin"], chunks)
	if err != nil || !reflect.DeepEqual(plan, goldenBinaryPlan(false)) {
		t.Errorf("restore_plan.bin decodes to %+v, %v", plan, err)
	}
	plan, err = DecodePlanBinary(files["restore_plan_last.bin"], chunks)
	if err != nil || !reflect.DeepEqual(plan, goldenBinaryPlanLast(false)) {
		t.Errorf("restore_plan_last.bin decodes to %+v, %v", plan, err)
	}
	if b := files["restore_plan_last.bin"]; string(b[:4]) != "KVP2" || string(files["restore_plan.bin"][:4]) != "KVP1" {
		t.Errorf("magics %q and %q, want KVP2 with last-only objects and KVP1 without", b[:4], files["restore_plan.bin"][:4])
	}
}

// goldenValue is the value of the golden case name (golden_test.go).
func goldenValue(t *testing.T, name string) any {
	t.Helper()
	for _, c := range goldenCases() {
		if c.name == name {
			return c.v
		}
	}
	t.Fatalf("no golden case %s", name)
	return nil
}
