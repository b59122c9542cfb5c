package rankd

import (
	"context"
	"errors"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// Sentinel errors of rankd.
var (
	// ErrConfig: a Config field breaks a rule.
	ErrConfig = errors.New("rankd: invalid config")
	// ErrBadRequest: an engine request failed decoding or validation.
	ErrBadRequest = errors.New("rankd: bad request")
	// ErrTooLarge: an engine request exceeds a size limit.
	ErrTooLarge = errors.New("rankd: request too large")
	// ErrUnavailable: the daemon is shutting down or overloaded.
	ErrUnavailable = errors.New("rankd: unavailable")
	// ErrNotFound: an inventory snapshot is unknown or expired.
	ErrNotFound = errors.New("rankd: not found")
	// ErrStarted and ErrClosed: lifecycle misuse.
	ErrStarted = errors.New("rankd: already started")
	ErrClosed  = errors.New("rankd: shut down")
	// ErrNoCoordinator: no coordinator NATS URL was found in time.
	ErrNoCoordinator = errors.New("rankd: no coordinator found")
	// ErrDuplicateRank: another live rankd serves this rank.
	ErrDuplicateRank = errors.New("rankd: the rank is served by another live rankd")
)

// Code maps an error to its stable wire code.
func Code(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrTooLarge):
		return wire.CodeTooLarge
	case errors.Is(err, transfer.ErrUnknownNamespace):
		return wire.CodeUnknownNamespace
	case errors.Is(err, transfer.ErrStaleSession):
		return wire.CodeStaleSession
	case errors.Is(err, transfer.ErrUnknownSession):
		return wire.CodeUnknownSession
	case errors.Is(err, transfer.ErrUnauthorized):
		return wire.CodeUnauthorized
	case errors.Is(err, dcp.ErrGeometry):
		return wire.CodeGeometry
	case errors.Is(err, ErrBadRequest), errors.Is(err, wire.ErrMalformed),
		errors.Is(err, transfer.ErrBadRequest), errors.Is(err, transfer.ErrRegistration),
		errors.Is(err, transfer.ErrWrongDevice), errors.Is(err, dcp.ErrLayout),
		errors.Is(err, dcp.ErrBlock), errors.Is(err, dcp.ErrKey):
		return wire.CodeBadRequest
	case errors.Is(err, transfer.ErrNotFound), errors.Is(err, ErrNotFound):
		return wire.CodeNotFound
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrClosed), errors.Is(err, transfer.ErrClosed),
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, transfer.ErrTimeout), errors.Is(err, transfer.ErrL1Full):
		return wire.CodeUnavailable
	}
	return wire.CodeInternal
}
