// Package index is the coordinator's durable placement index: for every
// object key, which ranks hold it in which tier, with size, checksum, the
// holder's incarnation and the event sequence that put it there. bbolt is the
// durable truth; nothing is acknowledged before it has committed (C7). The
// package also holds the pure restore-verdict state machine (C5). It never
// moves KV bytes and never talks to the network.
package index
