// Package testutil is the one home of the helpers that tests in several
// packages share (STYLE 34): a metric reader, a poll with a deadline, an
// embedded NATS server, a free port, and Main: every package's TestMain,
// goleak's check plus a watchdog that names the stuck test before the
// binary's -test.timeout (a CI log keeps only the end of the output).
//
// Every helper fails the test loudly instead of returning a neutral value:
// a metric or series that is absent fails (it never reads as 0), a
// condition that does not come true in time fails with what was awaited,
// a server that does not start fails. Servers listen on loopback at a port
// the kernel chooses and are stopped by tb.Cleanup.
//
// testutil imports no kvtier package but internal/netutil (which imports
// none), so every package's tests, internal or external, can import it
// without a cycle. It is imported only by tests, never by a daemon nor by
// the campaign lab: code without a testing.TB picks its ports through
// netutil.PickPort, and `make lint` fails when cmd/campaign, cmd/rankd or
// cmd/coordinator links a kvtier package that imports testing.
package testutil
