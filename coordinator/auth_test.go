package coordinator

import (
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// The NATS permissions decide who may publish on a scoped subject; these
// tests check the coordinator's half of C9: a body naming another rank or
// instance than its subject is refused, counted by subject kind, and a
// forged report cannot move the verdict. (Insecure mode, so the test can
// publish anywhere; auth/ and e2e/ test the permissions.)
func TestScopedSubjectsRefuseOtherIdentities(t *testing.T) {
	f := newRestoreFixture(t, 3)
	c, nc := f.c, f.nc
	// A deadline past the test's length: the tests' 400 ms default expired
	// the restore before the real reports in a CI run at a load of ~15
	// (the forged heartbeat's refusal is awaited in between).
	plan := call[wire.RestorePlan](t, nc, c.subj.EngineCoord("eng", wire.CoordRestoreBegin),
		wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks, DeadlineMS: 30000})
	if plan.Prefix != 3 || len(plan.Ranks) != 2 {
		t.Fatalf("plan = %+v", plan)
	}
	if id, err := hex.DecodeString(plan.RestoreID); err != nil || len(id) != 16 {
		t.Fatalf("restore id %q is not 128 random bits in hex", plan.RestoreID)
	}
	r0, r1 := wire.Rank{Instance: "eng", TPRank: 0}, wire.Rank{Instance: "eng", TPRank: 1}
	// Rank 0 (on its own subject) forges rank 1's report with the planned
	// sums, and its own: without the check that gives COMPLETE.
	forged := wire.RestoreReport{RestoreID: plan.RestoreID, Rank: r1, Results: results(plan.Ranks[r1.String()])}
	callErr[wire.ReportAck](t, nc, c.subj.Report(r0), forged, wire.CodeUnauthorized)
	ack := call[wire.ReportAck](t, nc, c.subj.Report(r0),
		wire.RestoreReport{RestoreID: plan.RestoreID, Rank: r0, Results: results(plan.Ranks[r0.String()])})
	if ack.State != wire.VerdictPending {
		t.Fatalf("after rank 0's own report and a forged rank 1 report: state %s, want pending", ack.State)
	}
	// Engine instance "other" asks about, and waits on, instance eng.
	callErr[wire.LookupReply](t, nc, c.subj.EngineCoord("other", wire.CoordLookup),
		wire.LookupRequest{Namespace: f.ns, Chunks: f.chunks, Instance: "eng"}, wire.CodeUnauthorized)
	callErr[wire.RestorePlan](t, nc, c.subj.EngineCoord("other", wire.CoordRestoreBegin),
		wire.RestoreBeginRequest{RestoreBegin: wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks}, Instance: "eng"}, wire.CodeUnauthorized)
	callErr[wire.RestoreVerdict](t, nc, c.subj.EngineCoord("other", wire.CoordRestoreWait),
		wire.RestoreWait{RestoreID: plan.RestoreID}, wire.CodeUnauthorized)
	// A scoped lookup without an instance is the caller's own: instance
	// "other" has no ranks, so nothing is restorable for it.
	lr := call[wire.LookupReply](t, nc, c.subj.EngineCoord("other", wire.CoordLookup),
		wire.LookupRequest{Namespace: f.ns, Chunks: f.chunks, Detail: true})
	if lr.Prefix != 0 {
		t.Fatalf("lookup scoped to instance other = %+v, want prefix 0", lr)
	}
	// Lookup detail gives no checksums (admin.object does).
	lr = call[wire.LookupReply](t, nc, c.subj.EngineCoord("eng", wire.CoordLookup),
		wire.LookupRequest{Namespace: f.ns, Chunks: f.chunks, Detail: true})
	if lr.Prefix != 3 || len(lr.Sources) == 0 {
		t.Fatalf("lookup = %+v", lr)
	}
	for _, s := range lr.Sources {
		for _, p := range s.Placements {
			if p.Sum != 0 {
				t.Fatalf("lookup detail hands out sum %x of %s", p.Sum, s.Key)
			}
		}
	}
	// A heartbeat naming rank 1 on rank 0's subject is refused.
	hb, _ := json.Marshal(wire.Heartbeat{Rank: r1, Incarnation: 1, Seq: 99})
	if err := nc.Publish(c.subj.Heartbeat(r0), hb); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "the forged heartbeat to be refused", func() bool {
		return testutil.Metric(t, c.reg, "kvtier_coord_unauthorized_total", "subject", "heartbeat") == 1
	})
	for kind, want := range map[string]float64{"report": 1, "lookup": 1, "restore_begin": 1, "restore_wait": 1} {
		if got := testutil.Metric(t, c.reg, "kvtier_coord_unauthorized_total", "subject", kind); got != want {
			t.Errorf("unauthorized %s = %v, want %v", kind, got, want)
		}
	}
	// The real rank 1 completes it.
	ack = call[wire.ReportAck](t, nc, c.subj.Report(r1),
		wire.RestoreReport{RestoreID: plan.RestoreID, Rank: r1, Results: results(plan.Ranks[r1.String()])})
	if ack.State != wire.VerdictComplete {
		t.Fatalf("after both real reports: %s", ack.State)
	}
	// Decided, the verdict stays the instance's own: another instance that
	// names the id is refused, the owner still reads it.
	callErr[wire.RestoreVerdict](t, nc, c.subj.EngineCoord("other", wire.CoordRestoreWait),
		wire.RestoreWait{RestoreID: plan.RestoreID}, wire.CodeUnauthorized)
	v := call[wire.RestoreVerdict](t, nc, c.subj.EngineCoord("eng", wire.CoordRestoreWait),
		wire.RestoreWait{RestoreID: plan.RestoreID})
	if v.State != wire.VerdictComplete {
		t.Fatalf("owner's wait after the verdict: %s, want complete", v.State)
	}
	// A restore decided at begin (nothing stored: complete, empty) is its
	// instance's too.
	missing := []dcp.ChunkHash{{0xee}}
	empty := call[wire.RestorePlan](t, nc, c.subj.EngineCoord("eng", wire.CoordRestoreBegin),
		wire.RestoreBegin{Namespace: f.ns, Chunks: missing})
	if empty.Prefix != 0 {
		t.Fatalf("plan of an unstored chunk: %+v", empty)
	}
	if v := call[wire.RestoreVerdict](t, nc, c.subj.EngineCoord("eng", wire.CoordRestoreWait),
		wire.RestoreWait{RestoreID: empty.RestoreID}); v.State != wire.VerdictComplete {
		t.Fatalf("owner's wait of the empty restore: %s, want complete", v.State)
	}
	callErr[wire.RestoreVerdict](t, nc, c.subj.EngineCoord("other", wire.CoordRestoreWait),
		wire.RestoreWait{RestoreID: empty.RestoreID}, wire.CodeUnauthorized)
	if got := testutil.Metric(t, c.reg, "kvtier_coord_unauthorized_total", "subject", "restore_wait"); got != 3 {
		t.Errorf("unauthorized restore_wait = %v, want 3", got)
	}
}

