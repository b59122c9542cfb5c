package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/wire"
)

// (f) Malformed messages to the rankds and the coordinator get clear error
// replies with stable codes; the daemons keep serving, what was stored is
// still restorable and a normal store/restore works afterwards.
func TestBadInput(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	stored := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--keep-registered")
	sess0 := stored.Sessions[0]

	sc, _ := enginesim.LookupScenario("tp4dcp4")
	plan, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		t.Fatal(err)
	}
	ns := plan.R.Namespace
	rank0 := wire.Rank{Instance: "engine0", TPRank: 0}
	eng := func(op string) string { return c.subj.Engine(rank0, op) }
	js := func(v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	badSpec := sc.Spec
	badSpec.Groups = append([]dcp.Group(nil), sc.Spec.Groups...)
	badSpec.Groups[2].StrideBytes = 160000 // declared 177,408 B page over a 160,000 B stride
	unknownNS := dcp.Namespace{0xde, 0xad}
	hdl := cuda.MemHandle{Backend: "host", Device: "HOST-x", Raw: []byte("kvtier-1-m-00"), Size: 4 << 20}
	var pools []wire.PoolRegistration
	for gi, g := range sc.Spec.Groups {
		for l := range g.Layers {
			pools = append(pools, wire.PoolRegistration{Group: gi, Layer: l, Handle: hdl})
		}
	}
	tooMany := make([]dcp.ChunkHash, 1<<16+1)
	evHandle := cuda.EventHandle{Backend: "host", Device: "HOST-x", Raw: []byte("kvtier-1-e-00")}
	key0 := dcp.Key{NS: ns, Chunk: plan.Hashes[0], Shard: 0, Group: 0}

	cases := []struct {
		name, subject, body, code, says string
	}{
		// rankd engine API
		{"rankd garbage JSON", eng("store"), `{"request_id": tru`, wire.CodeBadRequest, "decode store request"},
		{"rankd not JSON at all", eng("retrieve"), "\x00\x01\x02binary", wire.CodeBadRequest, "decode retrieve request"},
		{"rankd unknown field", eng("store"), `{"request_id":"x","surprise":1}`, wire.CodeBadRequest, "unknown field"},
		{"rankd oversize", eng("store"), `{"request_id":"` + strings.Repeat("x", 5<<20) + `"}`, wire.CodeTooLarge, "exceeds"},
		{"rankd wrong geometry", eng("register"), js(wire.RegisterRequest{Spec: badSpec, DeviceUUID: "HOST-x", Pools: pools}),
			wire.CodeGeometry, "declared page 177408 B exceeds block stride 160000 B"},
		{"rankd wrong TP size", eng("register"), js(wire.RegisterRequest{Spec: func() dcp.Spec {
			s := sc.Spec
			s.Layout.TP = 8
			return s
		}(), DeviceUUID: "HOST-x", Pools: pools}), wire.CodeBadRequest, "TP size 8"},
		{"rankd unknown namespace", eng("store"), js(wire.StoreRequest{RequestID: "r", Namespace: unknownNS, Event: evHandle,
			Chunks: []wire.ChunkBlocks{{Chunk: plan.Hashes[0], Blocks: [][]int64{{0}}}}}), wire.CodeUnknownNamespace, "not registered"},
		{"rankd block outside the pool", eng("retrieve"), js(wire.RetrieveRequest{Namespace: ns, Session: sess0,
			Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key0, Blocks: []int64{1 << 40}}}}), wire.CodeBadRequest, "block"},
		{"rankd no session", eng("retrieve"), js(wire.RetrieveRequest{Namespace: ns,
			Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key0, Blocks: []int64{0}}}}), wire.CodeUnknownSession, "names no session"},
		{"rankd key of another shard", eng("retrieve"), js(wire.RetrieveRequest{Namespace: ns, Session: sess0,
			Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: dcp.Key{NS: ns, Chunk: plan.Hashes[0], Shard: 3}, Blocks: []int64{0}}}}),
			wire.CodeBadRequest, "shard"},
		{"rankd inventory garbage", c.subj.Inventory(rank0), `[[[`, wire.CodeBadRequest, "decode"},
		{"rankd status garbage", eng("status"), `{"verbose":true}`, wire.CodeBadRequest, "unknown field"},
		// coordinator
		{"coordinator garbage spec", c.subj.EngineCoord("engine0", wire.CoordRegister), `{"model":`, wire.CodeBadRequest, "decode"},
		{"coordinator wrong geometry", c.subj.EngineCoord("engine0", wire.CoordRegister), js(badSpec), wire.CodeGeometry, "exceeds block stride"},
		{"coordinator unknown field", c.subj.EngineCoord("engine0", wire.CoordLookup), `{"namespace":` + js(ns) + `,"chunks":[],"hint":1}`, wire.CodeBadRequest, "unknown field"},
		{"coordinator unknown namespace", c.subj.EngineCoord("engine0", wire.CoordLookup), js(wire.LookupRequest{Namespace: unknownNS, Chunks: plan.Hashes}),
			wire.CodeUnknownNamespace, ""},
		{"coordinator oversize chain", c.subj.EngineCoord("engine0", wire.CoordLookup), js(wire.LookupRequest{Namespace: ns, Chunks: tooMany}), wire.CodeTooLarge, "limit"},
		{"coordinator report of unknown restore", c.subj.Report(rank0), js(wire.RestoreReport{RestoreID: "nope", Rank: rank0}),
			wire.CodeNotFound, "not known"},
		{"coordinator wait of unknown restore", c.subj.EngineCoord("engine0", wire.CoordRestoreWait), js(wire.RestoreWait{RestoreID: "nope"}), wire.CodeNotFound, "not known"},
		{"coordinator garbage event batch", c.subj.Events(rank0), "KVB1\x07garbage", wire.CodeBadRequest, "event batch"},
		{"coordinator batch on another rank's subject", c.subj.Events(wire.Rank{Instance: "engine0", TPRank: 3}), func() string {
			b, _ := (&wire.Batch{Rank: rank0, Incarnation: 1}).MarshalBinary()
			return string(b)
		}(), wire.CodeUnauthorized, "arrived on"},
		{"coordinator admin bad key", c.subj.Admin(wire.AdminObject), `{"key":"not-a-key"}`, wire.CodeBadRequest, "key"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			m, err := c.connFor(tc.subject).RequestWithContext(ctx, tc.subject, []byte(tc.body))
			if err != nil {
				t.Fatalf("no reply: %v", err)
			}
			var rep wire.Reply[json.RawMessage]
			if err := json.Unmarshal(m.Data, &rep); err != nil {
				t.Fatalf("reply is not a wire.Reply: %v: %.200s", err, m.Data)
			}
			if rep.Error == nil || rep.Error.Code != tc.code || !strings.Contains(rep.Error.Message, tc.says) {
				t.Fatalf("reply %.300s, want code %s saying %q", m.Data, tc.code, tc.says)
			}
		})
	}

	// Everything is still up and nothing was lost.
	if !c.coord.alive() {
		t.Fatal("coordinator died")
	}
	for r, p := range c.ranks {
		if !p.alive() {
			t.Fatalf("rankd %d died", r)
		}
	}
	v, err := admin[wire.AdminVerifyReply](c, wire.AdminVerify, struct{}{})
	if err != nil || !v.OK {
		t.Fatalf("verify after bad input: %+v %v", v, err)
	}
	res := c.mustSim("--scenario", "tp4dcp4", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete {
		t.Fatalf("restore of what was stored before: %+v", res)
	}
	res = c.mustSim("--scenario", "tp4dcp1", "--phase", "all", "--seed", "7")
	if res.Verdict != wire.VerdictComplete {
		t.Fatal(fmt.Sprintf("a new store/restore after bad input: %+v", res))
	}
}
