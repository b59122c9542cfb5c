package auth_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/nats-io/nats.go"
)

func TestInitWritesRouteSecret(t *testing.T) {
	dir := initDir(t)
	path := filepath.Join(dir, auth.RouteSecretFile)
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("route secret mode %v, %v; want 0600", st, err)
	}
	user, pass, err := auth.RouteCredentials(dir)
	if err != nil || user != auth.RouteUser || len(pass) != 44 {
		t.Fatalf("RouteCredentials = %q, %d chars, %v; want %q and 44 chars (base64 of 32 B)", user, len(pass), err, auth.RouteUser)
	}
	if err := auth.InitRouteSecret(dir); !errors.Is(err, auth.ErrExists) {
		t.Fatalf("second InitRouteSecret: %v, want ErrExists", err)
	}
	if err := os.Chmod(path, 0o640); err != nil {
		t.Fatal(err)
	}
	if _, _, err := auth.RouteCredentials(dir); !errors.Is(err, auth.ErrCredsFile) || !strings.Contains(err.Error(), "mode 0640") {
		t.Fatalf("0640 route secret: %v", err)
	}
	short := t.TempDir()
	if err := os.WriteFile(filepath.Join(short, auth.RouteSecretFile), []byte("c2hvcnQ=\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := auth.RouteCredentials(short); !errors.Is(err, auth.ErrCredsFile) || !strings.Contains(err.Error(), "holds 5 bytes") {
		t.Fatalf("5-byte route secret: %v", err)
	}
}

// node is one embedded server of a NATS cluster with the users of dir.
type node struct {
	t   *testing.T
	dir string
	srv *bus.Embedded
}

// startNode starts a server with dir's users whose routes use dir's route
// credentials (unless edit changes them) and go to routes.
func startNode(t *testing.T, dir string, routes []string, edit func(*bus.EmbeddedConfig)) *node {
	t.Helper()
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	cfg := bus.DefaultEmbeddedConfig()
	cfg.Port, cfg.Users = 0, u.ServerUsers("kvtier")
	cfg.Cluster.Host, cfg.Cluster.Port, cfg.Cluster.Routes = "127.0.0.1", 0, routes
	if cfg.Cluster.Username, cfg.Cluster.Password, err = auth.RouteCredentials(dir); err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		edit(&cfg)
	}
	srv, err := bus.StartEmbedded(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return &node{t: t, dir: dir, srv: srv}
}

func (n *node) routeURL() string { return "nats-route://" + n.srv.ClusterAddr() }

func (n *node) conn(id auth.Identity) (*nats.Conn, chan error) {
	c := &cluster{t: n.t, dir: n.dir, srv: n.srv}
	return c.conn(id)
}