// TestSecureCoordinatorReloadsCredentials runs the coordinator with auth
// on: anonymous clients are refused, the engine serves through its scoped
// subjects, an instance added later ('coordinator creds add') connects
// once the users are reloaded (SIGHUP), and a rotated key replaces the old.
func TestSecureCoordinatorReloadsCredentials(t *testing.T) {
	creds := filepath.Join(t.TempDir(), "creds")
	if err := auth.Init(creds, []auth.Instance{{Name: "eng", TPSize: 2}}); err != nil {
		t.Fatal(err)
	}
	c := startCoord(t, func(cfg *Config) { cfg.Insecure, cfg.CredsDir = false, creds })
	if nc, err := nats.Connect(c.NATSURL(), nats.MaxReconnects(0)); err == nil {
		nc.Close()
		t.Fatal("anonymous client accepted")
	}
	dial := func(id auth.Identity) (*nats.Conn, error) {
		opts, err := auth.Client{Identity: id, Dir: creds}.Options()
		if err != nil {
			t.Fatal(err)
		}
		return nats.Connect(c.NATSURL(), append(opts, nats.MaxReconnects(0))...)
	}
	eng, err := dial(auth.Engine("eng"))
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	if rep := call[wire.RegisterReply](t, eng, c.subj.EngineCoord("eng", wire.CoordRegister), testSpec(2)); rep.Namespace == (dcp.Namespace{}) {
		t.Fatal("register through the scoped subject gave no namespace")
	}
	// A new instance: refused until the coordinator reloads.
	if err := auth.AddInstance(creds, auth.Instance{Name: "eng2", TPSize: 1}); err != nil {
		t.Fatal(err)
	}
	if nc, err := dial(auth.Engine("eng2")); err == nil {
		nc.Close()
		t.Fatal("engine eng2 connected before the reload")
	}
	if err := c.ReloadAuth(); err != nil {
		t.Fatal(err)
	}
	nc2, err := dial(auth.Engine("eng2"))
	if err != nil {
		t.Fatalf("engine eng2 after the reload: %v", err)
	}
	defer nc2.Close()
	// Rotation: the old seed stops working after the reload.
	old, err := os.ReadFile(filepath.Join(creds, "engine-eng2.nk"))
	if err != nil {
		t.Fatal(err)
	}
	if err := auth.Rotate(creds, "engine-eng2"); err != nil {
		t.Fatal(err)
	}
	if err := c.ReloadAuth(); err != nil {
		t.Fatal(err)
	}
	// The connection made with the rotated-out key is closed by the reload.
	testutil.Eventually(t, 5*time.Second, "the old key's connection to be closed", func() bool { return nc2.IsClosed() })
	oldSeed := filepath.Join(t.TempDir(), "old.nk")
	if err := os.WriteFile(oldSeed, old, 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := auth.Client{Identity: auth.Engine("eng2"), SeedFile: oldSeed}.Options()
	if err != nil {
		t.Fatal(err)
	}
	if nc, err := nats.Connect(c.NATSURL(), append(opts, nats.MaxReconnects(0))...); err == nil {
		nc.Close()
		t.Fatal("the rotated-out seed still connects")
	}
	if nc, err := dial(auth.Engine("eng2")); err != nil {
		t.Fatalf("the new seed: %v", err)
	} else {
		nc.Close()
	}
	// The coordinator signed the NATS URL it gossips.
	m := c.member.LocalMember().Meta
	u, err := auth.LoadUsers(filepath.Join(creds, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	var pub string
	for _, x := range u.Users {
		if x.Role == auth.RoleCoordinator {
			pub = x.NKey
		}
	}
	sig, err := base64.StdEncoding.DecodeString(m.NATSSig)
	if err != nil || auth.Verify(pub, cluster.NATSStatement(m.Incarnation, m.NATS), sig) != nil {
		t.Fatalf("gossiped NATS URLs %v carry no valid signature (%q)", m.NATS, m.NATSSig)
	}
}

// TestSecureExternalNATS: a nats-server configured from the generated
// permission set (auth.NATSConfig, what 'coordinator creds nats-conf'
// writes) serves a secure coordinator and its engine; the engine's
// unscoped request is refused by the server.
func TestSecureExternalNATS(t *testing.T) {
	creds := filepath.Join(t.TempDir(), "creds")
	if err := auth.Init(creds, []auth.Instance{{Name: "eng", TPSize: 1}}); err != nil {
		t.Fatal(err)
	}
	u, err := auth.LoadUsers(filepath.Join(creds, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, []byte("listen: 127.0.0.1:-1\n"+auth.NATSConfig(u, "kvtier")), 0o644); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	opts.NoLog, opts.NoSigs = true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("external NATS not ready")
	}
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() }) // after the coordinator's (cleanups run last first)
	url := "nats://" + srv.Addr().String()
	c := startCoord(t, func(cfg *Config) { cfg.Insecure, cfg.CredsDir, cfg.NATSURL = false, creds, url })
	eopts, err := auth.Client{Identity: auth.Engine("eng"), Dir: creds}.Options()
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 4)
	eng, err := nats.Connect(url, append(eopts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { errs <- err }))...)
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	if rep := call[wire.RegisterReply](t, eng, c.subj.EngineCoord("eng", wire.CoordRegister), testSpec(1)); rep.Namespace == (dcp.Namespace{}) {
		t.Fatal("no namespace through the external server")
	}
	if err := eng.Publish(c.subj.Coord(wire.CoordRegister), []byte("{}")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errs:
		if !errors.Is(err, nats.ErrPermissionViolation) {
			t.Fatalf("unscoped publish: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the external server let the engine publish an unscoped subject")
	}
}

