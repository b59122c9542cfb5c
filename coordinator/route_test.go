package coordinator

import (
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// TestRouteHints (issue 26.4): group chat = engA (the prompt in L2),
// engB (in L1) and engD (nothing of its own). For the prompt every member
// could restore it all (engD from the others' L2), and admin.route ranks
// engB first (from DRAM), then engA (its own copies), then engD, with
// each one's tiers and shared objects; asked about an instance it answers
// for the instance's group; an instance in no group is answered alone.
// Seen failing first with the sort ignoring L1Prefix (engA, by name,
// before engB).
func TestRouteHints(t *testing.T) {
	c := startCoord(t, func(cfg *Config) {
		cfg.ShareGroups = []ShareGroup{{Name: "chat", Instances: []string{"engA", "engB", "engD"}}}
	})
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	chunks := chain(ns, 3, 5)
	for tp := range 2 {
		if _, werr := sendBatch(t, nc, c.subj, storeBatch(wire.Rank{Instance: "engA", TPRank: tp}, 1, 0, ns, chunks, wire.L2)); werr != nil {
			t.Fatal(werr)
		}
		if _, werr := sendBatch(t, nc, c.subj, storeBatch(wire.Rank{Instance: "engB", TPRank: tp}, 1, 0, ns, chunks, wire.L1)); werr != nil {
			t.Fatal(werr)
		}
	}
	check := func(rep *wire.RouteReply) {
		t.Helper()
		if rep.Group != "chat" || len(rep.Instances) != 3 {
			t.Fatalf("route = %+v", rep)
		}
		want := []struct {
			inst            string
			l1, own, shared int
			nl1, nl2        int
		}{{"engB", 3, 3, 0, 6, 0}, {"engA", 0, 3, 0, 0, 6}, {"engD", 0, 0, 6, 0, 6}}
		for i, w := range want {
			ri := rep.Instances[i]
			if ri.Instance != w.inst || ri.Prefix != 3 || ri.L1Prefix != w.l1 || ri.OwnPrefix != w.own || ri.Shared != w.shared ||
				ri.Objects["L1"] != w.nl1 || ri.Objects["L2"] != w.nl2 {
				t.Fatalf("instance %d: %+v, want %+v", i, ri, w)
			}
		}
	}
	route := func(req wire.RouteRequest) *wire.RouteReply {
		t.Helper()
		req.Namespace, req.Chunks = ns, chunks
		return call[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), req)
	}
	check(route(wire.RouteRequest{Group: "chat"}))
	check(route(wire.RouteRequest{Instance: "engB"}))
	check(route(wire.RouteRequest{Instance: "engD", Group: "chat"}))
	if own := route(wire.RouteRequest{Instance: "engC"}); own.Group != "" || len(own.Instances) != 1 ||
		own.Instances[0].Instance != "engC" || own.Instances[0].Prefix != 0 {
		t.Fatalf("engC's route = %+v", own)
	}
	callErr[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), wire.RouteRequest{Namespace: ns, Chunks: chunks, Group: "nope"}, wire.CodeNotFound)
	callErr[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), wire.RouteRequest{Namespace: ns, Chunks: chunks}, wire.CodeBadRequest)
	callErr[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute),
		wire.RouteRequest{Namespace: ns, Chunks: chunks, Instance: "engC", Group: "chat"}, wire.CodeBadRequest)
}

// TestRouteLoad: in a group every member can restore a prompt whole from
// the group's L2, so the members tie on prefix. Idle, admin.route ranks
// the member with its own copies (engA) first; once engA's engine has
// looked up more than twice as often as engB's (8 lookups against none),
// engB ranks first (the load term, routeload.go): without it every prompt
// that starts with a block engA stored went to engA (BENCHMARKS.md,
// issue 26: 12,028 of 12,031 requests). Seen failing with the load term
// left out of the sort: "engA ranked first at load 8.0".
func TestRouteLoad(t *testing.T) {
	c := startCoord(t, func(cfg *Config) {
		cfg.ShareGroups = []ShareGroup{{Name: "chat", Instances: []string{"engA", "engB"}}}
	})
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	chunks := chain(ns, 3, 5)
	for tp := range 2 {
		if _, werr := sendBatch(t, nc, c.subj, storeBatch(wire.Rank{Instance: "engA", TPRank: tp}, 1, 0, ns, chunks, wire.L2)); werr != nil {
			t.Fatal(werr)
		}
	}
	route := func() *wire.RouteReply {
		t.Helper()
		rep := call[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), wire.RouteRequest{Namespace: ns, Chunks: chunks, Group: "chat"})
		if len(rep.Instances) != 2 || rep.Instances[0].Prefix != 3 || rep.Instances[1].Prefix != 3 {
			t.Fatalf("route = %+v", rep)
		}
		return rep
	}
	if rep := route(); rep.Instances[0].Instance != "engA" || rep.Instances[0].OwnPrefix != 3 || rep.Instances[0].Load != 0 {
		t.Fatalf("idle: route = %+v, want engA (its own copies) first at load 0", rep)
	}
	for range 8 {
		call[wire.LookupReply](t, nc, c.subj.EngineCoord("engA", wire.CoordLookup), wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: "engA"})
	}
	rep := route()
	if a := rep.Instances[1]; rep.Instances[0].Instance != "engB" || a.Load < 1 {
		t.Fatalf("%s ranked first at load %.1f (the other at %.1f): want engB, engA's load 1 or more (route %+v)",
			rep.Instances[0].Instance, rep.Instances[0].Load, a.Load, rep)
	}
	// The route call itself counts no load: asked again, the same order.
	if again := route(); again.Instances[0].Instance != "engB" || again.Instances[0].Load != 0 {
		t.Fatalf("route asked again = %+v", again)
	}
}

