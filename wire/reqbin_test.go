package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

var testLimits = RequestLimits{MaxChunks: 8, MaxItems: 8, MaxBlocks: 8}

func goldenBin(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(compactDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func storeDec(p []byte) (any, error)    { return DecodeStoreBinary(p, testLimits) }
func retrieveDec(p []byte) (any, error) { return DecodeRetrieveBinary(p, testLimits) }

// Every proper prefix of a valid request, and the request with a byte
// more, is refused as malformed.
func TestRequestBinaryTruncatedAndTrailing(t *testing.T) {
	for _, c := range []struct {
		file string
		dec  func([]byte) (any, error)
	}{{"store_request.bin", storeDec}, {"store_request_pos.bin", storeDec}, {"retrieve_request.bin", retrieveDec},
		{"retrieve_request_skip.bin", retrieveDec}} {
		p := goldenBin(t, c.file)
		if _, err := c.dec(p); err != nil {
			t.Fatalf("%s: %v", c.file, err)
		}
		for n := range len(p) {
			if _, err := c.dec(p[:n]); !errors.Is(err, ErrMalformed) {
				t.Fatalf("%s cut to %d of %d bytes: %v, want ErrMalformed", c.file, n, len(p), err)
			}
		}
		if _, err := c.dec(append(bytes.Clone(p), 0)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "left") {
			t.Fatalf("%s with a trailing byte: %v", c.file, err)
		}
	}
}

// Offsets into the golden vectors (their layout is fixed by the values in
// golden_test.go: ids of 10 and 17 bytes, a 32-character session).
const (
	storeChunkCountAt = 4 + 1 + 2 + 17 + 16 + 1 + 32 + 1 + 4 + 1 + 40 + 2 + 64 // after the event
	retrieveKeysAt    = 4 + 1 + 2 + 10 + 16 + 1 + 32
	retrieveItemsAt   = retrieveKeysAt + 4 + 2*16 + 2 + 2*(1+7+2) + 4
)

func TestRequestBinaryRejects(t *testing.T) {
	store, retrieve := goldenBin(t, "store_request.bin"), goldenBin(t, "retrieve_request.bin")
	edit := func(p []byte, f func(q []byte)) []byte {
		q := bytes.Clone(p)
		f(q)
		return q
	}
	if got := binary.BigEndian.Uint32(store[storeChunkCountAt:]); got != 2 {
		t.Fatalf("store chunk count at %d reads %d, want 2: the offsets are stale", storeChunkCountAt, got)
	}
	if got := binary.BigEndian.Uint32(retrieve[retrieveItemsAt-4:]); got != 2 {
		t.Fatalf("retrieve item count at %d reads %d, want 2: the offsets are stale", retrieveItemsAt-4, got)
	}
	cases := []struct {
		name string
		dec  func([]byte) (any, error)
		p    []byte
		want error
		msg  string
	}{
		{"store json", storeDec, []byte(`{"request_id":"x"}`), ErrMalformed, "missing magic"},
		{"store empty", storeDec, nil, ErrMalformed, "missing magic"},
		{"store retrieve magic", storeDec, retrieve, ErrMalformed, "missing magic"},
		{"store version 3", storeDec, edit(store, func(q []byte) { q[3] = '3' }), ErrMalformed, `version '3', this build reads '1' or '2'`},
		{"store width 5", storeDec, edit(store, func(q []byte) { q[4] = 5 }), ErrMalformed, "block id width 5"},
		{"store width 4 of 8-byte ids", storeDec, edit(store, func(q []byte) { q[4] = 4 }), ErrMalformed, "left"},
		{"store chunks over limit", storeDec, edit(store, func(q []byte) { binary.BigEndian.PutUint32(q[storeChunkCountAt:], 9) }),
			ErrOverLimit, "9 chunks, limit 8"},
		{"store chunks over bytes", storeDec, edit(store, func(q []byte) { binary.BigEndian.PutUint32(q[storeChunkCountAt:], 8) }),
			ErrMalformed, "8 chunks need 136 bytes"},
		{"store blocks over limit", storeDec, edit(store, func(q []byte) { binary.BigEndian.PutUint32(q[storeChunkCountAt+4+17:], 9) }),
			ErrOverLimit, "chunk 0 group 0 lists 9 block ids, limit 8"},
		{"retrieve json", retrieveDec, []byte(`{}`), ErrMalformed, "missing magic"},
		{"retrieve version 0", retrieveDec, edit(retrieve, func(q []byte) { q[3] = '0' }), ErrMalformed, "version '0'"},
		{"retrieve items over limit", retrieveDec, edit(retrieve, func(q []byte) { binary.BigEndian.PutUint32(q[retrieveItemsAt-4:], 9) }),
			ErrOverLimit, "9 items, limit 8"},
		{"retrieve keys over bytes", retrieveDec, edit(retrieve, func(q []byte) { binary.BigEndian.PutUint32(q[retrieveKeysAt:], 1<<30) }),
			ErrMalformed, "keys need"},
		{"retrieve key index", retrieveDec, edit(retrieve, func(q []byte) { binary.BigEndian.PutUint32(q[retrieveItemsAt+8:], 2) }),
			ErrMalformed, "item 0: key 2 of 2"},
		{"retrieve holder index", retrieveDec, edit(retrieve, func(q []byte) {
			binary.BigEndian.PutUint16(q[retrieveItemsAt+retrieveItemSize+20:], 7)
		}), ErrMalformed, "item 1: holder 7 of 2"},
		{"retrieve blocks over limit", retrieveDec, edit(retrieve, func(q []byte) { binary.BigEndian.PutUint32(q[retrieveItemsAt+23:], 9) }),
			ErrOverLimit, "item 0 lists 9 block ids, limit 8"},
		{"retrieve blocks over bytes", retrieveDec, edit(retrieve, func(q []byte) { binary.BigEndian.PutUint32(q[retrieveItemsAt+23:], 8) }),
			ErrMalformed, "left"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v, err := c.dec(c.p)
			if !errors.Is(err, c.want) {
				t.Fatalf("got %+v, %v; want %v", v, err, c.want)
			}
			if !strings.Contains(err.Error(), c.msg) {
				t.Fatalf("error %q does not mention %q", err, c.msg)
			}
		})
	}
}

// A block id of 2^63 or more (width 8) decodes negative: the receiver's
// validation refuses it, as it refuses a negative id in JSON.
func TestRequestBinaryHighBlockID(t *testing.T) {
	p := bytes.Clone(goldenBin(t, "store_request.bin"))
	binary.BigEndian.PutUint64(p[len(p)-8:], 1<<63)
	req, err := DecodeStoreBinary(p, testLimits)
	if err != nil {
		t.Fatal(err)
	}
	if got := req.Chunks[1].Blocks[1][0]; got >= 0 {
		t.Fatalf("block id 2^63 decoded as %d", got)
	}
}

// A store request names its chunks' positions in KVS2, and only when one
// is not 0: an engine that sends none still talks KVS1 to an older rankd.
func TestRequestBinaryStorePositions(t *testing.T) {
	store := *goldenValue(t, "store_request").(*StoreRequest)
	store.Chunks = slices.Clone(store.Chunks)
	p, err := store.MarshalBinary()
	if err != nil || string(p[:4]) != storeMagic {
		t.Fatalf("no positions: magic %q, %v; want %q", p[:4], err, storeMagic)
	}
	store.Chunks[1].Pos = 7
	q, err := store.MarshalBinary()
	if err != nil || string(q[:4]) != storeMagicPos || len(q) != len(p)+4*len(store.Chunks) {
		t.Fatalf("a position: magic %q, %d bytes (KVS1 %d), %v; want %q and 4 bytes a chunk more", q[:4], len(q), len(p), err, storeMagicPos)
	}
	back, err := DecodeStoreBinary(q, testLimits)
	if err != nil || !reflect.DeepEqual(back, &store) {
		t.Fatalf("decoded %+v, %v; want %+v", back, err, store)
	}
	if back.Chunks[0].Pos != 0 || back.Chunks[1].Pos != 7 {
		t.Fatalf("positions %d, %d; want 0, 7", back.Chunks[0].Pos, back.Chunks[1].Pos)
	}
}

// A retrieve request names its items' skipped blocks in KVR2, and only
// when one is not 0: an engine that skips none still talks KVR1 to an
// older rankd, and a decoder of KVR1 alone (a rankd from before Skip)
// refuses KVR2 instead of placing every page.
func TestRequestBinaryRetrieveSkip(t *testing.T) {
	req := *goldenValue(t, "retrieve_request").(*RetrieveRequest)
	req.Items = slices.Clone(req.Items)
	p, err := req.MarshalBinary()
	if err != nil || string(p[:4]) != retrieveMagic {
		t.Fatalf("no skip: magic %q, %v; want %q", p[:4], err, retrieveMagic)
	}
	req.Items[1].Skip = 1<<32 - 1
	q, err := req.MarshalBinary()
	if err != nil || string(q[:4]) != retrieveMagicSkip || len(q) != len(p)+4*len(req.Items) {
		t.Fatalf("a skip: magic %q, %d bytes (KVR1 %d), %v; want %q and 4 bytes an item more", q[:4], len(q), len(p), err, retrieveMagicSkip)
	}
	back, err := DecodeRetrieveBinary(q, testLimits)
	if err != nil || !reflect.DeepEqual(back, &req) {
		t.Fatalf("decoded %+v, %v; want %+v", back, err, req)
	}
	old := &reqReader{what: "retrieve request", p: q}
	if old.header(retrieveMagic); !errors.Is(old.err, ErrMalformed) || !strings.Contains(old.err.Error(), `version '2', this build reads '1'`) {
		t.Fatalf("a KVR1-only decoder on KVR2: %v", old.err)
	}
	for _, n := range []int{-1, 1 << 32} {
		req.Items[1].Skip = n
		if _, err := req.MarshalBinary(); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "skips") {
			t.Errorf("skip %d: %v", n, err)
		}
	}
}

