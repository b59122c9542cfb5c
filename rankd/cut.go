package rankd

import (
	"slices"
	"sync"
	"time"

	"github.com/kvtier/kvtier/transfer"
)

// cutKey names the stores OpCut may cut: the caller's, of one request.
type cutKey struct{ caller, request string }

// maxCutMarks bounds the cuts remembered for stores not yet registered
// (cutRegistry.marks), so that an engine cannot grow the rankd's memory
// with cuts: past it the mark that expires first is dropped (its store,
// if it ever comes, then waits for its own deadline: bounded, C11).
const maxCutMarks = 4096

// cutMark is a cut that also applies to stores registered after it: those
// of its key whose engine deadline is at or before through.
type cutMark struct {
	through time.Time // the latest engine deadline of a store it cuts
	expires time.Time // forgotten after: no store sent before the cut registers this late
}

// cutStore is a store in flight that OpCut may cut.
type cutStore struct {
	f        *transfer.StoreFuture
	deadline time.Time // the engine's deadline (wire.HeaderDeadline); zero when it sent none
}

// cutRegistry holds the stores in flight by (caller, request id), and the
// recent cuts that name a deadline, for OpCut.
//
// A cut and the store it is meant for may arrive in either order: they
// come on different subscriptions (nats.go delivers each on its own
// goroutine), and a store registers only after its request is decoded and
// handed to the engine. A cut with a deadline bound (CutRequest.Through)
// therefore also cuts a store of its key that registers later, as long as
// the store's engine deadline is at or before the bound: the engine sent
// that store before it cut. A store of the same request sent after the
// cut (vLLM resumed the request) carries a later deadline and is not cut.
type cutRegistry struct {
	mu     sync.Mutex
	stores map[cutKey][]cutStore
	marks  map[cutKey]cutMark
}

// track records f (with the engine's deadline, zero for none) as a store
// OpCut may cut until the returned func runs. A remembered cut that covers
// it cuts it at once (cut true).
func (r *cutRegistry) track(k cutKey, f *transfer.StoreFuture, deadline time.Time, now time.Time) (release func(), cut bool) {
	r.mu.Lock()
	if r.stores == nil {
		r.stores = make(map[cutKey][]cutStore)
	}
	r.stores[k] = append(r.stores[k], cutStore{f, deadline})
	m, marked := r.marks[k]
	if marked && now.After(m.expires) {
		delete(r.marks, k)
		marked = false
	}
	r.mu.Unlock()
	if cut = marked && covers(m.through, deadline); cut {
		f.Cut()
	}
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		fs := slices.DeleteFunc(r.stores[k], func(s cutStore) bool { return s.f == f })
		if len(fs) == 0 {
			delete(r.stores, k)
		} else {
			r.stores[k] = fs
		}
	}, cut
}

// cut cuts k's stores in flight (when through is set, those with an
// engine deadline at or before it, or none), and remembers the cut until expires
// for the stores of k that register later (through set). It returns the
// stores it cut now. A store whose result is final is not in flight, though
// it stays tracked until its handler returns, after its reply: a cut the
// engine sends once it has the reply cuts nothing.
func (r *cutRegistry) cut(k cutKey, through, expires, now time.Time) int {
	r.mu.Lock()
	var fs []*transfer.StoreFuture
	for _, s := range r.stores[k] {
		select {
		case <-s.f.Done():
			continue
		default:
		}
		if through.IsZero() || s.deadline.IsZero() || covers(through, s.deadline) {
			fs = append(fs, s.f)
		}
	}
	if !through.IsZero() && expires.After(now) {
		r.remember(k, cutMark{through, expires}, now)
	}
	r.mu.Unlock()
	for _, f := range fs {
		f.Cut()
	}
	return len(fs)
}

// remember records m for k (the later bound of two cuts of one key),
// keeping at most maxCutMarks. Called with mu held.
func (r *cutRegistry) remember(k cutKey, m cutMark, now time.Time) {
	if r.marks == nil {
		r.marks = make(map[cutKey]cutMark)
	}
	if old, ok := r.marks[k]; ok {
		if old.through.After(m.through) {
			m.through = old.through
		}
		if old.expires.After(m.expires) {
			m.expires = old.expires
		}
	} else if len(r.marks) >= maxCutMarks {
		var first cutKey
		var at time.Time
		for mk, mm := range r.marks {
			if now.After(mm.expires) {
				delete(r.marks, mk)
				continue
			}
			if at.IsZero() || mm.expires.Before(at) {
				first, at = mk, mm.expires
			}
		}
		if len(r.marks) >= maxCutMarks {
			delete(r.marks, first)
		}
	}
	r.marks[k] = m
}

// marked returns how many cuts are remembered (for tests).
func (r *cutRegistry) marked() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.marks)
}

// covers says whether a remembered cut bounded by through applies to a
// store with the engine deadline dl: one that named no deadline (an
// engine that predates the header) is cut only while in flight.
func covers(through, dl time.Time) bool { return !dl.IsZero() && !dl.After(through) }
