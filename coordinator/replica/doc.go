// Package replica keeps several coordinators' indexes identical through
// hashicorp/raft (issue 16): the configuration of replicated mode, the
// command codec, raft's state machine (the index itself), its log and
// stable store (raft.db), the raft transport (mutual TLS 1.3 with the
// cluster CA, each peer's certificate naming its raft server id:
// transport.go) and the snapshots. Node is one raft server; the coordinator drives it through
// its replicator seam (coordinator/replicated.go) and decides what a
// leader serves. A single coordinator never builds a Node.
//
// It owns nothing of the coordinator: it never imports package
// coordinator, never touches NATS, never decides a restore, and never
// writes the index except by applying committed raft entries
// (index.ApplyReplicated). Its errors wrap its own sentinels (errors.go);
// the coordinator aliases ErrNotLeader.
//
// # What is replicated
//
// Every request that mutates the index is a raft log entry, and nothing
// else writes it: event batches (the wire.Batch binary encoding), rank
// inventories (resyncs: one entry per page, index.InventoryStep), fences (memberlist deaths and leaves, new
// incarnations' old L1 copies are fenced by the batch itself, the startup
// and leader sweeps), namespace registrations and operator rank resets.
// Restore state (plans, reports, verdicts) is not: it lives on the leader
// only, and restores in flight at a failover end failed (below). An entry
// is one command byte and its payload; it carries no time and no random
// value, and the index's apply (index/txn.go) reads neither, so every
// replica that applies the same entries in the same order holds the same
// index, byte for byte in index.Dump (rank ids are assigned in apply order).
//
// # Applying it
//
// The state machine is the index itself. raft hands committed entries to
// fsm.ApplyBatch (raft.BatchingFSM, up to MaxAppendEntries at once),
// which queues each into the index's committer (index.ApplyReplicated)
// without waiting: the committer's group commit merges many entries into
// one bbolt transaction, and while bbolt fsyncs one group raft already
// delivers the next, so a replica pays two fsyncs per group of batches
// (raft log, index), not per batch. The raft index of the last entry of a
// group is written in the same bbolt transaction as the group (meta
// "raft_applied"); on a restart raft replays its log from its last
// snapshot and the index skips every entry at or below that index, so no
// entry is applied twice (a replayed fence would otherwise fence a rank
// that has resynced since).
//
// # Snapshots
//
// raft's FSM.Snapshot takes an index.Snapshot at a barrier of the
// committer (a bbolt read transaction: a consistent copy of the whole file
// as of the last entry raft handed over), and Persist streams it with
// tx.WriteTo behind a header naming its raft index. Restore writes the
// stream beside the index file, fsyncs and load-checks it, and replaces
// and reopens the index; a snapshot no newer than the index (raft restores
// its latest snapshot at every start) is read and dropped. The log is
// compacted by raft after each snapshot (SnapshotThreshold,
// SnapshotInterval, TrailingLogs); a follower too far behind gets the
// snapshot (InstallSnapshot) and then the trailing log.
//
// # What an acknowledgement means (C7)
//
// An event batch is acknowledged only after raft committed its entry on a
// majority of the voters (each fsynced its raft log) AND the leader's
// index applied and committed it to its own bbolt: the acker waits on the
// raft future, then on the index request that entry became. A leader
// that loses its quorum cannot commit; raft deposes it after
// LeaderLeaseTimeout and every future still waiting fails (the sender gets
// code unavailable and resends to the new leader: a batch is idempotent by
// its sequence numbers).
package replica
