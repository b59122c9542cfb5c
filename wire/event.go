package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/kvtier/kvtier/dcp"
)

// ErrMalformed: a message could not be decoded.
var ErrMalformed = errors.New("wire: malformed message")

// Tier is where a rank holds an object.
type Tier uint8

const (
	L1 Tier = 1 // pinned host memory; lost when rankd restarts
	L2 Tier = 2 // files; survives restarts
	L3 Tier = 3 // an S3-compatible object store; survives restarts, shared by the instance
)

// Valid reports whether t is one of the tiers above.
func (t Tier) Valid() bool { return t == L1 || t == L2 || t == L3 }

func (t Tier) String() string {
	switch t {
	case L1:
		return "L1"
	case L2:
		return "L2"
	case L3:
		return "L3"
	}
	return "tier(" + strconv.Itoa(int(t)) + ")"
}

// Rank identifies one rankd: the engine instance and its TP rank.
type Rank struct {
	Instance string `json:"instance"`
	TPRank   int    `json:"tp_rank"`
}

func (r Rank) String() string { return r.Instance + "/" + strconv.Itoa(r.TPRank) }

// ParseRank parses the String form "instance/tp".
func ParseRank(s string) (Rank, error) {
	i := strings.LastIndexByte(s, '/')
	if i <= 0 {
		return Rank{}, fmt.Errorf("rank %q: want instance/tp_rank: %w", s, ErrMalformed)
	}
	tp, err := strconv.Atoi(s[i+1:])
	if err != nil || tp < 0 || tp > dcp.MaxTP {
		return Rank{}, fmt.Errorf("rank %q: TP rank not in 0..%d: %w", s, dcp.MaxTP, ErrMalformed)
	}
	return Rank{Instance: s[:i], TPRank: tp}, nil
}

// EventKind says whether a placement appeared or went away.
type EventKind uint8

const (
	Stored  EventKind = 1
	Removed EventKind = 2
)

// Event is one placement change on a rank.
type Event struct {
	Seq  uint64    `json:"seq"`
	Kind EventKind `json:"kind"`
	Tier Tier      `json:"tier"`
	Key  dcp.Key   `json:"key"`
	Size uint64    `json:"size"`
	Sum  uint64    `json:"sum"` // kvsum64 of the packed object
}

// Batch is a run of events from one rank incarnation, in sequence order.
type Batch struct {
	Rank        Rank    `json:"rank"`
	Incarnation uint64  `json:"incarnation"`
	Events      []Event `json:"events"`
}

// Limits on decoded batches.
const (
	MaxBatchEvents = 1 << 16
	maxInstance    = 255
	eventSize      = 8 + 1 + 1 + dcp.KeySize + 8 + 8
)

// Binary batch encoding, big-endian:
//
//	magic "KVB1" | u8 len(instance) | instance | u32 tp_rank | u64 incarnation
//	| u32 n | n x (u64 seq | u8 kind | u8 tier | key (dcp.KeySize) | u64 size | u64 sum)
//
// Fixed-size events keep encoding and decoding at memory speed; the index
// ingests millions of them a second.
const batchMagic = "KVB1"

// AppendBinary appends the binary encoding of b.
func (b *Batch) AppendBinary(dst []byte) ([]byte, error) {
	if len(b.Rank.Instance) > maxInstance {
		return dst, fmt.Errorf("instance name %d bytes, limit %d: %w", len(b.Rank.Instance), maxInstance, ErrMalformed)
	}
	if len(b.Events) > MaxBatchEvents {
		return dst, fmt.Errorf("batch of %d events, limit %d: %w", len(b.Events), MaxBatchEvents, ErrMalformed)
	}
	dst = append(dst, batchMagic...)
	dst = append(dst, byte(len(b.Rank.Instance)))
	dst = append(dst, b.Rank.Instance...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(b.Rank.TPRank))
	dst = binary.BigEndian.AppendUint64(dst, b.Incarnation)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(b.Events)))
	for i := range b.Events {
		e := &b.Events[i]
		dst = binary.BigEndian.AppendUint64(dst, e.Seq)
		dst = append(dst, byte(e.Kind), byte(e.Tier))
		dst, _ = e.Key.AppendBinary(dst)
		dst = binary.BigEndian.AppendUint64(dst, e.Size)
		dst = binary.BigEndian.AppendUint64(dst, e.Sum)
	}
	return dst, nil
}

