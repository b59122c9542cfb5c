package auth_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// TestExternalNATSConfig starts a nats-server from the generated
// configuration (server.ProcessConfigFile, as an operator's server would
// read it) and checks the same permissions hold there: anonymous refused,
// a rank's own events delivered, another rank's refused, ">" refused.
func TestExternalNATSConfig(t *testing.T) {
	dir := initDir(t)
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(t.TempDir(), "nats.conf")
	body := "listen: 127.0.0.1:-1\n" + auth.NATSConfig(u, "kvtier")
	if err := os.WriteFile(conf, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(conf)
	if err != nil {
		t.Fatalf("generated config does not parse: %v\n%s", err, body)
	}
	opts.NoLog, opts.NoSigs = true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("server not ready")
	}
	defer func() { srv.Shutdown(); srv.WaitForShutdown() }()
	url := "nats://" + srv.Addr().String()
	if nc, err := nats.Connect(url, nats.MaxReconnects(0)); err == nil {
		nc.Close()
		t.Fatal("anonymous connect accepted by the external server")
	}
	connect := func(id auth.Identity) (*nats.Conn, chan error) {
		o, err := auth.Client{Identity: id, Dir: dir}.Options()
		if err != nil {
			t.Fatal(err)
		}
		errs := make(chan error, 16)
		o = append(o, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { errs <- err }))
		nc, err := bus.Connect(url, id.Name(), o...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc, errs
	}
	coord, _ := connect(auth.Identity{Role: auth.RoleCoordinator})
	if _, err := coord.Subscribe(subj.EventsAll(), func(m *nats.Msg) { _ = m.Respond([]byte("ack")) }); err != nil {
		t.Fatal(err)
	}
	if err := coord.Flush(); err != nil {
		t.Fatal(err)
	}
	r0, errs := connect(auth.Rankd(rank0))
	if m, err := r0.Request(subj.Events(rank0), []byte("b"), 5*time.Second); err != nil || string(m.Data) != "ack" {
		t.Fatalf("own events through the external server: %v", err)
	}
	if err := r0.Publish(subj.Events(rank1), []byte("forged")); err != nil {
		t.Fatal(err)
	}
	wantViolation(t, errs, "rank0 publishing rank1's events (external)")
	if _, err := r0.SubscribeSync(">"); err != nil {
		t.Fatal(err)
	}
	wantViolation(t, errs, "rank0 subscribing > (external)")
}
