package auth_test

import (
	"encoding/json"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

func TestMain(m *testing.M) { testutil.Main(m) }

var (
	subj  = wire.Subjects{Prefix: "kvtier"}
	rank0 = wire.Rank{Instance: "engine0", TPRank: 0}
	rank1 = wire.Rank{Instance: "engine0", TPRank: 1}
)

func initDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "creds")
	// engine2 runs two pipeline stages of TP 1: rankds engine2-pp0/0 and
	// engine2-pp1/0, one engine identity for both.
	if err := auth.Init(dir, []auth.Instance{{Name: "engine0", TPSize: 2}, {Name: "engine1", TPSize: 1},
		{Name: "engine2", TPSize: 1, PPSize: 2}}); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestInitWritesPrivateFiles(t *testing.T) {
	dir := initDir(t)
	st, err := os.Stat(dir)
	if err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("dir mode = %v, %v; want 0700", st.Mode(), err)
	}
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, x := range u.Users {
		names = append(names, x.Name)
		st, err := os.Stat(filepath.Join(dir, x.Name+auth.SeedSuffix))
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Errorf("seed of %s: mode %v, %v; want 0600", x.Name, st.Mode(), err)
		}
	}
	want := "admin admin-write coordinator engine-engine0 engine-engine1 engine-engine2 " +
		"rankd-engine0-0 rankd-engine0-1 rankd-engine1-0 rankd-engine2-pp0-0 rankd-engine2-pp1-0"
	if got := strings.Join(names, " "); got != want {
		t.Fatalf("users = %q, want %q", got, want)
	}
	if k, more, err := auth.LoadGossipKeys(filepath.Join(dir, auth.GossipKeyFile)); err != nil || len(k) != 32 || len(more) != 0 {
		t.Fatalf("gossip key: %d B, %d more, %v", len(k), len(more), err)
	}
	// Init never overwrites.
	if err := auth.Init(dir, nil); !errors.Is(err, auth.ErrExists) {
		t.Fatalf("second Init: %v, want ErrExists", err)
	}
	// Add a rank later; a duplicate is refused.
	if err := auth.AddInstance(dir, auth.Instance{Name: "engine0", TPSize: 3}); err != nil {
		t.Fatal(err)
	}
	if err := auth.Add(dir, auth.Rankd(rank0)); !errors.Is(err, auth.ErrExists) {
		t.Fatalf("re-add: %v, want ErrExists", err)
	}
	if _, err := auth.LoadSeed(filepath.Join(dir, "rankd-engine0-2.nk")); err != nil {
		t.Fatal(err)
	}
}

func TestSeedFileChecks(t *testing.T) {
	dir := initDir(t)
	seed := filepath.Join(dir, "rankd-engine0-0.nk")
	// A readable seed is refused.
	if err := os.Chmod(seed, 0o640); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.LoadSeed(seed); !errors.Is(err, auth.ErrCredsFile) || !strings.Contains(err.Error(), "mode 0640") {
		t.Fatalf("0640 seed: %v", err)
	}
	if err := os.Chmod(seed, 0o600); err != nil {
		t.Fatal(err)
	}
	// A symlink to a seed is refused.
	link := filepath.Join(t.TempDir(), "link.nk")
	if err := os.Symlink(seed, link); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.LoadSeed(link); !errors.Is(err, auth.ErrCredsFile) || !strings.Contains(err.Error(), "symlinks are refused") {
		t.Fatalf("symlinked seed: %v", err)
	}
	if _, err := auth.LoadSeed(filepath.Join(dir, "nobody.nk")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing seed: %v", err)
	}
	// A users file others may write is refused: they could add a key.
	users := filepath.Join(dir, auth.UsersFile)
	if err := os.Chmod(users, 0o666); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.LoadUsers(users); !errors.Is(err, auth.ErrCredsFile) || !strings.Contains(err.Error(), "others could add keys") {
		t.Fatalf("world-writable users file: %v", err)
	}
}