// TestRouteOfPipelineStages (issue 27): engines a and b of two pipeline
// stages each, their stages in groups chat0 (a-pp0, b-pp0) and chat1
// (a-pp1, b-pp1). Engine a holds all 4 chunks of the prompt in stage 0
// but only 2 in stage 1; b holds 3 in both. Asked with the stages,
// admin.route answers per engine what every stage could restore (a: 2,
// b: 3), ranks b first, and counts both stages' objects of that common
// prefix; asked about stage 0 alone it ranks a first (4). A request with
// stages that names a member not "<engine>-pp0", or a stage chain of
// another length, or stages whose chains add up to more than MaxChunks
// (too_large), is refused. Seen failing with the engine's prefix left at
// stage 0's (a first, prefix 4).
func TestRouteOfPipelineStages(t *testing.T) {
	c := startCoord(t, func(cfg *Config) {
		cfg.ShareGroups = []ShareGroup{{Name: "chat0", Instances: []string{"a-pp0", "b-pp0"}},
			{Name: "chat1", Instances: []string{"a-pp1", "b-pp1"}}, {Name: "plain", Instances: []string{"d", "e"}}}
	})
	nc := connect(t, c)
	var ns [2]dcp.Namespace
	var chunks [2][]dcp.ChunkHash
	for st := range 2 {
		spec := testSpec(2)
		spec.Layout.PP, spec.Layout.PPStage = 2, st
		ns[st] = register(t, nc, c.subj, spec)
		chunks[st] = chain(ns[st], 4, 9)
	}
	if ns[0] == ns[1] {
		t.Fatal("the stages' namespaces are equal")
	}
	hold := map[string]int{"a-pp0": 4, "a-pp1": 2, "b-pp0": 3, "b-pp1": 3}
	for inst, n := range hold {
		st := int(inst[len(inst)-1] - '0')
		for tp := range 2 {
			if _, werr := sendBatch(t, nc, c.subj, storeBatch(wire.Rank{Instance: inst, TPRank: tp}, 1, 0, ns[st], chunks[st][:n], wire.L1)); werr != nil {
				t.Fatal(werr)
			}
		}
	}
	req := wire.RouteRequest{Namespace: ns[0], Chunks: chunks[0], Group: "chat0",
		Stages: []wire.RouteStage{{Namespace: ns[1], Chunks: chunks[1]}}}
	rep := call[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), req)
	want := []struct {
		inst, eng string
		prefix    int
	}{{"b-pp0", "b", 3}, {"a-pp0", "a", 2}}
	if len(rep.Instances) != 2 {
		t.Fatalf("route = %+v", rep)
	}
	for i, w := range want {
		ri := rep.Instances[i]
		// Each stage's 2 TP shards of every chunk of the common prefix.
		if ri.Instance != w.inst || ri.Engine != w.eng || ri.Prefix != w.prefix || ri.L1Prefix != w.prefix ||
			ri.OwnPrefix != w.prefix || ri.Objects["L1"] != 2*2*w.prefix {
			t.Fatalf("member %d: %+v, want %+v", i, ri, w)
		}
	}
	stage0 := call[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), wire.RouteRequest{Namespace: ns[0], Chunks: chunks[0], Group: "chat0"})
	if ri := stage0.Instances[0]; ri.Instance != "a-pp0" || ri.Prefix != 4 || ri.Engine != "" {
		t.Fatalf("stage 0 alone: %+v, want a-pp0 first with 4", stage0)
	}
	big := make([]dcp.ChunkHash, MaxChunks/2+1) // stage 0 within the limit, both stages over it
	tooLarge := wire.RouteRequest{Namespace: ns[0], Chunks: big, Group: "chat0", Stages: []wire.RouteStage{{Namespace: ns[1], Chunks: big}}}
	callErr[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), tooLarge, wire.CodeTooLarge)
	short := req
	short.Stages = []wire.RouteStage{{Namespace: ns[1], Chunks: chunks[1][:3]}}
	callErr[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), short, wire.CodeBadRequest)
	plain := req
	plain.Group = "plain"
	callErr[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), plain, wire.CodeBadRequest)
	stage1 := req
	stage1.Group, stage1.Instance = "", "a-pp1"
	callErr[wire.RouteReply](t, nc, c.subj.Admin(wire.AdminRoute), stage1, wire.CodeBadRequest)
}
