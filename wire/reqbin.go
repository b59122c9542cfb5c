package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/kvtier/kvtier/dcp"
)

// Binary store and retrieve requests (engine -> rankd). As JSON a restore's
// retrieve request is mostly text to parse: every item repeats the
// namespace and the chunk hash of its key in hex, and every block id is a
// decimal number; rankd spent ~22 ms decoding the retrieve of a 1.3 GB
// restore. The binary forms below carry the same values with the
// namespace once, each chunk hash once (a key table), fixed-width fields
// and the block ids packed. A rankd accepts both on engine.store and
// engine.retrieve and tells them apart by the first bytes: a binary request
// starts with its magic, JSON with '{' or white space. Replies stay JSON.
// Big-endian throughout.
//
// Store request:
//
//	magic "KVS1" | u8 W (block id width: 4 or 8)
//	u16 len(request_id) | request_id
//	namespace (16 B)
//	u8 len(session) | session
//	event: u8 len(backend) | backend | u8 len(device) | device | u16 len(raw) | raw
//	u32 N | N x (chunk hash (16 B) | u8 G | G x u32 block count)
//	block ids: W bytes each, chunk by chunk, group by group
//
// Store request with chunk positions (ChunkBlocks.Pos), the same but for
// the magic and a u32 after each chunk hash:
//
//	magic "KVS2" | u8 W
//	... as KVS1 up to the chunk count ...
//	u32 N | N x (chunk hash (16 B) | u32 pos | u8 G | G x u32 block count)
//	block ids: as KVS1
//
// The encoder writes KVS1 when every position is 0 and KVS2 otherwise, so
// an engine that sends no positions still talks to a rankd older than KVS2
// (which refuses KVS2 as a version it cannot read); a decoder reads both
// (KVS1: every position 0).
//
// Retrieve request:
//
//	magic "KVR1" | u8 W (block id width: 4 or 8)
//	u16 len(restore_id) | restore_id
//	namespace (16 B)
//	u8 len(session) | session
//	u32 K | K x chunk hash (16 B)                  the key table
//	u16 H | H x (u8 len(instance) | instance | u16 tp_rank)   the holders
//	u32 N | N x item (27 B):
//	    u32 chunk | u16 group | u16 shard | u32 key index | u64 sum
//	    | u16 holder index | u8 tier | u32 block count
//	block ids: W bytes each, item by item
//
// Retrieve request with skipped blocks (RetrieveItem.Skip), the same but
// for the magic and a u32 at the end of each item:
//
//	magic "KVR2" | u8 W
//	... as KVR1 up to the item count ...
//	u32 N | N x item (31 B): a KVR1 item | u32 skip
//	block ids: as KVR1
//
// The encoder writes KVR1 when every Skip is 0 and KVR2 otherwise, as for
// KVS1/KVS2: a rankd from before Skip refuses KVR2 as a version it cannot
// read rather than placing pages the engine holds.
//
// A decoded item is RetrieveItem{Chunk, Group, Key: {namespace,
// keys[key index], shard, group}, Sum, Source: {holders[holder index],
// tier}, Blocks}: the key's namespace and group are the request's and the
// item's by construction (the JSON form can say otherwise, which rankd
// refuses). The block ids are unsigned on the wire: with W = 8 one at or
// above 2^63 decodes negative, which rankd refuses as in JSON. The encoder
// picks W = 4 when every block id fits in 32 bits.
//
// A decoder bounds every count by the bytes left before it allocates and
// the chunk, item and block counts by RequestLimits (ErrOverLimit), and
// refuses a bad magic, a width other than 4 or 8, an index outside its
// table and any byte after the last block id (ErrMalformed). Whether the
// values make a valid request (ids, namespace, group counts, tiers) is the
// receiver's check, the same for both forms.
const (
	storeMagic        = "KVS1"
	storeMagicPos     = "KVS2" // KVS1 with a position per chunk
	retrieveMagic     = "KVR1"
	retrieveMagicSkip = "KVR2" // KVR1 with a skip per item
	// storeFamily and retrieveFamily are the magics without their version
	// digit: a request starting with one is binary, of some version.
	storeFamily      = "KVS"
	retrieveFamily   = "KVR"
	retrieveItemSize = 4 + 2 + 2 + 4 + 8 + 2 + 1 + 4
	retrieveItemSkip = retrieveItemSize + 4 // KVR2
)

// ErrOverLimit: a decoded message has more of something than its
// RequestLimits allow (rankd answers too_large).
var ErrOverLimit = errors.New("wire: message over a limit")

