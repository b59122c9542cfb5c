// Package cluster owns kvtier's membership: a hashicorp/memberlist gossip
// cluster of the coordinator and the rankds, each member's metadata (role,
// rank identity, incarnation, NATS address) and the failure detector tuned so
// a dead rank is noticed within 1.5 s on a LAN of GPU hosts. It reports joins,
// updates and deaths to its owner; it never touches the index or KV bytes.
package cluster
