package cuda

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

var timerIDs atomic.Uint64

// hostTimer is a Timer of the host backend: a mark is an operation of its
// stream that takes the time the work before it finished (or its own
// enqueue, on an idle stream).
type hostTimer struct {
	dev *hostDevice
	id  uint64

	mu       sync.Mutex // guards the following
	released bool
	marked   uint64    // number of the most recent Mark; 0: never marked
	reached  uint64    // number of the most recent mark the stream reached
	at       time.Time // when the stream reached mark number reached
	failed   uint64    // number of the most recent mark abandoned by a failed stream
	changed  chan struct{}
}

func (d *hostDevice) NewTimer() (Timer, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	t := &hostTimer{dev: d, id: timerIDs.Add(1), changed: make(chan struct{})}
	if err := d.res.add(t); err != nil {
		return nil, err
	}
	return t, nil
}

// Mark enqueues the mark of t: the stream takes the time when it reaches it.
func (s *hostStream) Mark(t Timer) error {
	ht, ok := t.(*hostTimer)
	if !ok || ht == nil {
		return fmt.Errorf("%w: Mark of a %T, not a host timer", ErrBadHandle, t)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.refuseLocked(); err != nil {
		return err
	}
	ht.mu.Lock()
	if ht.released {
		ht.mu.Unlock()
		return fmt.Errorf("%w: timer #%d was released", ErrReleased, ht.id)
	}
	ht.marked++
	seq := ht.marked
	ht.mu.Unlock()
	enq := time.Now()
	s.enqueueLocked(&hostOp{
		what: fmt.Sprintf("mark %d of timer #%d", seq, ht.id),
		// Reached when the work before it finished (taken before that
		// work's waiters woke), or when it was enqueued on an idle stream.
		run: func(<-chan struct{}) error {
			at := enq
			if s.doneAt.After(at) {
				at = s.doneAt
			}
			ht.resolve(seq, at, false)
			return nil
		},
		abandon: func() { ht.resolve(seq, time.Time{}, true) },
	})
	return nil
}

// resolve records that the stream reached (or, failed, never reaches)
// mark seq.
func (t *hostTimer) resolve(seq uint64, at time.Time, failed bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if failed {
		t.failed = max(t.failed, seq)
	} else if seq > t.reached {
		t.reached, t.at = seq, at
	}
	close(t.changed)
	t.changed = make(chan struct{})
}

func (t *hostTimer) Time(ctx context.Context) (time.Time, error) {
	for {
		t.mu.Lock()
		switch {
		case t.released:
			t.mu.Unlock()
			return time.Time{}, fmt.Errorf("%w: timer #%d was released", ErrReleased, t.id)
		case t.marked == 0:
			t.mu.Unlock()
			return time.Time{}, fmt.Errorf("cuda: time of timer #%d: it was never marked", t.id)
		case t.failed == t.marked:
			t.mu.Unlock()
			return time.Time{}, fmt.Errorf("%w: timer #%d: its stream failed before reaching the mark", ErrStreamFailed, t.id)
		case t.reached == t.marked:
			at := t.at
			t.mu.Unlock()
			return at, nil
		}
		ch := t.changed
		t.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("cuda: time of timer #%d: %w", t.id, ctx.Err())
		}
	}
}

func (t *hostTimer) Release() error {
	t.mu.Lock()
	first := !t.released
	t.released = true
	if first {
		close(t.changed)
		t.changed = make(chan struct{})
	}
	t.mu.Unlock()
	if first {
		t.dev.res.remove(t)
	}
	return nil
}