// RequestLimits bounds what a binary request decoder allocates. A zero
// field allows none.
type RequestLimits struct {
	MaxChunks int // chunks of one store request
	MaxItems  int // items of one retrieve request
	MaxBlocks int // block ids of one group of a chunk, or of one retrieve item
}

// IsBinaryStore reports whether p is a binary store request (of any
// version: a version this build cannot read is an error of DecodeStoreBinary).
func IsBinaryStore(p []byte) bool { return len(p) >= 3 && string(p[:3]) == storeFamily }

// IsBinaryRetrieve reports whether p is a binary retrieve request (of any version).
func IsBinaryRetrieve(p []byte) bool { return len(p) >= 3 && string(p[:3]) == retrieveFamily }

// blockWidth is 4 when every id fits in 32 unsigned bits, else 8.
func blockWidth(fits bool) byte {
	if fits {
		return 4
	}
	return 8
}

func fitsU32(ids []int64) bool {
	for _, id := range ids {
		if uint64(id) > math.MaxUint32 {
			return false
		}
	}
	return true
}

func appendBlocks(dst []byte, w byte, ids []int64) []byte {
	if w == 4 {
		for _, id := range ids {
			dst = binary.BigEndian.AppendUint32(dst, uint32(id))
		}
		return dst
	}
	for _, id := range ids {
		dst = binary.BigEndian.AppendUint64(dst, uint64(id))
	}
	return dst
}

func appendStr8(dst []byte, s string) []byte { return append(append(dst, byte(len(s))), s...) }

func appendStr16(dst []byte, s string) []byte {
	return append(binary.BigEndian.AppendUint16(dst, uint16(len(s))), s...)
}

// AppendBinary appends the binary encoding of r. It fails (ErrMalformed)
// for a request the form cannot carry: a request id over 65535 bytes, a
// session, event backend or device over 255 bytes, an event handle over
// 65535 bytes, more than 255 groups in a chunk, more than 2^32-1 chunks or
// block ids in a group, or a negative block id.
func (r *StoreRequest) AppendBinary(dst []byte) ([]byte, error) {
	bad := func(format string, args ...any) ([]byte, error) {
		return dst, fmt.Errorf("encode store request: "+format+": %w", append(args, ErrMalformed)...)
	}
	switch {
	case len(r.RequestID) > math.MaxUint16:
		return bad("request id of %d B, limit %d", len(r.RequestID), math.MaxUint16)
	case len(r.Session) > math.MaxUint8 || len(r.Event.Backend) > math.MaxUint8 || len(r.Event.Device) > math.MaxUint8:
		return bad("session %d B, event backend %d B, event device %d B: limit %d each",
			len(r.Session), len(r.Event.Backend), len(r.Event.Device), math.MaxUint8)
	case len(r.Event.Raw) > math.MaxUint16:
		return bad("event handle of %d B, limit %d", len(r.Event.Raw), math.MaxUint16)
	case uint64(len(r.Chunks)) > math.MaxUint32:
		return bad("%d chunks, limit %d", len(r.Chunks), uint64(math.MaxUint32))
	}
	fits, pos := true, false
	for i := range r.Chunks {
		c := &r.Chunks[i]
		pos = pos || c.Pos != 0
		if len(c.Blocks) > math.MaxUint8 {
			return bad("chunk %d has %d groups, limit %d", i, len(c.Blocks), math.MaxUint8)
		}
		for g, ids := range c.Blocks {
			if uint64(len(ids)) > math.MaxUint32 {
				return bad("chunk %d group %d has %d block ids, limit %d", i, g, len(ids), uint64(math.MaxUint32))
			}
			for _, id := range ids {
				if id < 0 {
					return bad("chunk %d group %d: block id %d is negative", i, g, id)
				}
			}
			fits = fits && fitsU32(ids)
		}
	}
	w := blockWidth(fits)
	if pos {
		dst = append(dst, storeMagicPos...)
	} else {
		dst = append(dst, storeMagic...)
	}
	dst = append(dst, w)
	dst = appendStr16(dst, r.RequestID)
	dst = append(dst, r.Namespace[:]...)
	dst = appendStr8(dst, r.Session)
	dst = appendStr8(dst, r.Event.Backend)
	dst = appendStr8(dst, r.Event.Device)
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(r.Event.Raw)))
	dst = append(dst, r.Event.Raw...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(r.Chunks)))
	for i := range r.Chunks {
		c := &r.Chunks[i]
		dst = append(dst, c.Chunk[:]...)
		if pos {
			dst = binary.BigEndian.AppendUint32(dst, c.Pos)
		}
		dst = append(dst, byte(len(c.Blocks)))
		for _, ids := range c.Blocks {
			dst = binary.BigEndian.AppendUint32(dst, uint32(len(ids)))
		}
	}
	for i := range r.Chunks {
		for _, ids := range r.Chunks[i].Blocks {
			dst = appendBlocks(dst, w, ids)
		}
	}
	return dst, nil
}

