package rankd

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/wire"
)

// stallDevice hands the transfer engine streams whose Scatters (Gathers)
// wait behind a Delay of stall (gstall) when set: a copy the device has
// not finished when the engine's deadline passes.
type stallDevice struct {
	cuda.Device
	stall  atomic.Int64 // time.Duration
	gstall atomic.Int64 // time.Duration
}

type stallStream struct {
	cuda.Stream
	d *stallDevice
}

func (d *stallDevice) NewStream() (cuda.Stream, error) {
	s, err := d.Device.NewStream()
	if err != nil {
		return nil, err
	}
	return &stallStream{Stream: s, d: d}, nil
}

func (s *stallStream) Gather(dst cuda.HostBuf, objs []cuda.Object) (*cuda.Op, error) {
	if d := time.Duration(s.d.gstall.Load()); d > 0 {
		if err := s.Stream.Delay(d); err != nil {
			return nil, err
		}
	}
	return s.Stream.Gather(dst, objs)
}

func (s *stallStream) Scatter(src cuda.HostBuf, objs []cuda.Object) (*cuda.Op, error) {
	if d := time.Duration(s.d.stall.Load()); d > 0 {
		if err := s.Stream.Delay(d); err != nil {
			return nil, err
		}
	}
	return s.Stream.Scatter(src, objs)
}

// TestRetrieveWithBlocksInUseIsNotAnswered (C10): a retrieve whose
// deadline passed while its scatter was still queued on the device, and
// which the rankd's shutdown keeps from draining, may still write the
// engine's blocks: the engine gets no reply (it keeps the blocks until
// its own bound) rather than a failure it would recompute over at once.
// Red with the reply sent: the engine got an error reply while the
// scatter was still queued.
func TestRetrieveWithBlocksInUseIsNotAnswered(t *testing.T) {
	dev := &stallDevice{}
	h := newHarness(t, func(c *Config) {
		c.ShutdownTimeout, c.FlushTimeout = 500*time.Millisecond, 500*time.Millisecond
		c.wrapDevice = func(d cuda.Device) cuda.Device { dev.Device = d; return dev }
	})
	e, reg, want, key := storedPage(t, h)
	body, err := json.Marshal(wire.RetrieveRequest{RestoreID: "restore-1", Namespace: e.res.Namespace, Session: reg.Session,
		Items: []wire.RetrieveItem{{Chunk: 0, Group: 0, Key: key, Sum: checksum.Sum(want), Blocks: []int64{5}}}})
	if err != nil {
		t.Fatal(err)
	}

	dev.stall.Store(int64(time.Hour))
	m := nats.NewMsg(h.subj.Engine(h.rank, OpRetrieve))
	m.Data = body
	deadline := time.Now().Add(300 * time.Millisecond)
	m.Header.Set(wire.HeaderDeadline, wire.FormatDeadline(deadline))
	type answer struct {
		msg *nats.Msg
		err error
	}
	got := make(chan answer, 1)
	go func() {
		rep, err := h.nc.RequestMsg(m, 5*time.Second)
		got <- answer{rep, err}
	}()
	time.Sleep(time.Until(deadline) + 300*time.Millisecond) // the scatter timed out and waits to drain
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = h.d.Shutdown(sctx) // cuts the drain short: the scatter may still write block 5

	a := <-got
	if a.err == nil {
		t.Fatalf("the engine got a reply while its blocks may still be written: %s", a.msg.Data)
	}
	if !errors.Is(a.err, nats.ErrTimeout) && !errors.Is(a.err, nats.ErrNoResponders) {
		t.Fatalf("retrieve request: %v, want no reply (a timeout)", a.err)
	}
}
