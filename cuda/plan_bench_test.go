package cuda

import (
	"fmt"
	"syscall"
	"testing"
	"time"
)

// cpuTime is the CPU time (user + system) of the process so far: on a
// shared machine a better measure of host work than wall time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// planMem is a Mem for planning benchmarks: no memory behind it.
type planMem struct{ size uint64 }

func (m *planMem) Size() uint64   { return m.size }
func (m *planMem) Release() error { return nil }

// rowSpanObjects builds the 561 B-row geometry with one span per row
// (issue 12.7): rows of 561 B in 64-row pages of stride 64*561+37, nobj
// objects of 256 rows (4 pages) each, pages of object k at distinct places
// of one pool, objects back to back in the host buffer.
func rowSpanObjects(nobj int) ([]Object, *planMem) {
	const row, rows, perPage = 561, 256, 64
	const stride = perPage*row + 37
	pool := &planMem{size: uint64(nobj*rows/perPage) * stride}
	objs := make([]Object, nobj)
	var host uint64
	for k := range objs {
		spans := make([]Span, 0, rows)
		for p := range rows / perPage {
			// Pages of an object spread over the pool (not adjacent).
			page := uint64((p*nobj + k) % (nobj * rows / perPage))
			for r := range perPage {
				spans = append(spans, Span{Mem: pool, Off: page*stride + uint64(r)*row, Len: row})
			}
		}
		objs[k] = Object{HostOff: host, Spans: spans}
		host += rows * row
	}
	return objs, pool
}

// BenchmarkPlanRowSpans measures the host side of planning a scatter of
// 561 B rows as one span per row, per stage and per span: the transfer
// checks (checkTransfer: bounds, Mems, the overlap sort of every
// destination span), the device-address objects, the staged plan, and the
// encoded tables. Not asserted anywhere; it prints ns/span.
//
//	go test -run '^$' -bench PlanRowSpans -benchtime 5x ./cuda
func BenchmarkPlanRowSpans(b *testing.B) {
	for _, nobj := range []int{1024, 14848} { // 262,144 and 3.8 M spans
		b.Run(fmt.Sprintf("spans=%d", nobj*256), func(b *testing.B) {
			objs, pool := rowSpanObjects(nobj)
			nspans := nobj * 256
			var hostLen uint64
			for _, o := range objs {
				hostLen = max(hostLen, o.HostOff+o.Len())
			}
			resolve := func(m Mem) (*planMem, memView, error) {
				fm := m.(*planMem)
				return fm, memView{size: fm.size, base: devBase}, nil
			}
			var check, build, plan, enc time.Duration
			var buf []byte
			cpu0 := cpuTime()
			for b.Loop() {
				t0 := time.Now()
				t, err := checkTransfer(objs, hostLen, true, resolve)
				if err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				xobjs := deviceObjects(t, func(*planMem) uint64 { return devBase })
				t2 := time.Now()
				p, err := planStaged(xobjs, [2]uint64{stageBase, stageBase + 32<<20}, 32<<20)
				if err != nil {
					b.Fatal(err)
				}
				t3 := time.Now()
				lay := p.layout()
				if uint64(len(buf)) < lay.size {
					buf = make([]byte, lay.size)
				}
				p.encode(buf, lay)
				t4 := time.Now()
				check += t1.Sub(t0)
				build += t2.Sub(t1)
				plan += t3.Sub(t2)
				enc += t4.Sub(t3)
			}
			cpu := cpuTime() - cpu0
			_ = pool
			per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(b.N) / float64(nspans) }
			total := per(check) + per(build) + per(plan) + per(enc)
			b.ReportMetric(total, "ns/span")
			b.ReportMetric(per(cpu), "cpu-ns/span")
			b.ReportMetric(per(check), "check-ns/span")
			b.ReportMetric(per(plan), "plan-ns/span")
			fmt.Printf("plan 561 B rows, one span per row, %d spans: %.1f ns/span wall = check %.1f + device objects %.1f + staged plan %.1f + encode %.1f; process CPU %.1f ns/span\n",
				nspans, total, per(check), per(build), per(plan), per(enc), per(cpu))
		})
	}
}
