// Package bus is kvtier's NATS glue: an embedded NATS server for single-binary
// clusters (alone, or routed with the other coordinators' servers into one
// NATS cluster), connections that hold several server URLs and move to a
// surviving one, typed JSON request/reply helpers that carry wire.Error
// codes, and one jittered retry policy (Retry) for requests nobody
// received. It owns no protocol state; the coordinator and rankd own their
// subscriptions. The embedded server never runs without users, or off
// loopback without TLS, and never accepts a route without the route
// credentials, unless its config says Insecure (C9); package auth makes
// the users, the route credentials and the client credentials.
package bus