// cluster is an embedded server with the users of dir, or with no auth at
// all when insecure (the code before C9).
type cluster struct {
	t        *testing.T
	dir      string
	srv      *bus.Embedded
	insecure bool
}

func start(t *testing.T, insecure bool) *cluster {
	t.Helper()
	dir := initDir(t)
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	cfg := bus.DefaultEmbeddedConfig()
	cfg.Port = 0
	if insecure {
		cfg.Insecure = true
	} else {
		cfg.Users = u.ServerUsers("kvtier")
	}
	srv, err := bus.StartEmbedded(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return &cluster{t: t, dir: dir, srv: srv, insecure: insecure}
}

// conn connects as id and records asynchronous errors (permission
// violations) in errs.
func (c *cluster) conn(id auth.Identity) (*nats.Conn, chan error) {
	c.t.Helper()
	opts, err := auth.Client{Identity: id, Dir: c.dir, Insecure: c.insecure}.Options()
	if err != nil {
		c.t.Fatal(err)
	}
	errs := make(chan error, 16)
	opts = append(opts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		select {
		case errs <- err:
		default:
		}
	}))
	nc, err := bus.Connect(c.srv.ClientURL(), id.Name(), opts...)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(nc.Close)
	return nc, errs
}

func wantViolation(t *testing.T, errs chan error, what string) {
	t.Helper()
	select {
	case err := <-errs:
		if !errors.Is(err, nats.ErrPermissionViolation) {
			t.Fatalf("%s: async error %v, want a permission violation", what, err)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: no permission violation", what)
	}
}

// received waits for one message on sub; false if none came within a
// flush round trip of the publisher plus a grace.
func received(t *testing.T, pub *nats.Conn, sub *nats.Subscription) bool {
	t.Helper()
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	_, err := sub.NextMsg(500 * time.Millisecond)
	return err == nil
}

func TestAnonymousConnectRefused(t *testing.T) {
	for _, insecure := range []bool{true, false} {
		c := start(t, insecure)
		nc, err := nats.Connect(c.srv.ClientURL(), nats.MaxReconnects(0))
		if insecure {
			if err != nil {
				t.Fatalf("insecure server refused an anonymous client: %v", err)
			}
			nc.Close()
			continue
		}
		if err == nil {
			nc.Close()
			t.Fatal("anonymous connect accepted by a server with users")
		}
		if !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
			t.Fatalf("anonymous connect: %v, want an authorization violation", err)
		}
	}
}

func TestUnknownKeyRefused(t *testing.T) {
	c := start(t, false)
	other := initDir(t) // another cluster's credentials
	opts, err := auth.Client{Identity: auth.Rankd(rank0), Dir: other}.Options()
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(c.srv.ClientURL(), append(opts, nats.MaxReconnects(0))...)
	if err == nil {
		nc.Close()
		t.Fatal("a seed of another cluster was accepted")
	}
}

