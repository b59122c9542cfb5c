// Package rankd is the per-GPU kvtier daemon: it opens its device, runs the
// rank's transfer engine (package transfer), serves the engine API (register,
// store, retrieve, release, status) and the inventory over NATS
// request/reply, publishes the engine's placement events to the coordinator
// in order and waits for their durable acknowledgment (pulling each batch
// from the engine's event buffer, the only queue, when its window of
// unacknowledged batches has room, and acknowledging it back to the engine
// only after the coordinator did), reports restore
// results to the coordinator, and joins the memberlist cluster with its rank
// identity and incarnation.
//
// It owns the process-level glue only: it never interprets geometry beyond
// validating requests (dcp does), never moves bytes itself (transfer does)
// and never decides whether a restore is complete (the coordinator does).
// Bad input gets an error reply with a stable wire code; the daemon keeps
// serving.
//
// Its goroutines are started through its groups (internal/group):
// Daemon.requests for the engine requests being served, closed when
// Shutdown begins (a request refused by it is answered unavailable), and
// Daemon.goroutines for the others, closed in Shutdown's last phase and
// waited for before the connection closes.
//
// # Engine sessions
//
// Every engine.register that succeeds opens a session: the rankd imports
// that registration's pools for it alone and answers a random 128-bit
// session id (wire.RegisterReply.Session, 32 hex characters). Every store,
// retrieve and release names the session; the rankd serves it only against
// that session's own pools, and checks every block id against that
// session's pool geometry before any copy. A session's imports are
// released only after its last store or retrieve in flight has finished.
//
// Policy for a second registration of a namespace on this rank (the same
// instance):
//   - From the engine identity that owns the live session (an engine
//     restart, or a second process of the instance): the new registration
//     supersedes the old session. The old session's stores and retrieves in
//     flight drain against the old session's pools; every later request
//     naming the old session is refused with stale_session. Each
//     supersession is counted (kvtier_rankd_engine_sessions_superseded_total)
//     and logged at Warn.
//   - From another identity while a session is live: refused with
//     unauthorized. After the owner released its session, anyone entitled to
//     the instance may register.
//
// A request naming a session this rank never issued (or none) is refused
// with unknown_session, one from another identity than the session's owner
// with unauthorized; a released session is stale. No request is ever served
// against another session's pools, so no object is committed from pages
// its store did not name and no retrieve writes outside its own engine's
// pools. The engine identity comes from the connection layer
// (Config.EngineIdentity); by default it is "engine/<instance>", the only
// identity NATS lets publish on this rank's engine subjects.
//
// # Locks
//
// Locks, outermost first (a lock is only taken while holding locks above
// it): publisher.mu, then the transfer engine's Engine.mu (the publisher
// takes and acknowledges the engine's event batches under its own lock;
// the engine never calls the publisher). Daemon.mu (lifecycle flags, the
// NATS connection and subscriptions) and the small leaf locks (regDedup,
// snapshots, indexWatch, trust, stageRecorder) are taken alone: nothing
// else is locked while one is held. No lock is held across a NATS request
// or a wait for the device; publisher.mu is held while the run goroutine
// hands a batch to the NATS client (a buffered publish whose reply arrives
// on a subscription, never waited for under the lock).
package rankd
