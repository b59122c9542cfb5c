package wire

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

// Golden vectors: the exact bytes Go encodes for a set of messages, kept in
// testdata/golden and checked by both this test and the Python client's
// (python/tests/test_golden.py), so the two encodings cannot drift.
//
//	go test ./wire -run Golden -update    rewrites the files
//
// manifest.json maps each file to its Go type, which is also the Python
// class name. Slices in the vectors are never nil: Python encodes an empty
// list as [], never null (Go decodes both the same).
var updateGolden = flag.Bool("update", false, "rewrite wire/testdata/golden from the Go values")

const goldenDir = "testdata/golden"

type goldenCase struct {
	name string // file name without extension
	typ  string // Go (and Python) type name
	v    any    // pointer to the value
}

func goldenNS() dcp.Namespace {
	var n dcp.Namespace
	for i := range n {
		n[i] = byte(0xf0 + i)
	}
	return n
}

// Engine session ids of the vectors (wire.CheckSessionID form).
const (
	goldenSession    = "5e5510a1d00000000000000000c0ffee"
	goldenSuperseded = "0000000000000000000000005e5510a1"
)

func goldenChunk(seed byte) dcp.ChunkHash {
	var c dcp.ChunkHash
	for i := range c {
		c[i] = seed ^ byte(i*17)
	}
	return c
}

// goldenSpec is a two-group spec: an FP8 MLA group with an index tail and
// padding (the seed 561-byte row) and a recurrent group.
func goldenSpec() dcp.Spec {
	return dcp.Spec{
		Model: "tiny-llama <rev&1>", CacheSalt: "tenant-ä",
		Layout: dcp.Layout{TP: 4, DCP: 2, Interleave: 1, PP: 1},
		Groups: []dcp.Group{
			{Name: "mla", Kind: dcp.Attention, MLA: true, BlockSize: 64, Layers: 3,
				SemanticBytes: 64 * 528, PageBytes: 64 * 561, StrideBytes: 64*561 + 37, KVFormat: "fp8_mla_tail"},
			{Name: "mamba", Kind: dcp.Recurrent, BlockSize: 128, Layers: 1,
				SemanticBytes: 4096 * 265, PageBytes: 4096 * 265, StrideBytes: 4096 * 266, KVFormat: "bf16"},
		},
		ChunkTokens: 256,
	}
}

func goldenKey(chunk byte, shard, group uint16) dcp.Key {
	return dcp.Key{NS: goldenNS(), Chunk: goldenChunk(chunk), Shard: shard, Group: group}
}

