package cudatest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/cuda"
)

func testInfo(t *testing.T, dev cuda.Device) {
	in := dev.Info()
	switch in.Backend {
	case "host":
	case "cuda":
		if !strings.HasPrefix(in.UUID, "GPU-") {
			t.Errorf("CUDA device UUID %q does not start with GPU-", in.UUID)
		}
	default:
		t.Errorf("Info().Backend = %q, want host or cuda", in.Backend)
	}
	if in.UUID == "" {
		t.Error("Info().UUID is empty")
	}
	if in2 := dev.Info(); in2 != in {
		t.Errorf("Info() changed: %+v then %+v", in, in2)
	}
}

func testWriteRead(t *testing.T, dev cuda.Device) {
	m := alloc(t, dev, 1000)
	want := randomBytes(1000, 11)
	write(t, dev, m, 0, want)
	equalBytes(t, "Read after Write", readAll(t, dev, m), want)
	part := randomBytes(101, 12)
	write(t, dev, m, 333, part)
	copy(want[333:], part)
	got := make([]byte, 500)
	if err := dev.Read(m, 17, got); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "Read at offset 17", got, want[17:517])
	write(t, dev, m, 1000, nil) // empty, at the end: allowed

	for _, c := range []struct {
		name string
		err  error
	}{
		{"Write 2 B at 999", dev.Write(m, 999, []byte{1, 2})},
		{"Write 2 B at MaxUint64", dev.Write(m, math.MaxUint64, []byte{1, 2})},
		{"Read 2 B at 999", dev.Read(m, 999, make([]byte, 2))},
		{"Read 0 B at 1001", dev.Read(m, 1001, nil)},
	} {
		isErr(t, c.name, c.err, cuda.ErrOutOfRange)
	}
	equalBytes(t, "pool after rejected Writes", readAll(t, dev, m), want)
}

func testUpload(t *testing.T, dev cuda.Device) {
	s := newStream(t, dev)
	m := alloc(t, dev, 4096)
	want := sentinelBytes(4096, 9)
	write(t, dev, m, 0, want)
	data := randomBytes(1001, 13)
	op, err := s.Upload(m, 7, data)
	if err != nil {
		t.Fatal(err)
	}
	wait(t, op, "Upload")
	copy(want[7:], data)
	equalBytes(t, "pool after Upload", readAll(t, dev, m), want)

	op, err = s.Upload(m, 4000, make([]byte, 97))
	if op != nil {
		t.Fatal("Upload past the end returned an Op")
	}
	isErr(t, "Upload past the end", err, cuda.ErrOutOfRange)
	if err := s.Synchronize(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "pool after rejected Upload", readAll(t, dev, m), want)
}

// Event tests judge ordering by timing against device-side Delays, so they
// run one at a time: run in parallel on the H200, a sibling's device work
// and driver calls (context creation, event and memory teardown) held a
// 4 KiB gather back past the tests' 1 s margin in 2-3 of 10 runs of the
// suite, in direct and staged mode alike, although the same gather behind
// a 1 s Delay on another stream of the same process finished in 0.03-14 ms
// in every trial with nothing else running (and with Alloc, AllocHost,
// NewStream, NewEvent, Write or Read issued concurrently).
func testEvents(t *testing.T, open Opener) {
	run := func(name string, f func(t *testing.T, dev cuda.Device)) {
		t.Run(name, func(t *testing.T) {
			f(t, openDev(t, open))
		})
	}
	for _, ipc := range []bool{false, true} {
		name := "local"
		if ipc {
			name = "interprocess"
		}
		run(name+"/NeverRecorded", func(t *testing.T, dev cuda.Device) { testNeverRecorded(t, dev, ipc) })
		run(name+"/WaitBeforeRecord", func(t *testing.T, dev cuda.Device) { testWaitBeforeRecord(t, dev, ipc) })
		run(name+"/WaitBlocksLaterWork", func(t *testing.T, dev cuda.Device) { testWaitBlocks(t, dev, ipc) })
		run(name+"/RecordCapturesPosition", func(t *testing.T, dev cuda.Device) { testRecordPosition(t, dev, ipc) })
		run(name+"/ReleasedEventFailsStream", func(t *testing.T, dev cuda.Device) { testReleasedEvent(t, dev, ipc) })
	}
	run("Contexts", testContexts)
}

