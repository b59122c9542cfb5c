package auth

import "errors"

var (
	// ErrIdentity: an identity is malformed (unknown role, bad instance
	// name, TP rank out of range).
	ErrIdentity = errors.New("auth: bad identity")
	// ErrCredsFile: a seed or users file is missing, malformed, or has a
	// mode or owner that others could use.
	ErrCredsFile = errors.New("auth: bad credentials file")
	// ErrExists: Init or Add would overwrite existing credentials.
	ErrExists = errors.New("auth: credentials exist")
	// ErrPeerCert: a peer's certificate does not chain to the cluster CA,
	// is expired, lacks the key usage of its role, or names no (or more
	// than one) raft server.
	ErrPeerCert = errors.New("auth: peer certificate refused")
)
