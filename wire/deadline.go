package wire

import (
	"fmt"
	"strconv"
	"time"
)

// HeaderDeadline is the NATS header of a retrieve or store request that
// carries the engine's deadline: the wall-clock time (Unix nanoseconds,
// decimal) after which the rank must place nothing more (a retrieve) or
// keep the engine waiting no longer (a store). The engine gives the blocks
// of a load it gave up on back to its own use (vLLM recomputes them, or
// reuses them for another request), so a copy that lands after that would
// write stale bytes into memory the engine owns again; it holds a store's
// blocks until the store answers, so a store waiting for L1 room must give
// up by then (its gather, once begun, still ends before the answer). The
// engine and its rank share a host (CUDA IPC), so they share the clock. A
// request without the header is bounded by the rank's own retrieve or
// store timeout only; a rank that predates the header on stores ignores
// it there.
const HeaderDeadline = "Kvtier-Deadline"

// HeaderGatherLimit is the NATS header of a store request that says when
// the engine stops waiting for the store's answer (Unix nanoseconds,
// decimal, as HeaderDeadline): its deadline plus a grace for a gather
// already running. An engine whose step waits on the answer (vLLM's
// sliding-window and Mamba groups) goes on past it and may reuse the
// blocks, so a gather that ends after it may have read pages the engine
// has begun to overwrite: torn bytes whose sum is self-consistent. The
// rank commits none of the objects of such a gather (they fail, as past
// the deadline). A rank that predates the header ignores it.
const HeaderGatherLimit = "Kvtier-Gather-Limit"

// HeaderPace is the NATS header of a retrieve request that bounds the rate
// of its copies: bytes per second, decimal (transfer.RetrieveRequest.Pace;
// at least transfer.MinPace). An engine sends it for a load that runs while
// it decodes other requests, trading the load's time for their steps; it
// overrides the rank's own pace (rankd --restore-pace-gbps) for that
// request, 0 asking for full speed. A rank that predates the header
// ignores it.
const HeaderPace = "Kvtier-Pace"

// ParsePace reads a HeaderPace value: bytes per second (0: full speed).
func ParsePace(v string) (uint64, error) {
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("header %s %q: want bytes per second, a decimal integer: %w", HeaderPace, v, ErrMalformed)
	}
	return n, nil
}

// FormatDeadline is the header value of t (HeaderDeadline or
// HeaderGatherLimit).
func FormatDeadline(t time.Time) string { return strconv.FormatInt(t.UnixNano(), 10) }

// ParseDeadline reads a HeaderDeadline value.
func ParseDeadline(v string) (time.Time, error) { return parseUnixNano(HeaderDeadline, v) }

// ParseGatherLimit reads a HeaderGatherLimit value.
func ParseGatherLimit(v string) (time.Time, error) { return parseUnixNano(HeaderGatherLimit, v) }

func parseUnixNano(header, v string) (time.Time, error) {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return time.Time{}, fmt.Errorf("header %s %q: want Unix nanoseconds > 0: %w", header, v, ErrMalformed)
	}
	return time.Unix(0, n), nil
}
