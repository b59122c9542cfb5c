package wire

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/kvtier/kvtier/dcp"
)

// Binary lookup request. A lookup of a long chain is mostly chunk hashes:
// as JSON each is 34 characters of hex to parse (the coordinator spent most
// of a 128-chunk lookup decoding it); binary, 16 bytes copied. The
// coordinator accepts both on coord.lookup and tells them apart by the
// first bytes (JSON starts with '{' or white space). The reply stays JSON.
// Big-endian:
//
//	magic "KVL1" | u8 flags (bit 0: Detail; bit 1: StateAtEnd; others must be 0)
//	| namespace (16 B) | u8 len(instance) | instance (0..64 B)
//	| u32 n | n x chunk hash (16 B)
//
// A decoder rejects a bad magic, unknown flags, an instance over 64 bytes,
// a count over maxLookupChunks and any length that disagrees with the count,
// with an error wrapping ErrMalformed.
const lookupMagic = "KVL1"

// maxLookupChunks bounds the chunks of a decoded binary lookup.
const maxLookupChunks = 1 << 20

const (
	lookupDetail     = 1
	lookupStateAtEnd = 2
)

// IsBinaryLookup reports whether p is a binary lookup request.
func IsBinaryLookup(p []byte) bool { return bytes.HasPrefix(p, []byte(lookupMagic)) }

// AppendBinary appends the binary encoding of r.
func (r *LookupRequest) AppendBinary(dst []byte) ([]byte, error) {
	if len(r.Instance) > 64 {
		return dst, fmt.Errorf("lookup: instance name %d bytes, limit 64: %w", len(r.Instance), ErrMalformed)
	}
	if len(r.Chunks) > maxLookupChunks {
		return dst, fmt.Errorf("lookup: %d chunks, limit %d: %w", len(r.Chunks), maxLookupChunks, ErrMalformed)
	}
	var flags byte
	if r.Detail {
		flags |= lookupDetail
	}
	if r.StateAtEnd {
		flags |= lookupStateAtEnd
	}
	dst = append(dst, lookupMagic...)
	dst = append(dst, flags)
	dst = append(dst, r.Namespace[:]...)
	dst = append(dst, byte(len(r.Instance)))
	dst = append(dst, r.Instance...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(r.Chunks)))
	for i := range r.Chunks {
		dst = append(dst, r.Chunks[i][:]...)
	}
	return dst, nil
}

// MarshalBinary returns the binary encoding of r.
func (r *LookupRequest) MarshalBinary() ([]byte, error) {
	return r.AppendBinary(make([]byte, 0, 26+len(r.Instance)+16*len(r.Chunks)))
}

// UnmarshalBinary decodes a binary lookup request, reusing r.Chunks'
// capacity when it suffices.
func (r *LookupRequest) UnmarshalBinary(p []byte) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("lookup request: "+format+": %w", append(args, ErrMalformed)...)
	}
	if !IsBinaryLookup(p) {
		return bad("missing magic %q", lookupMagic)
	}
	p = p[len(lookupMagic):]
	if len(p) < 1+16+1 {
		return bad("truncated header: %d bytes after the magic, want >= 18", len(p))
	}
	flags := p[0]
	if flags&^(lookupDetail|lookupStateAtEnd) != 0 {
		return bad("unknown flags %#x", flags)
	}
	r.Detail, r.StateAtEnd = flags&lookupDetail != 0, flags&lookupStateAtEnd != 0
	copy(r.Namespace[:], p[1:17])
	n := int(p[17])
	p = p[18:]
	if n > 64 {
		return bad("instance name %d bytes, limit 64", n)
	}
	if len(p) < n+4 {
		return bad("truncated: %d bytes for an instance of %d and a count", len(p), n)
	}
	r.Instance = string(p[:n])
	count := binary.BigEndian.Uint32(p[n:])
	p = p[n+4:]
	if count > maxLookupChunks {
		return bad("%d chunks, limit %d", count, maxLookupChunks)
	}
	if uint64(len(p)) != uint64(count)*16 {
		return bad("%d bytes of chunk hashes, want %d x 16", len(p), count)
	}
	if uint64(cap(r.Chunks)) >= uint64(count) {
		r.Chunks = r.Chunks[:count] // reused: a server decodes into pooled requests
	} else {
		r.Chunks = make([]dcp.ChunkHash, count)
	}
	for i := range r.Chunks {
		copy(r.Chunks[i][:], p[16*i:])
	}
	return nil
}
