// Package indextest holds test helpers for the index and for anything that
// feeds it: a simulated rank that produces placement events and knows its
// own inventory, and a faulty event transport that drops, duplicates and
// reorders batches. Both are deterministic for a given seed. The package
// depends only on dcp and wire, never on index, so index's own tests can
// use it; it does no I/O and starts no goroutines.
package indextest