func TestRequestBinaryEncodeRefuses(t *testing.T) {
	store := *goldenValue(t, "store_request").(*StoreRequest)
	store.Chunks = []ChunkBlocks{{Chunk: goldenChunk(1), Blocks: [][]int64{{1, -2}}}}
	if _, err := store.MarshalBinary(); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "block id -2 is negative") {
		t.Fatalf("negative block id: %v", err)
	}
	retrieve := *goldenValue(t, "retrieve_request").(*RetrieveRequest)
	items := retrieve.Items
	for _, c := range []struct {
		msg  string
		edit func(it *RetrieveItem)
	}{
		{"is not in namespace", func(it *RetrieveItem) { it.Key.NS[0] ^= 1 }},
		{"group 1, its key's group 0", func(it *RetrieveItem) { it.Key.Group = 0 }},
		{"chunk index -1", func(it *RetrieveItem) { it.Chunk = -1 }},
		{"holder engine0/70000 does not fit", func(it *RetrieveItem) { it.Source.Holder.TPRank = 70000 }},
		{"block id -1 is negative", func(it *RetrieveItem) { it.Blocks = []int64{-1} }},
	} {
		it := items[1]
		c.edit(&it)
		retrieve.Items = []RetrieveItem{items[0], it}
		if _, err := retrieve.MarshalBinary(); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: %v", c.msg, err)
		}
	}
}

