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
// Every goroutine is started through one of its groups (internal/group:
// Coordinator.ingestGroup for the ingest workers and ackers,
// Coordinator.goroutines for the rest; replica.Node and replica.Transport
// hold their own), which Shutdown closes before it waits: a goroutine asked
// for after that is refused, and the caller answers or drops the work
// itself.
// It never moves KV bytes and never decides a restore outside the index's
// verdict state machine. Unless configured insecure it accepts only the
// identities of its credentials directory (C9, auth.go): a batch,
// heartbeat or report whose body names another rank than its subject, or
// an engine request naming another instance, is refused and counted, never
// applied.
//
// Lookups and restore begins (the vLLM connector's lookup) arrive on a NATS
// connection of their own (never behind the event stream) and are answered
// by a pool of workers fed from one queue (lookupWorkPool), a begin
// preparing its plan outside the restore table's lock; both read the index
// without waiting for its committer (index/chunkmap.go), from JSON or
// binary requests (wire/lookup.go). Event batches are queued into the index
// in arrival order per rank and acknowledged in that order once committed,
// so a rank's in-flight batches share group commits. restore.begin answers
// a JSON or binary plan (wire/plan.go) and refuses one that cannot fit a
// message before the restore exists.
//
// # Packages
//
// The raft side of replicated mode (config, command codec, state machine,
// log store, transport, snapshots) is package replica; the admin replies,
// tables and the client side of the cluster-wide raft queries are package
// admin. Neither imports this package. The coordinator reaches raft only
// through its replicator (replicator.go): standalone writes the index
// directly, replicated (replicated.go) proposes through a replica.Node and
// holds the leader gate.
//
// # Locks
//
// Locks, outermost first (a lock is only taken while holding locks above
// it in this list):
//
//  1. Coordinator.lifeMu: started, closed. Held by Start across the whole
//     start-up (NATS connect, index open, cluster join, raft start), by
//     Shutdown's first step and by ReloadAuth; no handler takes it.
//  2. Coordinator.ingestMu (read by dispatchBatch while it queues a batch,
//     written by Shutdown when it closes the queues).
//  3. replicated.mu: the leader gate's subscriptions and the leadership
//     term's context (replicator.term). Held while the leader subscribes
//     its handlers (and flushes the connections), and across
//     afterGainLeadership, which takes drainMu; term takes it alone.
//  4. Coordinator.drainMu: draining, resyncing, resyncLimit.
//  5. restores.mu: the restore table. admit judges reader liveness under
//     it (liveTable.mu, below, and the index's own read paths); verdicts
//     are delivered and waiters answered after it is released.
//  6. Leaves, nothing taken under them: liveTable.mu, heartbeats.mu,
//     geometries.mu, deaths.mu (the death check reads the index before
//     it takes deaths.mu, and acts after releasing it), rankBudgets.mu,
//     and rankBudget.mu (a rank's budget: the index's read paths Rank,
//     BatchGrowth and MinObjectSize are taken under it, nothing of the
//     coordinator; budget.go), and the goroutine groups' own mutex
//     (internal/group; Go takes it under drainMu when a resync or the
//     leader's fence sweep starts).
//
// The index's locks and raft's are theirs (index/doc.go, hashicorp/raft)
// and are only ever taken inside the calls above, never around a
// coordinator lock; replica.Transport.liveMu is a leaf of package replica.
//
// No lock is held across a NATS request (inventory fetches, the raft admin
// queries), across a KV event publish (kvevents.go: its worker owns its
// state and takes no coordinator lock, only replicator.term's), across a
// wait for another coordinator, or across a raft Apply:
// batches are proposed and waited on by the ingest acker without a lock,
// fences and inventories are proposed by their caller without one, and the
// COMPLETE check (raft.VerifyLeader) runs after restores.mu is released.
// A fence and an inventory requested before it are ordered by the index,
// not by a coordinator lock: the rank's fence generation (durable, moved
// by every fence, on every replica) is read before the inventory request
// and checked when the inventory is applied (resync.go resyncOnce,
// index.ApplyInventoryAt); a resync ends with the leadership term it was
// started in.
package coordinator
