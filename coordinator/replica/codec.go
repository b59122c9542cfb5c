package replica

import (
	"encoding/json"
	"fmt"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// The command codec: every raft log entry this package writes is one
// byte of version, one of kind, and the payload. An entry carries no time
// and no random value, and the index's apply reads neither, so every
// replica that applies the same entries in the same order holds the same
// index.

// Commands: one byte of version, one of kind, the payload.
const (
	raftCmdVersion  = 1
	raftCmdBatch    = 1 // wire.Batch binary
	raftCmdInv      = 2 // wire.Inventory JSON
	raftCmdFence    = 3 // fenceCmd JSON
	raftCmdRegister = 4 // dcp.Spec JSON
	raftCmdReset    = 5 // wire.Rank JSON
	raftCmdInvAt    = 6 // invAtCmd JSON (issue 29.1; older nodes refuse it: upgrade every replica first)
	// raftCmdInvStep is one step of a streamed inventory, index.InventoryStep
	// JSON: a page is at most wire.MaxInventoryPageSize objects (issue 28.3;
	// older nodes refuse it: upgrade every replica first).
	raftCmdInvStep = 7
)

// invAtCmd is an inventory with the fence generation it was requested
// under (index.ApplyInventoryAt): every replica drops it alike if a fence
// entry before it in the log moved the generation.
type invAtCmd struct {
	Inventory wire.Inventory `json:"inventory"`
	FenceGen  uint64         `json:"fence_gen"`
}

type fenceCmd struct {
	Rank wire.Rank `json:"rank"`
	UpTo uint64    `json:"up_to"`
}

func decodeCommand(data []byte) (index.Op, error) {
	var op index.Op
	if len(data) < 2 || data[0] != raftCmdVersion {
		return op, fmt.Errorf("raft command of %d B does not start with version %d: %w", len(data), raftCmdVersion, index.ErrInvalid)
	}
	p := data[2:]
	var err error
	switch data[1] {
	case raftCmdBatch:
		var b wire.Batch
		err = b.UnmarshalBinary(p)
		op.Batch = &b
	case raftCmdInv:
		var inv wire.Inventory
		err = json.Unmarshal(p, &inv)
		op.Inventory = &inv
	case raftCmdInvAt:
		var c invAtCmd
		err = json.Unmarshal(p, &c)
		op.Inventory, op.FenceGen = &c.Inventory, &c.FenceGen
	case raftCmdInvStep:
		var s index.InventoryStep
		err = json.Unmarshal(p, &s)
		op.Step = &s
	case raftCmdFence:
		var f fenceCmd
		err = json.Unmarshal(p, &f)
		op.Fence, op.UpTo = &f.Rank, f.UpTo
	case raftCmdRegister:
		var s dcp.Spec
		err = json.Unmarshal(p, &s)
		op.Register = &s
	case raftCmdReset:
		var r wire.Rank
		err = json.Unmarshal(p, &r)
		op.Reset = &r
	default:
		return op, fmt.Errorf("raft command kind %d unknown: %w", data[1], index.ErrInvalid)
	}
	if err != nil {
		return op, fmt.Errorf("raft command kind %d: %w: %w", data[1], index.ErrInvalid, err)
	}
	return op, nil
}

// appendCommand returns the entry of one command.
func appendCommand(kind byte, payload []byte) []byte {
	data := make([]byte, 0, 2+len(payload))
	data = append(data, raftCmdVersion, kind)
	return append(data, payload...)
}
