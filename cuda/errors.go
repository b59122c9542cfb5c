package cuda

import "errors"

// Sentinel errors. Callers test them with errors.Is; every returned error
// wraps one of them (or a *DriverError) with context naming the numbers.
var (
	// ErrReleased: the memory, buffer, stream or event was released or
	// destroyed (by this process or, for an imported event, by its owner).
	ErrReleased = errors.New("cuda: used after release")
	// ErrOutOfRange: a span or host range does not lie inside its allocation.
	ErrOutOfRange = errors.New("cuda: range outside allocation")
	// ErrOverlap: destination spans of a Scatter overlap.
	ErrOverlap = errors.New("cuda: overlapping destination spans")
	// ErrStreamFailed: an earlier operation on the stream failed; nothing
	// after it ran.
	ErrStreamFailed = errors.New("cuda: stream failed")
	// ErrNoDriver: libcuda.so.1 could not be loaded or no device exists.
	ErrNoDriver = errors.New("cuda: no CUDA driver")
	// ErrBadHandle: an IPC handle is malformed, of another backend, or names
	// memory that no longer exists.
	ErrBadHandle = errors.New("cuda: bad IPC handle")
)
