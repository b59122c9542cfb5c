package rankd

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap/zaptest"
)

// A 503 status reply (nats-server's "no responders") is taken as that,
// and sent again, not as a malformed acknowledgement.
func TestPublisherNoRespondersReply(t *testing.T) {
	p := newPublisher("s", time.Second, 10, 4, zaptest.NewLogger(t), newMetrics("e/0"))
	if err := p.Publish(batch(1)); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	b, _ := p.nextLocked() // taken as run takes it, into the window
	p.taken = append(p.taken, b)
	p.mu.Unlock()
	out := make(chan reply, 1)
	m := &nats.Msg{Subject: "_INBOX.x.1.0", Header: nats.Header{"Status": []string{"503"}}}
	deliverReply(m, "_INBOX.x", out, nil)
	r := <-out
	w := window{head: 0, sent: 1, round: 1, deadline: []time.Time{time.Now().Add(time.Second)}, got: map[uint64]outcome{}}
	p.take(&w, r)
	if o := w.got[0]; o.done || !errors.Is(o.err, nats.ErrNoResponders) {
		t.Fatalf("503 reply: outcome %+v, want an ErrNoResponders to send again", o)
	}
}

// TestPublisherSurvivesServerMove: a rank's publisher holding the URLs of
// two routed NATS servers, connected to A, keeps every batch when A dies
// mid-stream: batches sent before, during and after the move all reach
// the coordinator (connected to B), each acknowledged batch applied, in
// order, none lost, and none past a gap.
func TestPublisherSurvivesServerMove(t *testing.T) {
	start := func(routes ...string) *bus.Embedded {
		cfg := bus.DefaultEmbeddedConfig()
		cfg.Port, cfg.Insecure = 0, true
		cfg.Cluster.Host, cfg.Cluster.Port, cfg.Cluster.Routes = "127.0.0.1", 0, routes
		srv, err := bus.StartEmbedded(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Shutdown)
		return srv
	}
	a := start()
	b := start("nats-route://" + a.ClusterAddr())
	testutil.Eventually(t, 10*time.Second, "the servers to be routed", func() bool { return a.NumRoutes() > 0 && b.NumRoutes() > 0 })

	// The coordinator on B applies batches in sequence, acknowledges
	// each applied one and ignores duplicates (as the index does).
	coord, err := bus.Connect(b.ClientURL(), "coordinator")
	if err != nil {
		t.Fatal(err)
	}
	defer coord.Close()
	var (
		mu      sync.Mutex
		applied []uint64
		gaps    int // batches that arrived past a gap (each a resync)
	)
	if _, err := coord.Subscribe("kvtier.events.e.0", func(m *nats.Msg) {
		var bt wire.Batch
		if err := bt.UnmarshalBinary(m.Data); err != nil {
			_ = bus.RespondError(m, wire.CodeBadRequest, err.Error())
			return
		}
		mu.Lock()
		seq := bt.Events[0].Seq
		last := uint64(len(applied))
		switch {
		case seq == last+1:
			applied = append(applied, seq)
			last = seq
		case seq > last+1:
			gaps++
			mu.Unlock()
			_ = bus.Respond(m, &wire.EventAck{AppliedThrough: last, Resync: true})
			return
		}
		mu.Unlock()
		_ = bus.Respond(m, &wire.EventAck{AppliedThrough: last})
	}); err != nil {
		t.Fatal(err)
	}
	if err := coord.Flush(); err != nil {
		t.Fatal(err)
	}

	nc, err := bus.Connect(a.ClientURL()+","+b.ClientURL(), "rank", nats.DontRandomize())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if nc.ConnectedUrl() != a.ClientURL() {
		t.Fatalf("rank on %s, want A %s", nc.ConnectedUrl(), a.ClientURL())
	}
	p := newPublisher("kvtier.events.e.0", 300*time.Millisecond, 1000, 4, zaptest.NewLogger(t), newMetrics("e/0"))
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { p.run(stop); close(done) }()
	defer func() { close(stop); <-done }()
	nc.SetReconnectHandler(func(*nats.Conn) { p.reconnected() })
	p.setConn(nc)
	const n = 60
	for i := uint64(1); i <= n; i++ {
		if err := p.Publish(batch(i)); err != nil {
			t.Fatal(err)
		}
		if i == n/3 {
			a.Shutdown() // kill A in the middle of the stream
		}
		time.Sleep(2 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if left := p.flush(ctx); left != 0 {
		t.Fatalf("%d batches not acknowledged 30 s after A died", left)
	}
	if nc.ConnectedUrl() != b.ClientURL() {
		t.Fatalf("rank on %q after A died, want B %s", nc.ConnectedUrl(), b.ClientURL())
	}
	mu.Lock()
	defer mu.Unlock()
	want := make([]uint64, n)
	for i := range want {
		want[i] = uint64(i + 1)
	}
	if !slices.Equal(applied, want) {
		t.Fatalf("applied %v, want 1..%d each once in order", applied, n)
	}
	// What was in flight on A is sent again first on B, and nothing is
	// sent while moving: the coordinator never sees a gap.
	if gaps != 0 {
		t.Fatalf("%d batches reached the coordinator past a gap (each would cost the rank a resync)", gaps)
	}
}