// MarshalBinary returns the binary encoding of b.
func (b *Batch) MarshalBinary() ([]byte, error) {
	return b.AppendBinary(make([]byte, 0, 32+len(b.Rank.Instance)+len(b.Events)*eventSize))
}

// UnmarshalBinary decodes a binary batch, validating every field.
func (b *Batch) UnmarshalBinary(p []byte) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("event batch: "+format+": %w", append(args, ErrMalformed)...)
	}
	if len(p) < 5 || string(p[:4]) != batchMagic {
		return bad("missing magic %q", batchMagic)
	}
	n := int(p[4])
	p = p[5:]
	if len(p) < n+16 {
		return bad("truncated header")
	}
	b.Rank.Instance = string(p[:n])
	p = p[n:]
	tp := binary.BigEndian.Uint32(p)
	if tp > dcp.MaxTP {
		return bad("TP rank %d exceeds %d", tp, dcp.MaxTP)
	}
	b.Rank.TPRank = int(tp)
	b.Incarnation = binary.BigEndian.Uint64(p[4:])
	count := binary.BigEndian.Uint32(p[12:])
	p = p[16:]
	if count > MaxBatchEvents {
		return bad("%d events, limit %d", count, MaxBatchEvents)
	}
	if uint64(len(p)) != uint64(count)*eventSize {
		return bad("%d bytes of events, want %d x %d", len(p), count, eventSize)
	}
	b.Events = make([]Event, count)
	for i := range b.Events {
		e := &b.Events[i]
		e.Seq = binary.BigEndian.Uint64(p)
		e.Kind, e.Tier = EventKind(p[8]), Tier(p[9])
		if e.Kind != Stored && e.Kind != Removed {
			return bad("event %d: kind %d", i, e.Kind)
		}
		if !e.Tier.Valid() {
			return bad("event %d: tier %d", i, e.Tier)
		}
		if err := e.Key.UnmarshalBinary(p[10 : 10+dcp.KeySize]); err != nil {
			return fmt.Errorf("event batch: event %d: %w", i, errors.Join(err, ErrMalformed))
		}
		q := p[10+dcp.KeySize:]
		e.Size = binary.BigEndian.Uint64(q)
		e.Sum = binary.BigEndian.Uint64(q[8:])
		p = p[eventSize:]
	}
	return nil
}

// Placement is one object a rank holds, as listed in its inventory.
type Placement struct {
	Key  dcp.Key `json:"key"`
	Tier Tier    `json:"tier"`
	Size uint64  `json:"size"`
	Sum  uint64  `json:"sum"`
}

// Inventory is everything a rank holds, as of event sequence Seq (every
// event with a sequence <= Seq is reflected in it).
type Inventory struct {
	Rank        Rank        `json:"rank"`
	Incarnation uint64      `json:"incarnation"`
	Seq         uint64      `json:"seq"`
	Objects     []Placement `json:"objects"`
}