func goldenCases() []goldenCase {
	ns := goldenNS()
	spec := goldenSpec()
	mem := MemHandle{Backend: "cuda", Device: "GPU-5e1c0d2a-7f7e-4a8e-9c1b-0123456789ab",
		Raw: bytes.Repeat([]byte{0x00, 0xff, 0x7e, 0x3f}, 16), Offset: 1 << 33, Size: 3<<30 + 561}
	ev := EventHandle{Backend: "cuda", Device: mem.Device, Raw: bytes.Repeat([]byte{0xa5, 0x01}, 32)}
	hostMem := MemHandle{Backend: "host", Device: "HOST-0011223344556677",
		Raw: []byte("kvtier-4242-0123456789abcdef"), Offset: 4096, Size: 36 * 1024}
	item := func(chunk int, group int, shard uint16, tier Tier, blocks []int64) RetrieveItem {
		return RetrieveItem{Chunk: chunk, Group: group, Key: goldenKey(byte(chunk), shard, uint16(group)),
			Sum: 0xfedcba9876543210 - uint64(chunk), Source: Source{Holder: Rank{Instance: "engine0", TPRank: int(shard)}, Tier: tier},
			Blocks: blocks}
	}
	skip := func(it RetrieveItem, n int) RetrieveItem {
		it.Skip = n
		return it
	}
	return []goldenCase{
		{"spec", "Spec", &spec},
		{"register_request", "RegisterRequest", &RegisterRequest{Spec: spec, DeviceUUID: mem.Device, Pools: []PoolRegistration{
			{Group: 0, Layer: 0, Handle: mem}, {Group: 1, Layer: 0, Handle: hostMem}}}},
		{"register_reply", "RegisterReply", &RegisterReply{Namespace: ns, Session: goldenSession, Superseded: goldenSuperseded}},
		{"register_reply_min", "RegisterReply", &RegisterReply{Namespace: ns}}, // the coordinator's ns.register: no session
		{"store_request", "StoreRequest", &StoreRequest{RequestID: "req-1/<prompt>&co", Namespace: ns, Session: goldenSession,
			Chunks: []ChunkBlocks{{Chunk: goldenChunk(1), Blocks: [][]int64{{7, 8, 9, 10}, {}}},
				{Chunk: goldenChunk(2), Blocks: [][]int64{{2198, 1 << 40}, {3}}}}, Event: ev}},
		// With chunk positions (binary: KVS2); the first is 0 (omitted).
		{"store_request_pos", "StoreRequest", &StoreRequest{RequestID: "req-2", Namespace: ns, Session: goldenSession,
			Chunks: []ChunkBlocks{{Chunk: goldenChunk(3), Blocks: [][]int64{{11, 12, 13, 14}, {}}, Pos: 5},
				{Chunk: goldenChunk(4), Blocks: [][]int64{{1}, {2}}}, {Chunk: goldenChunk(5), Blocks: [][]int64{{}, {}}, Pos: 1<<32 - 1}},
			Event: ev}},
		{"store_reply", "StoreReply", &StoreReply{Stored: 3, Deduped: 1, Failed: []string{"ns.chunk.0.1: device"}, BlocksInUse: true}},
		{"store_reply_min", "StoreReply", &StoreReply{Stored: 2}},
		{"retrieve_request", "RetrieveRequest", &RetrieveRequest{RestoreID: "r-00000001", Namespace: ns, Session: goldenSession,
			Items: []RetrieveItem{item(0, 0, 0, L1, []int64{4, 5}), item(1, 1, 1, L2, []int64{0})}}},
		// With skipped blocks (binary: KVR2): chunk 0 of group 0 places
		// its blocks 3.. only; the second item skips none (omitted).
		{"retrieve_request_skip", "RetrieveRequest", &RetrieveRequest{RestoreID: "r-00000003", Namespace: ns, Session: goldenSession,
			Items: []RetrieveItem{skip(item(0, 0, 0, L1, []int64{6}), 3), item(1, 0, 0, L2, []int64{7, 1 << 20, 9, 10})}}},
		{"retrieve_reply", "RetrieveReply", &RetrieveReply{Results: []ItemResult{
			{Chunk: 0, Group: 0, OK: true, Sum: 1<<64 - 1}, {Chunk: 1, Group: 1, Reason: "corrupt"}}}},
		{"lookup_request", "LookupRequest", &LookupRequest{Namespace: ns, Chunks: []dcp.ChunkHash{goldenChunk(0), goldenChunk(1)},
			Instance: "engine0", Detail: true}},
		{"lookup_reply", "LookupReply", &LookupReply{Instance: "engine0", Prefix: 1,
			Sources: []ObjectInfo{{Chunk: 0, Key: goldenKey(0, 1, 0), Reader: "engine0/1", Placements: []ObjectPlacement{
				{Holder: Rank{Instance: "engine0", TPRank: 1}, Tier: L2, Size: 35904, Sum: 1 << 63, Incarnation: 1700000000000000001, Seq: 9}}}},
			NotAlive: []string{"engine0/3"}, Reason: "rank engine0/3 is dead"}},
		{"restore_begin_request", "RestoreBeginRequest", &RestoreBeginRequest{RestoreBegin: RestoreBegin{Namespace: ns,
			Chunks: []dcp.ChunkHash{goldenChunk(0)}, DeadlineMS: 10000}, Instance: "engine0"}},
		{"restore_plan", "RestorePlan", &RestorePlan{RestoreID: "r-00000001", Prefix: 2, Ranks: map[string][]RetrieveItem{
			"engine0/1": {item(0, 0, 1, L1, []int64{})}, "engine0/0": {item(0, 0, 0, L2, []int64{}), item(1, 1, 0, L1, []int64{})},
			"engine0/10": {item(1, 0, 0, L2, []int64{})}}}},
		{"restore_report", "RestoreReport", &RestoreReport{RestoreID: "r-00000001", Rank: Rank{Instance: "engine0", TPRank: 2},
			Results: []ItemResult{{Chunk: 0, Group: 0, OK: true, Sum: 42}}}},
		{"restore_wait", "RestoreWait", &RestoreWait{RestoreID: "r-00000001"}},
		{"restore_verdict", "RestoreVerdict", &RestoreVerdict{RestoreID: "r-00000001", State: VerdictFailed, Prefix: 2,
			Failed: []int{1}, Reasons: []string{"engine0/1 chunk 1 group 0: corrupt"}}},
		{"restore_verdict_groups", "RestoreVerdict", &RestoreVerdict{RestoreID: "r-4", State: VerdictFailed, Prefix: 3,
			Failed: []int{1, 2}, Reasons: []string{"chunk 1: rank 0 group 1 shard 0: corrupt", "chunk 2: rank 1 group 0 shard 1: missing"},
			GroupReasons: [][]string{{"rank 0 group 1 shard 0: corrupt", "rank 0 group 2 shard 0: no report by the deadline"},
				{"rank 1 group 0 shard 1: missing"}}}},
		{"restore_verdict_complete", "RestoreVerdict", &RestoreVerdict{RestoreID: "r-2", State: VerdictComplete, Prefix: 5}},
		{"restore_verdict_refused", "RestoreVerdict", &RestoreVerdict{RestoreID: "r-3", State: VerdictRefused,
			Reason: "reader engine0/2 is not alive"}},
		{"store_reply_not_durable", "StoreReply", &StoreReply{Stored: 1, NotDurable: "L2 directory /nvme/kvtier is gone"}},
		{"blocks_freed", "BlocksFreed", &BlocksFreed{Rank: Rank{Instance: "engine0", TPRank: 1}, RequestID: "req-1",
			Namespace: ns, Chunks: []dcp.ChunkHash{goldenChunk(1), goldenChunk(2)}}},
		{"report_ack", "ReportAck", &ReportAck{Duplicate: true, State: VerdictPending}},
		{"event_ack", "EventAck", &EventAck{AppliedThrough: 1 << 62, Resync: true}},
		{"heartbeat", "Heartbeat", &Heartbeat{Rank: Rank{Instance: "engine0", TPRank: 3}, Incarnation: 77, Seq: 1 << 50}},
		{"reply_ok", "Reply[StoreReply]", &Reply[StoreReply]{OK: &StoreReply{Stored: 1}}},
		{"reply_error", "Reply[StoreReply]", &Reply[StoreReply]{Error: &Error{Code: CodeGeometry,
			Message: "declared page 177408 B exceeds block stride 160000 B"}}},
		{"mem_handle", "MemHandle", &mem},
		{"event_handle", "EventHandle", &ev},
	}
}

