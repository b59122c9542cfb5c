// Package group is the one way a long-lived component starts goroutines
// (STYLE 9 and 21, after nats-server's startGoRoutine): the component holds
// one Group, starts every goroutine through Group.Go, and on shutdown closes
// the group before it waits for it.
//
// A Group refuses to start a goroutine once it is closed: Go returns false
// and starts nothing, so a goroutine can never be added to a WaitGroup that
// Shutdown is already waiting on, and a caller learns that it must answer
// (or drop) the work itself instead of handing it to a goroutine that would
// outlive its owner. Every goroutine runs with two runtime/pprof labels,
// "group" (the Group's name) and "goroutine" (the name given to Go), so a
// goroutine profile (/debug/pprof/goroutine?debug=1) says which component
// started each goroutine and why; goroutines that f starts inherit them.
//
// Group never stops a goroutine: the function it runs must watch its
// owner's stop signal (a closed channel or a cancelled context) and return.
// It never recovers a panic, and never starts a goroutine after Close.
package group
