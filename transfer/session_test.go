package transfer

import (
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kvtier/kvtier/wire"
)

// TestSecondRegistrationSupersedes is the root cause of issue 14: two
// engine processes register the same namespace (the same instance). On the
// unfixed code the first engine's store, naming only the namespace, was
// gathered from the second engine's pools and committed under the first
// engine's chunk hash (seen failing: "byte 20992 (block 2, page offset 0)
// = 0x24, want 0xd9" on the restore of that chunk). Now the second
// registration supersedes the first session: the first engine's store and
// retrieve are refused as stale, nothing is read or written in either
// engine's pools, and the second engine's session works.
func TestSecondRegistrationSupersedes(t *testing.T) {
	dev := openDevice(t, "")
	ra := newRig(t, dev, c1Spec(), []int64{8})
	rb := newRig(t, dev, c1Spec(), []int64{8})
	core, logs := observer.New(zap.WarnLevel)
	cfg := engineConfig(t, dev, 0, 1)
	cfg.Logger = zap.New(core)
	e := newEngine(t, cfg)
	ra.register(e)
	rb.register(e)
	if ra.session == rb.session || wire.CheckSessionID(ra.session) != nil || wire.CheckSessionID(rb.session) != nil {
		t.Fatalf("session ids %q and %q: want two distinct 32-hex ids", ra.session, rb.session)
	}
	if n := logs.FilterMessageSnippet("superseded the live session").Len(); n != 1 {
		t.Fatalf("%d supersession warnings, want 1", n)
	}
	if n := e.Sessions(); n != 1 {
		t.Fatalf("%d live sessions, want 1", n)
	}

	c := ra.newChunk(0, ra.consecutiveN(0))
	ra.write(c, c.blocks, 0)
	_, h := ra.record()
	_, err := e.Store(testCtx(t), ra.storeReq("a", h, c))
	if !errors.Is(err, ErrStaleSession) || !strings.Contains(err.Error(), "superseded by session "+rb.session) {
		t.Fatalf("store of the superseded session = %v, want ErrStaleSession naming session %s", err, rb.session)
	}
	_, err = e.Retrieve(testCtx(t), ra.retrieveReq(0, []chunk{c}, [][][]int64{ra.consecutiveN(1)}))
	if !errors.Is(err, ErrStaleSession) {
		t.Fatalf("retrieve of the superseded session = %v, want ErrStaleSession", err)
	}
	if err := e.Release(ra.res.Namespace, ra.session, ""); !errors.Is(err, ErrStaleSession) {
		t.Fatalf("release of the superseded session = %v, want ErrStaleSession", err)
	}
	if st := e.Stats(); st.ObjectsStored != 0 || st.BytesStoredL1 != 0 || st.BytesRetrievedL1 != 0 {
		t.Fatalf("stats after refused requests: %+v", st)
	}

	// The live session stores and restores its own bytes.
	cb := rb.newChunk(1, rb.consecutiveN(2))
	rb.write(cb, cb.blocks, 0)
	_, hb := rb.record()
	f, err := e.Store(testCtx(t), rb.storeReq("b", hb, cb))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := f.Wait(testCtx(t)); err != nil || res.Objects[0].Status != Stored {
		t.Fatalf("store of the live session: %+v %v", res, err)
	}
	tgt := rb.consecutiveN(3)
	rr, err := e.Retrieve(testCtx(t), rb.retrieveReq(0, []chunk{cb}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve of the live session: %+v %v", rr, err)
	}
	rb.expectRestored(cb, tgt)
	ra.check("engine A's pools after its refused requests")
	rb.check("engine B's pools")
}

// TestSupersededSessionDrainsOnItsOwnPools: a store of the first session
// is in flight (its producer is late) when a second registration of the
// namespace supersedes it; the store still gathers from the first engine's
// pools and commits the first engine's bytes, and those pools are released
// only after it.
func TestSupersededSessionDrainsOnItsOwnPools(t *testing.T) {
	dev := openDevice(t, "")
	ra := newRig(t, dev, c1Spec(), []int64{8})
	rb := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	ra.register(e)
	e.mu.Lock()
	old := e.sess.byNS[ra.res.Namespace]
	e.mu.Unlock()
	c := ra.newChunk(0, ra.consecutiveN(0))
	ra.write(c, c.blocks, 300*time.Millisecond)
	_, h := ra.record()
	f, err := e.Store(testCtx(t), ra.storeReq("a", h, c))
	if err != nil {
		t.Fatal(err)
	}
	rb.register(e) // supersedes while the store waits on its producer
	res, err := f.Wait(testCtx(t))
	if err != nil || res.Objects[0].Status != Stored {
		t.Fatalf("in-flight store of the superseded session: %+v %v", res, err)
	}
	if err := e.WaitRequest(testCtx(t), "a"); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	released := old.pools == nil && old.refs == 0 && old.retired
	e.mu.Unlock()
	if !released {
		t.Fatal("the superseded session's imports are not released after its last store")
	}
	// Restored into the new engine's pools: the first engine's bytes.
	tgt := rb.consecutiveN(1)
	rr, err := e.Retrieve(testCtx(t), rb.retrieveReq(0, []chunk{c}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) {
		t.Fatalf("retrieve: %+v %v", rr, err)
	}
	rb.expectRestored(c, tgt)
	rb.check("engine B's pools after restoring engine A's chunk")
	ra.check("engine A's pools")
}

// TestUnknownSession: a request naming no session, a malformed one, or a
// well-formed one this engine never issued is refused as unknown; nothing
// is written.
func TestUnknownSession(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	c := r.newChunk(0, r.consecutiveN(0))
	r.write(c, c.blocks, 0)
	_, h := r.record()
	live := r.session
	for _, tc := range []struct{ session, want string }{
		{"", "names no session"},
		{"0123", "session id of 4 characters, want 32"},
		{strings.Repeat("A", 32), "want lowercase hex"},
		{strings.Repeat("ab", 16), "never issued by this rank"},
	} {
		r.session = tc.session
		_, err := e.Store(testCtx(t), r.storeReq("x", h, c))
		if !errors.Is(err, ErrUnknownSession) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("store with session %q = %v, want ErrUnknownSession naming %q", tc.session, err, tc.want)
		}
		_, err = e.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{r.consecutiveN(1)}))
		if !errors.Is(err, ErrUnknownSession) {
			t.Errorf("retrieve with session %q = %v, want ErrUnknownSession", tc.session, err)
		}
		if err := e.Release(r.res.Namespace, tc.session, ""); !errors.Is(err, ErrUnknownSession) {
			t.Errorf("release with session %q = %v, want ErrUnknownSession", tc.session, err)
		}
	}
	// A live session of another namespace is not this namespace's.
	r.session = live
	req := r.storeReq("x", h, c)
	req.Namespace[0] ^= 1
	if _, err := e.Store(testCtx(t), req); !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), "serves namespace") {
		t.Errorf("store naming another namespace = %v", err)
	}
	r.check("after unknown-session requests")
}

