package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"
	"unicode/utf8"

	"github.com/kvtier/kvtier/dcp"
)

// Binary restore.begin requests and restore reports. A begin of a long
// chain is mostly chunk hashes (34 characters of JSON each, 16 bytes here)
// and a report mostly per-item results (about 60 characters of JSON each,
// 17 bytes here): for a 32k-token prompt in 16-token chunks, 2,048 of
// either, whose JSON decoding was most of the coordinator's time for such
// a restore (issue 25.4). The coordinator accepts both forms on both
// subjects and tells them apart by the first bytes (JSON starts with '{'
// or white space); replies stay JSON. Big-endian:
//
//	begin:  magic "KVG1" | u8 flags (bit 0: StateAtEnd; bit 1: Lookup;
//	        bit 2: PlanEncoding binary; others must be 0)
//	        | namespace (16 B) | u8 len(instance) | instance (0..64 B)
//	        | u32 deadline_ms | u32 n | n x chunk hash (16 B)
//	report: magic "KVT1" | u16 len(restore_id) | restore_id
//	        | u8 len(instance) | instance | u16 tp_rank | u32 n
//	        | n x (u32 chunk | u16 group | u8 ok (0 or 1) | u64 sum
//	               | u16 len(reason) | reason)
//
// Strings are UTF-8. A decoder rejects a bad magic, unknown flags or ok
// values, an over-long instance, a count over maxLookupChunks (begin) or
// over what the bytes left can hold (report), and any length that
// disagrees with the count, with an error wrapping ErrMalformed. A
// coordinator from before these forms refuses them as bad JSON
// (bad_request): senders then fall back to JSON (rankd's report, the
// Python client's begin).
const (
	beginMagic  = "KVG1"
	reportMagic = "KVT1"
)

// NotJSONRefusal is what a coordinator from before these forms answers a
// binary begin or report with (bad_request): its JSON decoder stopped at
// the magic's first byte. A sender falls back to JSON on exactly this,
// not on any bad_request: a coordinator that read the binary form and
// refused the request for what it says would refuse the JSON too, and a
// sender that switched would wrongly conclude the coordinator is old.
const NotJSONRefusal = "invalid character 'K' looking for beginning of value"

// IsNotJSONRefusal reports whether err is that refusal.
func IsNotJSONRefusal(err error) bool {
	var we *Error
	return errors.As(err, &we) && we.Code == CodeBadRequest && strings.Contains(we.Message, NotJSONRefusal)
}

const (
	beginStateAtEnd = 1 << iota
	beginLookup
	beginPlanBinary
)

// reportItemMin is a report item's size without its reason.
const reportItemMin = 4 + 2 + 1 + 8 + 2

// IsBinaryBegin reports whether p is a binary restore.begin request.
func IsBinaryBegin(p []byte) bool { return bytes.HasPrefix(p, []byte(beginMagic)) }

// IsBinaryReport reports whether p is a binary restore report.
func IsBinaryReport(p []byte) bool { return bytes.HasPrefix(p, []byte(reportMagic)) }

// MarshalBinary returns the binary encoding of r; an error wrapping
// ErrMalformed for a request the form cannot carry (an instance over 64
// bytes, a deadline outside 0..2^32-1 ms, an unknown plan encoding, too
// many chunks).
func (r *RestoreBeginRequest) MarshalBinary() ([]byte, error) {
	bad := func(format string, args ...any) ([]byte, error) {
		return nil, fmt.Errorf("restore.begin: "+format+": %w", append(args, ErrMalformed)...)
	}
	if len(r.Instance) > 64 {
		return bad("instance name %d bytes, limit 64", len(r.Instance))
	}
	if r.DeadlineMS < 0 || int64(r.DeadlineMS) > math.MaxUint32 {
		return bad("deadline %d ms outside 0..%d", r.DeadlineMS, uint32(math.MaxUint32))
	}
	if len(r.Chunks) > maxLookupChunks {
		return bad("%d chunks, limit %d", len(r.Chunks), maxLookupChunks)
	}
	var flags byte
	switch r.PlanEncoding {
	case "", PlanEncodingJSON:
	case PlanEncodingBinary:
		flags |= beginPlanBinary
	default:
		return bad("plan encoding %q", r.PlanEncoding)
	}
	if r.StateAtEnd {
		flags |= beginStateAtEnd
	}
	if r.Lookup {
		flags |= beginLookup
	}
	dst := make([]byte, 0, 4+1+16+1+len(r.Instance)+8+16*len(r.Chunks))
	dst = append(dst, beginMagic...)
	dst = append(dst, flags)
	dst = append(dst, r.Namespace[:]...)
	dst = append(dst, byte(len(r.Instance)))
	dst = append(dst, r.Instance...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(r.DeadlineMS))
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(r.Chunks)))
	for i := range r.Chunks {
		dst = append(dst, r.Chunks[i][:]...)
	}
	return dst, nil
}

