// Package index is the coordinator's durable placement index: for every
// object key, which ranks hold it in which tier, with size, checksum, the
// holder's incarnation and the event sequence that put it there; per rank,
// its incarnation, last applied sequence and fence; per namespace, its
// spec. bbolt is the durable truth; nothing is acknowledged before it has
// committed (C7). The package also holds the pure restore-verdict state
// machine (C5, restore.go). It never moves KV bytes, never talks to the
// network and never reads a clock for a decision.
//
// # Driving it
//
// Any number of goroutines may call Apply, ApplyAsync, ApplyInventory,
// ApplyInventoryAt, ApplyInventoryStep, FenceRank and RegisterNamespace. Each call is a request to one committer
// goroutine, which merges the requests waiting for it into one bbolt
// transaction (group commit, Config.MaxGroupEvents and MaxGroupDelay). A
// writer goroutine commits it (fsync) while the committer already stages
// the next group on top of it (a two-stage pipeline: the CPU work of one
// group overlaps the disk wait of the one before); the committer then
// publishes the change to the in-memory state and only then answers. Its
// two map-bound steps fan out to Config.PublishFan short-lived goroutines
// it waits for (reading a batch's live chunk values before staging it,
// installing a committed group's chunks into the shard maps, each
// goroutine on its own shards), so it stays the one writer of the state. The
// C7 rules are applied by a pure core (txn.go) in queue order. Queries (Lookup, LookupInto, Get, ListRank, Ranks, ListNamespace,
// Namespaces, Stats) read the in-memory state under a read lock and never
// touch bbolt. Close is idempotent and waits for the committer. One group
// (internal/group, STYLE 21) starts every goroutine of the index: the
// committer, the writer, and the work they hand off (a fold's sort,
// Verify's copy and comparison, a Dump's encoding, chunk-list
// compactions); Close closes it first and waits for all of them, and work
// handed off during the committer's final drain runs on the committer.
//
// Every call that writes placements checks them first (validate.go): the
// rules about the index's data are the index's (STYLE 31), among them that
// every stored object has a nonzero sum (ErrZeroSum); nothing of a batch or
// inventory that breaks one is applied. Placements of sum 0 written before
// that rule are still read.
//
// Where it lives: the type, Open and Close in index.go; the write calls in
// apply.go, their checks in validate.go; the committer and writer
// goroutines in committer.go; the fold of the change log into the
// snapshot in fold.go; Verify in verify.go; the metrics and what each
// committed request is counted as in metrics.go.
//
// # Locks
//
// Locks, outermost first: Index.closeMu (read: a caller queueing its
// request; write: Close marking the index closed; never held with another
// lock); Index.mu (write: the committer publishing a commit, Verify's
// copy switching the committer's record of changed chunks, a snapshot
// install swapping the state; read: queries and Verify's copy of the
// chunk maps); a chunk shard's lock (chunkShard.mu: the committer's set
// and del and a slab compaction's swap, or its fan's, under Index.mu for
// writing; lookups and chunk-list compactions take only these, for
// reading, never Index.mu). No lock is held across a
// bbolt transaction or an fsync (the writer goroutine holds none, and the
// committer publishes a group only once it is committed), nor while
// waiting for the committer's answer; the one wait under a lock is a
// caller holding closeMu for reading while its request waits for room in
// the queue, which the committer, holding none, empties.
//
// # Usability (Lookup)
//
// An L1 copy lives in its holder rankd's pinned memory: only the holder
// itself can restore from it. An L2 copy is a file under the engine
// instance's L2 root, which the instance's rankds share: any reader of the
// same instance can restore from it, even while its holder is fenced, and
// (LookupSharedInto) any reader of an instance of the holder's share
// group, whose rankds share the directory.
// Fenced L1 copies are never usable; the index drops them when it fences
// (new incarnation, or FenceRank when memberlist declares a rank dead).
// Every rank keeps the set of chunks it has placements in, so a fence, an
// inventory or ListRank visits the rank's own chunks, never the whole index
// (STYLE 24). A large fence, inventory or reset is applied in slices between
// other ranks' group commits (fence.go, inventory.go, reset.go), hidden from
// queries until it is whole: a rank being resynced or reset shows none of
// its placements meanwhile. A streamed inventory (stream.go) arrives as
// steps, a page each, so its caller never holds it whole.
//
// # bbolt layout
//
// One file, five buckets; integers are varints unless noted, and every
// value starts with a format version byte (formatVersion, codec.go).
// Chunk, rank and log values are sealed: version 2, the version-1 payload,
// then its CRC-32C (4 B); a mismatch is ErrCorrupt at Open. Version-1
// values of older files are read unchecked.
//
//	meta    "version" -> 2 (1: chunk keys of the older layout only; Open
//	        upgrades it in place)
//	ns      namespace (16 B) -> dcp.Spec as JSON
//	ranks   rank id (4 B big-endian, dense from 1) -> instance, TP rank,
//	        incarnation, last applied seq, fenced flag, fence generation
//	        (absent while 0: every FenceRank and ResetRank moves it; an
//	        inventory requested under an older one is dropped at apply,
//	        ApplyInventoryAt, issue 29.1)
//	chunks  2 | generation (4 B big-endian) | namespace (16) | chunk hash
//	        (16), the generation being the fold that wrote the record, so
//	        each fold's records sort after the older ones (older files:
//	        the first 33 bytes of the dcp.Key encoding, generation 0) ->
//	        every placement of the chunk: shard, group, tier, rank id,
//	        incarnation, seq, size, kvsum64 (8 B)
//	log     record number (8 B big-endian) -> the ops of one group commit:
//	        put/del of one placement, fence a rank's L1, drop a rank
//
// The durable state is the chunks snapshot with the log replayed on top. A
// group commit appends one log record (one sequential bbolt value: the
// cost of a commit does not grow with the index) and rewrites the few rank
// records it touched. When the log reaches Config.CheckpointBytes (and at
// Close) the committer folds it: it writes every chunk changed since the
// last fold from memory under a new generation (appended at the end of the
// bucket, deleting the chunk's older record), in key order, Config.FoldSliceChunks chunks per
// bbolt transaction riding along with the next group commits (or alone
// when none waits), and the last slice deletes the log records the fold
// covers; Close and Checkpoint fold whatever is left in one transaction
// and empty the log (published placement slices are never modified, so
// the fold reads them while the committer carries on; see foldJob for why
// a crash mid-fold is safe). One record per chunk rather than per object key keeps the
// fold at one bbolt put per chunk (8 objects of a TP8 chunk, say, and
// their L1 and L2 copies); the object key stays the identity (Get takes a
// dcp.Key). bbolt runs with the map freelist and NoFreelistSync.
//
// Open rebuilds the in-memory state from the snapshot and the log,
// checking every sealed record's checksum; Verify does the same from
// scratch into a second state and compares (STYLE 16). What each catches:
//
//   - Open: a record damaged on disk (checksum), a record that does not
//     decode, a placement naming an unknown rank, chunks out of slot order;
//   - Verify's comparison: the live state and bbolt diverging while the
//     index runs (a commit published but not written, or written but not
//     published). Right after Open both are decodings of the same bytes,
//     so at startup the comparison cannot fail;
//   - Verify's invariants, on the live state: counters (per rank, per
//     namespace, totals) equal a recount from the chunks; no placement from
//     a future incarnation or past its rank's last sequence; no L1 copy of a
//     fenced or superseded incarnation. These hold for any state the C7
//     rules can produce, so a file whose records decode and check but whose
//     ranks and placements disagree (a rank record restored from another
//     backup, say) fails here.
package index