// whole is one object covering all of m at host offset off.
func whole(m cuda.Mem, off uint64) []cuda.Object {
	return []cuda.Object{{HostOff: off, Spans: []cuda.Span{{Mem: m, Off: 0, Len: m.Size()}}}}
}

// An event never recorded is complete, and waiting on it waits for nothing.
func testNeverRecorded(t *testing.T, dev cuda.Device, ipc bool) {
	e := newEvent(t, dev, ipc)
	if done, err := e.Query(); err != nil || !done {
		t.Fatalf("Query of a never-recorded event = %v, %v; want true, nil", done, err)
	}
	if err := e.Synchronize(testCtx(t)); err != nil {
		t.Fatalf("Synchronize of a never-recorded event: %v", err)
	}
	s := newStream(t, dev)
	if err := s.WaitEvent(e); err != nil {
		t.Fatalf("WaitEvent on a never-recorded event: %v", err)
	}
	if err := s.Synchronize(testCtx(t)); err != nil {
		t.Fatal(err)
	}
}

// A wait issued before any Record is bound to nothing: it does not wait for
// a Record issued later (cuStreamWaitEvent semantics). Once recorded, a new
// wait does wait.
func testWaitBeforeRecord(t *testing.T, dev cuda.Device, ipc bool) {
	const delay = 2 * time.Second
	a, b := newStream(t, dev), newStream(t, dev)
	m := alloc(t, dev, 4096)
	old, fresh := sentinelBytes(4096, 1), randomBytes(4096, 21)
	write(t, dev, m, 0, old)
	hb := allocHost(t, dev, 4096)
	e := newEvent(t, dev, ipc)

	if err := b.WaitEvent(e); err != nil {
		t.Fatalf("WaitEvent before any Record: %v", err)
	}
	if err := a.Delay(delay); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Upload(m, 0, fresh); err != nil {
		t.Fatal(err)
	}
	if err := a.Record(e); err != nil {
		t.Fatal(err)
	}
	op, err := b.Gather(hb, whole(m, 0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), delay/2)
	defer cancel()
	if err := op.Wait(ctx); err != nil {
		t.Fatalf("work after a wait issued before any Record is held back (by a later Record?): %v", err)
	}
	equalBytes(t, "gathered before the producer wrote", hb.Bytes(), old)

	if err := b.WaitEvent(e); err != nil {
		t.Fatal(err)
	}
	gather(t, b, hb, whole(m, 0))
	equalBytes(t, "gathered after waiting on the recorded event", hb.Bytes(), fresh)
}

// WaitEvent holds back later work of the waiting stream until the recorded
// work of the other stream is done.
func testWaitBlocks(t *testing.T, dev cuda.Device, ipc bool) {
	const delay = 500 * time.Millisecond
	a, b := newStream(t, dev), newStream(t, dev)
	m := alloc(t, dev, 4096+37)
	old, fresh := sentinelBytes(m.Size(), 1), randomBytes(m.Size(), 22)
	write(t, dev, m, 0, old)
	hb := allocHost(t, dev, m.Size()+3)
	e := newEvent(t, dev, ipc)

	start := time.Now()
	if err := a.Delay(delay); err != nil {
		t.Fatal(err)
	}
	up, err := a.Upload(m, 0, fresh)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Record(e); err != nil {
		t.Fatal(err)
	}
	done, err := e.Query()
	if err != nil {
		t.Fatal(err)
	}
	if done && time.Since(start) < delay/2 {
		t.Fatal("Query reports the event complete while the recorded work is still running")
	}
	if err := b.WaitEvent(e); err != nil {
		t.Fatal(err)
	}
	sums := gather(t, b, hb, whole(m, 3))
	equalBytes(t, "gathered after WaitEvent", hb.Bytes()[3:], fresh)
	if want := checksum.Sum(fresh); sums[0] != want {
		t.Fatalf("sum %#016x, want %#016x", sums[0], want)
	}
	if err := up.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if done, err := e.Query(); err != nil || !done {
		t.Fatalf("Query after the work = %v, %v; want true, nil", done, err)
	}
	if err := e.Synchronize(testCtx(t)); err != nil {
		t.Fatal(err)
	}
}

