package admin

import "errors"

// Sentinel errors. Every error this package returns wraps one of them (or
// an error of the package it called) with the rule that failed and the
// numbers.
var (
	// ErrReplicas: the replicas of a raft cluster do not agree (a digest
	// differs at one raft index) or one failed its own verification. It
	// comes with index.ErrInconsistent.
	ErrReplicas = errors.New("replicas inconsistent")
	// ErrCollect: an admin request to the coordinators could not be sent.
	ErrCollect = errors.New("admin request not sent")
)
