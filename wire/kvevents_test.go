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

// TestKVEventsGolden pins the JSON of a KV event batch to vLLM's field
// names (testdata/kvevents/batch.json; -update rewrites it): the tag as
// "type", BlockStored's required fields present even when null or empty,
// the optional ones left out when unset, and a round trip through
// UnmarshalJSON giving the same value back.
func TestKVEventsGolden(t *testing.T) {
	a, b := goldenChunk(0x11), goldenChunk(0x22)
	batch := KVEventBatch{Ts: 1767225600.25, Events: []KVEvent{
		&AllBlocksCleared{},
		&BlockStored{BlockHashes: []dcp.ChunkHash{a, b}, TokenIDs: []int{}, BlockSize: 256, Medium: MediumCPU},
		&BlockStored{BlockHashes: []dcp.ChunkHash{a}, TokenIDs: []int{}, BlockSize: 256, Medium: MediumStorage,
			Ownership: KVOwnershipL2},
		&BlockRemoved{BlockHashes: []dcp.ChunkHash{b}, Medium: MediumCPU},
		&BlockRemoved{BlockHashes: []dcp.ChunkHash{a}, Medium: MediumStorage, Ownership: KVOwnershipL3},
	}}
	got, err := json.MarshalIndent(&batch, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	path := filepath.Join("testdata", "kvevents", "batch.json")
	if *updateGolden {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./wire -run KVEventsGolden -update)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("KV event batch JSON drifted from %s:\ngot:\n%s\nwant:\n%s", path, got, want)
	}
	var back KVEventBatch
	if err := json.Unmarshal(want, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, batch) {
		t.Fatalf("round trip:\ngot  %#v\nwant %#v", back, batch)
	}
}

// TestKVEventsUnknownType: a tag the decoder does not know is malformed,
// not silently skipped (a router would miss a removal).
func TestKVEventsUnknownType(t *testing.T) {
	var b KVEventBatch
	err := json.Unmarshal([]byte(`{"ts":1,"events":[{"type":"BlockMoved"}]}`), &b)
	if err == nil || !bytesContains(err.Error(), "BlockMoved") {
		t.Fatalf("err = %v, want a malformed-event error naming the type", err)
	}
}

func bytesContains(s, sub string) bool { return bytes.Contains([]byte(s), []byte(sub)) }

func TestKVEventsSubjects(t *testing.T) {
	s := Subjects{Prefix: "p"}
	if got := s.KVEvents("eng-a"); got != "p.kvevents.eng-a" {
		t.Fatalf("KVEvents = %q", got)
	}
	if got := s.KVEventsAll(); got != "p.kvevents.*" {
		t.Fatalf("KVEventsAll = %q", got)
	}
}