// MarshalBinary returns the binary encoding of r (AppendBinary).
func (r *StoreRequest) MarshalBinary() ([]byte, error) {
	n := 64 + len(r.RequestID) + len(r.Session) + len(r.Event.Backend) + len(r.Event.Device) + len(r.Event.Raw)
	for i := range r.Chunks {
		n += 16 + 4 + 1 + 4*len(r.Chunks[i].Blocks)
		for _, ids := range r.Chunks[i].Blocks {
			n += 8 * len(ids)
		}
	}
	return r.AppendBinary(make([]byte, 0, n))
}

// AppendBinary appends the binary encoding of r. It fails (ErrMalformed)
// for a request the form cannot carry: a restore id over 65535 bytes, a
// session over 255 bytes, an item whose key is in another namespace or
// names another group than the item, a chunk index or block count outside
// 0..2^32-1, a group outside 0..65535, a holder whose instance is over
// 255 bytes or whose TP rank is outside 0..65535, more than 65535 holders,
// a tier over 255, a negative block id or a Skip outside 0..2^32-1.
func (r *RetrieveRequest) AppendBinary(dst []byte) ([]byte, error) {
	bad := func(format string, args ...any) ([]byte, error) {
		return dst, fmt.Errorf("encode retrieve request: "+format+": %w", append(args, ErrMalformed)...)
	}
	switch {
	case len(r.RestoreID) > math.MaxUint16:
		return bad("restore id of %d B, limit %d", len(r.RestoreID), math.MaxUint16)
	case len(r.Session) > math.MaxUint8:
		return bad("session of %d B, limit %d", len(r.Session), math.MaxUint8)
	case uint64(len(r.Items)) > math.MaxUint32:
		return bad("%d items, limit %d", len(r.Items), uint64(math.MaxUint32))
	}
	keys := make(map[dcp.ChunkHash]uint32)
	var keyList []dcp.ChunkHash
	holders := make(map[Rank]uint16)
	var holderList []Rank
	keyIdx := make([]uint32, len(r.Items))
	holderIdx := make([]uint16, len(r.Items))
	fits, skips := true, false
	var lastKey dcp.ChunkHash
	var lastIdx uint32
	for i := range r.Items {
		it := &r.Items[i]
		switch {
		case it.Key.NS != r.Namespace:
			return bad("item %d key %s is not in namespace %s", i, it.Key, r.Namespace)
		case it.Group < 0 || it.Group > math.MaxUint16 || it.Group != int(it.Key.Group):
			return bad("item %d group %d, its key's group %d: want the same, in 0..%d", i, it.Group, it.Key.Group, math.MaxUint16)
		case it.Chunk < 0 || uint64(it.Chunk) > math.MaxUint32:
			return bad("item %d chunk index %d outside 0..%d", i, it.Chunk, uint64(math.MaxUint32))
		case uint64(len(it.Blocks)) > math.MaxUint32:
			return bad("item %d has %d block ids, limit %d", i, len(it.Blocks), uint64(math.MaxUint32))
		case it.Skip < 0 || uint64(it.Skip) > math.MaxUint32:
			return bad("item %d skips %d blocks, outside 0..%d", i, it.Skip, uint64(math.MaxUint32))
		}
		skips = skips || it.Skip != 0
		for _, id := range it.Blocks {
			if id < 0 {
				return bad("item %d: block id %d is negative", i, id)
			}
		}
		fits = fits && fitsU32(it.Blocks)
		if i == 0 || it.Key.Chunk != lastKey {
			idx, ok := keys[it.Key.Chunk]
			if !ok {
				idx = uint32(len(keyList))
				keys[it.Key.Chunk] = idx
				keyList = append(keyList, it.Key.Chunk)
			}
			lastKey, lastIdx = it.Key.Chunk, idx
		}
		keyIdx[i] = lastIdx
		h := it.Source.Holder
		hi, ok := holders[h]
		if !ok {
			if len(h.Instance) > math.MaxUint8 || h.TPRank < 0 || h.TPRank > math.MaxUint16 {
				return bad("item %d holder %s does not fit (instance <= %d B, TP rank in 0..%d)", i, h, math.MaxUint8, math.MaxUint16)
			}
			if len(holderList) == math.MaxUint16 {
				return bad("more than %d holders", math.MaxUint16)
			}
			hi = uint16(len(holderList))
			holders[h] = hi
			holderList = append(holderList, h)
		}
		holderIdx[i] = hi
	}
	w := blockWidth(fits)
	if skips {
		dst = append(dst, retrieveMagicSkip...)
	} else {
		dst = append(dst, retrieveMagic...)
	}
	dst = append(dst, w)
	dst = appendStr16(dst, r.RestoreID)
	dst = append(dst, r.Namespace[:]...)
	dst = appendStr8(dst, r.Session)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(keyList)))
	for i := range keyList {
		dst = append(dst, keyList[i][:]...)
	}
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(holderList)))
	for _, h := range holderList {
		dst = appendStr8(dst, h.Instance)
		dst = binary.BigEndian.AppendUint16(dst, uint16(h.TPRank))
	}
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(r.Items)))
	for i := range r.Items {
		it := &r.Items[i]
		dst = binary.BigEndian.AppendUint32(dst, uint32(it.Chunk))
		dst = binary.BigEndian.AppendUint16(dst, uint16(it.Group))
		dst = binary.BigEndian.AppendUint16(dst, it.Key.Shard)
		dst = binary.BigEndian.AppendUint32(dst, keyIdx[i])
		dst = binary.BigEndian.AppendUint64(dst, it.Sum)
		dst = binary.BigEndian.AppendUint16(dst, holderIdx[i])
		dst = append(dst, byte(it.Source.Tier))
		dst = binary.BigEndian.AppendUint32(dst, uint32(len(it.Blocks)))
		if skips {
			dst = binary.BigEndian.AppendUint32(dst, uint32(it.Skip))
		}
	}
	for i := range r.Items {
		dst = appendBlocks(dst, w, r.Items[i].Blocks)
	}
	return dst, nil
}