// An event captures the work enqueued before Record, not work enqueued
// after it.
func testRecordPosition(t *testing.T, dev cuda.Device, ipc bool) {
	const later = 1500 * time.Millisecond
	a, c := newStream(t, dev), newStream(t, dev)
	m := alloc(t, dev, 1024)
	old, fresh := sentinelBytes(1024, 4), randomBytes(1024, 23)
	write(t, dev, m, 0, old)
	hb := allocHost(t, dev, 1024)
	e := newEvent(t, dev, ipc)

	if err := a.Delay(200 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := a.Record(e); err != nil {
		t.Fatal(err)
	}
	if err := a.Delay(later); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Upload(m, 0, fresh); err != nil {
		t.Fatal(err)
	}
	if err := e.Synchronize(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	synced := time.Now()
	gather(t, c, hb, whole(m, 0))
	if time.Since(synced) < later/2 {
		equalBytes(t, "gathered after the event (the work after Record must not have run)", hb.Bytes(), old)
	} else {
		t.Log("machine too slow to check that the event excludes later work")
	}
	if err := a.Synchronize(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	gather(t, c, hb, whole(m, 0))
	equalBytes(t, "gathered after the stream finished", hb.Bytes(), fresh)
}

// Waiting on a released event is an error, never a silent success: the
// stream fails, nothing enqueued after the wait runs, every later result of
// the stream reports ErrStreamFailed, and other streams are unaffected.
func testReleasedEvent(t *testing.T, dev cuda.Device, ipc bool) {
	a, s := newStream(t, dev), newStream(t, dev)
	m := alloc(t, dev, 2048)
	pool := randomBytes(2048, 24)
	write(t, dev, m, 0, pool)
	hb := allocHost(t, dev, 2048)
	host := sentinelBytes(2048, 5)
	copy(hb.Bytes(), host)

	e, err := dev.NewEvent(ipc)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Record(e); err != nil {
		t.Fatal(err)
	}
	if err := a.Synchronize(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(); err != nil {
		t.Fatalf("second Release: %v", err)
	}
	_, err = e.Query()
	isErr(t, "Query of a released event", err, cuda.ErrReleased)
	isErr(t, "Synchronize of a released event", e.Synchronize(testCtx(t)), cuda.ErrReleased)

	if err := s.WaitEvent(e); err != nil {
		isErr(t, "WaitEvent on a released event", err, cuda.ErrReleased)
	}
	checkFailed := func(what string, op *cuda.Op, err error) {
		t.Helper()
		if err == nil {
			err = op.Wait(testCtx(t))
		}
		isErr(t, what+" after a wait on a released event", err, cuda.ErrStreamFailed)
	}
	op, err := s.Gather(hb, whole(m, 0))
	checkFailed("Gather", op, err)
	op, err = s.Scatter(hb, whole(m, 0))
	checkFailed("Scatter", op, err)
	op, err = s.Upload(m, 0, make([]byte, 16))
	checkFailed("Upload", op, err)
	for i := range 2 {
		isErr(t, fmt.Sprintf("Synchronize #%d of the failed stream", i+1), s.Synchronize(testCtx(t)),
			cuda.ErrStreamFailed, cuda.ErrReleased)
	}
	equalBytes(t, "host buffer (nothing may have been gathered)", hb.Bytes(), host)
	equalBytes(t, "pool (nothing may have been scattered or uploaded)", readAll(t, dev, m), pool)

	other := newStream(t, dev)
	gather(t, other, hb, whole(m, 0))
	equalBytes(t, "gathered on another stream", hb.Bytes(), pool)
}

// Synchronize and Wait return when their context ends, and the work still
// completes afterwards.
func testContexts(t *testing.T, dev cuda.Device) {
	const delay = time.Second
	a := newStream(t, dev)
	m := alloc(t, dev, 512)
	e := newEvent(t, dev, false)
	start := time.Now()
	if err := a.Delay(delay); err != nil {
		t.Fatal(err)
	}
	up, err := a.Upload(m, 0, randomBytes(512, 25))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Record(e); err != nil {
		t.Fatal(err)
	}
	short := func() context.Context {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		t.Cleanup(cancel)
		return ctx
	}
	errStream := a.Synchronize(short())
	errEvent := e.Synchronize(short())
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	errOp := up.Wait(canceled)
	if time.Since(start) < delay*3/4 {
		isErr(t, "Stream.Synchronize past its deadline", errStream, context.DeadlineExceeded)
		isErr(t, "Event.Synchronize past its deadline", errEvent, context.DeadlineExceeded)
		isErr(t, "Op.Wait with a canceled context", errOp, context.Canceled)
	} else {
		t.Log("machine too slow to check deadlines")
	}
	if err := a.Synchronize(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := up.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if done, err := e.Query(); err != nil || !done {
		t.Fatalf("Query = %v, %v after the stream finished", done, err)
	}
}

// Many streams at once: a chain of streams, each waiting on the previous
// one's event and copying its region onward, while independent goroutines
// run round trips on their own streams.
func testManyStreams(t *testing.T, dev cuda.Device) {
	const (
		stages  = 8
		workers = 4
		rounds  = 5
		w       = 561 * 16
	)
	data := randomBytes(w, 31)
	pool := alloc(t, dev, (stages+1)*w)
	poolImg := sentinelBytes((stages+1)*w, 6)
	write(t, dev, pool, 0, poolImg)
	region := func(i int) []cuda.Span { // three spans of odd sizes
		base := uint64(i * w)
		return []cuda.Span{
			{Mem: pool, Off: base, Len: 1001},
			{Mem: pool, Off: base + 1001, Len: 3},
			{Mem: pool, Off: base + 1004, Len: w - 1004},
		}
	}
	streams := make([]cuda.Stream, stages)
	events := make([]cuda.Event, stages)
	var gathers []*cuda.Op
	for i := range stages {
		streams[i] = newStream(t, dev)
		events[i] = newEvent(t, dev, i%2 == 1)
	}
	if err := streams[0].Delay(100 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := streams[0].Upload(pool, 0, data); err != nil {
		t.Fatal(err)
	}
	if err := streams[0].Record(events[0]); err != nil {
		t.Fatal(err)
	}
	for i := 1; i < stages; i++ {
		s := streams[i]
		hb := allocHost(t, dev, w+uint64(i))
		if err := s.WaitEvent(events[i-1]); err != nil {
			t.Fatal(err)
		}
		op, err := s.Gather(hb, []cuda.Object{{HostOff: uint64(i), Spans: region(i - 1)}})
		if err != nil {
			t.Fatal(err)
		}
		gathers = append(gathers, op)
		if _, err := s.Scatter(hb, []cuda.Object{{HostOff: uint64(i), Spans: region(i)}}); err != nil {
			t.Fatal(err)
		}
		if err := s.Record(events[i]); err != nil {
			t.Fatal(err)
		}
	}

	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for g := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := streamWorker(dev, g, rounds); err != nil {
				errs <- fmt.Errorf("worker %d: %w", g, err)
			}
		}()
	}

	if err := streams[stages-1].Synchronize(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	want := append([]byte(nil), poolImg...)
	for i := range stages {
		copy(want[i*w:], data)
	}
	equalBytes(t, "pool after the chain", readAll(t, dev, pool), want)
	sum := checksum.Sum(data)
	for i, op := range gathers {
		if err := op.Wait(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if op.Sums()[0] != sum {
			t.Fatalf("stage %d: sum %#016x, want %#016x", i+1, op.Sums()[0], sum)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// streamWorker runs gather/scatter round trips on its own stream and pools
// and checks every byte; it reports instead of failing (it runs off the
// test goroutine).
func streamWorker(dev cuda.Device, g, rounds int) (err error) {
	const pages, width, stride = 12, 656, 656 + 37
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := dev.NewStream()
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, s.Close()) }()
	src, err := dev.Alloc(pages * stride)
	if err != nil {
		return err
	}
	defer src.Release()
	dst, err := dev.Alloc(pages * stride)
	if err != nil {
		return err
	}
	defer dst.Release()
	hb, err := dev.AllocHost(pages*width + 1)
	if err != nil {
		return err
	}
	defer hb.Release()
	for r := range rounds {
		img := randomBytes(pages*stride, uint64(1000*g+r))
		pad := sentinelBytes(pages*stride, byte(g))
		if err := dev.Write(src, 0, img); err != nil {
			return err
		}
		if err := dev.Write(dst, 0, pad); err != nil {
			return err
		}
		var gObjs, sObjs []cuda.Object
		want := append([]byte(nil), pad...)
		for p := range pages {
			from, to := uint64(p*stride), uint64(((p+r+1)%pages)*stride)
			host := uint64(1 + p*width)
			gObjs = append(gObjs, cuda.Object{HostOff: host, Spans: []cuda.Span{{Mem: src, Off: from, Len: width}}})
			sObjs = append(sObjs, cuda.Object{HostOff: host, Spans: []cuda.Span{{Mem: dst, Off: to, Len: width}}})
			copy(want[to:to+width], img[from:from+width])
		}
		gop, err := s.Gather(hb, gObjs)
		if err != nil {
			return err
		}
		sop, err := s.Scatter(hb, sObjs)
		if err != nil {
			return err
		}
		if err := sop.Wait(ctx); err != nil {
			return err
		}
		if err := gop.Wait(ctx); err != nil {
			return err
		}
		for p := range pages {
			if gop.Sums()[p] != sop.Sums()[p] || gop.Sums()[p] != checksum.Sum(img[p*stride:p*stride+width]) {
				return fmt.Errorf("round %d page %d: sums differ", r, p)
			}
		}
		got := make([]byte, pages*stride)
		if err := dev.Read(dst, 0, got); err != nil {
			return err
		}
		if err := diff(got, want); err != nil {
			return fmt.Errorf("round %d: destination pool: %w", r, err)
		}
	}
	return nil
}

// Release and Close are idempotent; anything used after release is
// refused with ErrReleased.
func testLifecycle(t *testing.T, dev cuda.Device) {
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	m := alloc(t, dev, 64)
	hb := allocHost(t, dev, 64)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Stream.Close: %v", err)
	}
	_, err = s.Gather(hb, whole(m, 0))
	isErr(t, "Gather on a closed stream", err, cuda.ErrReleased)
	isErr(t, "Delay on a closed stream", s.Delay(time.Millisecond), cuda.ErrReleased)

	live := newStream(t, dev)
	dead, err := dev.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := dead.Release(); err != nil {
			t.Fatalf("Mem.Release #%d: %v", i+1, err)
		}
	}
	isErr(t, "Write to a released Mem", dev.Write(dead, 0, []byte{1}), cuda.ErrReleased)
	isErr(t, "Read from a released Mem", dev.Read(dead, 0, make([]byte, 1)), cuda.ErrReleased)
	_, err = live.Upload(dead, 0, []byte{1})
	isErr(t, "Upload to a released Mem", err, cuda.ErrReleased)

	h, err := dev.AllocHost(16)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := h.Release(); err != nil {
			t.Fatalf("HostBuf.Release #%d: %v", i+1, err)
		}
	}
	e, err := dev.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := e.Release(); err != nil {
			t.Fatalf("Event.Release #%d: %v", i+1, err)
		}
	}
	isErr(t, "Record of a released event", live.Record(e), cuda.ErrReleased)
	if err := live.Synchronize(testCtx(t)); err != nil {
		t.Fatalf("a refused Record failed the stream: %v", err)
	}

	if err := dev.Close(); err != nil {
		t.Fatal(err)
	}
	if err := dev.Close(); err != nil {
		t.Fatalf("second Device.Close: %v", err)
	}
	if _, err := dev.Alloc(64); err == nil {
		t.Fatal("Alloc after Device.Close succeeded")
	}
	if _, err := dev.NewStream(); err == nil {
		t.Fatal("NewStream after Device.Close succeeded")
	}
}