// TestReleasedSessionIsStale: after a release every request of the
// session is refused as stale, and a new registration gets a new session.
func TestReleasedSessionIsStale(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	r.register(e)
	first := r.session
	if err := e.Release(r.res.Namespace, first, ""); err != nil {
		t.Fatal(err)
	}
	c := r.newChunk(0, r.consecutiveN(0))
	r.write(c, c.blocks, 0)
	_, h := r.record()
	if _, err := e.Store(testCtx(t), r.storeReq("x", h, c)); !errors.Is(err, ErrStaleSession) || !strings.Contains(err.Error(), "was released") {
		t.Fatalf("store of a released session = %v", err)
	}
	if err := e.Release(r.res.Namespace, first, ""); !errors.Is(err, ErrStaleSession) {
		t.Fatalf("second release = %v", err)
	}
	r.register(e)
	if r.session == first {
		t.Fatal("a new registration reused the released session id")
	}
	if e.Sessions() != 1 {
		t.Fatalf("%d live sessions", e.Sessions())
	}
	r.check("after a released session's store")
}

// TestOtherOwnerRefused: while a session is live, another engine identity
// may neither register the namespace nor use or release the session: a
// store or retrieve it sends is refused where the engine finds the session
// (STYLE 32), before anything is imported or placed; the owner's session
// keeps working.
func TestOtherOwnerRefused(t *testing.T) {
	dev := openDevice(t, "")
	ra := newRig(t, dev, c1Spec(), []int64{8})
	rb := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	sa, err := e.Register(testCtx(t), ra.registration(), "engine/a")
	if err != nil {
		t.Fatal(err)
	}
	ra.session, ra.caller = sa.ID, "engine/a"
	_, err = e.Register(testCtx(t), rb.registration(), "engine/b")
	if !errors.Is(err, ErrUnauthorized) || !strings.Contains(err.Error(), `live session `+sa.ID+` of engine "engine/a", the caller is "engine/b"`) {
		t.Fatalf("registration by another identity = %v", err)
	}
	c0 := ra.newChunk(0, ra.consecutiveN(1))
	ra.write(c0, c0.blocks, 0)
	_, h0 := ra.record()
	for _, caller := range []string{"engine/b", ""} {
		sr := ra.storeReq("other", h0, c0)
		sr.Caller = caller
		if _, err := e.Store(testCtx(t), sr); !errors.Is(err, ErrUnauthorized) ||
			!strings.Contains(err.Error(), `belongs to engine "engine/a", the caller is "`+caller+`"`) {
			t.Fatalf("Store by %q = %v", caller, err)
		}
		rr := ra.retrieveReq(0, []chunk{c0}, [][][]int64{ra.consecutiveN(2)})
		rr.Caller = caller
		if _, err := e.Retrieve(testCtx(t), rr); !errors.Is(err, ErrUnauthorized) {
			t.Fatalf("Retrieve by %q = %v", caller, err)
		}
	}
	if st := e.Stats(); st.StoresInflight != 0 || st.ObjectsStored != 0 {
		t.Fatalf("refused stores left work: %+v", st)
	}
	if err := e.Release(ra.res.Namespace, sa.ID, "engine/b"); !errors.Is(err, ErrUnauthorized) {
		t.Fatalf("Release(other) = %v", err)
	}
	// The owner's re-registration supersedes (its restart).
	sa2, err := e.Register(testCtx(t), ra.registration(), "engine/a")
	if err != nil || sa2.Superseded != sa.ID {
		t.Fatalf("owner re-registration: %+v %v", sa2, err)
	}
	ra.session = sa2.ID
	c := ra.newChunk(0, ra.consecutiveN(0))
	ra.write(c, c.blocks, 0)
	_, h := ra.record()
	f, err := e.Store(testCtx(t), ra.storeReq("a", h, c))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	rb.check("engine B's pools were never imported")
}

