package rankd

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

func testSpec() dcp.Spec {
	return dcp.Spec{Model: "m", Layout: dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}, ChunkTokens: 16,
		Groups: []dcp.Group{{Name: "a", Kind: dcp.Attention, MLA: true, BlockSize: 16, Layers: 2,
			SemanticBytes: 16 * 528, PageBytes: 16 * 561, StrideBytes: 16*561 + 37, KVFormat: "fp8"}}}
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func validStore(t testing.TB) []byte {
	return mustJSON(t, wire.StoreRequest{RequestID: "r1", Namespace: dcp.Namespace{1},
		Chunks: []wire.ChunkBlocks{{Chunk: dcp.ChunkHash{2}, Blocks: [][]int64{{3}}}},
		Event:  cuda.EventHandle{Backend: "host", Device: "d", Raw: []byte("x")}})
}

func validRetrieve(t testing.TB) []byte {
	ns := dcp.Namespace{1}
	return mustJSON(t, wire.RetrieveRequest{RestoreID: "x", Namespace: ns, Items: []wire.RetrieveItem{
		{Chunk: 0, Group: 0, Key: dcp.Key{NS: ns, Chunk: dcp.ChunkHash{2}}, Blocks: []int64{4}}}})
}

func validRegister(t testing.TB) []byte {
	h := cuda.MemHandle{Backend: "host", Device: "d", Raw: []byte("m"), Size: 1 << 20}
	return mustJSON(t, wire.RegisterRequest{Spec: testSpec(), DeviceUUID: "d",
		Pools: []wire.PoolRegistration{{Group: 0, Layer: 0, Handle: h}, {Group: 0, Layer: 1, Handle: h}}})
}

func TestDecodeValid(t *testing.T) {
	if _, err := DecodeStoreRequest(validStore(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := DecodeRetrieveRequest(validRetrieve(t)); err != nil {
		t.Fatal(err)
	}
	if _, r, err := DecodeRegisterRequest(validRegister(t)); err != nil || r.Namespace == (dcp.Namespace{}) {
		t.Fatal(err)
	}
}

// Every kind of bad input gets an error with a stable code and a message
// naming the problem.
func TestDecodeRejects(t *testing.T) {
	edit := func(data []byte, f func(m map[string]any)) []byte {
		var m map[string]any
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatal(err)
		}
		f(m)
		return mustJSON(t, m)
	}
	ns2 := dcp.Namespace{9}
	cases := []struct {
		name   string
		decode func([]byte) error
		data   []byte
		code   string
		msg    string
	}{
		{"garbage", storeDec, []byte("{nope"), wire.CodeBadRequest, "decode store request"},
		{"empty", storeDec, nil, wire.CodeBadRequest, "decode store request"},
		{"array", storeDec, []byte("[1,2]"), wire.CodeBadRequest, "decode store request"},
		{"unknown field", storeDec, edit(validStore(t), func(m map[string]any) { m["bogus"] = 1 }), wire.CodeBadRequest, "unknown field"},
		{"trailing", storeDec, append(validStore(t), []byte(` {}`)...), wire.CodeBadRequest, "trailing data"},
		{"oversize", storeDec, []byte(`{"request_id":"` + strings.Repeat("x", MaxRequestBytes) + `"}`), wire.CodeTooLarge, "exceeds"},
		{"no request id", storeDec, edit(validStore(t), func(m map[string]any) { m["request_id"] = "" }), wire.CodeBadRequest, "request id is empty"},
		{"no namespace", storeDec, edit(validStore(t), func(m map[string]any) { delete(m, "namespace") }), wire.CodeBadRequest, "namespace is missing"},
		{"bad namespace", storeDec, edit(validStore(t), func(m map[string]any) { m["namespace"] = "zz" }), wire.CodeBadRequest, "namespace"},
		{"no chunks", storeDec, edit(validStore(t), func(m map[string]any) { m["chunks"] = []any{} }), wire.CodeBadRequest, "no chunks"},
		{"no event", storeDec, edit(validStore(t), func(m map[string]any) { delete(m, "event") }), wire.CodeBadRequest, "producer event"},
		{"negative block", storeDec, edit(validStore(t), func(m map[string]any) {
			m["chunks"].([]any)[0].(map[string]any)["blocks"] = [][]int64{{-1}}
		}), wire.CodeBadRequest, "block id -1"},
		{"retrieve other namespace", retrieveDec, edit(validRetrieve(t), func(m map[string]any) { m["namespace"] = ns2 }), wire.CodeBadRequest, "not in namespace"},
		{"retrieve no blocks", retrieveDec, edit(validRetrieve(t), func(m map[string]any) {
			it := m["items"].([]any)[0].(map[string]any)
			it["blocks"] = nil
		}), wire.CodeBadRequest, "no target blocks"},
		{"retrieve group mismatch", retrieveDec, edit(validRetrieve(t), func(m map[string]any) {
			m["items"].([]any)[0].(map[string]any)["group"] = 3
		}), wire.CodeBadRequest, "does not match"},
		{"register geometry", registerDec, edit(validRegister(t), func(m map[string]any) {
			g := m["spec"].(map[string]any)["groups"].([]any)[0].(map[string]any)
			g["page_bytes"] = 1 << 20
		}), wire.CodeGeometry, "exceeds block stride"},
		{"register layout", registerDec, edit(validRegister(t), func(m map[string]any) {
			m["spec"].(map[string]any)["layout"].(map[string]any)["dcp"] = 3
		}), wire.CodeBadRequest, "not divisible"},
		{"register missing pool", registerDec, edit(validRegister(t), func(m map[string]any) {
			m["pools"] = m["pools"].([]any)[:1]
		}), wire.CodeBadRequest, "1 pools, the spec has 2"},
		{"register pool too small", registerDec, edit(validRegister(t), func(m map[string]any) {
			m["pools"].([]any)[1].(map[string]any)["handle"].(map[string]any)["size"] = 100
		}), wire.CodeGeometry, "cannot hold one"},
		{"release empty", func(b []byte) error { _, err := DecodeReleaseRequest(b); return err }, []byte(`{}`), wire.CodeBadRequest, "namespace is missing"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.decode(c.data)
			if err == nil {
				t.Fatal("accepted")
			}
			if got := Code(err); got != c.code {
				t.Fatalf("code %q, want %q (%v)", got, c.code, err)
			}
			if !strings.Contains(err.Error(), c.msg) {
				t.Fatalf("error %q does not mention %q", err, c.msg)
			}
		})
	}
}

