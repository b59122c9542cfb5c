package coordinator

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

func TestConfigValidate(t *testing.T) {
	good := testConfig(t, t.TempDir())
	if err := good.Validate(); err != nil {
		t.Fatalf("test config: %v", err)
	}
	for name, mod := range map[string]func(*Config){
		"no data dir":      func(c *Config) { c.DataDir = "" },
		"bad url":          func(c *Config) { c.NATSURL = "::nope" },
		"bad prefix":       func(c *Config) { c.Prefix = "a.b" },
		"bad http":         func(c *Config) { c.HTTPAddr = "nohostport" },
		"zero deadline":    func(c *Config) { c.RestoreDeadline = 0 },
		"deadline > max":   func(c *Config) { c.MaxRestoreDeadline = time.Millisecond },
		"no history":       func(c *Config) { c.VerdictHistory = 0 },
		"bad embedded":     func(c *Config) { c.Embedded.Host = "localhost" },
		"backoff > max":    func(c *Config) { c.ResyncBackoff = time.Hour },
		"no resync tries":  func(c *Config) { c.ResyncAttempts = 0 },
		"no active limit":  func(c *Config) { c.MaxActiveRestores = 0 },
		"no logger":        func(c *Config) { c.Logger = nil; c.DataDir = "" },
		"zero join window": func(c *Config) { c.JoinTimeout = 0 },
	} {
		cfg := good
		mod(&cfg)
		if err := cfg.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: err = %v, want ErrConfig", name, err)
		}
	}
}

