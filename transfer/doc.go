// Package transfer is the per-rank store/retrieve engine at the heart of
// rankd: pool registration, store futures that each own their producer event
// (C1), objects packed at the declared page width (C2) with their kvsum64
// checksums, the L1 pinned pool with LRU eviction and pins, and the L2 file
// tier that survives restarts (C6). It sequences every placement change as an
// event and holds the events in one bounded buffer until its consumer (rankd's
// publisher) pulls and acknowledges them (EventSource: it never pushes nor
// retries); it never decides cluster-wide completeness (that is the
// coordinator's).
//
// Usage (in-process or behind the daemon):
//
//	e, err := transfer.New(cfg)                      // allocates L1, rescans L2
//	s, err := e.Register(ctx, reg, owner)            // a session: its own pool imports
//	storeReq.Session = s.ID                          // every request names its session
//	f, err := e.Store(ctx, storeReq)                 // one future per store
//	<-f.Released()                                   // the engine may reuse the blocks
//	result, err := f.Wait(ctx)                       // committed in L1 (or failed)
//	err = e.WaitRequest(ctx, reqID)                  // every store of the request
//	rr, err := e.Retrieve(ctx, retrieveReq)          // placed and verified, per item
//	inv := e.Inventory()                             // for a coordinator resync
//	b, ok := e.NextEvents()                          // KeepEvents: the next batch (Ready wakes)
//	e.AckEvents(b.Events[len(b.Events)-1].Seq)       // once durable: released from the buffer
//	err = e.Release(ns, s.ID, owner)                 // the engine is going away
//	err = e.Close(ctx)                               // drain, flush, stop
//
// Sessions: each registration imports its pools for itself alone; a Store
// or Retrieve is served only against the pools of the session it names, and
// every block id is checked against that session's pools before any copy.
// A later registration of the namespace by the same owner supersedes the
// session (its work in flight drains on its own pools; its later requests
// get ErrStaleSession); another owner gets ErrUnauthorized while it is live.
//
// Objects: one per (chunk, shard, group), holding every layer's pages of the
// chunk's blocks packed layer-major then in block order, each page exactly
// the declared PageBytes. An object's kvsum64 is computed by the device
// inside the gather and recorded at commit; a retrieve compares the checksum
// the scatter computes with it, and L2 bytes are verified before any
// scatter, so a chunk that fails verification before the scatter has
// nothing written into its pages. L1 bytes are not re-hashed on the CPU
// before a scatter (that would cap restores at one core's hashing rate, far
// below the copy engine's): bytes corrupted in pinned memory after commit
// are caught by the scatter's own checksum, so the chunk is reported failed
// and the engine recomputes it, but its pages have been written. The
// exception is an item that skips the chunk's first blocks (the engine's
// prefix cache holds them, wire.RetrieveItem.Skip): its skipped pages are
// never written, its source object is hashed on the CPU before the chunk's
// scatter and each placed run is checked as read back against it
// (retrievepartial.go).
//
// Tiers: L1 is pinned host memory this engine owns. With a host L1
// directory (Config.HostL1Dir) L1 is a shared-memory segment
// (transfer/hostl1) that the other ranks of the host map read-only: a
// lock-free catalog of slots the holder publishes and retires (under
// Engine.mu) and readers lease, so a rank restores from a peer's L1
// without a copy through L2. L2 is the
// file tier (transfer/tier.FileTier): one file per object, written
// durably, verified on every read, quarantined when corrupt, bounded and
// evicted LRU by the engine. L3 is an object-storage bucket
// (transfer/tier.L3Tier) written behind L2 by a queue of writers and
// read when neither L1 nor L2 holds an object; L2 files and L3 objects
// share one object format (tier.EncodeObject). In a share group
// (docs/sharing.md) a rank also reads the copies of the members its
// Config names, checked as its own: their files in a shared L2 directory
// (a store of what one holds, or of what a retrieve read from one, keeps
// no second copy, L2SharedWith, or an L1 copy only, KeepSharedInL1),
// their L3 objects under their bucket prefixes (L3SharedWith; also when
// the member's copy a plan named in another tier is gone) and their host
// L1 segments (HostL1SharedWith).
//
// Packages: transfer/tier holds the L2 file tier, the L3 bucket tier and
// the object format; it never takes Engine.mu and knows nothing of the
// engine. Its sentinel errors (ErrNotFound, ErrCorrupt, ErrIO, ErrUnsafe,
// ErrConfig) are aliased here, with its types (L2Object, FileTier,
// L3Tier, ...), so callers keep the transfer names. transfer/hostl1 holds
// the host-shared L1 segment (its layout, the lock-free catalog, its
// files); it never takes Engine.mu either and has its own sentinel errors,
// which the engine matches to its own of the same meaning where they
// reach a caller (ErrConfig, ErrIO, ... from New). Here stay the engine's
// side of the host L1 (peerl1.go: publishing and retiring under
// Engine.mu, the table of mapped peer segments registered with the
// device, and the retrieve's reads from peers).
//
// Locks, outermost first: Engine.mu (guards the catalog, sessions, futures,
// the event buffer, the L2 and L3 accounting and the holder's side of the
// host L1 segment); then peerTable.mu (the mapped peer segments and their
// reference counts; taken alone, or inside Engine.mu when a retrieve drops
// its peer references). transfer/tier takes no lock of its own;
// transfer/hostl1 is lock-free (atomics, seqlocked slots and leases). No
// lock is held across a NATS request (the engine makes none: its consumer
// pulls events with NextEvents and sends them itself), nor across an L2 or
// L3 Put (the writers unlock around it).
//
// The package must never: release a producer event before the device has
// read the store's pages and its objects are committed; key in-flight work by
// request id; evict a pinned object; drop an object only L1 holds under
// write-back without writing it to L2 first; report an object restored that
// was not verified; announce an L2 object before it is durable; move bytes
// of one namespace into another's geometry; or serve a request against the
// pools of another session than the one it names.
//
// Goroutines: every goroutine of the engine is started through its group
// (Engine.goroutines, internal/group), which Close closes once it has
// canceled the engine's life (step 3) and then waits for. A refused Go
// never loses work: a store's own goroutine (goFunc) then runs on its
// caller and fails at once, and a retrieve loads from L2 on its own
// goroutine. Retrieve itself runs on its caller's goroutine.
package transfer
