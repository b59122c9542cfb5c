// Package bus is kvtier's NATS glue: an embedded NATS server for single-binary
// clusters, connections with sane reconnect settings, and typed JSON
// request/reply helpers that carry wire.Error codes. It owns no protocol
// state; the coordinator and rankd own their subscriptions. The embedded
// server never runs without users, or off loopback without TLS, unless its
// config says Insecure (C9); package auth makes the users and the client
// credentials.
package bus
