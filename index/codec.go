package index

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// Encodings of what the index keeps in bbolt (see doc.go for the layout).
// Integers are unsigned varints unless noted; checksums are 8 bytes
// little-endian. Every value starts with a format version byte.

const formatVersion = 1

// Record checksums (issue 11.11). A value whose first byte is
// sealedVersion carries the version-1 payload followed by the CRC-32C
// (Castagnoli, 4 bytes little-endian) of every byte before it, version
// byte included. Every chunk, rank and log record written is sealed;
// version-1 values (written before sealing existed) are still read,
// unchecked. A sealed value whose checksum does not match is ErrCorrupt:
// Open, and so a coordinator's start, refuses the file, naming the record.
const sealedVersion = 2

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// seal turns the record that starts at b[start] (a formatVersion byte)
// into a sealed one: version byte sealedVersion, checksum appended.
func seal(b []byte, start int) []byte {
	b[start] = sealedVersion
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b[start:], castagnoli))
}

// unseal returns the payload of a record (after its version byte),
// checking the checksum of a sealed one. what names the record in errors.
func unseal(v []byte, what string) ([]byte, error) {
	switch {
	case len(v) == 0:
		return nil, fmt.Errorf("%s: empty: %w", what, ErrCorrupt)
	case v[0] == formatVersion:
		return v[1:], nil
	case v[0] != sealedVersion:
		return nil, fmt.Errorf("%s: format version %d, want %d or %d: %w", what, v[0], formatVersion, sealedVersion, ErrCorrupt)
	case len(v) < 5:
		return nil, fmt.Errorf("%s: sealed record of %d B has no room for its checksum: %w", what, len(v), ErrCorrupt)
	}
	body := v[:len(v)-4]
	want := binary.LittleEndian.Uint32(v[len(v)-4:])
	if got := crc32.Checksum(body, castagnoli); got != want {
		return nil, fmt.Errorf("%s: checksum mismatch: bytes give crc32c %#08x, record says %#08x (damaged on disk): %w",
			what, got, want, ErrCorrupt)
	}
	return body[1:], nil
}

// Change-log ops. A log record is formatVersion followed by ops; put and
// del use the (rank, incarnation) and namespace set by the last ctx and ns
// ops of the same record.
const (
	opCtx   = 'r' // rank id, incarnation
	opNS    = 'n' // namespace (16 bytes)
	opPut   = 'p' // tier, chunk (16), shard, group, seq delta (signed varint), size, sum (8)
	opDel   = 'd' // tier, chunk (16), shard, group
	opFence = 'f' // rank id, below: drop the rank's L1 placements with incarnation < below
	opDrop  = 'x' // rank id: drop every placement of the rank
)

// opEncoder builds one log record.
type opEncoder struct {
	buf    []byte
	hasCtx bool
	rank   uint32
	inc    uint64
	seq    uint64
	hasNS  bool
	ns     dcp.Namespace
	ops    int
}

func (e *opEncoder) reset() {
	*e = opEncoder{buf: append(e.buf[:0], formatVersion)}
}

func (e *opEncoder) empty() bool { return e.ops == 0 }

func (e *opEncoder) setCtx(rank uint32, inc uint64, ns dcp.Namespace) {
	if !e.hasCtx || e.rank != rank || e.inc != inc {
		e.buf = append(e.buf, opCtx)
		e.buf = binary.AppendUvarint(e.buf, uint64(rank))
		e.buf = binary.AppendUvarint(e.buf, inc)
		e.hasCtx, e.rank, e.inc, e.seq = true, rank, inc, 0
	}
	if !e.hasNS || e.ns != ns {
		e.buf = append(e.buf, opNS)
		e.buf = append(e.buf, ns[:]...)
		e.hasNS, e.ns = true, ns
	}
}

func (e *opEncoder) put(ref chunkRef, p *placement) {
	e.setCtx(p.rank, p.inc, ref.ns)
	e.buf = append(e.buf, opPut, byte(p.tier))
	e.buf = append(e.buf, ref.chunk[:]...)
	e.buf = binary.AppendUvarint(e.buf, uint64(p.shard))
	e.buf = binary.AppendUvarint(e.buf, uint64(p.group))
	e.buf = binary.AppendVarint(e.buf, int64(p.seq-e.seq))
	e.seq = p.seq
	e.buf = binary.AppendUvarint(e.buf, p.size)
	e.buf = binary.LittleEndian.AppendUint64(e.buf, p.sum)
	e.ops++
}