// TestCrossRankPublishRefused: rank 0 forging rank 1's events, heartbeat
// and restore report, and an engine forging a report. Insecure (the code
// before C9) delivers every forgery to the coordinator.
func TestCrossRankPublishRefused(t *testing.T) {
	coordID := auth.Identity{Role: auth.RoleCoordinator}
	e1r0 := wire.Rank{Instance: "engine1"}
	e2p1 := wire.Rank{Instance: "engine2-pp1"}
	forgeries := []struct {
		name     string
		from, to auth.Identity
		subject  string
	}{
		{"rank0 -> rank1 events", auth.Rankd(rank0), coordID, subj.Events(rank1)},
		{"rank0 -> rank1 heartbeat", auth.Rankd(rank0), coordID, subj.Heartbeat(rank1)},
		{"rank0 -> rank1 report", auth.Rankd(rank0), coordID, subj.Report(rank1)},
		{"rank0 -> unscoped report", auth.Rankd(rank0), coordID, subj.Coord(wire.CoordRestoreReport)},
		{"engine -> rank0 report", auth.Engine("engine0"), coordID, subj.Report(rank0)},
		{"engine -> rank0 events", auth.Engine("engine0"), coordID, subj.Events(rank0)},
		{"engine0 -> engine1 rank engine API", auth.Engine("engine0"), auth.Rankd(e1r0), subj.Engine(e1r0, "release")},
		{"engine0 -> engine1 restore.begin", auth.Engine("engine0"), coordID, subj.EngineCoord("engine1", wire.CoordRestoreBegin)},
		{"engine0 -> unscoped restore.begin", auth.Engine("engine0"), coordID, subj.Coord(wire.CoordRestoreBegin)},
		{"admin -> engine API", auth.Identity{Role: auth.RoleAdmin}, auth.Rankd(rank0), subj.Engine(rank0, "release")},
		{"rank1 -> rank0 engine API", auth.Rankd(rank1), auth.Rankd(rank0), subj.Engine(rank0, "retrieve")},
		{"rank1 -> rank0 blocks freed", auth.Rankd(rank1), auth.Engine("engine0"), subj.Freed(rank0)},
		// Pipeline stages: engine2's stage instances are engine2's only,
		// and engine2 acts for no other instance.
		{"engine0 -> engine2's stage rank engine API", auth.Engine("engine0"), auth.Rankd(e2p1), subj.Engine(e2p1, "release")},
		{"engine0 -> engine2's stage restore.begin", auth.Engine("engine0"), coordID, subj.EngineCoord("engine2-pp1", wire.CoordRestoreBegin)},
		{"engine2 -> engine0 rank engine API", auth.Engine("engine2"), auth.Rankd(rank0), subj.Engine(rank0, "release")},
		{"engine2 -> engine1 lookup", auth.Engine("engine2"), coordID, subj.EngineCoord("engine1", wire.CoordLookup)},
		{"stage rank -> other stage's events", auth.Rankd(wire.Rank{Instance: "engine2-pp0"}), coordID, subj.Events(e2p1)},
	}
	for _, insecure := range []bool{true, false} {
		c := start(t, insecure)
		for _, f := range forgeries {
			// The legitimate receiver of the subject listens.
			rcv, _ := c.conn(f.to)
			sub, err := rcv.SubscribeSync(f.subject)
			if err != nil {
				t.Fatal(err)
			}
			if err := rcv.Flush(); err != nil {
				t.Fatal(err)
			}
			from, errs := c.conn(f.from)
			if err := from.Publish(f.subject, []byte("forged")); err != nil {
				t.Fatal(err)
			}
			got := received(t, from, sub)
			if insecure {
				if !got {
					t.Errorf("insecure %s: forgery not delivered (the attack should work without auth)", f.name)
				}
				continue
			}
			if got {
				t.Errorf("%s: forgery delivered to the receiver", f.name)
			}
			wantViolation(t, errs, f.name)
			_ = sub.Unsubscribe()
		}
	}
}