// Requests round-trip, with the key table and the holder table shared by
// items and the block width following the largest id.
func TestRequestBinaryRoundTrip(t *testing.T) {
	ns := goldenNS()
	req := &RetrieveRequest{Namespace: ns, Session: goldenSession}
	for c := range 3 {
		for g := range 2 {
			req.Items = append(req.Items, RetrieveItem{Chunk: c, Group: g, Key: goldenKey(byte(c), 1, uint16(g)),
				Sum: uint64(c*2 + g), Source: Source{Holder: Rank{Instance: "e", TPRank: g}, Tier: L1}, Blocks: []int64{int64(c), 1<<32 - 1}})
		}
	}
	p, err := req.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if p[4] != 4 {
		t.Fatalf("width %d for ids below 2^32, want 4", p[4])
	}
	if want := 4 + 1 + 2 + 16 + 1 + 32 + 4 + 3*16 + 2 + 2*(1+1+2) + 4 + 6*retrieveItemSize + 6*2*4; len(p) != want {
		t.Fatalf("%d bytes, want %d (3 keys and 2 holders in the tables)", len(p), want)
	}
	back, err := DecodeRetrieveBinary(p, testLimits)
	if err != nil || !reflect.DeepEqual(back, req) {
		t.Fatalf("decoded %+v, %v", back, err)
	}
	req.Items[5].Blocks[1] = 1 << 32
	if p, err = req.MarshalBinary(); err != nil || p[4] != 8 {
		t.Fatalf("an id of 2^32: width %d, %v; want 8", p[4], err)
	}
	if back, err = DecodeRetrieveBinary(p, testLimits); err != nil || !reflect.DeepEqual(back, req) {
		t.Fatalf("decoded %+v, %v", back, err)
	}
	peek, err := PeekRetrieveBinary(p[:len(p)-1], testLimits)
	if err != nil || len(peek.Items) != 6 || peek.Items[5].Chunk != 2 || peek.Items[5].Group != 1 || peek.Items[5].Blocks != nil {
		t.Fatalf("peek of a request with its last byte cut: %+v, %v", peek, err)
	}
}

