package testutil

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATS starts an embedded NATS server on 127.0.0.1 at a port the kernel
// chooses (Port: -1), without authentication and with an 8 MiB max
// payload (as the daemons' embedded server), edited by each of edit before
// it starts; tb.Cleanup shuts it down. Connect to srv.ClientURL().
func NATS(tb testing.TB, edit ...func(*server.Options)) *server.Server {
	tb.Helper()
	opts := &server.Options{
		Host:       "127.0.0.1",
		Port:       server.RANDOM_PORT,
		MaxPayload: 8 << 20,
		NoLog:      true,
		NoSigs:     true,
	}
	for _, e := range edit {
		e(opts)
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		tb.Fatalf("embedded NATS: %v", err)
	}
	go srv.Start()
	tb.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(10 * time.Second) {
		tb.Fatalf("embedded NATS not ready for connections within 10s")
	}
	return srv
}
