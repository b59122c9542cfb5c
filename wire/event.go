package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/kvtier/kvtier/dcp"
)

// ErrMalformed: a message could not be decoded.
var ErrMalformed = errors.New("wire: malformed message")

// Tier is where a rank holds an object.
type Tier uint8

const (
	L1 Tier = 1 // pinned host memory; lost when rankd restarts
	L2 Tier = 2 // files; survives restarts
)

func (t Tier) String() string {
	switch t {
	case L1:
		return "L1"
	case L2:
		return "L2"
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
		if e.Tier != L1 && e.Tier != L2 {
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
type Heartbeat struct {
	Rank        Rank   `json:"rank"`
	Incarnation uint64 `json:"incarnation"`
	Seq         uint64 `json:"seq"`
}
