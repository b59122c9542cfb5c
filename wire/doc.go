// Package wire defines the messages that cross process boundaries between
// rankd, the coordinator and engines: placement events and inventories
// (rankd -> coordinator), and their encodings. Types here are plain data with
// stable encodings; every decoder returns an error wrapping ErrMalformed for
// bad input (ErrOverLimit for a count over the caller's RequestLimits) and
// never panics. The package holds no state and does no I/O.
package wire
