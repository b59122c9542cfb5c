package coordinator

import (
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// A restore plan larger than the connection's max payload is refused up
// front with too_large naming both numbers, counted, and leaves no restore
// behind; a lookup detail reply that does not fit is refused the same way.
// On f044f94 the begin is never answered (the send error was discarded).
func TestReplyTooLargeRefused(t *testing.T) {
	const maxPayload = 16 << 10
	c := startCoord(t, func(cfg *Config) { cfg.Embedded.MaxPayload = maxPayload })
	nc := connect(t, c)
	if got := nc.MaxPayload(); got != maxPayload {
		t.Fatalf("client max payload %d, want %d", got, maxPayload)
	}
	ns := register(t, nc, c.subj, testSpec(8))
	chunks := chain(ns, 64, 3)
	for tp := range 8 {
		r := wire.Rank{Instance: "eng", TPRank: tp}
		if _, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 0, ns, chunks, wire.L1)); werr != nil {
			t.Fatal(werr)
		}
	}

	we := callErr[wire.RestorePlan](t, nc, c.subj.Coord(wire.CoordRestoreBegin),
		wire.RestoreBegin{Namespace: ns, Chunks: chunks}, wire.CodeTooLarge)
	re := regexp.MustCompile(`^restore plan of 64 chunks for 8 ranks: reply of (\d+) B exceeds the NATS max payload of 16384 B: reply exceeds the NATS max payload$`)
	sm := re.FindStringSubmatch(we.Message)
	if sm == nil {
		t.Fatalf("too_large message %q does not match %s", we.Message, re)
	}
	if n, _ := strconv.Atoi(sm[1]); n <= maxPayload {
		t.Fatalf("reported plan size %d B is not over the limit %d B", n, maxPayload)
	}
	waitMetric(t, c, 1, "kvtier_coord_replies_total", "op", wire.CoordRestoreBegin, "outcome", replyTooLarge)
	// No state was created: nothing active, nothing in the history.
	c.rs.mu.Lock()
	active, decided := len(c.rs.active), len(c.rs.decided)
	c.rs.mu.Unlock()
	if active != 0 || decided != 0 {
		t.Fatalf("refused begin left %d active and %d decided restores, want 0 and 0", active, decided)
	}
	if got := testutil.Metric(t, c.reg, "kvtier_coord_restores_active"); got != 0 {
		t.Fatalf("restores_active = %v, want 0", got)
	}
	hist := call[wire.AdminRestoresReply](t, nc, c.subj.Admin(wire.AdminRestores), struct{}{})
	if len(hist.Restores) != 0 {
		t.Fatalf("history has %d restores, want 0", len(hist.Restores))
	}

	// The generic path: lookup with detail lists 512 sources.
	we = callErr[wire.LookupReply](t, nc, c.subj.Coord(wire.CoordLookup),
		wire.LookupRequest{Namespace: ns, Chunks: chunks, Detail: true}, wire.CodeTooLarge)
	if !regexp.MustCompile(`^reply of \d+ B exceeds the NATS max payload of 16384 B: reply exceeds the NATS max payload$`).MatchString(we.Message) {
		t.Fatalf("lookup too_large message %q", we.Message)
	}
	waitMetric(t, c, 1, "kvtier_coord_replies_total", "op", wire.CoordLookup, "outcome", replyTooLarge)
	// Without detail the same lookup fits and is answered.
	lr := call[wire.LookupReply](t, nc, c.subj.Coord(wire.CoordLookup), wire.LookupRequest{Namespace: ns, Chunks: chunks})
	if lr.Prefix != 64 {
		t.Fatalf("lookup prefix %d, want 64", lr.Prefix)
	}
	waitMetric(t, c, 1, "kvtier_coord_replies_total", "op", wire.CoordLookup, "outcome", replyOK)
	waitMetric(t, c, 8, "kvtier_coord_replies_total", "op", opEvents, "outcome", replyOK)
}

// A reply whose send fails is counted as send_failed (and logged), not
// dropped silently.
func TestReplySendFailureCounted(t *testing.T) {
	c := startCoord(t, nil)
	// A message not bound to a subscription: Respond fails.
	m := &nats.Msg{Subject: "kvtier.test", Reply: "_INBOX.nobody"}
	if c.reply("test.op", m, &wire.EventAck{}) {
		t.Fatal("reply reported success for a failed send")
	}
	if c.replyError("test.op", m, wire.CodeInternal, "boom") {
		t.Fatal("replyError reported success for a failed send")
	}
	waitMetric(t, c, 2, "kvtier_coord_replies_total", "op", "test.op", "outcome", replySendFailed)
	// No reply subject: counted as no_inbox, nothing sent.
	if c.reply("test.op", &nats.Msg{Subject: "kvtier.test"}, &wire.EventAck{}) {
		t.Fatal("reply without an inbox reported success")
	}
	waitMetric(t, c, 1, "kvtier_coord_replies_total", "op", "test.op", "outcome", replyNoInbox)
}

// waitMetric polls until metric name with labelPairs reaches want: a
// reply is counted once its send returned, which may be just after the
// requester has it.
func waitMetric(t *testing.T, c *Coordinator, want float64, name string, labelPairs ...string) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, fmt.Sprintf("%s%v = %v", name, labelPairs, want), func() bool {
		return testutil.Metric(t, c.reg, name, labelPairs...) == want
	})
}