// Heartbeat is a rank's periodic statement of the last event sequence it
// has assigned. A lost event is otherwise noticed only when a later batch
// arrives; an idle rank's heartbeat exposes it, and the coordinator
// resyncs the rank when the index stays behind a sequence announced one
// heartbeat earlier.
//
// Heartbeats are also the authenticated half of failure detection: only
// the rank's own NATS identity may publish on its heartbeat subject (C9),
// so the coordinator acts on a gossip death or leave only when the rank's
// heartbeats have stopped, its NATS connection is gone, or the rank said
// it is leaving here (Leaving). IntervalMS and Leaving are absent from
// rankds from before; decoders ignore fields they do not know.
type Heartbeat struct {
	Rank        Rank   `json:"rank"`
	Incarnation uint64 `json:"incarnation"`
	Seq         uint64 `json:"seq"`
	// IntervalMS is the rank's heartbeat interval in milliseconds: the
	// coordinator confirms a gossip death once no heartbeat of the
	// incarnation arrived for a few of these. 0: not announced (the
	// coordinator assumes its configured default).
	IntervalMS int64 `json:"interval_ms,omitempty"`
	// Leaving: the rank has begun a graceful shutdown and is about to
	// leave the cluster (sent once, after its last events were flushed,
	// before its gossip leave). It is the rank's own, authenticated word
	// for the leave that gossip then reports.
	Leaving bool `json:"leaving,omitempty"`
	// Capacity is what the rank declares it can hold (issue 28.3): the
	// coordinator bounds the rank's placements by it (and by its own
	// per-rank cap). Absent from rankds from before: the cap alone.
	Capacity *Capacity `json:"capacity,omitempty"`
	// OfferIndex is set after the rank saw the coordinator's signed index
	// id change (a coordinator restarted on a lost data directory): it
	// names the new id, and the coordinator whose index has that id asks
	// the rank for its inventory (a resync). It stays set until the rank
	// serves an inventory, for a bounded time. A rank the coordinator did
	// not ask at its start (partitioned, its NATS connection down) is
	// otherwise never asked while it sends no events. Older peers ignore it.
	OfferIndex string `json:"offer_index,omitempty"`
}

// MaxHeartbeatInterval caps the interval a heartbeat may announce; a
// larger one is taken as this (a rank cannot make its death unconfirmable
// by announcing a huge interval).
const MaxHeartbeatInterval = time.Minute

// Inventory paging. An inventory travels as pages of one snapshot, so a
// rank of any size fits the NATS payload limit: the first request (no
// Snapshot) makes the rank take one consistent snapshot and keep it for a
// short while under a random id; later requests name that id and a page.
const (
	// DefaultInventoryPageSize is the page size a rank uses when the
	// request names none: about 130 B of JSON per object keeps a page near
	// 0.5 MiB.
	DefaultInventoryPageSize = 4096
	// MaxInventoryPageSize caps a requested page size (about 2 MiB of
	// JSON, well under the 8 MiB NATS payload limit).
	MaxInventoryPageSize = 16384
)

// InventoryRequest asks a rank for one page of an inventory snapshot.
type InventoryRequest struct {
	// Snapshot is the id from an earlier page; "" takes a new snapshot.
	Snapshot string `json:"snapshot,omitempty"`
	// Page is the 0-based page number.
	Page int `json:"page"`
	// PageSize is the objects per page; 0 means the rank's default. It
	// applies when a snapshot is taken; later requests must send 0 or the
	// same size.
	PageSize int `json:"page_size,omitempty"`
	// Encoding is "" for JSON pages or InventoryEncodingBinary for binary
	// ones (the reply is then the page's bytes, or a JSON error reply).
	Encoding string `json:"encoding,omitempty"`
	// Probe asks only whether the rank is there: it answers a RankProbe at
	// once and takes no snapshot (the other fields must be zero). The
	// coordinator probes a rank that gossip reports dead or left: "no
	// responders" from NATS means no connection of the rank's identity
	// is subscribed (its NATS connection is gone). A rankd from before
	// refuses the unknown field (strict decoding) with bad_request, which
	// still proves a connection of the rank's identity is there.
	Probe bool `json:"probe,omitempty"`
}

// HeaderIndex is the NATS header of an InventoryRequest that takes a new
// snapshot: the id of the asking coordinator's index (cluster.Meta.Index).
// A rank that serves the inventory records the id as one it has synced
// with, so seeing it later in gossip starts no offer (the index watch,
// rankd/indexwatch.go): a coordinator restarted on a lost directory asks
// every live rank at start, and without the header each rank offered its
// inventory again once gossip showed it the new id, a second resync that
// hid the rank's placements while it streamed. A header rather than a
// field: a rank that predates it ignores it (it decodes requests
// strictly), and one that gets none offers as before.
const HeaderIndex = "Kvtier-Index"

