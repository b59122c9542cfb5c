// Package dcp owns kvtier's geometry and cache identity, as pure functions of
// their inputs: the parallel layout (TP, DCP, interleave), which DCP rank owns
// each token and where it lives (vLLM's formula), who stores and who restores
// each shard, the page geometry of every KV group (contract C2), the exact
// byte ranges a transfer moves, and the keys that name stored objects
// (contract C4).
//
// It never does I/O, never starts goroutines and never allocates device
// memory. Every error names the rule that failed and the numbers.
package dcp
