package hostl1

import "errors"

// Sentinel errors. Every error this package returns wraps one of them
// with the rule that failed and the numbers; callers use errors.Is. The
// engine (package transfer) also matches them to its own sentinels of the
// same meaning (ErrConfig, ErrCorrupt, ErrIO, ErrNotFound, ErrL1Full).
var (
	// ErrConfig: the segment directory breaks a rule (not a real
	// directory of this uid, or it grants something to group or others).
	ErrConfig = errors.New("hostl1: invalid segment directory")
	// ErrCorrupt: a segment file or header failed a check (not a private
	// regular file of this uid, a bad magic, version or geometry).
	ErrCorrupt = errors.New("hostl1: segment failed verification")
	// ErrIO: creating, reading or mapping a segment failed.
	ErrIO = errors.New("hostl1: segment I/O error")
	// ErrNotFound: the rank has no segment file (its holder never started
	// one, or closed it).
	ErrNotFound = errors.New("hostl1: no segment")
	// ErrFull: every slot of the catalog is live (cannot happen with the
	// geometry's two slots per slab).
	ErrFull = errors.New("hostl1: catalog full")
)
