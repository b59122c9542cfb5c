package replica

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

func TestMain(m *testing.M) { testutil.Main(m) }

// TestCommandCodec: every command kind decodes to the index operation it
// was encoded from, and a bad entry is an index.ErrInvalid, never a panic.
func TestCommandCodec(t *testing.T) {
	r := wire.Rank{Instance: "eng", TPRank: 3}
	js := func(v any) []byte {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	batch := wire.Batch{Rank: r, Incarnation: 7}
	bb, err := batch.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		entry []byte
		check func(index.Op) bool
	}{
		{"batch", appendCommand(raftCmdBatch, bb), func(op index.Op) bool {
			return op.Batch != nil && op.Batch.Rank == r && op.Batch.Incarnation == 7
		}},
		{"inventory", appendCommand(raftCmdInv, js(wire.Inventory{Rank: r, Incarnation: 7})), func(op index.Op) bool {
			return op.Inventory != nil && op.Inventory.Rank == r && op.FenceGen == nil
		}},
		{"inventory at a fence generation", appendCommand(raftCmdInvAt, js(invAtCmd{Inventory: wire.Inventory{Rank: r, Incarnation: 7}, FenceGen: 4})),
			func(op index.Op) bool {
				return op.Inventory != nil && op.Inventory.Rank == r && op.FenceGen != nil && *op.FenceGen == 4
			}},
		{"fence", appendCommand(raftCmdFence, js(fenceCmd{Rank: r, UpTo: 9})), func(op index.Op) bool {
			return op.Fence != nil && *op.Fence == r && op.UpTo == 9
		}},
		{"inventory step", appendCommand(raftCmdInvStep, js(index.InventoryStep{Kind: index.StepPage, Rank: r, Incarnation: 7, Seq: 5,
			FenceGen: 2, Objects: []wire.Placement{{Tier: wire.L2, Size: 1, Sum: 3}}})), func(op index.Op) bool {
			s := op.Step
			return s != nil && s.Kind == index.StepPage && s.Rank == r && s.Incarnation == 7 && s.Seq == 5 && s.FenceGen == 2 &&
				len(s.Objects) == 1 && s.Objects[0].Sum == 3
		}},
		{"reset", appendCommand(raftCmdReset, js(r)), func(op index.Op) bool {
			return op.Reset != nil && *op.Reset == r
		}},
	} {
		op, err := decodeCommand(tc.entry)
		if err != nil || !tc.check(op) {
			t.Errorf("%s: decoded %+v, %v", tc.name, op, err)
		}
	}
	for name, bad := range map[string][]byte{
		"empty":         nil,
		"one byte":      {raftCmdVersion},
		"version 2":     {2, raftCmdFence, '{', '}'},
		"unknown kind":  {raftCmdVersion, 99},
		"bad json":      appendCommand(raftCmdFence, []byte("{")),
		"bad batch":     appendCommand(raftCmdBatch, []byte{1, 2, 3}),
		"bad inventory": appendCommand(raftCmdInv, []byte("[]")),
		"bad step":      appendCommand(raftCmdInvStep, []byte("[]")),
	} {
		if _, err := decodeCommand(bad); !errors.Is(err, index.ErrInvalid) {
			t.Errorf("%s: %v, want index.ErrInvalid", name, err)
		}
	}
}
