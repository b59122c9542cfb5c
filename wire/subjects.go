package wire

import (
	"fmt"
	"strconv"
	"strings"
)

// NATS subjects. Every subject starts with a configurable prefix (default
// "kvtier") so several clusters can share one NATS deployment. Instance
// names are restricted (ValidInstance) so they are always one token.
//
//	<p>.events.<instance>.<tp>             rankd -> coordinator, request: binary Batch; reply EventAck
//	<p>.heartbeat.<instance>.<tp>          rankd -> coordinator, publish: JSON Heartbeat (no reply)
//	<p>.rank.<instance>.<tp>.inventory     coordinator -> rankd, request: InventoryRequest; reply InventoryPage
//	<p>.rank.<instance>.<tp>.engine.<op>   engine worker -> rankd, request/reply JSON (register, store, retrieve, release, status)
//	<p>.coord.<op>                         scheduler/rankd -> coordinator (ns.register, lookup, restore.begin, restore.report, restore.wait)
//	<p>.admin.<op>                         operators -> coordinator (members, ranks, object, namespaces, restores, verify)
//
// Inventories are paged, so a rank of any size fits the NATS payload limit
// (8 MiB): the coordinator sends InventoryRequest{Page: 0} (no snapshot);
// the rank takes one consistent snapshot, keeps it for a short TTL under a
// random id and replies page 0 with the id and the page count. The
// coordinator then asks for pages 1..Pages-1 naming that id and joins them
// (AssembleInventory) into one Inventory. An unknown or expired id gets
// code not_found; the coordinator then starts over with a new snapshot.
// An empty request ({} or no body) is a request for page 0 of a new
// snapshot.
const DefaultPrefix = "kvtier"

// Subjects builds subjects under one prefix.
type Subjects struct{ Prefix string }

func (s Subjects) p() string {
	if s.Prefix == "" {
		return DefaultPrefix
	}
	return s.Prefix
}

// Events is where rank r publishes its event batches.
func (s Subjects) Events(r Rank) string {
	return s.p() + ".events." + r.Instance + "." + strconv.Itoa(r.TPRank)
}

// EventsAll matches every rank's event subject.
func (s Subjects) EventsAll() string { return s.p() + ".events.>" }

// Inventory is where rank r answers inventory requests.
func (s Subjects) Inventory(r Rank) string {
	return s.p() + ".rank." + r.Instance + "." + strconv.Itoa(r.TPRank) + ".inventory"
}

// Engine is where rank r serves engine API operation op.
func (s Subjects) Engine(r Rank, op string) string {
	return s.p() + ".rank." + r.Instance + "." + strconv.Itoa(r.TPRank) + ".engine." + op
}

// Coord is a coordinator operation.
func (s Subjects) Coord(op string) string { return s.p() + ".coord." + op }

// Admin is an admin operation.
func (s Subjects) Admin(op string) string { return s.p() + ".admin." + op }

// ValidInstance checks an engine instance name: 1..64 characters of
// [A-Za-z0-9_-], so it is one NATS subject token and one path element.
func ValidInstance(name string) error {
	if name == "" || len(name) > 64 {
		return fmt.Errorf("instance name %q: want 1..64 characters: %w", name, ErrMalformed)
	}
	if i := strings.IndexFunc(name, func(c rune) bool {
		return !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-')
	}); i >= 0 {
		return fmt.Errorf("instance name %q: character %d is not one of [A-Za-z0-9_-]: %w", name, i, ErrMalformed)
	}
	return nil
}

// Heartbeat is where rank r announces the last event sequence it assigned.
func (s Subjects) Heartbeat(r Rank) string {
	return s.p() + ".heartbeat." + r.Instance + "." + strconv.Itoa(r.TPRank)
}

// HeartbeatAll matches every rank's heartbeat subject.
func (s Subjects) HeartbeatAll() string { return s.p() + ".heartbeat.>" }
