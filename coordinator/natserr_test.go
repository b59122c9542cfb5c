package coordinator

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// violation is the error nats.go hands the async error handler for a
// server's "-ERR 'Permissions Violation ...'" line.
func violation(text string) error {
	return fmt.Errorf("%w: %s", nats.ErrPermissionViolation, text)
}

// TestNATSErrorKind: a permission violation publishing to a reply inbox
// (a second reply to a duplicated request, or a reply after the
// allow_responses window) is reply_permission; a violation on any other
// subject, even one carrying an inbox as its reply, stays permission; a
// slow consumer and anything else keep their own kinds.
func TestNATSErrorKind(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"second reply to an inbox", violation(`Permissions Violation for Publish to "_INBOX.engine-eng.Xy3.7"`), natsErrReplyPermission},
		{"unscoped inbox", violation(`Permissions Violation for Publish to "_INBOX.abc"`), natsErrReplyPermission},
		{"lower-cased prefix", violation(`permissions violation for publish to "_INBOX.abc"`), natsErrReplyPermission},
		{"plain subject", violation(`Permissions Violation for Publish to "kvtier.restore.plan"`), natsErrPermission},
		{"inbox-like subject", violation(`Permissions Violation for Publish to "_INBOXES.x"`), natsErrPermission},
		{"bare _INBOX", violation(`Permissions Violation for Publish to "_INBOX"`), natsErrPermission},
		{"request with an inbox reply", violation(`Permissions Violation for Publish to "kvtier.x" using reply subject "_INBOX.a.b"`), natsErrPermission},
		{"reply subject refused", violation(`Permissions Violation for Publish with Reply of "_INBOX.a.b"`), natsErrPermission},
		{"subscription", violation(`Permissions Violation for Subscription to "_INBOX.>"`), natsErrPermission},
		{"unquoted subject", violation(`Permissions Violation for Publish to _INBOX.a`), natsErrPermission},
		{"inbox text without the sentinel", errors.New(`Permissions Violation for Publish to "_INBOX.a"`), natsErrOther},
		{"slow consumer", nats.ErrSlowConsumer, natsErrSlowConsumer},
		{"wrapped slow consumer", fmt.Errorf("sub 3: %w", nats.ErrSlowConsumer), natsErrSlowConsumer},
		{"other", nats.ErrMaxSubscriptionsExceeded, natsErrOther},
		{"nil", nil, natsErrOther},
	} {
		if got := natsErrorKind(tc.err); got != tc.want {
			t.Errorf("%s: natsErrorKind(%v) = %q, want %q", tc.name, tc.err, got, tc.want)
		}
	}
}

// TestDuplicateReplyLogsWarn: on a real NATS server with allow_responses
// max 1 (C9's responder permission), answering one request twice makes
// the server refuse the second reply; the coordinator's handler logs it
// at Warn, counts it as reply_permission and not as a dropped request,
// while another async error stays at Error and counts as dropped. Seen
// failing before the classification: the refusal was logged at Error
// ("NATS error; requests may have been dropped") and counted dropped.
func TestDuplicateReplyLogsWarn(t *testing.T) {
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true,
		Users: []*server.User{
			{Username: "engine", Password: "e"},
			{Username: "coord", Password: "c", Permissions: &server.Permissions{
				Publish:   &server.SubjectPermission{Allow: []string{"kvtier.>"}},
				Subscribe: &server.SubjectPermission{Allow: []string{"kvtier.>"}},
				Response:  &server.ResponsePermission{MaxMsgs: 1, Expires: time.Minute},
			}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("NATS server not ready")
	}

	core, logs := observer.New(zapcore.DebugLevel)
	c := &Coordinator{log: zap.New(core), met: newMetrics()}
	asyncErrs := make(chan error, 4)
	coord, err := nats.Connect(srv.ClientURL(), nats.UserInfo("coord", "c"),
		nats.ErrorHandler(func(nc *nats.Conn, sub *nats.Subscription, err error) {
			c.natsError(nc, sub, err)
			asyncErrs <- err
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(coord.Close)
	if _, err := coord.Subscribe("kvtier.op", func(m *nats.Msg) {
		_ = m.Respond([]byte("first"))
		_ = m.Respond([]byte("second")) // the duplicate's reply
	}); err != nil {
		t.Fatal(err)
	}
	if err := coord.Flush(); err != nil {
		t.Fatal(err)
	}
	eng, err := nats.Connect(srv.ClientURL(), nats.UserInfo("engine", "e"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(eng.Close)
	rep, err := eng.Request("kvtier.op", nil, 10*time.Second)
	if err != nil || string(rep.Data) != "first" {
		t.Fatalf("request: %v %v, want the first reply", rep, err)
	}
	var got error
	select {
	case got = <-asyncErrs:
	case <-time.After(10 * time.Second):
		t.Fatal("the server never refused the second reply")
	}
	if !errors.Is(got, nats.ErrPermissionViolation) {
		t.Fatalf("async error %v, want a permission violation", got)
	}
	c.natsError(coord, nil, nats.ErrMaxSubscriptionsExceeded)

	entries := logs.All()
	if len(entries) != 2 {
		t.Fatalf("%d log entries, want 2: %+v", len(entries), entries)
	}
	if e := entries[0]; e.Level != zapcore.WarnLevel || e.Message != "NATS refused a reply: the request was already answered (a duplicate) or its response window expired" ||
		e.ContextMap()["kind"] != natsErrReplyPermission {
		t.Errorf("reply refusal logged %v %q %v, want Warn, kind %s", e.Level, e.Message, e.ContextMap(), natsErrReplyPermission)
	}
	if e := entries[1]; e.Level != zapcore.ErrorLevel || e.Message != "NATS error; requests may have been dropped" ||
		e.ContextMap()["kind"] != natsErrOther {
		t.Errorf("other error logged %v %q %v, want Error, kind %s", e.Level, e.Message, e.ContextMap(), natsErrOther)
	}
	for kind, want := range map[string]float64{natsErrReplyPermission: 1, natsErrOther: 1, natsErrPermission: 0, natsErrSlowConsumer: 0} {
		var m dto.Metric
		if err := c.met.natsErrors.WithLabelValues(kind).Write(&m); err != nil {
			t.Fatal(err)
		}
		if v := m.GetCounter().GetValue(); v != want {
			t.Errorf("kvtier_coord_nats_errors_total{kind=%q} = %v, want %v", kind, v, want)
		}
	}
	var m dto.Metric
	if err := c.met.dropped.Write(&m); err != nil {
		t.Fatal(err)
	}
	if v := m.GetCounter().GetValue(); v != 1 {
		t.Errorf("kvtier_coord_nats_dropped_total = %v, want 1 (the other error only)", v)
	}
}