// TestBlockBoundsOfTheSession: block ids are checked against the pools of
// the request's own session, before any copy; the refusal names the
// numbers.
func TestBlockBoundsOfTheSession(t *testing.T) {
	dev := openDevice(t, "")
	big := newRig(t, dev, c1Spec(), []int64{16})
	small := newRig(t, dev, c1Spec(), []int64{8})
	e := newEngine(t, engineConfig(t, dev, 0, 1))
	big.register(e)
	c := big.newChunk(0, big.consecutiveN(6)) // blocks 12, 13
	big.write(c, c.blocks, 0)
	_, h := big.record()
	f, err := e.Store(testCtx(t), big.storeReq("a", h, c))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	small.register(e)
	// Blocks 12 and 13 were in the big engine's pools, not in the small one's.
	rq := small.retrieveReq(0, []chunk{c}, [][][]int64{small.consecutiveN(6)})
	_, err = e.Retrieve(testCtx(t), rq)
	if !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), "block id 12: page [125952, 136448) lies outside the 83968 B pool (8 blocks)") {
		t.Fatalf("retrieve past the session's pool = %v", err)
	}
	_, h2 := small.record()
	_, err = e.Store(testCtx(t), small.storeReq("b", h2, c))
	if !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), "block id 12") {
		t.Fatalf("store past the session's pool = %v", err)
	}
	rq = small.retrieveReq(0, []chunk{c}, [][][]int64{{{-1, 0}}})
	if _, err := e.Retrieve(testCtx(t), rq); !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), "-1") {
		t.Fatalf("retrieve of a negative block = %v", err)
	}
	small.check("small engine's pools after refused requests")
}