// TestTLSCoordinatorAnswersLookups: with NATS TLS on (a server certificate
// in the credentials directory, as 'coordinator init --tls-host' makes)
// the coordinator starts and answers a lookup over its in-process lookup
// connection, while an engine connects over TLS. Seen red with the lookup
// connection given the server's tls:// URL: the client insisted on TLS
// over the pipe and failed its handshake, and Start did not return within
// the test's 30 s (nats.go's minute of flush timeout, before
// inProcessWriteBound; TestInProcessConnectFailureFailsStart).
func TestTLSCoordinatorAnswersLookups(t *testing.T) {
	creds := tlsCreds(t)
	started := make(chan *Coordinator, 1)
	go func() { started <- startCoord(t, func(cfg *Config) { cfg.Insecure, cfg.CredsDir = false, creds }) }()
	var c *Coordinator
	select {
	case c = <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the coordinator did not start within 30 s with NATS TLS on")
	}
	if !strings.HasPrefix(c.NATSURL(), "tls://") {
		t.Fatalf("NATS URL %s: TLS is not on", c.NATSURL())
	}
	opts, err := auth.Client{Identity: auth.Engine("eng"), Dir: creds}.Options()
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(c.NATSURL(), append(opts, nats.MaxReconnects(0))...)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ns := call[wire.RegisterReply](t, nc, c.subj.EngineCoord("eng", wire.CoordRegister), testSpec(1)).Namespace
	lr := call[wire.LookupReply](t, nc, c.subj.EngineCoord("eng", wire.CoordLookup),
		wire.LookupRequest{Namespace: ns, Chunks: chain(ns, 2, 1)})
	if lr.Prefix != 0 {
		t.Fatalf("lookup of chunks nobody stored: %+v, want prefix 0", lr)
	}
	if got := testutil.Metric(t, c.reg, "kvtier_coord_lookups_total", "outcome", "miss"); got != 1 {
		t.Fatalf("lookups counted: %v", got)
	}
}

