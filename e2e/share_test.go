package e2e

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// TestShareGroupAcrossInstances (issue 26): engine0 and engine1 are one
// share group (coordinator --share-group), TP4/DCP4 each on the host
// backend, their rankds on one L2 directory; engine2 has credentials but
// is in no group. engine0 stores a prompt; engine1 storing the same
// prompt keeps no second copy (--l2-shared-with: every object
// deduplicated onto engine0's files, counted); engine0's rankds stop and
// engine1 restores the prompt COMPLETE and byte-exact from engine0's L2
// files, its own ranks confirming engine0's recorded sums. engine2, an engine of another
// instance, gets a miss for its own lookup and restore and is refused (and
// counted) when it names the group's instances or engine1's restore, or
// publishes on their subjects; another layout of the same model never
// matches, even in the group. The routing hint (admin.route) ranks
// engine1 first once its restore has the prompt in its L1. Seen red
// without --share-group: engine1's
// restore planned nothing (prefix 0); and without --l2-shared-with:
// engine1 stored its own 64 copies.
func TestShareGroupAcrossInstances(t *testing.T) {
	c := newKV(t, 4)
	c.addInstanceCreds("engine1")
	c.addInstanceCreds("engine2")
	c.coordArgs = append(c.coordArgs, "--share-group", "chat=engine0,engine1")
	c.rankArgs = []string{"--l2-shared-with", "engine1"}
	c.startAll()
	const seed = "41"
	store := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", seed)
	want := make([]int64, c.tp)
	for r := range want {
		want[r] = int64(store.Stored / c.tp)
	}
	c.waitL2(want)

	// engine1's rankds write and read the same L2 directory (the flag
	// given again overrides startInstance's own). Its store of the same
	// prompt keeps no second copy (issue 26.3).
	c.rankArgs = []string{"--l2-dir", c.l2D, "--l2-shared-with", "engine0"}
	b := startInstance(c, "engine1")
	dup := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", seed, "--instance", "engine1")
	if dup.Stored != 0 || dup.Deduped != store.Stored {
		t.Fatalf("engine1's store of engine0's prompt: %d stored, %d deduplicated; want 0 and %d", dup.Stored, dup.Deduped, store.Stored)
	}
	var shared float64
	for r, p := range b {
		shared += testutil.MetricSum(t, metricsOf(t, "engine1 rankd "+strconv.Itoa(r), p.output()), "kvtier_transfer_dedupe_shared_total")
	}
	if shared != float64(store.Stored) {
		t.Fatalf("engine1's rankds counted %v objects deduplicated onto engine0's copies, want %d", shared, store.Stored)
	}
	rep, err := admin[wire.AdminRanksReply](c, wire.AdminRanks, struct{}{})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range rep.Ranks {
		if k.Rank.Instance == "engine1" && k.L1Objects+k.L2Objects > 0 {
			t.Fatalf("engine1's rank %d holds %d L1 and %d L2 objects after deduplicating", k.Rank.TPRank, k.L1Objects, k.L2Objects)
		}
	}
	c.stopRanks() // engine0's rankds are gone: only their L2 files are left

	res, out, err := c.sim("--scenario", "tp4dcp4", "--phase", "restore", "--seed", seed, "--instance", "engine1")
	if err != nil || res == nil || res.Verdict != wire.VerdictComplete || res.Prefix != len(want) {
		t.Fatalf("engine1 restoring engine0's prompt: %v %+v\n%s", err, res, tail(out, 30))
	}
	exact(t, "engine1", res)
	t.Logf("engine1 restores engine0's prompt:\n%s", tableOf(out))
	var reads float64
	for r, p := range b {
		reads += testutil.MetricSum(t, metricsOf(t, "engine1 rankd "+strconv.Itoa(r), p.output()), "kvtier_transfer_l2_reads_total")
	}
	if reads != float64(store.Stored) {
		t.Fatalf("engine1's rankds read %v objects from L2, want the %d engine0 stored", reads, store.Stored)
	}
	if got := testutil.Metric(t, c.coordMetrics(), "kvtier_coord_share_restores_total"); got < 1 {
		t.Fatalf("share restores %v, want >= 1", got)
	}

	// engine2 is outside the group: what it asks for itself is a miss ...
	sc, _ := enginesim.LookupScenario("tp4dcp4")
	plan, err := enginesim.NewPlan(sc, 41)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e2 := c.as(auth.Engine("engine2"))
	lr, err := bus.Call[wire.LookupReply](ctx, e2, c.subj.EngineCoord("engine2", wire.CoordLookup),
		wire.LookupRequest{Namespace: plan.R.Namespace, Chunks: plan.Hashes})
	if err != nil || lr.Prefix != 0 {
		t.Fatalf("engine2's lookup of the group's prompt: %+v %v, want prefix 0", lr, err)
	}
	rp, err := bus.Call[wire.RestorePlan](ctx, e2, c.subj.EngineCoord("engine2", wire.CoordRestoreBegin),
		wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: plan.R.Namespace, Chunks: plan.Hashes}})
	if err != nil || rp.Prefix != 0 || len(rp.Ranks) != 0 {
		t.Fatalf("engine2's restore of the group's prompt: %+v %v, want nothing planned", rp, err)
	}
	// ... naming the group's instances or engine1's restore is refused ...
	refused := func(what string, err error) {
		t.Helper()
		var we *wire.Error
		if !errors.As(err, &we) || we.Code != wire.CodeUnauthorized {
			t.Fatalf("%s: %v, want %s", what, err, wire.CodeUnauthorized)
		}
	}
	_, err = bus.Call[wire.LookupReply](ctx, e2, c.subj.EngineCoord("engine2", wire.CoordLookup),
		wire.LookupRequest{Namespace: plan.R.Namespace, Chunks: plan.Hashes, Instance: "engine0"})
	refused("engine2 looking up as engine0", err)
	_, err = bus.Call[wire.RestorePlan](ctx, e2, c.subj.EngineCoord("engine2", wire.CoordRestoreBegin),
		wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: plan.R.Namespace, Chunks: plan.Hashes}, Instance: "engine1"})
	refused("engine2 restoring as engine1", err)
	_, err = bus.Call[wire.RestoreVerdict](ctx, e2, c.subj.EngineCoord("engine2", wire.CoordRestoreWait),
		wire.RestoreWait{RestoreID: res.RestoreID})
	refused("engine2 waiting on engine1's restore", err)
	coord := c.coordMetrics()
	for _, op := range []string{"lookup", "restore_begin", "restore_wait"} {
		if got := testutil.Metric(t, coord, "kvtier_coord_share_refused_total", "op", op); got != 1 {
			t.Errorf("share refused %s = %v, want 1", op, got)
		}
	}
	// ... and its credentials cannot publish on the group's subjects.
	violations := make(chan error, 8)
	e2v, err := c.dial(auth.Engine("engine2"), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) {
			select {
			case violations <- err:
			default:
			}
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer e2v.Close()
	for _, subject := range []string{c.subj.EngineCoord("engine0", wire.CoordLookup), c.subj.EngineCoord("engine1", wire.CoordLookup),
		c.subj.Admin(wire.AdminRoute)} {
		if err := e2v.Publish(subject, []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
		if err := e2v.Flush(); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-violations:
			t.Logf("engine2 publishing on %s: %v", subject, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("engine2 published on %s: no permission violation", subject)
		}
	}

	// The routing hint (issue 26.4), as a router holding the read-only
	// admin identity asks it: engine1 now holds the prompt in L1 (its
	// restore loaded it) on its host, engine0 only in L2 with its rankds
	// down.
	route, err := bus.Call[wire.RouteReply](ctx, c.as(auth.Identity{Role: auth.RoleAdmin}), c.subj.Admin(wire.AdminRoute),
		wire.RouteRequest{Namespace: plan.R.Namespace, Chunks: plan.Hashes, Group: "chat"})
	if err != nil || route.Group != "chat" || len(route.Instances) != 2 {
		t.Fatalf("route: %+v %v", route, err)
	}
	t.Logf("route: %+v", route.Instances)
	if b, a := route.Instances[0], route.Instances[1]; b.Instance != "engine1" || b.Prefix != len(want) || b.L1Prefix != len(want) ||
		len(b.Hosts) != 1 || a.Instance != "engine0" || a.Prefix != len(want) || a.L1Prefix != 0 || a.OwnPrefix != len(want) || len(a.Hosts) != 0 {
		t.Fatalf("route: %+v, want engine1 first (all in L1 on its host), then engine0 (its L2, no live rankd)", route.Instances)
	}

	// Another layout of the same model (interleave 2) is another
	// namespace: nothing engine0 stored matches it, even for a member.
	spec := plan.R.Spec
	spec.Layout.Interleave = 2
	e1 := c.as(auth.Engine("engine1"))
	reg, err := bus.Call[wire.RegisterReply](ctx, e1, c.subj.EngineCoord("engine1", wire.CoordRegister), spec)
	if err != nil || reg.Namespace == plan.R.Namespace {
		t.Fatalf("register the other layout: %+v %v", reg, err)
	}
	tokens := plan.Tokens
	for what, chunks := range map[string][]dcp.ChunkHash{
		"engine0's chunks": plan.Hashes,
		"the prompt's own": dcp.ChunkHashes(reg.Namespace, tokens, spec.ChunkTokens),
	} {
		lr, err := bus.Call[wire.LookupReply](ctx, e1, c.subj.EngineCoord("engine1", wire.CoordLookup),
			wire.LookupRequest{Namespace: reg.Namespace, Chunks: chunks})
		if err != nil || lr.Prefix != 0 {
			t.Fatalf("engine1's lookup of %s under another layout: %+v %v, want prefix 0", what, lr, err)
		}
	}
}
