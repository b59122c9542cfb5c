// Package cluster owns kvtier's membership: a hashicorp/memberlist gossip
// cluster of the coordinator and the rankds, each member's metadata (role,
// rank identity, incarnation, NATS address) and the failure detector tuned so
// a dead rank is noticed within 1.5 s on a LAN of GPU hosts (DetectorConfig
// says how). It reports joins, updates, graceful leaves and deaths to its
// owner through Subscriptions and a Members snapshot. A graceful leave is
// told from a death by an announcement Leave makes before it leaves
// (leave.go), through memberlist's public API only. Gossip is encrypted
// and authenticated with SecretKey (SecondaryKeys during a rotation); off
// loopback a member refuses to run without a key unless Insecure (C9). A
// coordinator's NATS URLs carry its signature (Meta.NATSSig); checking it
// is the rankd's job, never membership's.
//
// It never touches the index or KV bytes and never decides what a death
// means: fencing is the coordinator's. It never blocks memberlist's
// callbacks: they update a table under a mutex and queue an event; one
// goroutine owned by the Cluster delivers the events (and one per
// acknowledgement of a leave announcement sends it).
package cluster
