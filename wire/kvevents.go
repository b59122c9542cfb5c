package wire

import (
	"encoding/json"
	"fmt"

	"github.com/kvtier/kvtier/dcp"
)

// KV events for routers (issue 26.4, docs/kvevents.md): the coordinator
// publishes, per engine instance, which chunks a restore by that instance
// could read whole from which tier, in the shape of vLLM's KV events
// (vllm/distributed/kv_events.py: EventBatch, BlockStored, BlockRemoved,
// AllBlocksCleared) so a router that already consumes vLLM's events reads
// ours with the same code. vLLM sends msgpack over ZMQ; we send JSON on
// NATS with the same field names, each event tagged by "type" with its
// class name (msgspec's tag=True).

// The media of vLLM's events. kvtier's L1 (pinned host memory) is "CPU";
// L2 (files) and L3 (an object store) are both "STORAGE", told apart by
// Ownership (KVOwnershipL2, KVOwnershipL3). kvtier never reports "GPU".
const (
	MediumGPU     = "GPU"
	MediumCPU     = "CPU"
	MediumStorage = "STORAGE"
)

// Ownership values of STORAGE events: which kvtier tier holds the chunk
// (vLLM's "secondary offloading tier identifier").
const (
	KVOwnershipL2 = "L2"
	KVOwnershipL3 = "L3"
)

// Type tags of the events ("type" in JSON).
const (
	KVBlockStored      = "BlockStored"
	KVBlockRemoved     = "BlockRemoved"
	KVAllBlocksCleared = "AllBlocksCleared"
)

// KVMedium returns the medium and ownership a tier is announced with.
func KVMedium(t Tier) (medium, ownership string) {
	switch t {
	case L1:
		return MediumCPU, ""
	case L2:
		return MediumStorage, KVOwnershipL2
	case L3:
		return MediumStorage, KVOwnershipL3
	}
	return "", ""
}

// KVEventBatch is one message on a Subjects.KVEvents subject: vLLM's
// EventBatch. Ts is the publisher's clock in seconds since the epoch.
// DataParallelRank is never set by kvtier (one subject per instance).
type KVEventBatch struct {
	Ts               float64   `json:"ts"`
	Events           []KVEvent `json:"events"`
	DataParallelRank *int      `json:"data_parallel_rank,omitempty"`
}

// KVEvent is one of *BlockStored, *BlockRemoved, *AllBlocksCleared.
type KVEvent interface{ kvEventType() string }

// BlockStored: the chunks became readable whole by the instance from
// Medium. BlockHashes are kvtier chunk hashes (hex); BlockSize is the
// namespace's chunk size in tokens. The coordinator never sees tokens, so
// ParentBlockHash is always null and TokenIDs always empty; the fields are
// kept because vLLM's consumers expect them.
type BlockStored struct {
	BlockHashes     []dcp.ChunkHash `json:"block_hashes"`
	ParentBlockHash *dcp.ChunkHash  `json:"parent_block_hash"`
	TokenIDs        []int           `json:"token_ids"`
	BlockSize       int             `json:"block_size"`
	LoraID          *int            `json:"lora_id"`
	Medium          string          `json:"medium"`
	LoraName        *string         `json:"lora_name"`
	GroupIdx        *int            `json:"group_idx,omitempty"`
	Locality        string          `json:"locality,omitempty"`
	Ownership       string          `json:"ownership,omitempty"`
}

// BlockRemoved: the chunks stopped being readable whole from Medium.
type BlockRemoved struct {
	BlockHashes []dcp.ChunkHash `json:"block_hashes"`
	Medium      string          `json:"medium"`
	GroupIdx    *int            `json:"group_idx,omitempty"`
	Locality    string          `json:"locality,omitempty"`
	Ownership   string          `json:"ownership,omitempty"`
}

// AllBlocksCleared: forget everything announced for the instance; a
// snapshot of BlockStored events follows when the coordinator resyncs.
type AllBlocksCleared struct{}

func (*BlockStored) kvEventType() string      { return KVBlockStored }
func (*BlockRemoved) kvEventType() string     { return KVBlockRemoved }
func (*AllBlocksCleared) kvEventType() string { return KVAllBlocksCleared }

// MarshalJSON writes the event with its "type" tag first.
func (e *BlockStored) MarshalJSON() ([]byte, error) {
	type plain BlockStored
	return marshalTagged(KVBlockStored, (*plain)(e))
}

// MarshalJSON writes the event with its "type" tag first.
func (e *BlockRemoved) MarshalJSON() ([]byte, error) {
	type plain BlockRemoved
	return marshalTagged(KVBlockRemoved, (*plain)(e))
}

// MarshalJSON writes {"type":"AllBlocksCleared"}.
func (e *AllBlocksCleared) MarshalJSON() ([]byte, error) {
	return []byte(`{"type":"` + KVAllBlocksCleared + `"}`), nil
}

// marshalTagged encodes v (a struct) with "type": tag as its first field.
func marshalTagged(tag string, v any) ([]byte, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(body)+len(tag)+10)
	out = append(out, `{"type":"`...)
	out = append(out, tag...)
	out = append(out, '"')
	if len(body) > 2 {
		out = append(out, ',')
	}
	return append(out, body[1:]...), nil
}

// UnmarshalJSON decodes a batch, each event by its "type" tag; an unknown
// tag is an error wrapping ErrMalformed.
func (b *KVEventBatch) UnmarshalJSON(p []byte) error {
	var raw struct {
		Ts               float64           `json:"ts"`
		Events           []json.RawMessage `json:"events"`
		DataParallelRank *int              `json:"data_parallel_rank"`
	}
	if err := json.Unmarshal(p, &raw); err != nil {
		return fmt.Errorf("kv event batch: %w: %w", err, ErrMalformed)
	}
	*b = KVEventBatch{Ts: raw.Ts, DataParallelRank: raw.DataParallelRank, Events: make([]KVEvent, 0, len(raw.Events))}
	for i, r := range raw.Events {
		var tag struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(r, &tag); err != nil {
			return fmt.Errorf("kv event %d: %w: %w", i, err, ErrMalformed)
		}
		var e KVEvent
		switch tag.Type {
		case KVBlockStored:
			e = new(BlockStored)
		case KVBlockRemoved:
			e = new(BlockRemoved)
		case KVAllBlocksCleared:
			b.Events = append(b.Events, &AllBlocksCleared{})
			continue
		default:
			return fmt.Errorf("kv event %d: type %q: %w", i, tag.Type, ErrMalformed)
		}
		type plainStored BlockStored
		type plainRemoved BlockRemoved
		var err error
		switch v := e.(type) {
		case *BlockStored:
			err = json.Unmarshal(r, (*plainStored)(v))
		case *BlockRemoved:
			err = json.Unmarshal(r, (*plainRemoved)(v))
		}
		if err != nil {
			return fmt.Errorf("kv event %d (%s): %w: %w", i, tag.Type, err, ErrMalformed)
		}
		b.Events = append(b.Events, e)
	}
	return nil
}

// KVEventType returns an event's "type" tag.
func KVEventType(e KVEvent) string { return e.kvEventType() }

// KVEvents is where the serving coordinator publishes the KV events of
// engine instance inst (KVEventBatch, JSON). Routers subscribe with the
// admin identity; KVEventsAll matches every instance's.
func (s Subjects) KVEvents(inst string) string { return s.p() + ".kvevents." + inst }

// KVEventsAll matches KVEvents(*).
func (s Subjects) KVEventsAll() string { return s.p() + ".kvevents.*" }
