// Package bus is kvtier's NATS glue: an embedded NATS server for single-binary
// clusters, connections with sane reconnect settings, and typed JSON
// request/reply helpers that carry wire.Error codes. It owns no protocol
// state; the coordinator and rankd own their subscriptions.
package bus