// waitRouted waits until every node has a route.
func waitRouted(t *testing.T, nodes ...*node) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for _, n := range nodes {
		for n.srv.NumRoutes() == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("server %s has no route after 10 s", n.srv.ClusterAddr())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// TestClusterCarriesAndEnforces: two servers routed with the cluster's
// route secret are one NATS: a rank connected to B reaches the coordinator
// on A, request and reply; and B enforces the same permissions as A: the
// rank still cannot publish another rank's events, not even to a
// subscriber on A.
func TestClusterCarriesAndEnforces(t *testing.T) {
	dir := initDir(t)
	a := startNode(t, dir, nil, nil)
	b := startNode(t, dir, []string{a.routeURL()}, nil)
	waitRouted(t, a, b)

	coord, _ := a.conn(auth.Identity{Role: auth.RoleCoordinator})
	own, err := coord.Subscribe(subj.Events(rank0), func(m *nats.Msg) { _ = m.Respond(append([]byte("ack:"), m.Data...)) })
	if err != nil {
		t.Fatal(err)
	}
	defer own.Unsubscribe()
	forged, err := coord.SubscribeSync(subj.Events(rank1))
	if err != nil {
		t.Fatal(err)
	}
	if err := coord.Flush(); err != nil {
		t.Fatal(err)
	}
	r0, errs := b.conn(auth.Rankd(rank0))
	// The subscription on A reaches B's interest graph asynchronously.
	var rep *nats.Msg
	deadline := time.Now().Add(10 * time.Second)
	for {
		rep, err = r0.Request(subj.Events(rank0), []byte("batch"), time.Second)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("rank 0 on B -> coordinator on A: %v", err)
	}
	if string(rep.Data) != "ack:batch" {
		t.Fatalf("rank 0 on B -> coordinator on A: reply %q, want \"ack:batch\"", rep.Data)
	}
	if err := r0.Publish(subj.Events(rank1), []byte("forged")); err != nil {
		t.Fatal(err)
	}
	if received(t, r0, forged) {
		t.Fatal("rank 0 connected to B forged rank 1's events to the coordinator on A")
	}
	wantViolation(t, errs, "rank 0 on B -> rank 1 events")
}

// TestUnauthenticatedRouteRefused: a server presenting no route
// credentials, or another cluster's, gets no route to A, and its clients'
// messages never reach A's; one with the right secret does (the control).
func TestUnauthenticatedRouteRefused(t *testing.T) {
	dir := initDir(t)
	a := startNode(t, dir, nil, nil)
	coord, _ := a.conn(auth.Identity{Role: auth.RoleCoordinator})
	sub, err := coord.SubscribeSync(subj.EventsAll())
	if err != nil {
		t.Fatal(err)
	}
	if err := coord.Flush(); err != nil {
		t.Fatal(err)
	}
	other := initDir(t)
	for _, tc := range []struct {
		name string
		edit func(*bus.EmbeddedConfig)
	}{
		{"no route credentials", func(c *bus.EmbeddedConfig) { c.Insecure, c.Cluster.Username, c.Cluster.Password = true, "", "" }},
		{"another cluster's route secret", func(c *bus.EmbeddedConfig) {
			var err error
			if c.Cluster.Username, c.Cluster.Password, err = auth.RouteCredentials(other); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		rogue := startNode(t, dir, []string{a.routeURL()}, tc.edit)
		r0, _ := rogue.conn(auth.Rankd(rank0))
		// Publish for a while: a route that formed late would carry one.
		for range 10 {
			if err := r0.Publish(subj.Events(rank0), []byte(tc.name)); err != nil {
				t.Fatal(err)
			}
			if received(t, r0, sub) {
				t.Fatalf("%s: a message of the rogue server's client reached the coordinator on A", tc.name)
			}
		}
		if n := a.srv.NumRoutes() + rogue.srv.NumRoutes(); n != 0 {
			t.Fatalf("%s: %d routes between A and the rogue server, want 0", tc.name, n)
		}
		rogue.srv.Shutdown()
	}
	good := startNode(t, dir, []string{a.routeURL()}, nil)
	waitRouted(t, a, good)
	r0, _ := good.conn(auth.Rankd(rank0))
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := r0.Publish(subj.Events(rank0), []byte("good")); err != nil {
			t.Fatal(err)
		}
		if received(t, r0, sub) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("control: the server with the route secret did not carry a message to A")
		}
	}
}

// TestClusterRefusesInsecureConfig: routes without credentials, or off
// loopback without TLS, are refused unless insecure; malformed routes and
// credentials in a route URL are refused always.
func TestClusterRefusesInsecureConfig(t *testing.T) {
	dir := initDir(t)
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	base := bus.DefaultEmbeddedConfig()
	base.Port, base.Users = 0, u.ServerUsers("kvtier")
	base.Cluster.Host, base.Cluster.Port = "127.0.0.1", 0
	for _, tc := range []struct {
		name string
		edit func(*bus.EmbeddedConfig)
		want error
		msg  string
	}{
		{"no route credentials", func(*bus.EmbeddedConfig) {}, bus.ErrInsecure, "no route credentials"},
		{"off loopback without TLS", func(c *bus.EmbeddedConfig) {
			c.Cluster.Host, c.Cluster.Username, c.Cluster.Password = "0.0.0.0", auth.RouteUser, "secret"
		}, bus.ErrInsecure, "listens on 0.0.0.0, off loopback, without TLS"},
		{"credentials in a route URL", func(c *bus.EmbeddedConfig) {
			c.Insecure, c.Cluster.Routes = true, []string{"nats-route://u:p@127.0.0.1:6222"}
		}, bus.ErrClusterConfig, "carries credentials in its URL"},
		{"route without a port", func(c *bus.EmbeddedConfig) {
			c.Insecure, c.Cluster.Routes = true, []string{"nats-route://127.0.0.1"}
		}, bus.ErrClusterConfig, "must be nats-route://host:port"},
		{"routes without a cluster listener", func(c *bus.EmbeddedConfig) {
			c.Insecure, c.Cluster.Host, c.Cluster.Routes = true, "", []string{"nats-route://127.0.0.1:6222"}
		}, bus.ErrClusterConfig, "1 routes but no cluster listen address"},
	} {
		cfg := base
		tc.edit(&cfg)
		srv, err := bus.StartEmbedded(cfg)
		if err == nil {
			srv.Shutdown()
		}
		if !errors.Is(err, tc.want) || err == nil || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want %v with %q", tc.name, err, tc.want, tc.msg)
		}
	}
}