// TestOwnSubjectsWork: each role can do its part of the protocol under
// auth: a rank's own events reach the coordinator and are answered, the
// engine reaches its rank and the coordinator's scoped subjects, the
// coordinator reaches a rank's inventory, admin reaches admin.
func TestOwnSubjectsWork(t *testing.T) {
	c := start(t, false)
	coord, cerrs := c.conn(auth.Identity{Role: auth.RoleCoordinator})
	r0, rerrs := c.conn(auth.Rankd(rank0))
	eng, eerrs := c.conn(auth.Engine("engine0"))
	adm, aerrs := c.conn(auth.Identity{Role: auth.RoleAdmin})
	echo := func(nc *nats.Conn, subject string) {
		t.Helper()
		if _, err := nc.Subscribe(subject, func(m *nats.Msg) { _ = m.Respond(append([]byte("re:"), m.Data...)) }); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	echo(coord, subj.EventsAll())
	echo(coord, subj.ReportAll())
	echo(coord, subj.EngineCoordAll(wire.CoordRestoreBegin))
	echo(coord, subj.Admin(wire.AdminRanks))
	echo(r0, subj.Engine(rank0, "store"))
	echo(r0, subj.Inventory(rank0))
	// The rank's blocks-freed announcement reaches its engine (C10).
	freed, err := eng.SubscribeSync(subj.Freed(rank0))
	if err != nil {
		t.Fatal(err)
	}
	if err := eng.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := r0.Publish(subj.Freed(rank0), []byte("free")); err != nil {
		t.Fatal(err)
	}
	if !received(t, r0, freed) {
		t.Fatal("the engine did not receive its rank's blocks-freed message")
	}
	for _, call := range []struct {
		nc      *nats.Conn
		subject string
	}{
		{r0, subj.Events(rank0)}, {r0, subj.Report(rank0)},
		{eng, subj.Engine(rank0, "store")}, {eng, subj.EngineCoord("engine0", wire.CoordRestoreBegin)},
		{coord, subj.Inventory(rank0)}, {adm, subj.Admin(wire.AdminRanks)},
	} {
		m, err := call.nc.Request(call.subject, []byte("x"), 5*time.Second)
		if err != nil || string(m.Data) != "re:x" {
			t.Fatalf("request %s: %v %+v", call.subject, err, m)
		}
	}
	for _, errs := range []chan error{cerrs, rerrs, eerrs, aerrs} {
		select {
		case err := <-errs:
			t.Fatalf("unexpected async error: %v", err)
		default:
		}
	}
	// The admin role sends no mutating op; admin-write does.
	admW, werrs := c.conn(auth.Identity{Role: auth.RoleAdminWrite})
	if err := admW.Publish(subj.Admin("rank.reset"), nil); err != nil {
		t.Fatal(err)
	}
	if err := admW.Flush(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-werrs:
		t.Fatalf("admin-write: %v", err)
	default:
	}
	if err := adm.Publish(subj.Admin("rank.reset"), nil); err != nil {
		t.Fatal(err)
	}
	wantViolation(t, aerrs, "admin sending a mutating op")
	// Raft membership changes are mutating too: admin-write only, although
	// the read-only raft status op shares their prefix.
	for _, op := range []string{wire.AdminRaftAddVoter, wire.AdminRaftRemove} {
		if err := admW.Publish(subj.Admin(op), nil); err != nil {
			t.Fatal(err)
		}
		if err := admW.Flush(); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-werrs:
			t.Fatalf("admin-write sending %s: %v", op, err)
		default:
		}
		if err := adm.Publish(subj.Admin(op), nil); err != nil {
			t.Fatal(err)
		}
		wantViolation(t, aerrs, "admin sending "+op)
	}
}

// TestSubscribeEverythingRefused: no identity may subscribe to ">", to
// another's inbox, or to another rank's engine API. Insecure lets all.
func TestSubscribeEverythingRefused(t *testing.T) {
	ids := []auth.Identity{{Role: auth.RoleCoordinator}, {Role: auth.RoleAdmin}, {Role: auth.RoleAdminWrite},
		auth.Engine("engine0"), auth.Rankd(rank0)}
	for _, insecure := range []bool{true, false} {
		c := start(t, insecure)
		for _, id := range ids {
			for _, pattern := range []string{">", "_INBOX.>", "kvtier.>", auth.Engine("engine1").InboxPrefix() + ".>",
				subj.Engine(rank1, "*"), subj.Freed(wire.Rank{Instance: "engine1"})} {
				if id.Role == auth.RoleCoordinator && pattern == "kvtier.>" {
					continue
				}
				nc, errs := c.conn(id)
				_, err := nc.SubscribeSync(pattern)
				if err != nil {
					t.Fatal(err)
				}
				if err := nc.Flush(); err != nil {
					t.Fatal(err)
				}
				if insecure {
					select {
					case err := <-errs:
						t.Fatalf("insecure %s subscribe %s: %v", id, pattern, err)
					default:
					}
					continue
				}
				wantViolation(t, errs, id.String()+" subscribing "+pattern)
			}
		}
	}
}

