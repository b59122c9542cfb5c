package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestTrustAttacksFail replays the control-plane attacks of issue 10
// (items 1 and 3) against a cluster of real daemons with auth on (C9),
// between normal enginesim runs that must still pass:
//   - anonymous connect and subscribe ">" are refused;
//   - a rank publishing another rank's events or report gets a permission
//     violation, and one naming another rank in the body of its own
//     subject is refused as unauthorized;
//   - forged reports cannot make a restore COMPLETE;
//   - an unkeyed gossip member cannot join;
//   - a member that claims the coordinator role (holding the gossip key
//     but not the coordinator's nkey) and gossips its own NATS URL is not
//     followed when the real coordinator goes away, nor keeps the ranks
//     from rejoining the real one when it is back.
func TestTrustAttacksFail(t *testing.T) {
	c := newKV(t, 4)
	c.startAll()
	c.mustSim("--scenario", "tp4dcp4", "--phase", "store")

	// Anonymous connect.
	if nc, err := nats.Connect(c.natsURL(), nats.MaxReconnects(0)); err == nil {
		nc.Close()
		t.Fatal("anonymous NATS connect accepted")
	} else if !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
		t.Fatalf("anonymous connect: %v, want an authorization violation", err)
	}

	rank := func(tp int) wire.Rank { return wire.Rank{Instance: "engine0", TPRank: tp} }
	// violations connects as id and collects its permission violations.
	violations := func(id auth.Identity) (*nats.Conn, chan error) {
		errs := make(chan error, 64)
		nc, err := c.dial(id, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrPermissionViolation) {
				select {
				case errs <- err:
				default:
				}
			}
		}))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc, errs
	}
	want := func(errs chan error, what string) {
		t.Helper()
		select {
		case err := <-errs:
			t.Logf("%s: refused: %v", what, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no permission violation", what)
		}
	}

	// Subscribe ">" (and another rank's engine API) as a rank.
	r0, r0errs := violations(auth.Rankd(rank(0)))
	for _, pattern := range []string{">", "kvtier.>", c.subj.Engine(rank(1), "*"), "_INBOX.>"} {
		if _, err := r0.SubscribeSync(pattern); err != nil {
			t.Fatal(err)
		}
		if err := r0.Flush(); err != nil {
			t.Fatal(err)
		}
		want(r0errs, "rank 0 subscribing "+pattern)
	}

	// Rank 0 publishes rank 1's events and heartbeat.
	forged, err := (&wire.Batch{Rank: rank(1), Incarnation: 1<<64 - 1}).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	for _, subject := range []string{c.subj.Events(rank(1)), c.subj.Heartbeat(rank(1)), c.subj.Report(rank(1)),
		c.subj.Coord(wire.CoordRestoreReport)} {
		if err := r0.Publish(subject, forged); err != nil {
			t.Fatal(err)
		}
		if err := r0.Flush(); err != nil {
			t.Fatal(err)
		}
		want(r0errs, "rank 0 publishing on "+subject)
	}
	// ... and in the body of its own subject: refused by the coordinator.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := r0.RequestWithContext(ctx, c.subj.Events(rank(0)), forged)
	if err != nil || !strings.Contains(string(m.Data), wire.CodeUnauthorized) {
		t.Fatalf("rank 1's batch on rank 0's subject: %v %s", err, m.Data)
	}
	for tp := range 4 {
		if _, err := c.rankInfo(tp); err != nil {
			t.Fatalf("rank %d after the forged batches: %v", tp, err)
		}
	}

	// Forged reports: an engine begins a restore of the stored prompt;
	// rank 0 reports "ok with the planned sums" for every rank. Only its
	// own report is accepted; the verdict fails at the deadline.
	sc, _ := enginesim.LookupScenario("tp4dcp4")
	plan, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		t.Fatal(err)
	}
	eng := c.as(auth.Engine("engine0"))
	rp, err := bus.Call[wire.RestorePlan](ctx, eng, c.subj.EngineCoord("engine0", wire.CoordRestoreBegin),
		wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: plan.R.Namespace, Chunks: plan.Hashes, DeadlineMS: 2000}})
	if err != nil || rp.Prefix != len(plan.Hashes) || len(rp.Ranks) != 4 {
		t.Fatalf("restore.begin: %+v %v", rp, err)
	}
	if len(rp.RestoreID) != 32 {
		t.Fatalf("restore id %q is not 128 bits of hex", rp.RestoreID)
	}
	for tp := range 4 {
		var res []wire.ItemResult
		for _, it := range rp.Ranks[rank(tp).String()] {
			res = append(res, wire.ItemResult{Chunk: it.Chunk, Group: it.Group, OK: true, Sum: it.Sum})
		}
		rep := wire.RestoreReport{RestoreID: rp.RestoreID, Rank: rank(tp), Results: res}
		_, err := bus.Call[wire.ReportAck](ctx, r0, c.subj.Report(rank(0)), rep)
		var we *wire.Error
		if tp == 0 {
			if err != nil {
				t.Fatalf("rank 0's own report: %v", err)
			}
			continue
		}
		if !errors.As(err, &we) || we.Code != wire.CodeUnauthorized {
			t.Fatalf("rank 0 reporting for rank %d: %v, want %s", tp, err, wire.CodeUnauthorized)
		}
		body, _ := json.Marshal(rep)
		if err := r0.Publish(c.subj.Report(rank(tp)), body); err != nil {
			t.Fatal(err)
		}
		if err := r0.Flush(); err != nil {
			t.Fatal(err)
		}
		want(r0errs, "rank 0 publishing rank "+rank(tp).String()+"'s report")
	}
	v, err := bus.Call[wire.RestoreVerdict](ctx, eng, c.subj.EngineCoord("engine0", wire.CoordRestoreWait), wire.RestoreWait{RestoreID: rp.RestoreID})
	if err != nil || v.State != wire.VerdictFailed {
		t.Fatalf("verdict after forged reports: %+v %v, want failed", v, err)
	}

	// An unkeyed gossip member cannot join.
	cc := cluster.DefaultConfig()
	cc.NodeName, cc.BindAddr, cc.BindPort = "intruder", "127.0.0.1", 0
	cc.Meta = cluster.Meta{Role: cluster.RoleRankd, Engine: "engine0", TPRank: 1, TPSize: 4, DCPRank: 1, DCPSize: 4}
	intruder, err := cluster.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	if err := intruder.Start(); err != nil {
		t.Fatal(err)
	}
	jctx, jcancel := context.WithTimeout(context.Background(), 3*time.Second)
	if n, err := intruder.Join(jctx, c.gossip); err == nil {
		t.Errorf("unkeyed member joined %d seeds", n)
	}
	jcancel()
	_ = intruder.Shutdown()
	ms, err := admin[wire.AdminMembersReply](c, wire.AdminMembers, struct{}{})
	if err != nil {
		t.Fatal(err)
	}
	for _, mm := range ms.Members {
		if mm.Name == "intruder" {
			t.Fatalf("the unkeyed intruder is a member: %+v", mm)
		}
	}

	// A keyed member claims the coordinator role with its own NATS URL.
	trapSrv := testutil.NATS(t)
	key, more, err := auth.LoadGossipKeys(filepath.Join(c.creds, auth.GossipKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	fc := cluster.DefaultConfig()
	fc.NodeName, fc.BindAddr, fc.BindPort = "fake-coordinator", "127.0.0.1", 0
	fc.SecretKey, fc.SecondaryKeys = key, more
	fc.Meta = cluster.Meta{Role: cluster.RoleCoordinator, NATS: []string{trapSrv.ClientURL()}, NATSSig: "bm90IGEgc2lnbmF0dXJl"}
	fake, err := cluster.New(fc)
	if err != nil {
		t.Fatal(err)
	}
	if err := fake.Start(); err != nil {
		t.Fatal(err)
	}
	jctx, jcancel = context.WithTimeout(context.Background(), 10*time.Second)
	if _, err := fake.Join(jctx, c.gossip); err != nil {
		t.Fatalf("keyed member could not join: %v", err)
	}
	jcancel()
	c.coord.stop()
	c.eventually(30*time.Second, "every rank refuses the fake coordinator's NATS URL", func() error {
		for r, p := range c.ranks {
			if !strings.Contains(p.output(), "did not sign") {
				return errors.New("rank " + rank(r).String() + " has not refused it yet")
			}
		}
		return nil
	})
	for r, p := range c.ranks {
		if strings.Contains(p.output(), trapSrv.ClientURL()) && strings.Contains(p.output(), "moved to the coordinator's new NATS URL") {
			t.Fatalf("rank %d moved to the fake coordinator's NATS", r)
		}
	}
	// The real coordinator comes back while the fake one is still a
	// member: the ranks rejoin it (an unverified coordinator does not count
	// as one) and restores work.
	defer func() { _ = fake.Shutdown() }()
	c.startCoordinator()
	for r := range c.tp {
		c.waitRank(r)
	}
	res := c.mustSim("--scenario", "tp4dcp4", "--phase", "restore")
	if res.Verdict != wire.VerdictComplete {
		t.Fatalf("restore after the attacks: %+v", res)
	}
}

// TestInsecureModeStillWorks: --insecure on every process is the one way
// to run without credentials; it works end to end and every daemon says
// so loudly in its log.
func TestInsecureModeStillWorks(t *testing.T) {
	c := newKV(t, 4)
	c.insecure = true
	c.startAll()
	res := c.mustSim("--scenario", "tp4dcp4", "--phase", "all")
	if res.Verdict != wire.VerdictComplete {
		t.Fatalf("insecure restore: %+v", res)
	}
	for _, p := range append([]*proc{c.coord}, c.ranks...) {
		if !strings.Contains(p.output(), "INSECURE") {
			t.Errorf("%s does not warn that it runs insecure:\n%s", p.name, tail(p.output(), 10))
		}
	}
}
