// Package e2e holds kvtier's multi-process end-to-end tests: real coordinator
// and rankd processes, real NATS, real bbolt, real files, network namespaces
// for partitions. It contains tests only, and natsnode, a helper command
// the tests run as a NATS cluster member without a coordinator.
package e2e
