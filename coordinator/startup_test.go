package coordinator

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// TestServesUnavailableWhileIndexOpens: a restarted coordinator brings NATS
// and its subscriptions up before it opens the index (issue 12 item 3,
// "restart serves at once"). While the index opens (held here by the test
// hook, as a large index would hold it) a lookup is answered with code
// unavailable and a retry hint, and an event batch is refused the same way,
// never acknowledged; once the index is open the lookup answers from the
// index as it was before the restart and the resent batch is acknowledged.
func TestServesUnavailableWhileIndexOpens(t *testing.T) {
	dir := t.TempDir()
	port := testutil.FreePort(t)
	cfg := testConfig(t, dir)
	cfg.Embedded.Port = port
	r := wire.Rank{Instance: "eng", TPRank: 0}

	// First life: a namespace and 8 chunks of rank 0.
	c1, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c1.Start(); err != nil {
		t.Fatal(err)
	}
	nc1 := connect(t, c1)
	ns := register(t, nc1, c1.subj, testSpec(1))
	chunks := chain(ns, 12, 1)
	if ack, werr := sendBatch(t, nc1, c1.subj, storeBatch(r, 7, 0, ns, chunks[:8], wire.L1)); werr != nil || ack.AppliedThrough != 8 {
		t.Fatalf("first life ack = %+v, %v", ack, werr)
	}
	nc1.Close()
	c1.Shutdown()

	// Second life, held in its index-opening phase.
	entered, release := make(chan struct{}), make(chan struct{})
	cfg.indexOpenHook = func() {
		close(entered)
		<-release
	}
	c2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan error, 1)
	go func() { started <- c2.Start() }()
	released := false
	defer func() {
		if !released {
			close(release)
		}
		<-started
		c2.Shutdown()
	}()
	select {
	case <-entered:
	case err := <-started:
		t.Fatalf("Start returned %v before opening the index", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Start never reached the index open")
	}
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	nc, err := bus.Connect(url, t.Name())
	if err != nil {
		t.Fatalf("connect to NATS while the index opens: %v (NATS must be up before the index)", err)
	}
	defer nc.Close()
	subj := wire.Subjects{Prefix: cfg.Prefix}

	lookup := wire.LookupRequest{Namespace: ns, Chunks: chunks[:8], Instance: r.Instance}
	we := callErr[wire.LookupReply](t, nc, subj.Coord(wire.CoordLookup), lookup, wire.CodeUnavailable)
	if want := "index opening: the coordinator serves once it is open and verified; retry"; we.Message != want {
		t.Errorf("lookup while opening: message %q, want %q", we.Message, want)
	}
	if we.RetryAfterMS != startupRetryMS {
		t.Errorf("lookup while opening: retry_after_ms %d, want %d", we.RetryAfterMS, startupRetryMS)
	}
	if !we.Retryable() {
		t.Error("unavailable while opening is not retryable")
	}
	later := storeBatch(r, 7, 8, ns, chunks[8:], wire.L1)
	if ack, werr := sendBatch(t, nc, subj, later); ack != nil || werr == nil || werr.Code != wire.CodeUnavailable ||
		werr.RetryAfterMS != startupRetryMS {
		t.Fatalf("batch while opening: ack %+v, error %+v; want code unavailable, retry_after_ms %d", ack, werr, startupRetryMS)
	}
	callErr[wire.RegisterReply](t, nc, subj.Coord(wire.CoordRegister), testSpec(1), wire.CodeUnavailable)

	close(release)
	released = true
	if err := <-started; err != nil {
		t.Fatalf("Start: %v", err)
	}
	started <- nil // for the deferred receive

	// Open: the index as before the restart; the refused batch was not applied.
	rep := call[wire.LookupReply](t, nc, subj.Coord(wire.CoordLookup), wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: r.Instance})
	if rep.Prefix != 8 || rep.Instance != r.Instance {
		t.Fatalf("lookup after open: %+v, want prefix 8 of instance %s", rep, r.Instance)
	}
	if ack, werr := sendBatch(t, nc, subj, later); werr != nil || ack.AppliedThrough != 12 || ack.Resync || ack.Fenced {
		t.Fatalf("resent batch after open: ack %+v, error %+v; want applied through 12", ack, werr)
	}
	rep = call[wire.LookupReply](t, nc, subj.Coord(wire.CoordLookup), wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: r.Instance})
	if rep.Prefix != 12 {
		t.Fatalf("lookup after the resent batch: prefix %d, want 12", rep.Prefix)
	}
	mustVerify(t, c2)
}