func fuzzRequestErr(t *testing.T, err error) {
	if err != nil && !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrOverLimit) {
		t.Fatalf("decode error wraps no sentinel: %v", err)
	}
}

func FuzzDecodeStoreBinary(f *testing.F) {
	f.Add(goldenBin(f, "store_request.bin"))
	f.Add(goldenBin(f, "store_request_pos.bin"))
	f.Add([]byte(storeMagic + "\x04"))
	f.Fuzz(func(t *testing.T, p []byte) {
		req, err := DecodeStoreBinary(p, testLimits)
		fuzzRequestErr(t, err)
		if err != nil {
			return
		}
		for _, c := range req.Chunks {
			for _, ids := range c.Blocks {
				if len(ids) > testLimits.MaxBlocks {
					t.Fatalf("accepted %d block ids", len(ids))
				}
			}
		}
		if hasNegative(req) {
			return // the encoder refuses these; the receiver's validation too
		}
		q, err := req.MarshalBinary()
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		back, err := DecodeStoreBinary(q, testLimits)
		if err != nil || !reflect.DeepEqual(back, req) {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, req)
		}
	})
}

func hasNegative(req *StoreRequest) bool {
	for _, c := range req.Chunks {
		for _, ids := range c.Blocks {
			for _, id := range ids {
				if id < 0 {
					return true
				}
			}
		}
	}
	return false
}

func FuzzDecodeRetrieveBinary(f *testing.F) {
	f.Add(goldenBin(f, "retrieve_request.bin"))
	f.Add(goldenBin(f, "retrieve_request_skip.bin"))
	f.Add([]byte(retrieveMagic + "\x08"))
	f.Fuzz(func(t *testing.T, p []byte) {
		req, err := DecodeRetrieveBinary(p, testLimits)
		fuzzRequestErr(t, err)
		peek, perr := PeekRetrieveBinary(p, testLimits)
		fuzzRequestErr(t, perr)
		if err != nil {
			return
		}
		if perr != nil || len(peek.Items) != len(req.Items) {
			t.Fatalf("peek of an accepted request: %v", perr)
		}
		for _, it := range req.Items {
			if it.Key.NS != req.Namespace || it.Group != int(it.Key.Group) || len(it.Blocks) > testLimits.MaxBlocks {
				t.Fatalf("accepted an inconsistent item %+v", it)
			}
			for _, id := range it.Blocks {
				if id < 0 {
					return
				}
			}
		}
		q, err := req.MarshalBinary()
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		back, err := DecodeRetrieveBinary(q, testLimits)
		if err != nil || !reflect.DeepEqual(back, req) {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, req)
		}
	})
}
