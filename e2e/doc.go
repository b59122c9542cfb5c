// Package e2e holds kvtier's multi-process end-to-end tests: real coordinator
// and rankd processes, real NATS, real bbolt, real files, network namespaces
// for partitions. It contains tests only, and two helper commands:
// natsnode, which the tests run as a NATS cluster member without a
// coordinator, and s3node, an S3 server in a process of its own.
package e2e