func TestLifecycle(t *testing.T) {
	c, err := New(testConfig(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	if err := c.Start(); !errors.Is(err, ErrStarted) {
		t.Fatalf("second Start: %v", err)
	}
	resp, err := http.Get("http://" + c.HTTPAddr() + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("healthz: %v %v", resp, err)
	}
	resp.Body.Close()
	resp, err = http.Get("http://" + c.HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"kvtier_coord_restores_active", "kvtier_index_objects", "kvtier_cluster_members"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	c.Shutdown()
	c.Shutdown() // idempotent
	if err := c.Start(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Start after Shutdown: %v", err)
	}
	// Shutdown of a coordinator never started.
	c2, err := New(testConfig(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	c2.Shutdown()
}

func TestIngestAcksAfterCommit(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	chunks := chain(ns, 8, 1)
	r := wire.Rank{Instance: "eng", TPRank: 0}
	b := storeBatch(r, 7, 0, ns, chunks, wire.L1)
	ack, werr := sendBatch(t, nc, c.subj, b)
	if werr != nil || ack.AppliedThrough != 8 || ack.Resync || ack.Fenced {
		t.Fatalf("ack = %+v, %v", ack, werr)
	}
	// Acknowledged means committed and visible: no waiting.
	for _, e := range b.Events {
		hs := c.idx.Get(e.Key)
		if len(hs) != 1 || hs[0].Sum != e.Sum || hs[0].Rank != r || hs[0].Tier != wire.L1 {
			t.Fatalf("after ack, %s holders = %+v", e.Key, hs)
		}
	}
	// A retransmission is a duplicate: same ack, nothing changes.
	ack, werr = sendBatch(t, nc, c.subj, b)
	if werr != nil || ack.AppliedThrough != 8 || ack.Resync {
		t.Fatalf("duplicate ack = %+v, %v", ack, werr)
	}
	// A superseded incarnation is fenced.
	b2 := storeBatch(r, 8, 0, ns, chunks[:1], wire.L2)
	if ack, werr = sendBatch(t, nc, c.subj, b2); werr != nil || ack.AppliedThrough != 1 {
		t.Fatalf("new incarnation ack = %+v, %v", ack, werr)
	}
	if ack, werr = sendBatch(t, nc, c.subj, storeBatch(r, 7, 8, ns, chunks[:1], wire.L1)); werr != nil || !ack.Fenced {
		t.Fatalf("stale incarnation ack = %+v, %v", ack, werr)
	}
	if got := testutil.Metric(t, c.reg, "kvtier_coord_rank_fences_total", "cause", "incarnation"); got != 1 {
		t.Errorf("incarnation fences = %v, want 1", got)
	}
	mustVerify(t, c)
}

func TestMalformedBatchIsRejectedAndServingContinues(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	good := storeBatch(r, 1, 0, ns, chain(ns, 2, 1), wire.L1)
	p, _ := good.MarshalBinary()
	for name, bad := range map[string][]byte{
		"garbage":   []byte("not a batch"),
		"truncated": p[:len(p)-3],
		"empty":     nil,
	} {
		if _, werr := sendRaw(t, nc, c.subj.Events(r), bad); werr == nil || werr.Code != wire.CodeBadRequest {
			t.Fatalf("%s: error = %v, want %s", name, werr, wire.CodeBadRequest)
		}
	}
	// A batch on another rank's subject is refused as unauthorized (C9).
	if _, werr := sendRaw(t, nc, c.subj.Events(wire.Rank{Instance: "eng", TPRank: 1}), p); werr == nil || werr.Code != wire.CodeUnauthorized {
		t.Fatalf("wrong subject: error = %v", werr)
	}
	if got := testutil.Metric(t, c.reg, "kvtier_coord_bad_requests_total", "op", "events"); got != 3 {
		t.Errorf("bad requests counted = %v, want 3", got)
	}
	if got := testutil.Metric(t, c.reg, "kvtier_coord_unauthorized_total", "subject", "events"); got != 1 {
		t.Errorf("unauthorized counted = %v, want 1", got)
	}
	ack, werr := sendBatch(t, nc, c.subj, good)
	if werr != nil || ack.AppliedThrough != 2 {
		t.Fatalf("good batch after bad ones: %+v, %v", ack, werr)
	}
	// Bad JSON requests get bad_request as well.
	callErr[wire.RegisterReply](t, nc, c.subj.Coord(wire.CoordRegister), map[string]any{"bogus": 1}, wire.CodeBadRequest)
	callErr[wire.RegisterReply](t, nc, c.subj.Coord(wire.CoordRegister), dcp.Spec{Model: "x"}, wire.CodeGeometry)
	mustVerify(t, c)
}

func TestGapResyncAgreesWithRank(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	// Unregistered: the simulated rank's objects (random sizes, 3 shards,
	// 2 groups) follow no spec's geometry, so none is checked.
	ns := dcp.Namespace{0x51, 0x5e}
	r := wire.Rank{Instance: "eng", TPRank: 1}
	sim := indextest.NewRank(r, 42, indextest.Keys(ns, 3, 200, 2, 1), 9)

	// The fake rank answers inventory requests, counting them and checking
	// that at most one is in flight.
	var requests, inflight, overlap atomic.Int32
	rankNC := connect(t, c)
	invs := make(chan wire.Inventory, 1)
	srv := newInventoryServer(7)
	sub, err := rankNC.Subscribe(c.subj.Inventory(r), func(m *nats.Msg) {
		if inflight.Add(1) > 1 {
			overlap.Add(1)
		}
		defer inflight.Add(-1)
		if srv.fresh(m) && requests.Add(1) == 1 {
			// The first request fails: the coordinator must retry.
			_ = bus.RespondError(m, wire.CodeUnavailable, "busy")
			return
		}
		srv.serve(m, func() wire.Inventory {
			inv := <-invs
			invs <- inv
			return inv
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()

	b1 := sim.Next(50)
	if ack, werr := sendBatch(t, nc, c.subj, &b1); werr != nil || ack.AppliedThrough != 50 {
		t.Fatalf("b1: %+v %v", ack, werr)
	}
	_ = sim.Next(30) // lost in transit
	b3 := sim.Next(20)
	invs <- sim.Inventory() // what the rank holds as of seq 100
	ack, werr := sendBatch(t, nc, c.subj, &b3)
	if werr != nil || !ack.Resync || ack.AppliedThrough != 50 {
		t.Fatalf("b3 past the gap: %+v %v", ack, werr)
	}
	// A batch past the gap while the resync runs starts no second worker
	// (no overlap below); at most it asks the running one for one more
	// round, for events that raced past its inventory.
	sendBatch(t, nc, c.subj, &b3)
	// The batch during the resync may cost one more round, whose streamed
	// inventory hides the rank's placements while it runs: compare only once
	// no round is running (a CI run read the index in the middle of one).
	resyncRunning := func() bool {
		c.drainMu.Lock()
		defer c.drainMu.Unlock()
		_, running := c.resyncing[r]
		return running
	}
	testutil.Eventually(t, 5*time.Second, "the inventory to be applied and the resyncs to finish", func() bool {
		if resyncRunning() {
			return false
		}
		info, err := c.idx.ListRank(r) // all of it: see TestResyncPagedInventory
		return err == nil && info.LastSeq == sim.Seq && !info.Fenced && len(info.Placements) == len(sim.Inventory().Objects)
	})
	info, _ := c.idx.ListRank(r)
	if want := sim.Inventory().Objects; !slices.Equal(info.Placements, want) {
		t.Fatalf("index holds %d placements, rank %d", len(info.Placements), len(want))
	}
	if overlap.Load() != 0 {
		t.Fatalf("%d inventory requests overlapped", overlap.Load())
	}
	if got := testutil.Metric(t, c.reg, "kvtier_coord_event_gaps_total"); got < 1 {
		t.Errorf("gaps counted = %v", got)
	}
	if ok := testutil.Metric(t, c.reg, "kvtier_coord_resyncs_total", "outcome", "ok"); ok < 1 {
		t.Errorf("%v resyncs counted ok, want 1 or 2", ok)
	}
	if ok := testutil.Metric(t, c.reg, "kvtier_coord_resyncs_total", "outcome", "ok"); ok > 2 {
		t.Errorf("%v resyncs for one gap and one batch during it, want 1 or 2", ok)
	}
	// Events continue from the inventory's sequence.
	b4 := sim.Next(10)
	if ack, werr := sendBatch(t, nc, c.subj, &b4); werr != nil || ack.AppliedThrough != sim.Seq || ack.Resync {
		t.Fatalf("b4 after resync: %+v %v", ack, werr)
	}
	info, _ = c.idx.ListRank(r)
	if want := sim.Inventory().Objects; !slices.Equal(info.Placements, want) {
		t.Fatalf("after b4, index holds %d placements, rank %d", len(info.Placements), len(want))
	}
	mustVerify(t, c)
}

func TestResyncGivesUpAndCounts(t *testing.T) {
	c := startCoord(t, func(cfg *Config) {
		cfg.ResyncAttempts = 3
		cfg.ResyncTimeout = 50 * time.Millisecond
	})
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "gone", TPRank: 0}
	// Nobody answers the inventory request.
	if ack, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 5, ns, chain(ns, 1, 1), wire.L1)); werr != nil || !ack.Resync {
		t.Fatalf("batch past a gap: %+v %v", ack, werr)
	}
	testutil.Eventually(t, 10*time.Second, "the resync to fail", func() bool {
		return testutil.Metric(t, c.reg, "kvtier_coord_resyncs_total", "outcome", "failed") == 1
	})
	if got := testutil.Metric(t, c.reg, "kvtier_coord_resync_attempts_total"); got != 3 {
		t.Errorf("attempts = %v, want 3", got)
	}
}

// mustVerify checks the coordinator's index re-derives to its live state.
func mustVerify(t testing.TB, c *Coordinator) {
	t.Helper()
	rep, err := c.idx.Verify(tctx(t))
	if err != nil {
		for _, p := range rep.Problems {
			t.Log(p)
		}
		t.Fatalf("verify: %v", err)
	}
}

// TestStartsWithUnreachableSeeds: no seed answering is logged, not fatal.
func TestStartsWithUnreachableSeeds(t *testing.T) {
	c := startCoord(t, func(cfg *Config) {
		cfg.Cluster.Seeds = []string{"127.0.0.1:1"}
		cfg.JoinTimeout = 200 * time.Millisecond
	})
	nc := connect(t, c)
	register(t, nc, c.subj, testSpec(1))
}

// A new incarnation's first batch triggers a resync: its inventory replaces
// every placement of the rank, so L2 placements of files lost while it was
// down (which its rescan cannot announce) leave the index.
func TestNewIncarnationResyncDropsLostL2(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	r := wire.Rank{Instance: "eng", TPRank: 0}
	chunks := chain(ns, 4, 3)
	if ack, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, 0, ns, chunks, wire.L2)); werr != nil || ack.AppliedThrough != 4 {
		t.Fatalf("first incarnation: %+v %v", ack, werr)
	}
	// Restarted: only chunks 0 and 1 still have files; its rescan announces them.
	b := storeBatch(r, 2, 0, ns, chunks[:2], wire.L2)
	requests := serveInventory(t, c, r, inventoryOf(r, 2, 2, b.Events))
	if ack, werr := sendBatch(t, nc, c.subj, b); werr != nil || ack.AppliedThrough != 2 {
		t.Fatalf("new incarnation: %+v %v", ack, werr)
	}
	testutil.Eventually(t, 5*time.Second, "the stale L2 placements to leave the index", func() bool {
		info, err := c.idx.ListRank(r)
		return err == nil && info.L2Placements == 2 && !info.Partial // its counts include a streamed inventory's pages so far
	})
	for i, ch := range chunks {
		k := dcp.Key{NS: ns, Chunk: ch}
		if held := len(c.idx.Get(k)) > 0; held != (i < 2) {
			t.Errorf("chunk %d held = %v after the resync", i, held)
		}
	}
	if requests.Load() < 1 {
		t.Fatal("no inventory was requested")
	}
	mustVerify(t, c)
}

// A rank whose inventory spans many pages resyncs from pages of one
// snapshot; a page that does not belong to the snapshot fails the attempt
// and the retry assembles the whole inventory: the index then agrees with
// the rank exactly.
func TestResyncPagedInventory(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := dcp.Namespace{0x51, 0x5f} // unregistered: see TestGapResyncAgreesWithRank
	r := wire.Rank{Instance: "big", TPRank: 0}
	sim := indextest.NewRank(r, 7, indextest.Keys(ns, 3, 400, 2, 1), 11)

	const pageSize = 16
	var snapshots, pageReqs atomic.Int32
	var invMu sync.Mutex
	var inv wire.Inventory
	srv := newInventoryServer(pageSize)
	sub, err := connect(t, c).Subscribe(c.subj.Inventory(r), func(m *nats.Msg) {
		pageReqs.Add(1)
		if srv.fresh(m) {
			snapshots.Add(1)
		}
		req, _ := decodeInventoryRequest(m)
		if snapshots.Load() == 1 && req.Page == 3 {
			// The first attempt gets a page of another snapshot.
			_ = bus.Respond(m, &wire.InventoryPage{Rank: r, Incarnation: 7, Seq: 1, Snapshot: "other", Page: 3, Pages: 99})
			return
		}
		srv.serve(m, func() wire.Inventory {
			invMu.Lock()
			defer invMu.Unlock()
			return inv
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()

	b1 := sim.Next(100)
	if ack, werr := sendBatch(t, nc, c.subj, &b1); werr != nil || ack.AppliedThrough != 100 {
		t.Fatalf("b1: %+v %v", ack, werr)
	}
	_ = sim.Next(300) // lost in transit
	b3 := sim.Next(50)
	invMu.Lock()
	inv = sim.Inventory()
	invMu.Unlock()
	if len(inv.Objects) <= 4*pageSize {
		t.Fatalf("inventory of %d objects fits in 4 pages of %d; the test needs more", len(inv.Objects), pageSize)
	}
	if ack, werr := sendBatch(t, nc, c.subj, &b3); werr != nil || !ack.Resync {
		t.Fatalf("b3 past the gap: %+v %v", ack, werr)
	}
	// The index publishes a large commit in slices (index.publishSlice):
	// the rank's sequence can be visible a moment before all its chunks.
	testutil.Eventually(t, 10*time.Second, "the paged inventory to be applied", func() bool {
		info, err := c.idx.ListRank(r)
		return err == nil && info.LastSeq == sim.Seq && !info.Fenced && len(info.Placements) == len(inv.Objects)
	})
	info, _ := c.idx.ListRank(r)
	if !slices.Equal(info.Placements, inv.Objects) {
		t.Fatalf("index holds %d placements, rank %d", len(info.Placements), len(inv.Objects))
	}
	if snapshots.Load() < 2 {
		t.Errorf("%d snapshots taken; the bad page should have failed the first attempt", snapshots.Load())
	}
	if want := int32(4 + (len(inv.Objects)+pageSize-1)/pageSize); pageReqs.Load() < want {
		t.Errorf("%d page requests, want at least %d", pageReqs.Load(), want)
	}
	mustVerify(t, c)
}

// Batches of one rank sent back to back without waiting (rankd's publisher
// window) are all applied, in order, and acknowledged in the order they
// were sent, each only once committed; a duplicate in the stream is
// acknowledged with the sequence reached so far and changes nothing.
func TestIngestPipelinedBatchesAckInOrder(t *testing.T) {
	const ranks, batches, per = 2, 24, 8
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(ranks))
	subs := make([]*nats.Subscription, ranks)
	sent := make([][]*wire.Batch, ranks)
	for tp := range ranks {
		r := wire.Rank{Instance: "eng", TPRank: tp}
		inbox := nc.NewRespInbox()
		sub, err := nc.SubscribeSync(inbox)
		if err != nil {
			t.Fatal(err)
		}
		subs[tp] = sub
		for bi := range batches {
			sent[tp] = append(sent[tp], storeBatch(r, 1, uint64(bi*per), ns, chain(ns, per, uint32(1000*tp+bi)), wire.L1))
		}
		// The duplicate of batch 5 goes out right after batch 6.
		order := append(slices.Clone(sent[tp][:7]), sent[tp][5])
		order = append(order, sent[tp][7:]...)
		sent[tp] = order
	}
	for bi := range batches + 1 {
		for tp := range ranks {
			p, err := sent[tp][bi].MarshalBinary()
			if err != nil {
				t.Fatal(err)
			}
			if err := nc.PublishRequest(c.subj.Events(sent[tp][bi].Rank), subs[tp].Subject, p); err != nil {
				t.Fatal(err)
			}
		}
	}
	for tp := range ranks {
		reached := uint64(0)
		for bi, b := range sent[tp] {
			msg, err := subs[tp].NextMsg(10 * time.Second)
			if err != nil {
				t.Fatalf("rank %d ack %d: %v", tp, bi, err)
			}
			var rep wire.Reply[wire.EventAck]
			if err := json.Unmarshal(msg.Data, &rep); err != nil || rep.OK == nil {
				t.Fatalf("rank %d ack %d = %q (%v)", tp, bi, msg.Data, err)
			}
			reached = max(reached, b.Events[len(b.Events)-1].Seq)
			if got := rep.OK; got.AppliedThrough != reached || got.Resync || got.Fenced {
				t.Fatalf("rank %d ack %d = %+v, want applied through %d", tp, bi, *got, reached)
			}
			for _, e := range b.Events { // acknowledged means visible
				if hs := c.idx.Get(e.Key); len(hs) != 1 || hs[0].Sum != e.Sum {
					t.Fatalf("rank %d ack %d: %s holders = %+v", tp, bi, e.Key, hs)
				}
			}
		}
	}
	st := c.idx.Stats()
	if st.Objects != ranks*batches*per {
		t.Errorf("objects = %d, want %d", st.Objects, ranks*batches*per)
	}
	mustVerify(t, c)
}

// A binary lookup request is answered exactly like the same request as
// JSON (detail included), by any of the queue-group subscribers; a
// malformed one gets bad_request and serving continues.
func TestLookupBinaryMatchesJSON(t *testing.T) {
	c := startCoord(t, nil)
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(2))
	chunks := chain(ns, 6, 3)
	for tp := range 2 {
		sendBatch(t, nc, c.subj, storeBatch(wire.Rank{Instance: "eng", TPRank: tp}, 1, 0, ns, chunks[:4+tp], wire.L1))
	}
	subject := c.subj.Coord(wire.CoordLookup)
	for _, req := range []wire.LookupRequest{
		{Namespace: ns, Chunks: chunks, Instance: "eng"},
		{Namespace: ns, Chunks: chunks, Instance: "eng", Detail: true},
		{Namespace: ns, Chunks: chunks},
		{Namespace: dcp.Namespace{1}, Chunks: chunks},
	} {
		js, _ := json.Marshal(req)
		bin, err := req.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		for range 8 { // every subscriber of the queue group, most likely
			a, err := nc.RequestWithContext(tctx(t), subject, js)
			if err != nil {
				t.Fatal(err)
			}
			b, err := nc.RequestWithContext(tctx(t), subject, bin)
			if err != nil {
				t.Fatal(err)
			}
			if string(a.Data) != string(b.Data) {
				t.Fatalf("JSON lookup answered %s, binary %s", a.Data, b.Data)
			}
		}
	}
	rep := call[wire.LookupReply](t, nc, subject, wire.LookupRequest{Namespace: ns, Chunks: chunks, Instance: "eng"})
	if rep.Prefix != 4 {
		t.Fatalf("prefix %d, want 4", rep.Prefix)
	}
	m, err := nc.RequestWithContext(tctx(t), subject, []byte("KVL1\x00trunc"))
	if err != nil {
		t.Fatal(err)
	}
	var bad wire.Reply[wire.LookupReply]
	if err := json.Unmarshal(m.Data, &bad); err != nil || bad.Error == nil || bad.Error.Code != wire.CodeBadRequest {
		t.Fatalf("truncated binary lookup answered %s", m.Data)
	}
}