func (e *opEncoder) del(ref chunkRef, shard, group uint16, tier wire.Tier, rank uint32, inc uint64) {
	e.setCtx(rank, inc, ref.ns)
	e.buf = append(e.buf, opDel, byte(tier))
	e.buf = append(e.buf, ref.chunk[:]...)
	e.buf = binary.AppendUvarint(e.buf, uint64(shard))
	e.buf = binary.AppendUvarint(e.buf, uint64(group))
	e.ops++
}

func (e *opEncoder) fence(rank uint32, below uint64) {
	e.buf = append(e.buf, opFence)
	e.buf = binary.AppendUvarint(e.buf, uint64(rank))
	e.buf = binary.AppendUvarint(e.buf, below)
	e.ops++
}

func (e *opEncoder) drop(rank uint32) {
	e.buf = append(e.buf, opDrop)
	e.buf = binary.AppendUvarint(e.buf, uint64(rank))
	e.ops++
}

// decoder reads varints and fixed fields, remembering the first error.
type decoder struct {
	p   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("truncated or malformed %s: %w", what, ErrCorrupt)
	}
}

func (d *decoder) uvarint(what string) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.p)
	if n <= 0 {
		d.fail(what)
		return 0
	}
	d.p = d.p[n:]
	return v
}

func (d *decoder) varint(what string) int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.p)
	if n <= 0 {
		d.fail(what)
		return 0
	}
	d.p = d.p[n:]
	return v
}

func (d *decoder) u16(what string) uint16 {
	v := d.uvarint(what)
	if v > 0xffff {
		d.fail(what)
	}
	return uint16(v)
}

// bytes returns the next n bytes. After an error it returns zeros (up to
// 16 bytes, the most a fixed-size field needs; nothing for longer ones),
// never an allocation sized by untrusted input.
func (d *decoder) bytes(n int, what string) []byte {
	if d.err == nil && (n < 0 || len(d.p) < n) {
		d.fail(what)
	}
	if d.err != nil {
		var zero [16]byte
		if n >= 0 && n <= len(zero) {
			return zero[:n]
		}
		return nil
	}
	b := d.p[:n]
	d.p = d.p[n:]
	return b
}

func (d *decoder) byte1(what string) byte { return d.bytes(1, what)[0] }

func (d *decoder) tier(what string) wire.Tier {
	t := wire.Tier(d.byte1(what))
	if d.err == nil && !t.Valid() {
		d.err = fmt.Errorf("%s: tier %d: %w", what, t, ErrCorrupt)
	}
	return t
}

// replay applies one log record to t (whose enc is nil). nRanks bounds the
// rank ids the record may name.
func replay(rec []byte, t *txn, nRanks int) error {
	body, err := unseal(rec, "log record")
	if err != nil {
		return err
	}
	d := decoder{p: body}
	var (
		hasCtx, hasNS bool
		rank          uint32
		inc, seq      uint64
		ns            dcp.Namespace
	)
	rankID := func(what string) uint32 {
		v := d.uvarint(what)
		if d.err == nil && (v == 0 || v >= uint64(nRanks)) {
			d.err = fmt.Errorf("%s names rank id %d, the store knows 1..%d: %w", what, v, nRanks-1, ErrCorrupt)
		}
		return uint32(v)
	}
	for len(d.p) > 0 && d.err == nil {
		op := d.byte1("op")
		switch op {
		case opCtx:
			rank = rankID("ctx op")
			inc = d.uvarint("ctx incarnation")
			seq, hasCtx = 0, true
		case opNS:
			copy(ns[:], d.bytes(16, "namespace"))
			hasNS = true
		case opPut, opDel:
			if !hasCtx || !hasNS {
				return fmt.Errorf("log record: %c op before its rank and namespace: %w", op, ErrCorrupt)
			}
			tier := d.tier("put/del tier")
			var ref chunkRef
			ref.ns = ns
			copy(ref.chunk[:], d.bytes(16, "chunk"))
			shard, group := d.u16("shard"), d.u16("group")
			if op == opDel {
				if d.err == nil {
					t.del(ref, shard, group, tier, rank, inc)
				}
				continue
			}
			seq += uint64(d.varint("seq"))
			size := d.uvarint("size")
			sum := binary.LittleEndian.Uint64(d.bytes(8, "sum"))
			if d.err == nil {
				t.put(ref, placement{size: size, sum: sum, seq: seq, inc: inc, rank: rank,
					shard: shard, group: group, tier: tier})
			}
		case opFence:
			r := rankID("fence op")
			below := d.uvarint("fence bound")
			if d.err == nil {
				t.fenceL1(r, below)
			}
		case opDrop:
			r := rankID("drop op")
			if d.err == nil {
				t.dropRank(r)
			}
		default:
			if d.err == nil {
				return fmt.Errorf("log record: unknown op %#x: %w", op, ErrCorrupt)
			}
		}
	}
	return d.err
}

