package coordinator

import (
	"testing"

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
