// Package coordinator is kvtier's coordinator: it joins the memberlist
// cluster, keeps the durable bbolt placement index (package index) fed from
// the ranks' event batches, answers lookups, runs the restore protocol (C5)
// on the index's pure verdict state machine, fences the L1 placements of
// ranks that die or leave (C7), and serves admin queries, all over NATS
// request/reply. By default it embeds the NATS server, so one coordinator is
// a working cluster.
//
// It acknowledges nothing before the index has committed it (C7), counts and
// logs every dropped event, fence, timeout and failed restore (C8), and owns
// every goroutine it starts: Shutdown stops them all, in a documented order.
// It never moves KV bytes and never decides a restore outside the index's
// verdict state machine. Unless configured insecure it accepts only the
// identities of its credentials directory (C9, auth.go): a batch,
// heartbeat or report whose body names another rank than its subject, or
// an engine request naming another instance, is refused and counted, never
// applied.
//
// Lookups are answered by several subscribers of one NATS queue group
// (lookupSubscribers) on a NATS connection of their own (never behind the
// event stream), reading the index without waiting for its committer
// (index/chunkmap.go), from JSON or binary requests (wire/lookup.go). Event batches are queued into the index
// in arrival order per rank and acknowledged in that order once committed,
// so a rank's in-flight batches share group commits. restore.begin answers
// a JSON or binary plan (wire/plan.go) and refuses one that cannot fit a
// message before the restore exists.
package coordinator