// A handshake that fails over the lookups' in-process pipe (here: the
// client insisting on TLS over it, as a tls:// URL made it) fails Start
// with an error naming the connection within seconds, instead of stalling
// it silently for nats.go's minute of flush timeout (the pipe is
// synchronous: both ends blocked writing).
func TestInProcessConnectFailureFailsStart(t *testing.T) {
	creds := tlsCreds(t)
	defer func(u string, b time.Duration) { inProcessURL, inProcessWriteBound = u, b }(inProcessURL, inProcessWriteBound)
	inProcessURL, inProcessWriteBound = "tls://in-process", time.Second
	cfg := testConfig(t, "")
	cfg.Insecure, cfg.CredsDir = false, creds
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Start() }()
	select {
	case err := <-done:
		c.Shutdown()
		if err == nil {
			t.Fatal("Start succeeded over a pipe whose handshake cannot")
		}
		if !strings.Contains(err.Error(), "lookups' connection") {
			t.Fatalf("Start: %v, want the lookups' connection named", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Start still running after 30 s: the in-process pipe's writes are not bounded")
	}
}

// tlsCreds makes a credentials directory for engine "eng" (TP 1) with
// NATS TLS certificates for 127.0.0.1.
func tlsCreds(t *testing.T) string {
	t.Helper()
	creds := filepath.Join(t.TempDir(), "creds")
	if err := auth.Init(creds, []auth.Instance{{Name: "eng", TPSize: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := auth.InitTLS(creds, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	return creds
}
