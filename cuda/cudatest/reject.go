package cudatest

import (
	"math"
	"testing"

	"github.com/kvtier/kvtier/cuda"
)

// rejectEnv is the state a rejection case builds its objects from.
type rejectEnv struct {
	m, other cuda.Mem     // live pools of poolA and poolB bytes
	dead     cuda.Mem     // released
	hb       cuda.HostBuf // hostN bytes
	deadHB   cuda.HostBuf // released
}

const (
	poolA = 4096
	poolB = 512
	hostN = 8192
)

// Bad transfers are rejected when they are issued, with the right
// sentinel, before anything is copied: the valid first object of the batch
// is not copied either, every byte of the pools and of the host buffer is
// unchanged, and the stream still works.
func testReject(t *testing.T, open Opener) {
	valid := cuda.Object{HostOff: 0}
	cases := []struct {
		name    string
		scatter bool // else gather
		deadHB  bool // use the released host buffer
		bad     func(e *rejectEnv) []cuda.Object
		want    error
	}{
		{"span end past Mem by 1 byte", false, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.m, Off: poolA - 97, Len: 98}}}}
		}, cuda.ErrOutOfRange},
		{"span offset past Mem", false, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.m, Off: poolA + 1, Len: 0}}}}
		}, cuda.ErrOutOfRange},
		{"span offset+length overflows uint64", false, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.m, Off: math.MaxUint64 - 10, Len: 20}}}}
		}, cuda.ErrOutOfRange},
		{"second span of an object in a small pool out of range", false, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.m, Off: 0, Len: 8}, {Mem: e.other, Off: poolB - 12, Len: 13}}}}
		}, cuda.ErrOutOfRange},
		{"host range past buffer by 1 byte", false, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: hostN - 50, Spans: []cuda.Span{{Mem: e.m, Off: 0, Len: 51}}}}
		}, cuda.ErrOutOfRange},
		{"host offset past buffer", false, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: hostN + 1, Spans: []cuda.Span{{Mem: e.m, Off: 0, Len: 1}}}}
		}, cuda.ErrOutOfRange},
		{"host offset+length overflows uint64", false, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: math.MaxUint64 - 5, Spans: []cuda.Span{{Mem: e.m, Off: 0, Len: 10}}}}
		}, cuda.ErrOutOfRange},
		{"released Mem", false, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.dead, Off: 0, Len: 10}}}}
		}, cuda.ErrReleased},
		{"released host buffer", false, true, func(e *rejectEnv) []cuda.Object { return nil }, cuda.ErrReleased},

		{"span end past Mem by 1 byte", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.m, Off: poolA - 97, Len: 98}}}}
		}, cuda.ErrOutOfRange},
		{"span offset+length overflows uint64", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.m, Off: math.MaxUint64 - 10, Len: 20}}}}
		}, cuda.ErrOutOfRange},
		{"second span of an object in a small pool out of range", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.m, Off: 1000, Len: 8}, {Mem: e.other, Off: poolB - 12, Len: 13}}}}
		}, cuda.ErrOutOfRange},
		{"host range past buffer by 1 byte", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: hostN - 50, Spans: []cuda.Span{{Mem: e.m, Off: 1000, Len: 51}}}}
		}, cuda.ErrOutOfRange},
		{"host offset+length overflows uint64", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: math.MaxUint64 - 5, Spans: []cuda.Span{{Mem: e.m, Off: 1000, Len: 10}}}}
		}, cuda.ErrOutOfRange},
		{"released Mem", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.dead, Off: 0, Len: 10}}}}
		}, cuda.ErrReleased},
		{"released host buffer", true, true, func(e *rejectEnv) []cuda.Object { return nil }, cuda.ErrReleased},
		{"overlapping spans in one object", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 200, Spans: []cuda.Span{{Mem: e.m, Off: 1000, Len: 100}, {Mem: e.m, Off: 1099, Len: 10}}}}
		}, cuda.ErrOverlap},
		{"overlap with the valid object", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 300, Spans: []cuda.Span{{Mem: e.m, Off: 50, Len: 60}}}}
		}, cuda.ErrOverlap},
		{"duplicate destination page", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 400, Spans: []cuda.Span{{Mem: e.m, Off: 0, Len: 100}}}}
		}, cuda.ErrOverlap},
		{"span inside another", true, false, func(e *rejectEnv) []cuda.Object {
			return []cuda.Object{{HostOff: 400, Spans: []cuda.Span{{Mem: e.other, Off: 0, Len: 1}, {Mem: e.m, Off: 10, Len: 1}}}}
		}, cuda.ErrOverlap},
	}
	for _, c := range cases {
		kind := "Gather/"
		if c.scatter {
			kind = "Scatter/"
		}
		t.Run(kind+c.name, func(t *testing.T) {
			dev := openDev(t, open)
			s := newStream(t, dev)
			e := &rejectEnv{
				m:      alloc(t, dev, poolA),
				other:  alloc(t, dev, poolB),
				hb:     allocHost(t, dev, hostN),
				deadHB: allocHost(t, dev, hostN),
			}
			dead, err := dev.Alloc(256)
			if err != nil {
				t.Fatal(err)
			}
			if err := dead.Release(); err != nil {
				t.Fatal(err)
			}
			e.dead = dead
			if err := e.deadHB.Release(); err != nil {
				t.Fatal(err)
			}
			poolM, poolO, host := sentinelBytes(poolA, 1), sentinelBytes(poolB, 2), sentinelBytes(hostN, 3)
			write(t, dev, e.m, 0, poolM)
			write(t, dev, e.other, 0, poolO)
			copy(e.hb.Bytes(), host)

			first := valid
			first.Spans = []cuda.Span{{Mem: e.m, Off: 0, Len: 100}}
			objs := append([]cuda.Object{first}, c.bad(e)...)
			hb := e.hb
			if c.deadHB {
				hb = e.deadHB
			}
			var op *cuda.Op
			if c.scatter {
				op, err = s.Scatter(hb, objs)
			} else {
				op, err = s.Gather(hb, objs)
			}
			if op != nil {
				werr := op.Wait(testCtx(t))
				t.Fatalf("accepted: returned an Op (Wait: %v), want an error wrapping %q when issued", werr, c.want)
			}
			isErr(t, "rejection", err, c.want)
			t.Logf("rejected: %v", err)
			if err := s.Synchronize(testCtx(t)); err != nil {
				t.Fatalf("a rejected call failed the stream: %v", err)
			}
			equalBytes(t, "pool after rejection", readAll(t, dev, e.m), poolM)
			equalBytes(t, "second pool after rejection", readAll(t, dev, e.other), poolO)
			equalBytes(t, "host buffer after rejection", e.hb.Bytes(), host)

			// The stream still works, and adjacent (touching) destinations
			// are not overlaps.
			ok := []cuda.Object{
				{HostOff: 1, Spans: []cuda.Span{{Mem: e.m, Off: 0, Len: 100}, {Mem: e.m, Off: 100, Len: 50}}},
				{HostOff: 151, Spans: []cuda.Span{{Mem: e.m, Off: 150, Len: 7}}},
			}
			gather(t, s, e.hb, ok)
			want := append([]byte(nil), host...)
			copy(want[1:], poolM[:157])
			equalBytes(t, "host buffer after a valid Gather", e.hb.Bytes(), want)
			scatter(t, s, e.hb, ok)
			equalBytes(t, "pool after a valid Scatter", readAll(t, dev, e.m), poolM)
		})
	}
}