// UnmarshalBinary decodes a binary restore.begin request.
func (r *RestoreBeginRequest) UnmarshalBinary(p []byte) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("restore.begin request: "+format+": %w", append(args, ErrMalformed)...)
	}
	if !IsBinaryBegin(p) {
		return bad("missing magic %q", beginMagic)
	}
	p = p[len(beginMagic):]
	if len(p) < 1+16+1 {
		return bad("truncated header: %d bytes after the magic, want >= 18", len(p))
	}
	flags := p[0]
	if flags&^(beginStateAtEnd|beginLookup|beginPlanBinary) != 0 {
		return bad("unknown flags %#x", flags)
	}
	*r = RestoreBeginRequest{StateAtEnd: flags&beginStateAtEnd != 0, Lookup: flags&beginLookup != 0}
	if flags&beginPlanBinary != 0 {
		r.PlanEncoding = PlanEncodingBinary
	}
	copy(r.Namespace[:], p[1:17])
	n := int(p[17])
	p = p[18:]
	if n > 64 {
		return bad("instance name %d bytes, limit 64", n)
	}
	if len(p) < n+8 {
		return bad("truncated: %d bytes for an instance of %d, a deadline and a count", len(p), n)
	}
	if !utf8.Valid(p[:n]) {
		return bad("instance name is not UTF-8")
	}
	r.Instance = string(p[:n])
	deadline := binary.BigEndian.Uint32(p[n:])
	if uint64(deadline) > math.MaxInt {
		return bad("deadline %d ms", deadline)
	}
	r.DeadlineMS = int(deadline)
	count := binary.BigEndian.Uint32(p[n+4:])
	p = p[n+8:]
	if count > maxLookupChunks {
		return bad("%d chunks, limit %d", count, maxLookupChunks)
	}
	if uint64(len(p)) != uint64(count)*16 {
		return bad("%d bytes of chunk hashes, want %d x 16", len(p), count)
	}
	r.Chunks = make([]dcp.ChunkHash, count)
	for i := range r.Chunks {
		copy(r.Chunks[i][:], p[16*i:])
	}
	return nil
}

