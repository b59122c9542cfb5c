package bus

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"github.com/nats-io/nats.go"
)

// Backoff is a capped exponential backoff with jitter: attempt n waits a
// random time in [d/2, d] where d = Initial * 2^n, at most Max.
type Backoff struct {
	// Initial is the first wait. Default 20 ms.
	Initial time.Duration
	// Max caps every wait. Default 500 ms: a client moving to another
	// NATS server is back within a few of them.
	Max time.Duration
}

// DefaultBackoff returns the defaults documented on Backoff.
func DefaultBackoff() Backoff {
	return Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond}
}

// Delay is the wait before retry attempt (0 is the first retry).
func (b Backoff) Delay(attempt int) time.Duration {
	d := b.Max
	if attempt < 30 && b.Initial<<attempt < b.Max {
		d = b.Initial << attempt
	}
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// Retry says which failed requests CallRetry sends again.
type Retry struct {
	// Idempotent also resends a request whose attempt timed out or whose
	// connection closed: it may have been handled, so only for requests
	// that may be handled twice (lookups, registrations, waits that the
	// responder answers again from history). Default false: only a request
	// nobody received (nats.ErrNoResponders) is resent, which is safe for
	// every request.
	Idempotent bool
	// Attempt bounds one attempt on top of ctx; 0 gives each attempt what
	// is left of ctx (then a lost reply is only noticed at ctx's end).
	// Default 0.
	Attempt time.Duration
	// For bounds the resending: no attempt starts later than this after
	// the first; 0 resends until ctx ends. Default 0; NoResponders sets 3 s,
	// beyond a client's move to another server (under 2 s), so a request to
	// a responder that is really gone still fails soon.
	For time.Duration
	// Backoff spaces the attempts. Default DefaultBackoff().
	Backoff Backoff
}

// NoResponders returns the policy that resends only requests nobody
// received: what every request may use while its client or its responder
// moves to another NATS server of a cluster.
func NoResponders() Retry { return Retry{For: 3 * time.Second, Backoff: DefaultBackoff()} }

// Retryable reports whether err (from Call) may be sent again under r.
func (r Retry) Retryable(err error) bool {
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return true
	case !r.Idempotent:
		return false
	}
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrConnectionReconnecting)
}

// Do runs f until it succeeds, fails for good (not Retryable) or ctx
// ends, spacing the attempts by r.Backoff; each attempt gets its own
// context bounded by r.Attempt. The error is the last attempt's.
func (r Retry) Do(ctx context.Context, f func(context.Context) error) error {
	first := time.Now()
	for attempt := 0; ; attempt++ {
		actx, cancel := ctx, context.CancelFunc(func() {})
		if r.Attempt > 0 {
			actx, cancel = context.WithTimeout(ctx, r.Attempt)
		}
		err := f(actx)
		cancel()
		if err == nil || ctx.Err() != nil || !r.Retryable(err) {
			return err
		}
		wait := r.Backoff.Delay(attempt)
		if r.For > 0 && time.Since(first)+wait > r.For {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

// CallRetry is Call sent again under r (Retry.Do). A reply carrying an
// error (*wire.Error) is never resent here: the responder decided.
func CallRetry[Resp any](ctx context.Context, nc *nats.Conn, subject string, req any, r Retry) (*Resp, error) {
	var rep *Resp
	err := r.Do(ctx, func(ctx context.Context) error {
		var err error
		rep, err = Call[Resp](ctx, nc, subject, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	return rep, nil
}