// Snapshot keys. A chunk's record is keyed by the generation of the fold
// that wrote it (its checkpoint epoch, state.epoch), then its namespace and
// hash:
//
//	2 | generation (4 B big-endian) | namespace (16) | chunk hash (16)
//
// so every fold's records sort after those of the folds before it: a fold
// appends its chunks at the end of the bucket (full pages, written once)
// instead of rewriting a page wherever a changed chunk's hash falls, and
// deletes the older record of each chunk it rewrites, which it knows from
// the dirty list (dirtyRef.prev). A chunk has one record at any time (the
// put and the delete are in one transaction). Files written before this
// layout hold 33-byte keys, the first 33 bytes of the dcp.Key encoding
// (version 1, namespace, chunk): read as generation 0 and deleted as such
// when their chunk is rewritten.
const (
	snapshotKeySize = 37
	legacyKeySize   = 33
	snapKeyVersion  = 2
	// legacyGen is the generation of a 33-byte key; noRecord marks a
	// dirty chunk with no record on disk.
	legacyGen = 0
	noRecord  = ^uint32(0)
	// maxGen bounds a key's generation: a fold per 128 MiB of change log
	// never gets near it, and the epoch after it is still not noRecord.
	maxGen = 1<<31 - 1
)

func appendSnapshotKey(b []byte, gen uint32, ref chunkRef) []byte {
	if gen == legacyGen {
		k := dcp.Key{NS: ref.ns, Chunk: ref.chunk}
		b, _ = k.AppendBinary(b)
		return b[:len(b)-4]
	}
	b = append(b, snapKeyVersion)
	b = binary.BigEndian.AppendUint32(b, gen)
	b = append(b, ref.ns[:]...)
	return append(b, ref.chunk[:]...)
}

func parseSnapshotKey(k []byte) (chunkRef, uint32, error) {
	switch {
	case len(k) == legacyKeySize:
		var full [dcp.KeySize]byte
		copy(full[:], k)
		var key dcp.Key
		if err := key.UnmarshalBinary(full[:]); err != nil {
			return chunkRef{}, 0, fmt.Errorf("snapshot key: %w: %w", err, ErrCorrupt)
		}
		return chunkRef{key.NS, key.Chunk}, legacyGen, nil
	case len(k) != snapshotKeySize:
		return chunkRef{}, 0, fmt.Errorf("snapshot key is %d bytes, want %d (or %d in files of the older layout): %w",
			len(k), snapshotKeySize, legacyKeySize, ErrCorrupt)
	case k[0] != snapKeyVersion:
		return chunkRef{}, 0, fmt.Errorf("snapshot key version %d, want %d: %w", k[0], snapKeyVersion, ErrCorrupt)
	}
	gen := binary.BigEndian.Uint32(k[1:5])
	if gen == legacyGen || gen > maxGen {
		return chunkRef{}, 0, fmt.Errorf("snapshot key of generation %d, want 1 to %d: %w", gen, maxGen, ErrCorrupt)
	}
	var ref chunkRef
	copy(ref.ns[:], k[5:21])
	copy(ref.chunk[:], k[21:37])
	return ref, gen, nil
}

// appendChunk encodes a chunk's placements: version, count, then per
// placement shard, group, tier (1 byte), rank id, incarnation, seq, size,
// sum (8 bytes).
func appendChunk(b []byte, s []placement) []byte {
	start := len(b)
	b = append(b, formatVersion)
	b = binary.AppendUvarint(b, uint64(len(s)))
	for i := range s {
		p := &s[i]
		b = binary.AppendUvarint(b, uint64(p.shard))
		b = binary.AppendUvarint(b, uint64(p.group))
		b = append(b, byte(p.tier))
		b = binary.AppendUvarint(b, uint64(p.rank))
		b = binary.AppendUvarint(b, p.inc)
		b = binary.AppendUvarint(b, p.seq)
		b = binary.AppendUvarint(b, p.size)
		b = binary.LittleEndian.AppendUint64(b, p.sum)
	}
	return seal(b, start)
}