// MarshalBinary returns the binary encoding of r; an error wrapping
// ErrMalformed for a report the form cannot carry (a restore id over 65535
// bytes, an instance over 255, a TP rank or a group outside 0..65535, a
// chunk outside 0..2^32-1, a reason over 65535 bytes): send it as JSON.
func (r *RestoreReport) MarshalBinary() ([]byte, error) {
	bad := func(format string, args ...any) ([]byte, error) {
		return nil, fmt.Errorf("restore report: "+format+": %w", append(args, ErrMalformed)...)
	}
	if len(r.RestoreID) > math.MaxUint16 || len(r.Rank.Instance) > math.MaxUint8 {
		return bad("restore id %d B (limit %d), instance %d B (limit %d)", len(r.RestoreID), math.MaxUint16,
			len(r.Rank.Instance), math.MaxUint8)
	}
	if r.Rank.TPRank < 0 || r.Rank.TPRank > math.MaxUint16 || int64(len(r.Results)) > math.MaxUint32 {
		return bad("TP rank %d, %d results", r.Rank.TPRank, len(r.Results))
	}
	size := 4 + 2 + len(r.RestoreID) + 1 + len(r.Rank.Instance) + 2 + 4
	for i := range r.Results {
		size += reportItemMin + len(r.Results[i].Reason)
	}
	dst := make([]byte, 0, size)
	dst = append(dst, reportMagic...)
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(r.RestoreID)))
	dst = append(dst, r.RestoreID...)
	dst = append(dst, byte(len(r.Rank.Instance)))
	dst = append(dst, r.Rank.Instance...)
	dst = binary.BigEndian.AppendUint16(dst, uint16(r.Rank.TPRank))
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(r.Results)))
	for i := range r.Results {
		it := &r.Results[i]
		if it.Chunk < 0 || int64(it.Chunk) > math.MaxUint32 || it.Group < 0 || it.Group > math.MaxUint16 ||
			len(it.Reason) > math.MaxUint16 {
			return bad("result %d: chunk %d, group %d, reason of %d B", i, it.Chunk, it.Group, len(it.Reason))
		}
		dst = binary.BigEndian.AppendUint32(dst, uint32(it.Chunk))
		dst = binary.BigEndian.AppendUint16(dst, uint16(it.Group))
		var ok byte
		if it.OK {
			ok = 1
		}
		dst = append(dst, ok)
		dst = binary.BigEndian.AppendUint64(dst, it.Sum)
		dst = binary.BigEndian.AppendUint16(dst, uint16(len(it.Reason)))
		dst = append(dst, it.Reason...)
	}
	return dst, nil
}

// UnmarshalBinary decodes a binary restore report.
func (r *RestoreReport) UnmarshalBinary(p []byte) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("restore report: "+format+": %w", append(args, ErrMalformed)...)
	}
	if !IsBinaryReport(p) {
		return bad("missing magic %q", reportMagic)
	}
	p = p[len(reportMagic):]
	str := func(n int) (string, bool) {
		if len(p) < n || !utf8.Valid(p[:n]) {
			return "", false
		}
		s := string(p[:n])
		p = p[n:]
		return s, true
	}
	if len(p) < 2 {
		return bad("truncated restore id")
	}
	n := int(binary.BigEndian.Uint16(p))
	p = p[2:]
	id, ok := str(n)
	if !ok || len(p) < 1 {
		return bad("restore id of %d B truncated or not UTF-8", n)
	}
	n = int(p[0])
	p = p[1:]
	inst, ok := str(n)
	if !ok || len(p) < 6 {
		return bad("instance of %d B truncated or not UTF-8", n)
	}
	*r = RestoreReport{RestoreID: id, Rank: Rank{Instance: inst, TPRank: int(binary.BigEndian.Uint16(p))}}
	count := binary.BigEndian.Uint32(p[2:])
	p = p[6:]
	if uint64(count) > uint64(len(p)/reportItemMin) {
		return bad("%d results, the %d bytes left hold at most %d", count, len(p), len(p)/reportItemMin)
	}
	r.Results = make([]ItemResult, count)
	for i := range r.Results {
		if len(p) < reportItemMin {
			return bad("result %d truncated", i)
		}
		it := &r.Results[i]
		it.Chunk = int(binary.BigEndian.Uint32(p))
		it.Group = int(binary.BigEndian.Uint16(p[4:]))
		switch p[6] {
		case 0:
		case 1:
			it.OK = true
		default:
			return bad("result %d: ok %d, want 0 or 1", i, p[6])
		}
		it.Sum = binary.BigEndian.Uint64(p[7:])
		n := int(binary.BigEndian.Uint16(p[15:]))
		p = p[reportItemMin:]
		if it.Reason, ok = str(n); !ok {
			return bad("result %d: reason of %d B truncated or not UTF-8", i, n)
		}
	}
	if len(p) != 0 {
		return bad("%d bytes after the last result", len(p))
	}
	return nil
}