func goldenBatch() *Batch {
	return &Batch{Rank: Rank{Instance: "engine0", TPRank: 3}, Incarnation: 1700000000000000001, Events: []Event{
		{Seq: 1, Kind: Stored, Tier: L1, Key: goldenKey(1, 3, 0), Size: 35904, Sum: 0xdeadbeefcafef00d},
		{Seq: 2, Kind: Removed, Tier: L2, Key: goldenKey(2, 0, 1), Size: 1 << 40, Sum: 1},
	}}
}

// goldenIdentity is what dcp derives from goldenSpec: the Python client
// computes the same namespace and chunk hashes itself.
type goldenIdentity struct {
	Spec           dcp.Spec        `json:"spec"`
	Fingerprint    string          `json:"fingerprint"`
	Namespace      dcp.Namespace   `json:"namespace"`
	SchedulerBlock int64           `json:"scheduler_block"`
	Tokens         []uint32        `json:"tokens"`
	Chunks         []dcp.ChunkHash `json:"chunks"`
	KeyText        string          `json:"key_text"`
	KeyBinary      string          `json:"key_binary"` // hex
}

func makeGoldenIdentity(t *testing.T, spec dcp.Spec) goldenIdentity {
	r, err := spec.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	tokens := make([]uint32, 2*spec.ChunkTokens+7) // two full chunks and a partial one
	for i := range tokens {
		tokens[i] = uint32(i)*2654435761 ^ 0xfffff000
	}
	k := goldenKey(5, 513, 2)
	return goldenIdentity{Spec: spec, Fingerprint: hex.EncodeToString(r.Fingerprint[:]), Namespace: r.Namespace,
		SchedulerBlock: r.SchedulerBlock, Tokens: tokens, Chunks: dcp.ChunkHashes(r.Namespace, tokens, spec.ChunkTokens),
		KeyText: k.String(), KeyBinary: hex.EncodeToString(k.Bytes())}
}