func storeDec(b []byte) error    { _, err := DecodeStoreRequest(b); return err }
func retrieveDec(b []byte) error { _, err := DecodeRetrieveRequest(b); return err }
func registerDec(b []byte) error { _, _, err := DecodeRegisterRequest(b); return err }

// checkDecoded holds for every accepted request; errors must carry a code
// that is not internal.
func fuzzCheck(t *testing.T, err error) {
	if err == nil {
		return
	}
	if c := Code(err); c == wire.CodeInternal {
		t.Fatalf("decode error maps to code internal: %v", err)
	}
	if !errors.Is(err, ErrBadRequest) && !errors.Is(err, ErrTooLarge) && !errors.Is(err, dcp.ErrGeometry) &&
		!errors.Is(err, dcp.ErrLayout) {
		t.Fatalf("decode error wraps no sentinel: %v", err)
	}
}

func FuzzDecodeStoreRequest(f *testing.F) {
	f.Add(validStore(f))
	f.Add([]byte(`{"request_id":"a","namespace":"01000000000000000000000000000000","chunks":[{"blocks":[[]]}],"event":{"backend":"host","raw":"eA=="}}`))
	f.Add([]byte(`{}`))
	f.Add(mustBinary(f, &wire.StoreRequest{RequestID: "r1", Namespace: dcp.Namespace{1},
		Chunks: []wire.ChunkBlocks{{Chunk: dcp.ChunkHash{2}, Blocks: [][]int64{{3}, {}}}},
		Event:  cuda.EventHandle{Backend: "host", Device: "d", Raw: []byte("x")}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		req, err := DecodeStoreRequest(data)
		fuzzCheck(t, err)
		if err == nil {
			if req.RequestID == "" || len(req.Chunks) == 0 || len(req.Event.Raw) == 0 {
				t.Fatalf("accepted an incomplete store request %+v", req)
			}
			for _, c := range req.Chunks {
				for _, ids := range c.Blocks {
					for _, id := range ids {
						if id < 0 {
							t.Fatalf("accepted block id %d", id)
						}
					}
				}
			}
		}
	})
}

func FuzzDecodeRetrieveRequest(f *testing.F) {
	f.Add(validRetrieve(f))
	f.Add([]byte(`{"namespace":"01000000000000000000000000000000","items":[{"blocks":[1]}]}`))
	ns := dcp.Namespace{1}
	f.Add(mustBinary(f, &wire.RetrieveRequest{RestoreID: "x", Namespace: ns, Items: []wire.RetrieveItem{
		{Chunk: 0, Group: 0, Key: dcp.Key{NS: ns, Chunk: dcp.ChunkHash{2}}, Blocks: []int64{4}},
		{Chunk: 1, Group: 1, Key: dcp.Key{NS: ns, Chunk: dcp.ChunkHash{3}, Group: 1}, Source: wire.Source{Tier: wire.L2}, Blocks: []int64{5, 1 << 33}}}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		req, err := DecodeRetrieveRequest(data)
		fuzzCheck(t, err)
		if err == nil {
			for _, it := range req.Items {
				if it.Key.NS != req.Namespace || len(it.Blocks) == 0 || it.Group != int(it.Key.Group) {
					t.Fatalf("accepted an inconsistent item %+v", it)
				}
			}
		}
	})
}

func FuzzDecodeRegisterRequest(f *testing.F) {
	f.Add(validRegister(f))
	f.Fuzz(func(t *testing.T, data []byte) {
		req, r, err := DecodeRegisterRequest(data)
		fuzzCheck(t, err)
		if err == nil && (r == nil || len(req.Pools) == 0) {
			t.Fatal("accepted a registration without pools or a resolved spec")
		}
	})
}

func mustBinary(t testing.TB, req interface{ MarshalBinary() ([]byte, error) }) []byte {
	t.Helper()
	b, err := req.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A request decodes to the same value, or is refused with the same code,
// as JSON and as binary.
func TestDecodeBinaryMatchesJSON(t *testing.T) {
	ns := dcp.Namespace{1}
	ev := cuda.EventHandle{Backend: "host", Device: "d", Raw: []byte("x")}
	store := func(f func(r *wire.StoreRequest)) *wire.StoreRequest {
		r := &wire.StoreRequest{RequestID: "r1", Namespace: ns, Session: "s", Event: ev,
			Chunks: []wire.ChunkBlocks{{Chunk: dcp.ChunkHash{2}, Blocks: [][]int64{{3, 4}, {}}}, {Chunk: dcp.ChunkHash{3}, Blocks: [][]int64{{5}, {6}}}}}
		f(r)
		return r
	}
	many := make([]int64, MaxBlocksPerGroup+1)
	for _, c := range []struct {
		name string
		req  *wire.StoreRequest
		code string
	}{
		{"valid", store(func(*wire.StoreRequest) {}), ""},
		{"no request id", store(func(r *wire.StoreRequest) { r.RequestID = "" }), wire.CodeBadRequest},
		{"long request id", store(func(r *wire.StoreRequest) { r.RequestID = strings.Repeat("i", MaxIDBytes+1) }), wire.CodeBadRequest},
		{"no namespace", store(func(r *wire.StoreRequest) { r.Namespace = dcp.Namespace{} }), wire.CodeBadRequest},
		{"no chunks", store(func(r *wire.StoreRequest) { r.Chunks = []wire.ChunkBlocks{} }), wire.CodeBadRequest},
		{"no event", store(func(r *wire.StoreRequest) { r.Event = cuda.EventHandle{} }), wire.CodeBadRequest},
		{"no groups", store(func(r *wire.StoreRequest) { r.Chunks[1].Blocks = [][]int64{} }), wire.CodeBadRequest},
		{"too many blocks", store(func(r *wire.StoreRequest) { r.Chunks[1].Blocks[1] = many }), wire.CodeTooLarge},
	} {
		t.Run("store/"+c.name, func(t *testing.T) {
			fromJSON, jerr := DecodeStoreRequest(mustJSON(t, c.req))
			fromBin, berr := DecodeStoreRequest(mustBinary(t, c.req))
			if Code(jerr) != c.code || Code(berr) != c.code {
				t.Fatalf("codes %q (JSON: %v) and %q (binary: %v), want %q", Code(jerr), jerr, Code(berr), berr, c.code)
			}
			if c.code == "" && !reflect.DeepEqual(fromJSON, fromBin) {
				t.Fatalf("JSON decodes to %+v, binary to %+v", fromJSON, fromBin)
			}
		})
	}
	item := func(c, g int) wire.RetrieveItem {
		return wire.RetrieveItem{Chunk: c, Group: g, Key: dcp.Key{NS: ns, Chunk: dcp.ChunkHash{byte(c)}, Shard: 1, Group: uint16(g)},
			Sum: 77, Source: wire.Source{Holder: wire.Rank{Instance: "e", TPRank: 1}, Tier: wire.L2}, Blocks: []int64{int64(c), 9}}
	}
	retrieve := func(f func(r *wire.RetrieveRequest)) *wire.RetrieveRequest {
		r := &wire.RetrieveRequest{RestoreID: "x", Namespace: ns, Session: "s", Items: []wire.RetrieveItem{item(0, 0), item(0, 1), item(1, 0)}}
		f(r)
		return r
	}
	overItems := make([]wire.RetrieveItem, MaxItemsPerRetrieve+1)
	for i := range overItems {
		overItems[i] = item(0, 0)
	}
	for _, c := range []struct {
		name string
		req  *wire.RetrieveRequest
		code string
	}{
		{"valid", retrieve(func(*wire.RetrieveRequest) {}), ""},
		{"no restore id", retrieve(func(r *wire.RetrieveRequest) { r.RestoreID = "" }), ""},
		{"long restore id", retrieve(func(r *wire.RetrieveRequest) { r.RestoreID = strings.Repeat("i", MaxIDBytes+1) }), wire.CodeBadRequest},
		{"no namespace", retrieve(func(r *wire.RetrieveRequest) {
			r.Namespace = dcp.Namespace{}
			r.Items = []wire.RetrieveItem{{Blocks: []int64{1}}}
		}), wire.CodeBadRequest},
		{"no items", retrieve(func(r *wire.RetrieveRequest) { r.Items = []wire.RetrieveItem{} }), wire.CodeBadRequest},
		{"no blocks", retrieve(func(r *wire.RetrieveRequest) { r.Items[2].Blocks = []int64{} }), wire.CodeBadRequest},
		{"bad tier", retrieve(func(r *wire.RetrieveRequest) { r.Items[1].Source.Tier = 7 }), wire.CodeBadRequest},
		{"too many blocks", retrieve(func(r *wire.RetrieveRequest) { r.Items[1].Blocks = many }), wire.CodeTooLarge},
		{"too many items", retrieve(func(r *wire.RetrieveRequest) { r.Items = overItems }), wire.CodeTooLarge},
	} {
		t.Run("retrieve/"+c.name, func(t *testing.T) {
			fromJSON, jerr := DecodeRetrieveRequest(mustJSON(t, c.req))
			fromBin, berr := DecodeRetrieveRequest(mustBinary(t, c.req))
			if Code(jerr) != c.code || Code(berr) != c.code {
				t.Fatalf("codes %q (JSON: %v) and %q (binary: %v), want %q", Code(jerr), jerr, Code(berr), berr, c.code)
			}
			if c.code == "" && !reflect.DeepEqual(fromJSON, fromBin) {
				t.Fatalf("JSON decodes to %+v, binary to %+v", fromJSON, fromBin)
			}
		})
	}
	// Block ids the binary form carries unsigned: 2^63 and above decode
	// negative and are refused, as a negative id in JSON.
	p := mustBinary(t, store(func(r *wire.StoreRequest) { r.Chunks[1].Blocks[1] = []int64{1 << 40} }))
	binary.BigEndian.PutUint64(p[len(p)-8:], 1<<63)
	if _, err := DecodeStoreRequest(p); Code(err) != wire.CodeBadRequest || !strings.Contains(err.Error(), "block id -9223372036854775808") {
		t.Fatalf("block id 2^63: %v", err)
	}
	if _, err := DecodeStoreRequest(append([]byte("KVS1"), make([]byte, MaxRequestBytes)...)); Code(err) != wire.CodeTooLarge {
		t.Fatalf("oversize binary store: %v", err)
	}
}
