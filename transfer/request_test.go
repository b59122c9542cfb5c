package transfer

import (
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// TestRequestsOfWire: StoreRequest and RetrieveRequest are their wire
// requests plus what the rankd adds from the message (the caller, STYLE
// 32; a retrieve's pace, from its header or the rank's flag), field for
// field, and the Of functions copy every field: a field added to the wire
// request fails here until the engine's request and its Of function carry
// it.
func TestRequestsOfWire(t *testing.T) {
	sameFields := func(w, e reflect.Type, added ...string) {
		t.Helper()
		var got []string
		for i := w.NumField(); i < e.NumField(); i++ {
			got = append(got, e.Field(i).Name)
		}
		if e.NumField() != w.NumField()+len(added) || !reflect.DeepEqual(got, added) {
			t.Fatalf("%s has %d fields, %s %d: want the wire fields, then %v (have %v)", e, e.NumField(), w, w.NumField(), added, got)
		}
		for i := range w.NumField() {
			if wf, ef := w.Field(i), e.Field(i); wf.Name != ef.Name || wf.Type != ef.Type {
				t.Fatalf("field %d: %s %s in %s, %s %s in %s", i, wf.Name, wf.Type, w, ef.Name, ef.Type, e)
			}
		}
	}
	sameFields(reflect.TypeFor[wire.StoreRequest](), reflect.TypeFor[StoreRequest](), "Caller")
	sameFields(reflect.TypeFor[wire.RetrieveRequest](), reflect.TypeFor[RetrieveRequest](), "Caller", "Pace")

	ns := dcp.Namespace{1}
	ws := wire.StoreRequest{RequestID: "r", Namespace: ns, Session: "s", Chunks: []wire.ChunkBlocks{{Blocks: [][]int64{{1}}}},
		Event: cuda.EventHandle{Backend: "host", Raw: []byte{1}}}
	if got, want := StoreRequestOf(&ws, "engine/a"), (StoreRequest{RequestID: "r", Namespace: ns, Session: "s",
		Chunks: ws.Chunks, Event: ws.Event, Caller: "engine/a"}); !reflect.DeepEqual(got, want) {
		t.Fatalf("StoreRequestOf = %+v, want %+v", got, want)
	}
	wr := wire.RetrieveRequest{RestoreID: "x", Namespace: ns, Session: "s", Items: []wire.RetrieveItem{{Chunk: 1}}}
	if got, want := RetrieveRequestOf(&wr, "engine/a"), (RetrieveRequest{RestoreID: "x", Namespace: ns, Session: "s",
		Items: wr.Items, Caller: "engine/a"}); !reflect.DeepEqual(got, want) {
		t.Fatalf("RetrieveRequestOf = %+v, want %+v", got, want)
	}
}
