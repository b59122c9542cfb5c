// Package enginesim simulates the workers and the scheduler of a TP x DCP
// inference engine against kvtier: each worker owns KV pools on its device,
// shares them with its rankd through IPC handles and fills them with
// deterministic per-token content; the scheduler registers the model's spec
// with the coordinator, stores a prompt in many incremental stores (each
// with its own producer event, C1), wipes the pages, restores them through
// the coordinator's restore protocol and compares every byte of every pool
// on every rank (declared pages restored, everything else untouched).
//
// Content is a pure function of the model, shard, group, layer and token
// position (or block index for opaque pages), so a new process regenerates
// exactly what an earlier one stored. The package is a test and demo tool:
// it never decides what kvtier does, it only checks it.
package enginesim
