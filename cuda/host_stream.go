package cuda

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// hostStream is a stream of the host backend: one goroutine that runs the
// queued operations in order.
type hostStream struct {
	dev    *hostDevice
	id     uint64
	stop   chan struct{} // closed by Close: Delays end, event waits fail
	exited chan struct{} // closed when the goroutine has returned
	// doneAt is when the goroutine finished its latest operation, taken
	// before the operation's waiters are woken (its marks' time); only
	// the goroutine uses it.
	doneAt time.Time

	mu     sync.Mutex // guards the following
	cond   *sync.Cond // signals queue and closed changes, with mu
	queue  []*hostOp
	last   *hostOp // most recently enqueued operation
	closed bool
	doomed error // new work is refused: a failing operation is queued
	failed error // an operation failed; everything after it fails with this
}

// hostOp is one queued operation.
type hostOp struct {
	what    string
	run     func(stop <-chan struct{}) error
	abandon func() // instead of run, when the stream failed before the op
	unref   func() // drops the memory references of the op, after run/abandon
	done    chan struct{}
	err     error // valid after done is closed
}

func newHostStream(d *hostDevice) *hostStream {
	s := &hostStream{
		dev:    d,
		id:     streamIDs.Add(1),
		stop:   make(chan struct{}),
		exited: make(chan struct{}),
	}
	s.cond = sync.NewCond(&s.mu)
	go s.loop()
	return s
}

func (s *hostStream) loop() {
	defer close(s.exited)
	for {
		s.mu.Lock()
		for len(s.queue) == 0 && !s.closed {
			s.cond.Wait()
		}
		if len(s.queue) == 0 {
			s.mu.Unlock()
			return
		}
		op := s.queue[0]
		s.queue[0] = nil
		s.queue = s.queue[1:]
		failed := s.failed
		s.mu.Unlock()

		if failed != nil {
			if op.abandon != nil {
				op.abandon()
			}
			op.err = failed
		} else if err := op.run(s.stop); err != nil {
			op.err = err
			s.mu.Lock()
			s.failed = fmt.Errorf("%w: stream %d: %s: %w", ErrStreamFailed, s.id, op.what, err)
			s.mu.Unlock()
		}
		if op.unref != nil {
			op.unref()
		}
		s.doneAt = time.Now()
		close(op.done)
	}
}

// enqueue appends op, or refuses it for a closed or failed stream.
func (s *hostStream) enqueue(op *hostOp) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.refuseLocked(); err != nil {
		return err
	}
	s.enqueueLocked(op)
	return nil
}

func (s *hostStream) refuseLocked() error {
	if s.closed {
		return fmt.Errorf("%w: stream %d is closed", ErrReleased, s.id)
	}
	if s.failed != nil {
		return s.failed
	}
	return s.doomed
}

func (s *hostStream) enqueueLocked(op *hostOp) {
	op.done = make(chan struct{})
	s.queue = append(s.queue, op)
	s.last = op
	s.cond.Signal()
}

// newOp wraps h into the API's Op.
func (s *hostStream) newOp(h *hostOp, sums, lens []uint64) *Op {
	return &Op{
		sums: sums,
		lens: lens,
		wait: func(ctx context.Context) error {
			select {
			case <-h.done:
				return h.err
			default:
			}
			select {
			case <-h.done:
				return h.err
			case <-ctx.Done():
				return fmt.Errorf("cuda: wait for %s on stream %d: %w", h.what, s.id, ctx.Err())
			}
		},
	}
}

