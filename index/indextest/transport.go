package indextest

import (
	"math/rand/v2"

	"github.com/kvtier/kvtier/wire"
)

// Faults are the probabilities, per batch sent, that the transport drops
// it, delivers it twice (the copy possibly later), or holds it back to
// deliver after later batches.
type Faults struct {
	Drop      float64
	Duplicate float64
	Reorder   float64
}

// Transport is a faulty event transport between simulated ranks and the
// index: at-most-once, at-least-once and out-of-order all at once.
// Deterministic for a given seed.
type Transport struct {
	f    Faults
	rng  *rand.Rand
	held []wire.Batch

	Sent, Dropped, Duplicated, Reordered int
}

// NewTransport returns a transport with faults f.
func NewTransport(f Faults, seed uint64) *Transport {
	return &Transport{f: f, rng: rand.New(rand.NewPCG(seed, 0x5bd1e995))}
}

// Send hands a batch to the transport and returns the batches delivered
// now, in delivery order: possibly none, the batch, a duplicate, and
// batches held back earlier.
func (t *Transport) Send(b wire.Batch) []wire.Batch {
	t.Sent++
	var out []wire.Batch
	switch x := t.rng.Float64(); {
	case x < t.f.Drop:
		t.Dropped++
	case x < t.f.Drop+t.f.Reorder:
		t.Reordered++
		t.held = append(t.held, b)
	default:
		out = append(out, b)
	}
	if t.rng.Float64() < t.f.Duplicate {
		t.Duplicated++
		if t.rng.IntN(2) == 0 {
			out = append(out, b)
		} else {
			t.held = append(t.held, b)
		}
	}
	// Release some held batches, in random order.
	for i := 0; i < len(t.held); {
		if t.rng.IntN(3) == 0 {
			out = append(out, t.held[i])
			t.held = append(t.held[:i], t.held[i+1:]...)
			continue
		}
		i++
	}
	return out
}

// Flush returns every held batch, in random order.
func (t *Transport) Flush() []wire.Batch {
	out := t.held
	t.held = nil
	t.rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}
