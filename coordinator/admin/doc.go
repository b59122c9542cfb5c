// Package admin is the coordinator's admin surface that needs none of its
// state: the replies of the admin subjects built from what the coordinator
// read (members, ranks, objects, namespaces, verify: reply.go), the
// operator's tables and JSON (table.go), and the client side of the
// cluster-wide raft queries (CollectRaft, CollectRaftVerify,
// ReplicasAgree: collect.go), which cmd/coordinator and campaign use.
//
// It never imports package coordinator, takes no lock of it, holds no
// state, subscribes nothing and never writes the index; the coordinator's
// handlers gather the inputs under their own rules and send the reply.
// Its errors wrap its own sentinels (errors.go).
package admin
