// Package rankd is the per-GPU kvtier daemon: it opens its device, runs the
// rank's transfer engine (package transfer), serves the engine API (register,
// store, retrieve, release, status) and the inventory over NATS
// request/reply, publishes the engine's placement events to the coordinator
// in order and waits for their durable acknowledgment, reports restore
// results to the coordinator, and joins the memberlist cluster with its rank
// identity and incarnation.
//
// It owns the process-level glue only: it never interprets geometry beyond
// validating requests (dcp does), never moves bytes itself (transfer does)
// and never decides whether a restore is complete (the coordinator does).
// Bad input gets an error reply with a stable wire code; the daemon keeps
// serving.
package rankd
