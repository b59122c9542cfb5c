package transfer

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvtier/kvtier/transfer/tier"
)

// Sentinel errors. The ones the durable tiers return are defined in
// transfer/tier and aliased here (as bbolt aliases bbolt/errors), so
// errors.Is works with either name. Every error this package returns wraps one of them (and,
// where one exists, the cause from dcp or cuda) with the rule that failed and
// the numbers; callers use errors.Is.
var (
	// ErrConfig: a Config field breaks a rule (tier.ErrConfig: an empty L2
	// root is one).
	ErrConfig = tier.ErrConfig
	// ErrClosed: the engine is closing or closed.
	ErrClosed = errors.New("transfer: engine closed")
	// ErrRegistration: a registration breaks a rule (geometry, pool count,
	// pool size, TP size). Geometry failures also wrap dcp.ErrGeometry.
	ErrRegistration = errors.New("transfer: invalid registration")
	// ErrWrongDevice: a handle names a device other than this rank's.
	ErrWrongDevice = errors.New("transfer: handle of another device")
	// ErrUnknownNamespace: no pools are registered for the namespace.
	ErrUnknownNamespace = errors.New("transfer: namespace not registered")
	// ErrUnknownSession: a request names no session, or one this engine
	// never issued (or has forgotten).
	ErrUnknownSession = errors.New("transfer: unknown session")
	// ErrStaleSession: a request names a session that a newer registration
	// of its namespace superseded, or that was released.
	ErrStaleSession = errors.New("transfer: stale session")
	// ErrUnauthorized: the caller is not the engine identity that owns the
	// session (or the namespace's live session).
	ErrUnauthorized = errors.New("transfer: unauthorized")
	// ErrBadRequest: a store or retrieve request breaks a rule (block
	// counts, block ids outside the pool, keys of another namespace).
	ErrBadRequest = errors.New("transfer: bad request")
	// ErrL1Full: an object could not be placed in L1 even after evicting
	// everything evictable (the rest is pinned by in-flight work, or dirty
	// and its write-back failed).
	ErrL1Full = errors.New("transfer: no room in L1")
	// ErrNotFound: no tier holds the object (tier.ErrNotFound).
	ErrNotFound = tier.ErrNotFound
	// ErrCorrupt: an object's bytes or file failed verification (checksum,
	// length, fingerprint, header). Corrupt L2 files are quarantined
	// (tier.ErrCorrupt).
	ErrCorrupt = tier.ErrCorrupt
	// ErrTimeout: a store or retrieve did not finish within its timeout.
	ErrTimeout = errors.New("transfer: timed out")
	// ErrDeadline is wrapped (with ErrTimeout) by the objects of a store
	// whose engine deadline (Store's context) passed before their
	// gather began: they were not stored and their pages were never read.
	ErrDeadline = errors.New("transfer: past the engine's deadline")
	// ErrGatherLate wraps ErrDeadline (and is wrapped with ErrTimeout) for
	// the objects of a store whose gather ended after its gather limit
	// (WithGatherLimit): the engine had stopped waiting and may
	// have reused the pages while they were read, so nothing of that
	// gather was committed.
	ErrGatherLate = fmt.Errorf("transfer: gather ended after the engine stopped waiting: %w", ErrDeadline)
	// ErrCut wraps ErrDeadline for the objects of a store the engine cut
	// (StoreFuture.Cut) before their gather began: not stored, their pages
	// never read.
	ErrCut = fmt.Errorf("transfer: store cut by the engine before its gather: %w", ErrDeadline)
	// ErrDevice: the device (stream, event, copy) reported an error.
	ErrDevice = errors.New("transfer: device error")
	// ErrIO: an L2 read or write failed for a reason other than corruption
	// (tier.ErrIO).
	ErrIO = tier.ErrIO
	// ErrUnsafe is wrapped (with ErrIO) by an L2 operation refused by a
	// file safety rule: a symlink, a foreign owner, a group/world-writable
	// root (tier.ErrUnsafe).
	ErrUnsafe = tier.ErrUnsafe
	// ErrUnverified is wrapped (with ErrCorrupt) by an object whose header
	// MAC does not verify with the cluster's storage key (tier.ErrUnverified,
	// C12).
	ErrUnverified = tier.ErrUnverified
)

// Reason is the stable, wire-safe reason an object or chunk failed.
type Reason string

// Failure reasons (wire.ItemResult.Reason).
const (
	ReasonNone     Reason = ""
	ReasonMissing  Reason = "missing"  // no tier holds the object
	ReasonCorrupt  Reason = "corrupt"  // verification failed (before or after the scatter)
	ReasonTimeout  Reason = "timeout"  // the device did not finish in time
	ReasonDevice   Reason = "device"   // the device reported an error
	ReasonNoSpace  Reason = "no_space" // L1 could not hold the object
	ReasonIO       Reason = "io"       // an L2 read or write failed
	ReasonSibling  Reason = "sibling"  // another object of the same chunk failed first; nothing written
	ReasonCanceled Reason = "canceled" // the caller's context ended or the engine closed
)

// reasonOf classifies an error into a Reason.
func reasonOf(err error) Reason {
	switch {
	case err == nil:
		return ReasonNone
	case errors.Is(err, ErrNotFound):
		return ReasonMissing
	case errors.Is(err, ErrCorrupt):
		return ReasonCorrupt
	case errors.Is(err, ErrTimeout):
		return ReasonTimeout
	case errors.Is(err, ErrL1Full):
		return ReasonNoSpace
	case errors.Is(err, ErrIO):
		return ReasonIO
	case errors.Is(err, ErrClosed), errors.Is(err, context.Canceled):
		return ReasonCanceled
	case errors.Is(err, context.DeadlineExceeded):
		return ReasonTimeout
	}
	return ReasonDevice
}