// TestClusterRouteTLS: with the CA and server certificate in the
// credentials dir, routes are TLS and verified: two servers of the cluster
// route to each other, one whose certificate another CA signed does not.
func TestClusterRouteTLS(t *testing.T) {
	dir := initDir(t)
	if err := auth.InitTLS(dir, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	dirOf := dir
	routeTLS := func(dir string) func(*bus.EmbeddedConfig) {
		return func(c *bus.EmbeddedConfig) {
			tc, err := auth.RouteTLS(dir)
			if err != nil || tc == nil {
				t.Fatalf("RouteTLS: %v %v", tc, err)
			}
			c.Cluster.TLS = tc
			// Clients keep the cluster's certificate (they verify with dir's CA).
			if c.TLS, err = auth.ServerTLS(dirOf); err != nil {
				t.Fatal(err)
			}
		}
	}
	a := startNode(t, dir, nil, routeTLS(dir))
	// Same route secret and users, a certificate of another CA.
	foreign := filepath.Join(t.TempDir(), "foreign")
	if err := os.MkdirAll(foreign, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := auth.InitTLS(foreign, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	rogue := startNode(t, dir, []string{a.routeURL()}, routeTLS(foreign))
	b := startNode(t, dir, []string{a.routeURL()}, routeTLS(dir))
	waitRouted(t, a, b)
	coord, _ := a.conn(auth.Identity{Role: auth.RoleCoordinator})
	sub, err := coord.SubscribeSync(subj.EventsAll())
	if err != nil {
		t.Fatal(err)
	}
	if err := coord.Flush(); err != nil {
		t.Fatal(err)
	}
	r0, _ := rogue.conn(auth.Rankd(rank0))
	for range 5 {
		if err := r0.Publish(subj.Events(rank0), []byte("rogue")); err != nil {
			t.Fatal(err)
		}
		if received(t, r0, sub) {
			t.Fatal("a server with another CA's certificate carried a message to A")
		}
	}
	if n := rogue.srv.NumRoutes(); n != 0 {
		t.Fatalf("the server with another CA's certificate has %d routes, want 0", n)
	}
	noCA := t.TempDir()
	for _, f := range []string{auth.ServerCertFile, auth.ServerKeyFile} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(noCA, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := auth.RouteTLS(noCA); !errors.Is(err, auth.ErrCredsFile) || !strings.Contains(err.Error(), "no ca.pem") {
		t.Fatalf("RouteTLS without a CA: %v", err)
	}
}
