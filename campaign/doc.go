// Package campaign runs a seeded fault campaign against a real kvtier
// cluster on this machine and checks, while it runs and at the end, that
// kvtier was never silently wrong.
//
// It owns a small harness (coordinator and rankd processes, one network
// namespace per rank when it runs as root, an L2 file system of its own),
// a fault-injecting NATS proxy in front of every rankd, the fault
// schedule (a pure function of the seed: a failing seed replays the same
// schedule), an engine workload replayed from the Mooncake trace through
// the Go engine simulator, a checker and the report.
//
// It never edits a daemon's state behind its back except through the
// faults it records: every injected fault is logged with its sequence
// number before it is applied, and every loss the checker accepts must be
// explained by a recorded fault or by an event the daemons themselves
// published.
package campaign
