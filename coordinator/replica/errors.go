package replica

import "errors"

// Sentinel errors. Every error this package returns wraps one of them (or
// an error of the package it called) with the rule that failed and the
// numbers. The coordinator aliases the ones its callers test for.
var (
	// ErrConfig: a Config field breaks a rule, or the raft dir, TLS
	// files or address cannot be used as configured.
	ErrConfig = errors.New("invalid raft config")
	// ErrNotLeader: this node is not (or no longer) the raft leader, or
	// raft has not started yet, so it cannot commit: the mutation was not
	// applied by it. The sender retries and reaches the new leader.
	ErrNotLeader = errors.New("not the raft leader")
	// ErrAuth: a peer of the raft port was refused: its TLS certificate
	// does not chain to the cluster CA, or names a raft server the
	// configuration does not place there.
	ErrAuth = errors.New("raft peer refused")
	// ErrCorrupt: a record of the raft log store does not decode.
	ErrCorrupt = errors.New("raft log record damaged")
	// ErrClosed: the node or its transport has been shut down.
	ErrClosed = errors.New("raft node shut down")
)
