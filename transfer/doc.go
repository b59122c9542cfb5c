// Package transfer is the per-rank store/retrieve engine at the heart of
// rankd: pool registration, store futures that each own their producer event
// (C1), objects packed at the declared page width (C2) with their kvsum64
// checksums, the L1 pinned pool with LRU eviction and pins, and the L2 file
// tier that survives restarts (C6). It publishes every placement change as an
// event; it never decides cluster-wide completeness (that is the coordinator's).
package transfer