// MarshalBinary returns the binary encoding of r (AppendBinary).
func (r *RetrieveRequest) MarshalBinary() ([]byte, error) {
	n := 64 + len(r.RestoreID) + len(r.Session) + (retrieveItemSkip+16)*len(r.Items)
	for i := range r.Items {
		n += 8 * len(r.Items[i].Blocks)
	}
	return r.AppendBinary(make([]byte, 0, n))
}

// reqReader reads a binary request, remembering the first error.
type reqReader struct {
	what string // "store request", "retrieve request"
	p    []byte
	err  error
}

func (r *reqReader) fail(sentinel error, format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf(r.what+": "+format+": %w", append(args, sentinel)...)
	}
}

func (r *reqReader) take(n int, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.p) {
		r.fail(ErrMalformed, "truncated %s: %d bytes left, want %d", what, len(r.p), n)
		return nil
	}
	b := r.p[:n:n]
	r.p = r.p[n:]
	return b
}

func (r *reqReader) u8(what string) int {
	if b := r.take(1, what); b != nil {
		return int(b[0])
	}
	return 0
}

func (r *reqReader) u16(what string) int {
	if b := r.take(2, what); b != nil {
		return int(binary.BigEndian.Uint16(b))
	}
	return 0
}

func (r *reqReader) u32(what string) uint64 {
	if b := r.take(4, what); b != nil {
		return uint64(binary.BigEndian.Uint32(b))
	}
	return 0
}

func (r *reqReader) str8(what string) string  { return string(r.take(r.u8(what), what)) }
func (r *reqReader) str16(what string) string { return string(r.take(r.u16(what), what)) }

// header reads the magic, one of magics (the same family, each a version
// digit more), and the block id width; it returns the magic read.
func (r *reqReader) header(magics ...string) (magic string, width int) {
	fam := magics[0][:len(magics[0])-1]
	if len(r.p) < len(fam)+1 || string(r.p[:len(fam)]) != fam {
		r.fail(ErrMalformed, "missing magic %q", magics[0])
		return "", 0
	}
	for _, m := range magics {
		if string(r.p[:len(m)]) == m {
			magic = m
		}
	}
	if magic == "" {
		reads := make([]string, len(magics))
		for i, m := range magics {
			reads[i] = fmt.Sprintf("%q", m[len(m)-1])
		}
		r.fail(ErrMalformed, "version %q, this build reads %s", r.p[len(fam)], strings.Join(reads, " or "))
		return "", 0
	}
	r.p = r.p[len(magic):]
	w := r.u8("block id width")
	if r.err == nil && w != 4 && w != 8 {
		r.fail(ErrMalformed, "block id width %d, want 4 or 8", w)
	}
	return magic, w
}

