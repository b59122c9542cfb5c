// Package transfer is the per-rank store/retrieve engine at the heart of
// rankd: pool registration, store futures that each own their producer event
// (C1), objects packed at the declared page width (C2) with their kvsum64
// checksums, the L1 pinned pool with LRU eviction and pins, and the L2 file
// tier that survives restarts (C6). It publishes every placement change as an
// event; it never decides cluster-wide completeness (that is the coordinator's).
//
// Usage (in-process or behind the daemon):
//
//	e, err := transfer.New(cfg)                      // allocates L1, rescans L2
//	res, err := e.Register(ctx, reg)                 // imports the engine's pools
//	f, err := e.Store(ctx, storeReq)                 // one future per store
//	<-f.Released()                                   // the engine may reuse the blocks
//	result, err := f.Wait(ctx)                       // committed in L1 (or failed)
//	err = e.WaitRequest(ctx, reqID)                  // every store of the request
//	rr, err := e.Retrieve(ctx, retrieveReq)          // placed and verified, per item
//	inv := e.Inventory()                             // for a coordinator resync
//	err = e.Close(ctx)                               // drain, flush, stop
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
// and the engine recomputes it, but its pages have been written.
//
// The package must never: release a producer event before the device has
// read the store's pages and its objects are committed; key in-flight work by
// request id; evict a pinned object; drop an object only L1 holds under
// write-back without writing it to L2 first; report an object restored that
// was not verified; announce an L2 object before it is durable; or move bytes
// of one namespace into another's geometry.
package transfer