func TestGolden(t *testing.T) {
	files := map[string][]byte{}
	manifest := map[string]string{}
	for _, c := range goldenCases() {
		b, err := json.Marshal(c.v)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		files[c.name+".json"] = b
		manifest[c.name+".json"] = c.typ
	}
	bb, err := goldenBatch().MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	files["batch.bin"] = bb
	manifest["batch.bin"] = "Batch"
	id, err := json.Marshal(makeGoldenIdentity(t, goldenSpec()))
	if err != nil {
		t.Fatal(err)
	}
	files["identity.json"] = id
	manifest["identity.json"] = "identity"
	// Stage 2 of a PP-3 layout: its namespace (and so its chunk hashes)
	// is its own (dcp.Layout.PPStage).
	pp := goldenSpec()
	pp.Layout.PP, pp.Layout.PPStage = 3, 2
	id, err = json.Marshal(makeGoldenIdentity(t, pp))
	if err != nil {
		t.Fatal(err)
	}
	files["identity_pp.json"] = id
	manifest["identity_pp.json"] = "identity"
	// Subjects pins every subject an engine or rank uses, so the Python
	// client's wire.Subjects cannot drift from Go's (C9 scoping included).
	sj, err := json.Marshal(goldenSubjects())
	if err != nil {
		t.Fatal(err)
	}
	files["subjects.json"] = sj
	manifest["subjects.json"] = "subjects"
	mb, err := json.MarshalIndent(manifest, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	files["manifest.json"] = append(mb, '\n')

	if *updateGolden {
		if err := os.MkdirAll(goldenDir, 0o755); err != nil {
			t.Fatal(err)
		}
		old, _ := filepath.Glob(filepath.Join(goldenDir, "*"))
		for _, p := range old {
			if _, ok := files[filepath.Base(p)]; !ok {
				if err := os.Remove(p); err != nil {
					t.Fatal(err)
				}
			}
		}
		for n, b := range files {
			if err := os.WriteFile(filepath.Join(goldenDir, n), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	entries, err := os.ReadDir(goldenDir)
	if err != nil {
		t.Fatalf("%v (run go test ./wire -run Golden -update)", err)
	}
	if len(entries) != len(files) {
		t.Errorf("%s holds %d files, the vectors are %d (run go test ./wire -run Golden -update)", goldenDir, len(entries), len(files))
	}
	for n, want := range files {
		got, err := os.ReadFile(filepath.Join(goldenDir, n))
		if err != nil {
			t.Errorf("%s: %v (run go test ./wire -run Golden -update)", n, err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s: file differs from what Go encodes now\n file %q\n   go %q", n, got, want)
		}
	}
	// Every file decodes and re-encodes to itself.
	for _, c := range goldenCases() {
		b := files[c.name+".json"]
		fresh := reflect.New(reflect.TypeOf(c.v).Elem()).Interface()
		if err := json.Unmarshal(b, fresh); err != nil {
			t.Fatalf("%s: decode: %v", c.name, err)
		}
		again, _ := json.Marshal(fresh)
		if !bytes.Equal(again, b) {
			t.Errorf("%s: decode + encode is not the identity:\n got %s\nwant %s", c.name, again, b)
		}
	}
	var batch Batch
	if err := batch.UnmarshalBinary(files["batch.bin"]); err != nil || !reflect.DeepEqual(&batch, goldenBatch()) {
		t.Errorf("batch.bin: decoded %+v, %v", batch, err)
	}
}

// goldenSubjects names each subject of prefix "kv", rank engine0/3 and
// instance engine0.
func goldenSubjects() map[string]string {
	s := Subjects{Prefix: "kv"}
	r := Rank{Instance: "engine0", TPRank: 3}
	out := map[string]string{
		"freed": s.Freed(r), "events": s.Events(r), "heartbeat": s.Heartbeat(r),
		"inventory": s.Inventory(r), "report": s.Report(r), "coord.unscoped.lookup": s.Coord(CoordLookup),
	}
	// The engine API's ops (rankd.Op*; wire cannot import rankd).
	for _, op := range []string{"register", "store", "retrieve", "release", "status"} {
		out["engine."+op] = s.Engine(r, op)
	}
	for _, op := range EngineCoordOps {
		out["coord."+op] = s.EngineCoord(r.Instance, op)
	}
	return out
}