// count reads a u32 count of records of size bytes each, bounded by limit
// (ErrOverLimit) and by the bytes left (ErrMalformed).
func (r *reqReader) count(what string, size, limit int) int {
	n := r.u32(what)
	switch {
	case r.err != nil:
		return 0
	case n > uint64(limit):
		r.fail(ErrOverLimit, "%d %s, limit %d", n, what, limit)
		return 0
	case n*uint64(size) > uint64(len(r.p)):
		r.fail(ErrMalformed, "%d %s need %d bytes, %d left", n, what, n*uint64(size), len(r.p))
		return 0
	}
	return int(n)
}

// blocks reads the packed block ids: total of them, w bytes each, which
// must be exactly the bytes left.
func (r *reqReader) blocks(total uint64, w int) []int64 {
	if r.err != nil {
		return nil
	}
	if total*uint64(w) != uint64(len(r.p)) {
		r.fail(ErrMalformed, "%d block ids of %d B need %d bytes, %d left", total, w, total*uint64(w), len(r.p))
		return nil
	}
	ids := make([]int64, total)
	p := r.p
	if w == 4 {
		for i := range ids {
			ids[i] = int64(binary.BigEndian.Uint32(p[4*i:]))
		}
	} else {
		for i := range ids {
			ids[i] = int64(binary.BigEndian.Uint64(p[8*i:]))
		}
	}
	r.p = nil
	return ids
}

// DecodeStoreBinary decodes a binary store request within lim. Bad input
// is an error wrapping ErrMalformed or ErrOverLimit, never a panic.
func DecodeStoreBinary(p []byte, lim RequestLimits) (*StoreRequest, error) {
	r := &reqReader{what: "store request", p: p}
	magic, w := r.header(storeMagic, storeMagicPos)
	// eh is the size of a chunk's entry in the table before its block
	// counts: hash, position (KVS2), group count.
	pos, eh := magic == storeMagicPos, 16+1
	if pos {
		eh += 4
	}
	req := &StoreRequest{}
	req.RequestID = r.str16("request id")
	copy(req.Namespace[:], r.take(16, "namespace"))
	req.Session = r.str8("session")
	req.Event.Backend = r.str8("event backend")
	req.Event.Device = r.str8("event device")
	if raw := r.take(r.u16("event handle"), "event handle"); raw != nil {
		req.Event.Raw = append([]byte(nil), raw...)
	}
	n := r.count("chunks", eh, lim.MaxChunks)
	if r.err != nil {
		return nil, r.err
	}
	req.Chunks = make([]ChunkBlocks, n)
	// First pass: the chunk table, to size one backing array of group
	// lists and one of block ids for the whole request.
	table := r.p
	var groups, total uint64
	for i := range n {
		copy(req.Chunks[i].Chunk[:], r.take(16, "chunk hash"))
		if pos {
			req.Chunks[i].Pos = uint32(r.u32("chunk position"))
		}
		g := r.u8("group count")
		for j := range g {
			c := r.u32("block count")
			if r.err == nil && c > uint64(lim.MaxBlocks) {
				r.fail(ErrOverLimit, "chunk %d group %d lists %d block ids, limit %d", i, j, c, lim.MaxBlocks)
			}
			total += c
		}
		if r.err == nil && total > uint64(len(r.p)) {
			r.fail(ErrMalformed, "chunks 0..%d list %d block ids, more than the %d bytes left", i, total, len(r.p))
		}
		groups += uint64(g)
	}
	ids := r.blocks(total, w)
	if r.err != nil {
		return nil, r.err
	}
	lists := make([][]int64, groups)
	var at, gi uint64
	for i := range n {
		// The table was read once without error: no bounds to check.
		g := int(table[eh-1])
		table = table[eh:]
		cb := lists[gi : gi+uint64(g) : gi+uint64(g)]
		gi += uint64(g)
		for j := range cb {
			c := uint64(binary.BigEndian.Uint32(table))
			table = table[4:]
			cb[j] = ids[at : at+c : at+c]
			at += c
		}
		req.Chunks[i].Blocks = cb
	}
	return req, nil
}

