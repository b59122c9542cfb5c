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
//	<p>.rank.<instance>.<tp>.freed         rankd -> engine worker, publish: JSON BlocksFreed (C10)
//	<p>.coord.<op>.<instance>              engine scheduler -> coordinator (ns.register, lookup, restore.begin, restore.wait),
//	                                       scoped to the caller's instance (C9); the body may not name another
//	<p>.coord.restore.report.<instance>.<tp>  rankd -> coordinator: RestoreReport of exactly that rank (C9)
//	<p>.coord.<op>                         unscoped engine subjects and report: served only by an --insecure
//	                                       coordinator, for clients from before C9
//	<p>.admin.<op>                         operators -> coordinator (members, ranks, object, namespaces, restores, verify)
//	<p>.kvevents.<instance>                coordinator -> routers, publish: JSON KVEventBatch (opt-in; docs/kvevents.md)
//
// Inventories are paged, so a rank of any size fits the NATS payload limit
// (8 MiB): the coordinator sends InventoryRequest{Page: 0} (no snapshot);
// the rank takes one consistent snapshot, keeps it for a short TTL under a
// random id and replies page 0 with the id and the page count. The
// coordinator then asks for pages 1..Pages-1 naming that id and applies
// each as it arrives, never joining them (issue 28.3; AssembleInventory
// joins them for tools and tests); its requests pace the rank, a few in
// flight at a time. An unknown or expired id gets
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

// Coord is the unscoped subject of a coordinator operation. Only an
// insecure coordinator serves it (for old clients); under auth no role may
// publish there. Engines use EngineCoord, ranks Report.
func (s Subjects) Coord(op string) string { return s.p() + ".coord." + op }

// EngineCoord is where engine instance inst sends coordinator operation op
// (CoordRegister, CoordLookup, CoordRestoreBegin, CoordRestoreWait). Only
// that instance's engine identity may publish there.
func (s Subjects) EngineCoord(inst, op string) string { return s.p() + ".coord." + op + "." + inst }

// EngineCoordAll matches EngineCoord(*, op).
func (s Subjects) EngineCoordAll(op string) string { return s.p() + ".coord." + op + ".*" }

// Report is where rank r sends its restore reports; only r may publish
// there, and the coordinator refuses a report whose body names another
// rank.
func (s Subjects) Report(r Rank) string {
	return s.p() + ".coord." + CoordRestoreReport + "." + r.Instance + "." + strconv.Itoa(r.TPRank)
}

// ReportAll matches every rank's report subject.
func (s Subjects) ReportAll() string { return s.p() + ".coord." + CoordRestoreReport + ".*.*" }

// EngineCoordOps are the coordinator operations an engine may call.
var EngineCoordOps = []string{CoordRegister, CoordLookup, CoordRestoreBegin, CoordRestoreWait, CoordRestoreCancel}

// InstanceOf returns the last token of subject, which names the instance
// of an EngineCoord subject.
func InstanceOf(subject string) string {
	if i := strings.LastIndexByte(subject, '.'); i >= 0 {
		return subject[i+1:]
	}
	return subject
}

// RankOf parses the rank from the last two tokens of subject (Events,
// Heartbeat, Report subjects).
func RankOf(subject string) (Rank, error) {
	i := strings.LastIndexByte(subject, '.')
	if i <= 0 {
		return Rank{}, fmt.Errorf("subject %q names no rank: %w", subject, ErrMalformed)
	}
	j := strings.LastIndexByte(subject[:i], '.')
	tp, err := strconv.Atoi(subject[i+1:])
	if err != nil || tp < 0 {
		return Rank{}, fmt.Errorf("subject %q: TP rank token %q: %w", subject, subject[i+1:], ErrMalformed)
	}
	r := Rank{Instance: subject[j+1 : i], TPRank: tp}
	if err := ValidInstance(r.Instance); err != nil {
		return Rank{}, fmt.Errorf("subject %q: %w", subject, err)
	}
	return r, nil
}

// Admin is an admin operation.
func (s Subjects) Admin(op string) string { return s.p() + ".admin." + op }

// AdminReadOps are the admin operations that change nothing; the admin
// role may send only these (admin-write may send every admin operation).
var AdminReadOps = []string{AdminMembers, AdminRanks, AdminObject, AdminNamespaces, AdminRestores, AdminVerify, AdminRaft, AdminRaftVerify, AdminRoute}

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

// StageInstance is the instance of pipeline stage stage of engine
// instance inst under pipeline-parallel size pp: inst itself under PP 1,
// else "<inst>-pp<stage>". Each stage is a world of its own (dcp.Layout
// PPStage): its rankds run as that instance, and the engine identity of
// inst acts for every stage (auth.Identity.PP).
func StageInstance(inst string, pp, stage int) string {
	if pp <= 1 {
		return inst
	}
	return inst + "-pp" + strconv.Itoa(stage)
}

// Heartbeat is where rank r announces the last event sequence it assigned.
func (s Subjects) Heartbeat(r Rank) string {
	return s.p() + ".heartbeat." + r.Instance + "." + strconv.Itoa(r.TPRank)
}

// HeartbeatAll matches every rank's heartbeat subject.
func (s Subjects) HeartbeatAll() string { return s.p() + ".heartbeat.>" }