// RankProbe is a rank's answer to an InventoryRequest with Probe set.
type RankProbe struct {
	Rank        Rank   `json:"rank"`
	Incarnation uint64 `json:"incarnation"`
	// Leaving: the rank has sent its leaving heartbeat (Heartbeat.Leaving).
	Leaving bool `json:"leaving,omitempty"`
	// Capacity is what the rank declares it can hold (issue 28.3): the
	// coordinator bounds the rank's placements by it (and by its own
	// per-rank cap). Absent from rankds from before: the cap alone.
	Capacity *Capacity `json:"capacity,omitempty"`
}

// InventoryPage is one page of an inventory snapshot. Every page of one
// snapshot carries the same Rank, Incarnation, Seq, Snapshot and Pages.
type InventoryPage struct {
	Rank        Rank        `json:"rank"`
	Incarnation uint64      `json:"incarnation"`
	Seq         uint64      `json:"seq"`
	Snapshot    string      `json:"snapshot"`
	Page        int         `json:"page"`
	Pages       int         `json:"pages"`
	Objects     []Placement `json:"objects"`
}

// AssembleInventory joins the pages of one snapshot, in order, into the
// inventory they describe. Every page must belong to the same snapshot
// (rank, incarnation, sequence, id and page count) and page i must be
// number i; otherwise the error wraps ErrMalformed.
func AssembleInventory(pages []InventoryPage) (Inventory, error) {
	if len(pages) == 0 {
		return Inventory{}, fmt.Errorf("inventory of no pages: %w", ErrMalformed)
	}
	first := &pages[0]
	if first.Pages != len(pages) {
		return Inventory{}, fmt.Errorf("inventory snapshot %q declares %d pages, got %d: %w",
			first.Snapshot, first.Pages, len(pages), ErrMalformed)
	}
	n := 0
	for i := range pages {
		if err := SamePage(first, &pages[i], i); err != nil {
			return Inventory{}, err
		}
		n += len(pages[i].Objects)
	}
	inv := Inventory{Rank: first.Rank, Incarnation: first.Incarnation, Seq: first.Seq, Objects: make([]Placement, 0, n)}
	for i := range pages {
		inv.Objects = append(inv.Objects, pages[i].Objects...)
	}
	return inv, nil
}

// SamePage checks that p is page i of first's snapshot (rank,
// incarnation, sequence, id and page count); the error wraps ErrMalformed.
func SamePage(first, p *InventoryPage, i int) error {
	switch {
	case p.Page != i:
		return fmt.Errorf("inventory snapshot %q: page %d arrived as page %d: %w", first.Snapshot, p.Page, i, ErrMalformed)
	case p.Rank != first.Rank || p.Incarnation != first.Incarnation || p.Seq != first.Seq ||
		p.Snapshot != first.Snapshot || p.Pages != first.Pages:
		return fmt.Errorf("inventory page %d (rank %s incarnation %d seq %d snapshot %q of %d pages) differs from page 0 (rank %s incarnation %d seq %d snapshot %q of %d pages): %w",
			i, p.Rank, p.Incarnation, p.Seq, p.Snapshot, p.Pages,
			first.Rank, first.Incarnation, first.Seq, first.Snapshot, first.Pages, ErrMalformed)
	}
	return nil
}

// PageInventory cuts inv into pages of at most pageSize objects under
// snapshot id; an empty inventory is one empty page. It is what a rank
// serves, and AssembleInventory reverses it.
func PageInventory(inv *Inventory, snapshot string, pageSize int) []InventoryPage {
	if pageSize < 1 {
		pageSize = DefaultInventoryPageSize
	}
	pages := max(1, (len(inv.Objects)+pageSize-1)/pageSize)
	out := make([]InventoryPage, pages)
	for i := range out {
		lo, hi := i*pageSize, min((i+1)*pageSize, len(inv.Objects))
		out[i] = InventoryPage{Rank: inv.Rank, Incarnation: inv.Incarnation, Seq: inv.Seq,
			Snapshot: snapshot, Page: i, Pages: pages, Objects: inv.Objects[lo:hi:hi]}
	}
	return out
}