// DecodeRetrieveBinary decodes a binary retrieve request within lim. Bad
// input is an error wrapping ErrMalformed or ErrOverLimit, never a panic.
func DecodeRetrieveBinary(p []byte, lim RequestLimits) (*RetrieveRequest, error) {
	req, counts, r := decodeRetrieveHead(p, lim)
	if r.err != nil {
		return nil, r.err
	}
	var total uint64
	for i, c := range counts {
		if c > uint64(lim.MaxBlocks) {
			return nil, fmt.Errorf("retrieve request: item %d lists %d block ids, limit %d: %w", i, c, lim.MaxBlocks, ErrOverLimit)
		}
		if total += c; total > uint64(len(r.p)) {
			return nil, fmt.Errorf("retrieve request: items 0..%d list %d block ids, more than the %d bytes left: %w", i, total, len(r.p), ErrMalformed)
		}
	}
	ids := r.blocks(total, r.width)
	if r.err != nil {
		return nil, r.err
	}
	var at uint64
	for i, c := range counts {
		req.Items[i].Blocks = ids[at : at+c : at+c]
		at += c
	}
	return req, nil
}

// PeekRetrieveBinary decodes a binary retrieve request up to its items,
// without their block ids (a receiver that refused the request reports
// its items failed); Blocks stay nil.
func PeekRetrieveBinary(p []byte, lim RequestLimits) (*RetrieveRequest, error) {
	req, _, r := decodeRetrieveHead(p, lim)
	if r.err != nil {
		return nil, r.err
	}
	return req, nil
}

type retrieveReader struct {
	reqReader
	width int
}

// decodeRetrieveHead reads everything but the block ids; it returns the
// items' block counts.
func decodeRetrieveHead(p []byte, lim RequestLimits) (*RetrieveRequest, []uint64, *retrieveReader) {
	r := &retrieveReader{reqReader: reqReader{what: "retrieve request", p: p}}
	magic, width := r.header(retrieveMagic, retrieveMagicSkip)
	r.width = width
	size := retrieveItemSize
	if magic == retrieveMagicSkip {
		size = retrieveItemSkip
	}
	req := &RetrieveRequest{}
	req.RestoreID = r.str16("restore id")
	copy(req.Namespace[:], r.take(16, "namespace"))
	req.Session = r.str8("session")
	nk := r.count("keys", 16, math.MaxInt32) // bounded by the bytes left in practice
	if r.err != nil {
		return nil, nil, r
	}
	keys := r.take(16*nk, "key table")
	nh := r.u16("holders")
	if r.err == nil && nh*3 > len(r.p) {
		r.fail(ErrMalformed, "%d holders need at least %d bytes, %d left", nh, nh*3, len(r.p))
	}
	if r.err != nil {
		return nil, nil, r
	}
	holders := make([]Rank, nh)
	for i := range holders {
		holders[i].Instance = r.str8("holder")
		holders[i].TPRank = r.u16("holder")
	}
	n := r.count("items", size, lim.MaxItems)
	if r.err != nil {
		return nil, nil, r
	}
	req.Items = make([]RetrieveItem, n)
	counts := make([]uint64, n)
	b := r.take(n*size, "items")
	for i := range req.Items {
		q := b[i*size : (i+1)*size]
		it := &req.Items[i]
		it.Chunk = int(binary.BigEndian.Uint32(q))
		group := binary.BigEndian.Uint16(q[4:])
		it.Group = int(group)
		k := uint64(binary.BigEndian.Uint32(q[8:]))
		h := int(binary.BigEndian.Uint16(q[20:]))
		if k >= uint64(nk) {
			r.fail(ErrMalformed, "item %d: key %d of %d", i, k, nk)
			return nil, nil, r
		}
		if h >= nh {
			r.fail(ErrMalformed, "item %d: holder %d of %d", i, h, nh)
			return nil, nil, r
		}
		it.Key.NS = req.Namespace
		copy(it.Key.Chunk[:], keys[16*k:])
		it.Key.Shard = binary.BigEndian.Uint16(q[6:])
		it.Key.Group = group
		it.Sum = binary.BigEndian.Uint64(q[12:])
		it.Source = Source{Holder: holders[h], Tier: Tier(q[22])}
		counts[i] = uint64(binary.BigEndian.Uint32(q[23:]))
		if size == retrieveItemSkip {
			// Up to 2^32-1 on 64-bit builds; whether it fits the chunk is
			// the receiver's check, as for the block count.
			it.Skip = int(binary.BigEndian.Uint32(q[27:]))
		}
	}
	return req, counts, r
}