// TestInboxesArePrivate: a reply to the engine cannot be read by another
// identity, and a rank's request reply comes back under its own prefix.
func TestInboxesArePrivate(t *testing.T) {
	c := start(t, false)
	eng, _ := c.conn(auth.Engine("engine0"))
	if got := eng.NewRespInbox(); !strings.HasPrefix(got, "_INBOX.engine-engine0.") {
		t.Fatalf("engine inbox %q", got)
	}
	spy, errs := c.conn(auth.Engine("engine1"))
	if _, err := spy.SubscribeSync("_INBOX.engine-engine0.>"); err != nil {
		t.Fatal(err)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	wantViolation(t, errs, "engine1 reading engine0's inbox")
}

func TestEmbeddedRefusesInsecureConfig(t *testing.T) {
	cfg := bus.DefaultEmbeddedConfig()
	cfg.Port = 0
	if _, err := bus.StartEmbedded(cfg); !errors.Is(err, bus.ErrInsecure) {
		t.Fatalf("no users: %v, want ErrInsecure", err)
	}
	dir := initDir(t)
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Users = u.ServerUsers("kvtier")
	cfg.Host = "0.0.0.0"
	if _, err := bus.StartEmbedded(cfg); !errors.Is(err, bus.ErrInsecure) || !strings.Contains(err.Error(), "without TLS") {
		t.Fatalf("off loopback without TLS: %v, want ErrInsecure", err)
	}
}

// TestTLS: with the CA and server certificate of InitTLS the server may
// listen off loopback; a client verifying against the CA connects, one
// without it does not, and a plaintext client is refused.
func TestTLS(t *testing.T) {
	dir := initDir(t)
	if err := auth.InitTLS(dir, []string{"127.0.0.1", "localhost"}); err != nil {
		t.Fatal(err)
	}
	if err := auth.InitTLS(dir, []string{"127.0.0.1"}); !errors.Is(err, auth.ErrExists) {
		t.Fatalf("second InitTLS: %v, want ErrExists", err)
	}
	st, err := os.Stat(filepath.Join(dir, auth.ServerKeyFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("server key mode %v %v", st.Mode(), err)
	}
	tlsCfg, err := auth.ServerTLS(dir)
	if err != nil || tlsCfg == nil {
		t.Fatalf("ServerTLS: %v %v", tlsCfg, err)
	}
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	cfg := bus.DefaultEmbeddedConfig()
	cfg.Host, cfg.Port, cfg.Users, cfg.TLS = "0.0.0.0", 0, u.ServerUsers("kvtier"), tlsCfg
	srv, err := bus.StartEmbedded(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	_, port, err := net.SplitHostPort(srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	url := "nats://127.0.0.1:" + port
	opts, err := auth.Client{Identity: auth.Rankd(rank0), Dir: dir}.Options()
	if err != nil {
		t.Fatal(err)
	}
	nc, err := bus.Connect(url, "tls-client", opts...)
	if err != nil {
		t.Fatalf("client with the cluster CA: %v", err)
	}
	if !nc.TLSRequired() {
		t.Error("connection is not TLS")
	}
	nc.Close()
	seedOnly, err := auth.Client{Identity: auth.Rankd(rank0), SeedFile: filepath.Join(dir, "rankd-engine0-0.nk")}.Options()
	if err != nil {
		t.Fatal(err)
	}
	if nc, err := nats.Connect(url, append(seedOnly, nats.MaxReconnects(0))...); err == nil {
		nc.Close()
		t.Fatal("a client without the cluster CA connected (the certificate is self-signed)")
	}
}

// TestKVEventsOnlyForRouters: the coordinator publishes KV events, the
// admin identity (a router) receives every instance's, and an engine
// cannot subscribe to another instance's events (nor to its own: they
// are for routers), nor can a rank or admin-write.
func TestKVEventsOnlyForRouters(t *testing.T) {
	c := start(t, false)
	coord, _ := c.conn(auth.Identity{Role: auth.RoleCoordinator})
	router, _ := c.conn(auth.Identity{Role: auth.RoleAdmin})
	sub, err := router.SubscribeSync(subj.KVEventsAll())
	if err != nil {
		t.Fatal(err)
	}
	if err := router.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := coord.Publish(subj.KVEvents("engine1"), []byte(`{"ts":1,"events":[]}`)); err != nil {
		t.Fatal(err)
	}
	if !received(t, coord, sub) {
		t.Fatal("the router did not receive the coordinator's KV events")
	}
	for _, tc := range []struct {
		id      auth.Identity
		subject string
	}{
		{auth.Engine("engine0"), subj.KVEvents("engine1")},
		{auth.Engine("engine0"), subj.KVEvents("engine0")},
		{auth.Engine("engine0"), subj.KVEventsAll()},
		{auth.Rankd(rank0), subj.KVEvents("engine1")},
		{auth.Identity{Role: auth.RoleAdminWrite}, subj.KVEventsAll()},
	} {
		nc, errs := c.conn(tc.id)
		if _, err := nc.SubscribeSync(tc.subject); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		wantViolation(t, errs, tc.id.String()+" subscribing "+tc.subject)
	}
	// Nobody but the coordinator may publish them (a forged removal would
	// steer a router away from a cache).
	eng, errs := c.conn(auth.Engine("engine1"))
	if err := eng.Publish(subj.KVEvents("engine1"), []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	if err := eng.Flush(); err != nil {
		t.Fatal(err)
	}
	wantViolation(t, errs, "engine1 publishing its KV events")
}

// TestPipelineEngineReachesEveryStage: under PP > 1 one engine identity
// drives every stage instance: each stage rank's engine API, the
// coordinator's subjects scoped to each stage instance, and each stage
// rank's blocks-freed announcements (its stage rankds are instances of
// their own, wire.StageInstance).
func TestPipelineEngineReachesEveryStage(t *testing.T) {
	c := start(t, false)
	coord, _ := c.conn(auth.Identity{Role: auth.RoleCoordinator})
	eng, eerrs := c.conn(auth.Engine("engine2"))
	for s := range 2 {
		r := wire.Rank{Instance: wire.StageInstance("engine2", 2, s)}
		rk, _ := c.conn(auth.Rankd(r))
		if _, err := rk.Subscribe(subj.Engine(r, "store"), func(m *nats.Msg) { _ = m.Respond([]byte("ok")) }); err != nil {
			t.Fatal(err)
		}
		if err := rk.Flush(); err != nil {
			t.Fatal(err)
		}
		if _, err := coord.Subscribe(subj.EngineCoord(r.Instance, wire.CoordLookup), func(m *nats.Msg) { _ = m.Respond([]byte("ok")) }); err != nil {
			t.Fatal(err)
		}
		if err := coord.Flush(); err != nil {
			t.Fatal(err)
		}
		for _, subject := range []string{subj.Engine(r, "store"), subj.EngineCoord(r.Instance, wire.CoordLookup)} {
			if m, err := eng.Request(subject, []byte("x"), 5*time.Second); err != nil || string(m.Data) != "ok" {
				t.Fatalf("stage %d: request %s: %v", s, subject, err)
			}
		}
		freed, err := eng.SubscribeSync(subj.Freed(r))
		if err != nil {
			t.Fatal(err)
		}
		if err := eng.Flush(); err != nil {
			t.Fatal(err)
		}
		if err := rk.Publish(subj.Freed(r), []byte("free")); err != nil {
			t.Fatal(err)
		}
		if !received(t, rk, freed) {
			t.Fatalf("stage %d: the engine did not receive its stage rank's blocks-freed message", s)
		}
	}
	select {
	case err := <-eerrs:
		t.Fatalf("unexpected async error: %v", err)
	default:
	}
}

// An instance added again with another PP size is refused: its engine
// identity kept as it was would not reach the new stages' rankds.
func TestAddInstanceRefusesAnotherPPSize(t *testing.T) {
	dir := initDir(t)
	if err := auth.AddInstance(dir, auth.Instance{Name: "engine2", TPSize: 1, PPSize: 2}); err != nil {
		t.Fatalf("the same instance again: %v", err)
	}
	err := auth.AddInstance(dir, auth.Instance{Name: "engine0", TPSize: 2, PPSize: 2})
	if !errors.Is(err, auth.ErrExists) || !strings.Contains(err.Error(), "engine-engine0") {
		t.Fatalf("engine0 again with PP 2: %v, want ErrExists naming engine-engine0", err)
	}
	for _, bad := range []auth.Identity{
		{Role: auth.RoleRankd, Instance: "engine2-pp0", PP: 2},
		{Role: auth.RoleEngine, Instance: "engine2", PP: 257},
		{Role: auth.RoleEngine, Instance: strings.Repeat("e", 62), PP: 2}, // its stage instances are over 64 characters
	} {
		if err := bad.Validate(); !errors.Is(err, auth.ErrIdentity) {
			t.Errorf("%+v: %v, want ErrIdentity", bad, err)
		}
	}
}

// No two engine identities may act for one instance: an engine "a" of PP 2
// acts for a-pp0 and a-pp1, so another tenant's engine named a-pp1 would
// share a-pp1's rankds and coordinator subjects with it. Refused at init,
// at add (either order) and in a hand-edited users file.
func TestPipelineStageInstancesAreNotAnotherEnginesInstance(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "creds")
	err := auth.Init(dir, []auth.Instance{{Name: "a-pp1", TPSize: 1}, {Name: "a", TPSize: 1, PPSize: 2}})
	if !errors.Is(err, auth.ErrIdentity) || !strings.Contains(err.Error(), "instance a-pp1") {
		t.Fatalf("init: %v, want ErrIdentity naming a-pp1", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("a refused init wrote %d files", len(ents))
	}
	dir = initDir(t) // engine2 runs PP 2: engine2-pp0, engine2-pp1
	if err := auth.AddInstance(dir, auth.Instance{Name: "engine2-pp1", TPSize: 1}); !errors.Is(err, auth.ErrIdentity) {
		t.Fatalf("adding engine2-pp1 beside engine2 of PP 2: %v, want ErrIdentity", err)
	}
	if err := auth.AddInstance(dir, auth.Instance{Name: "engine0", TPSize: 1, PPSize: 2}); err == nil {
		t.Fatal("engine0 again with PP 2 was accepted")
	}
	if err := auth.AddInstance(dir, auth.Instance{Name: "engine1-pp0", TPSize: 1}); err != nil {
		t.Fatalf("engine1-pp0 (engine1 runs PP 1): %v", err)
	}
	if err := auth.AddInstance(dir, auth.Instance{Name: "engine1", TPSize: 1, PPSize: 2}); err == nil {
		t.Fatal("engine1 of PP 2 over the existing engine1-pp0 was accepted")
	}
	// A users file edited by hand to the same effect does not load.
	path := filepath.Join(dir, auth.UsersFile)
	u, err := auth.LoadUsers(path)
	if err != nil {
		t.Fatal(err)
	}
	for i := range u.Users {
		if u.Users[i].Name == "engine-engine1" {
			u.Users[i].PP = 2
		}
	}
	data, err := json.Marshal(u)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.LoadUsers(path); !errors.Is(err, auth.ErrIdentity) {
		t.Fatalf("users file with engine1 of PP 2 beside engine1-pp0: %v, want ErrIdentity", err)
	}
}