func parseChunk(v []byte, nRanks int) ([]placement, error) {
	body, err := unseal(v, "chunk record")
	if err != nil {
		return nil, err
	}
	d := decoder{p: body}
	n := d.uvarint("placement count")
	if d.err == nil && n > uint64(len(d.p)) {
		d.fail("placement count")
	}
	if d.err != nil {
		return nil, d.err
	}
	s := make([]placement, n)
	for i := range s {
		p := &s[i]
		p.shard, p.group = d.u16("shard"), d.u16("group")
		p.tier = d.tier("chunk record")
		r := d.uvarint("rank id")
		if d.err == nil && (r == 0 || r >= uint64(nRanks)) {
			return nil, fmt.Errorf("chunk record names rank id %d, the store knows 1..%d: %w", r, nRanks-1, ErrCorrupt)
		}
		p.rank = uint32(r)
		p.inc = d.uvarint("incarnation")
		p.seq = d.uvarint("seq")
		p.size = d.uvarint("size")
		p.sum = binary.LittleEndian.Uint64(d.bytes(8, "sum"))
	}
	if d.err == nil && len(d.p) != 0 {
		d.err = fmt.Errorf("chunk record has %d trailing bytes: %w", len(d.p), ErrCorrupt)
	}
	return s, d.err
}

// Rank records: key = rank id (4 bytes big-endian); value = version,
// instance (length-prefixed), TP rank, incarnation, last seq, flags (1
// byte: 1 fenced, 2 partial; older builds read only 0 and 1), then the
// fence generation when it is not 0 (older records end at the flags and
// read as generation 0; a rank never fenced is encoded as before).

func appendRankKey(b []byte, id uint32) []byte { return binary.BigEndian.AppendUint32(b, id) }

func appendRank(b []byte, r wire.Rank, m rankMeta) []byte {
	start := len(b)
	b = append(b, formatVersion)
	b = binary.AppendUvarint(b, uint64(len(r.Instance)))
	b = append(b, r.Instance...)
	b = binary.AppendUvarint(b, uint64(r.TPRank))
	b = binary.AppendUvarint(b, m.inc)
	b = binary.AppendUvarint(b, m.last)
	f := byte(0)
	if m.fenced {
		f = 1
	}
	if m.partial {
		f |= 2
	}
	b = append(b, f)
	if m.fenceGen != 0 {
		b = binary.AppendUvarint(b, m.fenceGen)
	}
	return seal(b, start)
}

func parseRank(k, v []byte) (uint32, wire.Rank, rankMeta, error) {
	var r wire.Rank
	var m rankMeta
	if len(k) != 4 {
		return 0, r, m, fmt.Errorf("rank key is %d bytes, want 4: %w", len(k), ErrCorrupt)
	}
	id := binary.BigEndian.Uint32(k)
	body, err := unseal(v, fmt.Sprintf("rank %d record", id))
	if err != nil {
		return 0, r, m, err
	}
	d := decoder{p: body}
	n := d.uvarint("instance length")
	if d.err == nil && n > 255 {
		d.fail("instance length")
	}
	r.Instance = string(d.bytes(int(n), "instance"))
	tp := d.uvarint("tp rank")
	if d.err == nil && tp > dcp.MaxTP {
		d.fail("tp rank")
	}
	r.TPRank = int(tp)
	m.inc = d.uvarint("incarnation")
	m.last = d.uvarint("last seq")
	if f := d.byte1("fenced"); f > 3 {
		d.fail("fenced flag")
	} else {
		m.fenced, m.partial = f&1 != 0, f&2 != 0
	}
	if d.err == nil && len(d.p) != 0 {
		m.fenceGen = d.uvarint("fence generation")
		if d.err == nil && m.fenceGen == 0 {
			d.fail("fence generation 0 (never encoded)")
		}
	}
	if d.err == nil && len(d.p) != 0 {
		d.fail("rank record (trailing bytes)")
	}
	if d.err != nil {
		return 0, r, m, fmt.Errorf("rank %d: %w", id, d.err)
	}
	return id, r, m, nil
}
