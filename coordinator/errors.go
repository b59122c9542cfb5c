package coordinator

import "errors"

// Sentinel errors. Every error this package returns wraps one of them (or an
// error of the package it called) with the rule that failed and the numbers.
var (
	// ErrConfig: a Config field breaks a rule.
	ErrConfig = errors.New("invalid coordinator config")
	// ErrCorruptIndex: the index in DataDir failed verification at start;
	// the coordinator refuses to serve from it.
	ErrCorruptIndex = errors.New("index failed verification")
	// ErrStarted: Start was called twice.
	ErrStarted = errors.New("coordinator already started")
	// ErrClosed: the coordinator has been shut down.
	ErrClosed = errors.New("coordinator shut down")
)
