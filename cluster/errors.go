package cluster

import "errors"

// Sentinel errors. Every error this package returns wraps one of them with
// the rule that failed and the numbers, so callers use errors.Is.
var (
	// ErrConfig: a Config field breaks a rule (range, relation to another).
	ErrConfig = errors.New("invalid cluster config")
	// ErrMeta: a member's Meta breaks a rule or does not decode.
	ErrMeta = errors.New("invalid member meta")
	// ErrMetaTooLarge: the encoded Meta exceeds memberlist's per-node limit.
	ErrMetaTooLarge = errors.New("member meta too large")
	// ErrNotStarted: the call needs Start first.
	ErrNotStarted = errors.New("cluster not started")
	// ErrStarted: Start was called twice.
	ErrStarted = errors.New("cluster already started")
	// ErrClosed: the Cluster has been shut down.
	ErrClosed = errors.New("cluster shut down")
	// ErrJoin: no seed could be contacted before the context ended.
	ErrJoin = errors.New("no seed reachable")
	// ErrTimeout: a leave or meta update was not gossiped to any peer in time.
	// The local state has changed anyway; gossip keeps retrying it.
	ErrTimeout = errors.New("gossip broadcast timed out")
)

// errMessage: a member-to-member message (leave.go) does not decode. It is
// logged, never returned to a caller.
var errMessage = errors.New("invalid cluster message")
