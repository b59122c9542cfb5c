package dcp

import "errors"

// Sentinel errors; every error this package returns wraps one of them with
// the rule and the numbers, e.g. "declared page 177408 B exceeds block stride
// 160000 B: invalid geometry".
var (
	// ErrLayout: a parallel layout breaks a rule (sizes, divisibility).
	ErrLayout = errors.New("invalid parallel layout")
	// ErrGeometry: a page geometry breaks a rule of C2.
	ErrGeometry = errors.New("invalid page geometry")
	// ErrBlock: a block id or position outside its pool or table.
	ErrBlock = errors.New("block out of range")
	// ErrKey: a malformed object key or namespace encoding.
	ErrKey = errors.New("malformed object key")
)
