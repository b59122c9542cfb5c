package group

import (
	"context"
	"runtime/pprof"
	"sync"
	"sync/atomic"
)

// Group starts goroutines for one owner and waits for them. Make one with
// New; the zero Group is also ready to use and labels its goroutines with
// an empty group name. A Group must not be copied after first use.
type Group struct {
	name    string
	running atomic.Int64 // goroutines started and not yet returned

	// mu guards the following, so that Close and Go's Add are ordered: every
	// Add happens before Close returns or not at all.
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

// New returns an open Group whose goroutines carry the pprof label
// group=name (for example "coordinator", "transfer", "rankd").
func New(name string) *Group {
	return &Group{name: name}
}

// Name is the group's pprof label.
func (g *Group) Name() string { return g.name }

// Go runs f in a new goroutine labelled goroutine=name and tracked by the
// group, and reports true; once the group is closed it starts nothing and
// reports false, and the caller must finish or refuse the work itself.
func (g *Group) Go(name string, f func()) bool {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return false
	}
	g.wg.Add(1)
	g.running.Add(1)
	g.mu.Unlock()

	labels := pprof.Labels("group", g.name, "goroutine", name)
	go func() {
		defer g.wg.Done()
		defer g.running.Add(-1)
		pprof.Do(context.Background(), labels, func(context.Context) { f() })
	}()
	return true
}

// Close makes every later Go refuse. Goroutines already started keep
// running; Close does not wait for them (Wait does). Close may be called
// more than once and from several goroutines.
func (g *Group) Close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// Closed reports whether Close has been called.
func (g *Group) Closed() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.closed
}

// Wait blocks until every goroutine the group started has returned. Call it
// after Close: on an open group a Go may start a goroutine at any moment,
// and Wait would not know to wait for it (sync.WaitGroup forbids an Add
// from zero that races with Wait).
func (g *Group) Wait() {
	g.wg.Wait()
}

// CloseAndWait is Close followed by Wait.
func (g *Group) CloseAndWait() {
	g.Close()
	g.Wait()
}

// Running is the number of goroutines started and not yet returned.
func (g *Group) Running() int {
	return int(g.running.Load())
}