// WaitEvent makes later work wait until the work captured by e's most
// recent Record has completed. Waiting on an event that was never recorded
// waits for nothing. A wait on a released or destroyed event, whether that
// is known now or when the stream reaches the wait, fails the stream.
func (s *hostStream) WaitEvent(e Event) error {
	he, ok := e.(*hostEvent)
	if !ok || he == nil {
		return fmt.Errorf("%w: WaitEvent on a %T, not a host event", ErrBadHandle, e)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.refuseLocked(); err != nil {
		return err
	}
	target, err := he.capture()
	if err != nil {
		// Fail the stream where the wait stands: work enqueued before it
		// still runs, nothing after it does.
		s.doomed = fmt.Errorf("%w: stream %d: wait on event: %w", ErrStreamFailed, s.id, err)
		s.enqueueLocked(&hostOp{
			what: "wait on event " + he.label(),
			run:  func(<-chan struct{}) error { return err },
		})
		return fmt.Errorf("stream %d: wait on event: %w", s.id, err)
	}
	if target == 0 {
		return nil
	}
	s.enqueueLocked(&hostOp{
		what: fmt.Sprintf("wait on record %d of event %s", target, he.label()),
		run: func(stop <-chan struct{}) error {
			return he.wait(target, stop, func() error {
				return fmt.Errorf("%w: stream %d closed while waiting on record %d of event %s",
					ErrReleased, s.id, target, he.label())
			})
		},
	})
	return nil
}

// Record captures all work enqueued so far into e.
func (s *hostStream) Record(e Event) error {
	he, ok := e.(*hostEvent)
	if !ok || he == nil {
		return fmt.Errorf("%w: Record of a %T, not a host event", ErrBadHandle, e)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.refuseLocked(); err != nil {
		return err
	}
	seq, err := he.record()
	if err != nil {
		return fmt.Errorf("stream %d: record: %w", s.id, err)
	}
	s.enqueueLocked(&hostOp{
		what:    fmt.Sprintf("record %d of event %s", seq, he.label()),
		run:     func(<-chan struct{}) error { he.resolve(seq, false); return nil },
		abandon: func() { he.resolve(seq, true) },
	})
	return nil
}

// Delay enqueues work that takes d. Close ends it early.
func (s *hostStream) Delay(d time.Duration) error {
	return s.enqueue(&hostOp{
		what: "delay " + d.String(),
		run: func(stop <-chan struct{}) error {
			if d <= 0 {
				return nil
			}
			t := time.NewTimer(d)
			defer t.Stop()
			select {
			case <-t.C:
			case <-stop:
			}
			return nil
		},
	})
}

// Upload copies src to dst at off when the stream reaches it.
func (s *hostStream) Upload(dst Mem, off uint64, src []byte) (*Op, error) {
	hm, err := asHostMem(dst, "Upload")
	if err != nil {
		return nil, err
	}
	if err := checkRange(off, uint64(len(src)), hm.size); err != nil {
		return nil, fmt.Errorf("Upload: %w", err)
	}
	if err := hm.acquire(); err != nil {
		return nil, fmt.Errorf("Upload: %w", err)
	}
	h := &hostOp{
		what:  fmt.Sprintf("upload of %d B", len(src)),
		run:   func(<-chan struct{}) error { copy(hm.data[off:], src); return nil },
		unref: hm.unref,
	}
	if err := s.enqueue(h); err != nil {
		hm.unref()
		return nil, err
	}
	return s.newOp(h, nil, nil), nil
}

// Gather validates objs against dst, then enqueues the copy.
func (s *hostStream) Gather(dst HostBuf, objs []Object) (*Op, error) {
	return s.transfer(dst, objs, false)
}

// Scatter validates objs against src, then enqueues the copy.
func (s *hostStream) Scatter(src HostBuf, objs []Object) (*Op, error) {
	return s.transfer(src, objs, true)
}

func (s *hostStream) transfer(hb HostBuf, objs []Object, scatter bool) (*Op, error) {
	what := "gather"
	if scatter {
		what = "scatter"
	}
	plan, err := planTransfer(hb, objs, scatter, s.dev.path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	n := len(plan.objs)
	sums := make([]uint64, n)
	lens := make([]uint64, n)
	for i, o := range plan.objs {
		lens[i] = uint64(len(o.host))
	}
	h := &hostOp{
		what:  fmt.Sprintf("%s of %d objects (%s)", what, n, plan.path().name()),
		run:   func(<-chan struct{}) error { plan.run(sums, scatter); return nil },
		unref: plan.unref,
	}
	start := time.Now()
	if err := s.enqueue(h); err != nil {
		plan.unref()
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	op := s.newOp(h, sums, lens)
	op.path, op.started = plan.path().name(), start
	return op, nil
}

// Synchronize waits until everything enqueued so far has finished.
func (s *hostStream) Synchronize(ctx context.Context) error {
	s.mu.Lock()
	last := s.last
	s.mu.Unlock()
	if last != nil {
		select {
		case <-last.done:
		default:
			select {
			case <-last.done:
			case <-ctx.Done():
				return fmt.Errorf("cuda: synchronize stream %d: %w", s.id, ctx.Err())
			}
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed
}

// Close refuses new work and waits for the goroutine to finish what is
// queued. It never blocks on another stream or process: Delays end early,
// and a wait on an event that has not completed fails (with it, everything
// queued after it). Idempotent.
func (s *hostStream) Close() error {
	s.mu.Lock()
	first := !s.closed
	if first {
		s.closed = true
		close(s.stop)
		s.cond.Broadcast()
	}
	s.mu.Unlock()
	<-s.exited
	if first {
		s.dev.res.remove(s)
	}
	return nil
}
