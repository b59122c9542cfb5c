package wire

import (
	"encoding/binary"
	"fmt"

	"github.com/kvtier/kvtier/dcp"
)

// InventoryEncodingBinary is the InventoryRequest.Encoding that asks for
// pages in the binary encoding below instead of JSON. A rank that does not
// know the field refuses the request (strict decoding): the caller then
// asks again without it and reads JSON.
const InventoryEncodingBinary = "kvi1"

// Binary inventory page encoding, big-endian:
//
//	magic "KVI1" | u8 len(instance) | instance | u32 tp_rank | u64 incarnation
//	| u64 seq | u8 len(snapshot) | snapshot | u32 page | u32 pages
//	| u32 m | m x namespace (16 B)                       the key table
//	| u32 n | n x (u32 namespace index | chunk hash (16) | u16 shard
//	              | u16 group | u8 tier | u64 size | u64 sum)
//
// A rank's objects share a handful of namespaces, so a key names its
// namespace by its index in the page's table: 41 B an object against about
// 120 B of JSON. Decoding checks every length and field, refuses trailing
// bytes, more than MaxInventoryPageSize objects (so no more than
// MaxInventoryPageBytes is ever read as a page), and a table that is not
// the encoder's: every namespace once, in order of first use, each used.
// So a page decodes only from the one encoding AppendBinary gives it.
const inventoryMagic = "KVI1"

const (
	invObjectSize = 4 + 16 + 2 + 2 + 1 + 8 + 8
	// invHeaderMax is the largest header: instance and snapshot of 255 B.
	invHeaderMax = 4 + 1 + 255 + 4 + 8 + 8 + 1 + 255 + 4 + 4 + 4 + 4
	// MaxInventoryPageBytes bounds a binary page: MaxInventoryPageSize
	// objects, each with its own namespace, and the largest header.
	MaxInventoryPageBytes = invHeaderMax + MaxInventoryPageSize*(invObjectSize+16)
	// MaxSnapshotIDBytes bounds an inventory snapshot id.
	MaxSnapshotIDBytes = 255
)

// AppendBinary appends the binary encoding of p.
func (p *InventoryPage) AppendBinary(dst []byte) ([]byte, error) {
	switch {
	case len(p.Rank.Instance) > maxInstance:
		return dst, fmt.Errorf("inventory page: instance name %d B, limit %d B: %w", len(p.Rank.Instance), maxInstance, ErrMalformed)
	case p.Rank.TPRank < 0 || p.Rank.TPRank > dcp.MaxTP:
		return dst, fmt.Errorf("inventory page: TP rank %d not in 0..%d: %w", p.Rank.TPRank, dcp.MaxTP, ErrMalformed)
	case len(p.Snapshot) > MaxSnapshotIDBytes:
		return dst, fmt.Errorf("inventory page: snapshot id %d B, limit %d B: %w", len(p.Snapshot), MaxSnapshotIDBytes, ErrMalformed)
	case len(p.Objects) > MaxInventoryPageSize:
		return dst, fmt.Errorf("inventory page of %d objects, limit %d: %w", len(p.Objects), MaxInventoryPageSize, ErrMalformed)
	case p.Page < 0 || p.Pages < 1 || p.Page >= p.Pages || uint64(p.Pages) > 1<<32-1:
		return dst, fmt.Errorf("inventory page %d of %d: want 0 <= page < pages: %w", p.Page, p.Pages, ErrMalformed)
	}
	// The key table: namespaces in order of first use.
	var table []dcp.Namespace
	pos := make(map[dcp.Namespace]uint32)
	idx := make([]uint32, len(p.Objects))
	for i := range p.Objects {
		ns := p.Objects[i].Key.NS
		if i > 0 && ns == p.Objects[i-1].Key.NS {
			idx[i] = idx[i-1]
			continue
		}
		j, ok := pos[ns]
		if !ok {
			j = uint32(len(table))
			pos[ns] = j
			table = append(table, ns)
		}
		idx[i] = j
	}
	dst = append(dst, inventoryMagic...)
	dst = append(dst, byte(len(p.Rank.Instance)))
	dst = append(dst, p.Rank.Instance...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(p.Rank.TPRank))
	dst = binary.BigEndian.AppendUint64(dst, p.Incarnation)
	dst = binary.BigEndian.AppendUint64(dst, p.Seq)
	dst = append(dst, byte(len(p.Snapshot)))
	dst = append(dst, p.Snapshot...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(p.Page))
	dst = binary.BigEndian.AppendUint32(dst, uint32(p.Pages))
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(table)))
	for i := range table {
		dst = append(dst, table[i][:]...)
	}
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(p.Objects)))
	for i := range p.Objects {
		o := &p.Objects[i]
		dst = binary.BigEndian.AppendUint32(dst, idx[i])
		dst = append(dst, o.Key.Chunk[:]...)
		dst = binary.BigEndian.AppendUint16(dst, o.Key.Shard)
		dst = binary.BigEndian.AppendUint16(dst, o.Key.Group)
		dst = append(dst, byte(o.Tier))
		dst = binary.BigEndian.AppendUint64(dst, o.Size)
		dst = binary.BigEndian.AppendUint64(dst, o.Sum)
	}
	return dst, nil
}

