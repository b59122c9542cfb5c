// Package netutil holds the port picker that tests and the campaign lab
// share: PickPort hands out a loopback port free for both TCP and UDP,
// never the same one twice in a process.
//
// It imports neither testing nor a kvtier package, so a lab binary
// (cmd/campaign) can use it without linking the test framework; the tests'
// helper, testutil.FreePort, is PickPort failing the test instead of
// returning an error. Prefer a port the kernel chooses (listen on
// "127.0.0.1:0", or Port: -1 for NATS) and read it back: nothing can take
// it in between. PickPort is for what cannot do that: a port handed to
// another process on its command line, or one that must be known before
// the listener starts.
package netutil