// MarshalBinary returns the binary encoding of p.
func (p *InventoryPage) MarshalBinary() ([]byte, error) {
	return p.AppendBinary(make([]byte, 0, 64+len(p.Rank.Instance)+len(p.Snapshot)+len(p.Objects)*invObjectSize+16))
}

// IsBinaryInventoryPage reports whether data starts like a binary page
// (a JSON reply starts with '{').
func IsBinaryInventoryPage(data []byte) bool {
	return len(data) >= len(inventoryMagic) && string(data[:len(inventoryMagic)]) == inventoryMagic
}

// UnmarshalBinary decodes a binary inventory page strictly (see the
// encoding above).
func (p *InventoryPage) UnmarshalBinary(data []byte) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("inventory page: "+format+": %w", append(args, ErrMalformed)...)
	}
	if len(data) > MaxInventoryPageBytes {
		return bad("%d B, limit %d B", len(data), MaxInventoryPageBytes)
	}
	if !IsBinaryInventoryPage(data) {
		return bad("missing magic %q", inventoryMagic)
	}
	q := data[len(inventoryMagic):]
	take := func(n int, what string) ([]byte, error) {
		if len(q) < n {
			return nil, bad("truncated in the %s: %d B left, want %d", what, len(q), n)
		}
		b := q[:n]
		q = q[n:]
		return b, nil
	}
	b, err := take(1, "instance length")
	if err != nil {
		return err
	}
	if b, err = take(int(b[0]), "instance"); err != nil {
		return err
	}
	var out InventoryPage
	out.Rank.Instance = string(b)
	if b, err = take(4+8+8+1, "rank header"); err != nil {
		return err
	}
	tp := binary.BigEndian.Uint32(b)
	if tp > dcp.MaxTP {
		return bad("TP rank %d exceeds %d", tp, dcp.MaxTP)
	}
	out.Rank.TPRank = int(tp)
	out.Incarnation = binary.BigEndian.Uint64(b[4:])
	out.Seq = binary.BigEndian.Uint64(b[12:])
	if b, err = take(int(b[20]), "snapshot id"); err != nil {
		return err
	}
	out.Snapshot = string(b)
	if b, err = take(4+4+4, "page header"); err != nil {
		return err
	}
	page, pages, m := binary.BigEndian.Uint32(b), binary.BigEndian.Uint32(b[4:]), binary.BigEndian.Uint32(b[8:])
	if pages < 1 || page >= pages || uint64(pages) > uint64(maxInt) {
		return bad("page %d of %d: want 0 <= page < pages", page, pages)
	}
	out.Page, out.Pages = int(page), int(pages)
	if m > MaxInventoryPageSize {
		return bad("key table of %d namespaces, limit %d", m, MaxInventoryPageSize)
	}
	if b, err = take(int(m)*16, "key table"); err != nil {
		return err
	}
	table := make([]dcp.Namespace, m)
	seen := make(map[dcp.Namespace]struct{}, m)
	for i := range table {
		copy(table[i][:], b[16*i:])
		if _, dup := seen[table[i]]; dup {
			return bad("key table lists namespace %s twice", table[i])
		}
		seen[table[i]] = struct{}{}
	}
	if b, err = take(4, "object count"); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(b)
	switch {
	case n > MaxInventoryPageSize:
		return bad("%d objects, limit %d", n, MaxInventoryPageSize)
	case m > n:
		return bad("key table of %d namespaces for %d objects", m, n)
	case uint64(len(q)) != uint64(n)*invObjectSize:
		return bad("%d B of objects, want %d x %d B", len(q), n, invObjectSize)
	}
	out.Objects = make([]Placement, n)
	used := uint32(0) // table entries are listed in order of first use
	for i := range out.Objects {
		o := &out.Objects[i]
		r := q[i*invObjectSize : (i+1)*invObjectSize]
		ns := binary.BigEndian.Uint32(r)
		switch {
		case ns >= m:
			return bad("object %d: namespace index %d outside the table of %d", i, ns, m)
		case ns > used:
			return bad("object %d: namespace index %d, but the table lists namespaces in order of first use (next %d)", i, ns, used)
		case ns == used:
			used++
		}
		o.Key.NS = table[ns]
		copy(o.Key.Chunk[:], r[4:20])
		o.Key.Shard = binary.BigEndian.Uint16(r[20:])
		o.Key.Group = binary.BigEndian.Uint16(r[22:])
		o.Tier = Tier(r[24])
		if !o.Tier.Valid() {
			return bad("object %d: tier %d", i, o.Tier)
		}
		o.Size = binary.BigEndian.Uint64(r[25:])
		o.Sum = binary.BigEndian.Uint64(r[33:])
	}
	if used != m {
		return bad("key table of %d namespaces, %d used", m, used)
	}
	*p = out
	return nil
}

const maxInt = int(^uint(0) >> 1)
