package testutil

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestWatchdogAfter(t *testing.T) {
	for _, c := range []struct{ timeout, want time.Duration }{
		{0, 0},
		{20 * time.Minute, 19 * time.Minute},
		{5 * time.Minute, 4*time.Minute + 30*time.Second},
		{time.Minute, 54 * time.Second},
	} {
		if got := watchdogAfter(c.timeout); got != c.want {
			t.Errorf("watchdogAfter(%v) = %v, want %v", c.timeout, got, c.want)
		}
	}
}

// parkedInTest blocks until release closes: a stand-in for a test stuck
// on a channel.
func parkedInTest(release <-chan struct{}, parked chan<- struct{}) {
	close(parked)
	<-release
}

// TestStuckReportNamesTheWaitingTest takes a real dump with a goroutine of
// this file parked on a channel and checks that the report keeps it and
// this test function (last), and drops goroutines without test code.
func TestStuckReportNamesTheWaitingTest(t *testing.T) {
	release, parked := make(chan struct{}), make(chan struct{})
	defer close(release)
	go parkedInTest(release, parked)
	<-parked
	Eventually(t, 5*time.Second, "the goroutine to park on its channel", func() bool {
		return strings.Contains(string(allStacks()), "chan receive")
	})
	r := StuckReport(allStacks(), 64<<10)
	for _, want := range []string{"testutil.parkedInTest", "[chan receive", "testutil.TestStuckReportNamesTheWaitingTest", "main_test.go:"} {
		if !strings.Contains(r, want) {
			t.Fatalf("the report lacks %q:\n%s", want, r)
		}
	}
	if strings.Index(r, "parkedInTest") > strings.LastIndex(r, "TestStuckReportNamesTheWaitingTest") {
		t.Fatalf("the test function is not last:\n%s", r)
	}
}

func TestStuckReportKeepsTheTestsWithinItsLimit(t *testing.T) {
	g := func(id int, fn, file string) string {
		return "goroutine " + string(rune('0'+id)) + " [select]:\n" +
			"runtime.gopark(...)\n\t/go/src/runtime/proc.go:1\n" +
			modulePath + fn + "(...)\n\t" + file + ":10 +0x1\n" +
			"testing.tRunner(...)\n\t/go/src/testing/testing.go:2\n"
	}
	dump := strings.Join([]string{
		g(1, "coordinator.TestStuck", "/src/coordinator/x_test.go"),
		g(2, "coordinator.helperLoop", "/src/coordinator/y_test.go"),
		g(3, "coordinator.(*Coordinator).run", "/src/coordinator/run.go"),
	}, "\n")
	full := StuckReport([]byte(dump), 1<<20)
	if !strings.HasPrefix(full, "testutil.Main: 2 goroutines run test code:") || strings.Contains(full, "run.go") {
		t.Fatalf("want the two goroutines with test code only:\n%s", full)
	}
	if strings.Contains(full, "testing.tRunner") || !strings.Contains(full, "runtime.gopark") {
		t.Fatalf("want the top frame and this module's frames only:\n%s", full)
	}
	short := StuckReport([]byte(dump), 10)
	if !strings.Contains(short, "coordinator.TestStuck") || strings.Contains(short, "helperLoop") || !strings.Contains(short, "1 of them left out") {
		t.Fatalf("a short limit must keep the test function and say what it dropped:\n%s", short)
	}
}

const watchdogChildEnv = "KVTIER_TESTUTIL_WATCHDOG_CHILD"

// TestWatchdogChildHangs is the stuck test TestWatchdogFires runs in a
// child process; in the parent it returns at once.
func TestWatchdogChildHangs(t *testing.T) {
	if os.Getenv(watchdogChildEnv) == "" {
		return
	}
	parkedInTest(make(chan struct{}), make(chan struct{}))
}

// TestWatchdogFires runs this binary's hanging test with a 3 s timeout:
// the watchdog must end it with status 2 before the timeout's panic and
// name the test and where it waits at the end of its output.
func TestWatchdogFires(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestWatchdogChildHangs$", "-test.timeout=3s")
	cmd.Env = append(os.Environ(), watchdogChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("the child ended with %v, want exit status 2:\n%s", err, out)
	}
	s := string(out)
	if strings.Contains(s, "panic: test timed out") {
		t.Fatalf("the timeout's panic came first:\n%s", s)
	}
	tail := s[strings.Index(s, "testutil.Main:"):]
	for _, want := range []string{"testutil.parkedInTest", "testutil.TestWatchdogChildHangs", "main_test.go:", "testutil.Watchdog: the tests ran 2.7s"} {
		if !strings.Contains(tail, want) {
			t.Fatalf("the end of the output lacks %q:\n%s", want, s)
		}
	}
}

// TestWaitingReportNamesWhatAShutdownWaitsOn: a dump in the shape of the
// stop 59 CI hang (a test's cleanup in raft's Shutdown, waiting for raft's
// goroutines): the report lists raft's state-machine goroutine waiting in
// this module, longest first, and leaves out the test's own goroutine,
// short waits and goroutines in neither this module nor raft.
func TestWaitingReportNamesWhatAShutdownWaitsOn(t *testing.T) {
	dump := strings.Join([]string{
		"goroutine 11 [semacquire, 17 minutes]:\nsync.runtime_SemacquireWaitGroup(0xc0, 0x0)\n\t/go/src/runtime/sema.go:114 +0x2e\n" +
			modulePath + "coordinator/replica.(*Node).Shutdown(0xc0)\n\t/src/coordinator/replica/node.go:327 +0x90\n" +
			modulePath + "coordinator.newRaftCluster.func1()\n\t/src/coordinator/raft_test.go:64 +0xbd\n",
		"goroutine 12 [select, 18 minutes]:\nruntime.selectgo(0xc0, 0xc1, 0x0)\n\t/go/src/runtime/select.go:351 +0x1\n" +
			modulePath + "index.(*Index).enqueue(0xc0, {0x1, 0x2}, 0xc3)\n\t/src/index/index.go:385 +0x1\n" +
			modulePath + "coordinator/replica.fsm.ApplyBatch({0xc0}, {0xc4, 0x1, 0x1})\n\t/src/coordinator/replica/fsm.go:38 +0x1\n" +
			"github.com/hashicorp/raft.(*Raft).runFSM.func1(0xc5)\n\t/mod/raft/fsm.go:100 +0x1\n",
		"goroutine 13 [IO wait, 2 minutes, locked to thread]:\ninternal/poll.runtime_pollWait(0x7f, 0x72)\n\t/go/src/runtime/netpoll.go:351 +0x1\n" +
			"net.(*conn).Read(0xc0, {0xc1, 0x10, 0x10})\n\t/go/src/net/net.go:194 +0x1\n" +
			"github.com/hashicorp/raft.(*NetworkTransport).handleConn(0xc0, {0x1, 0x2}, {0x3, 0xc4})\n\t/mod/raft/net_transport.go:560 +0x1\n",
		"goroutine 14 [select]:\nruntime.selectgo(0xc0)\n\t/go/src/runtime/select.go:351 +0x1\n" +
			modulePath + "index.(*Index).run(0xc0)\n\t/src/index/committer.go:120 +0x1\n",
		"goroutine 15 [chan receive, 30 minutes]:\ngithub.com/nats-io/nats-server/v2/server.(*Server).loop(0xc0)\n\t/mod/nats/server.go:1 +0x1\n",
	}, "\n")
	r := WaitingReport([]byte(dump), 10)
	want := "testutil.Main: 2 goroutines outside test code have waited a minute or more in this module or raft:\n" +
		"goroutine 12 [select, 18 minutes]: index.(*Index).enqueue index.go:385\n" +
		"goroutine 13 [IO wait, 2 minutes, locked to thread]: net.(*conn).Read <- github.com/hashicorp/raft.(*NetworkTransport).handleConn net_transport.go:560\n"
	if r != want {
		t.Fatalf("report:\n%s\nwant:\n%s", r, want)
	}
	if none := WaitingReport([]byte(dump[strings.Index(dump, "goroutine 14"):]), 10); none != "" {
		t.Fatalf("no goroutine waited a minute in this module or raft, yet:\n%s", none)
	}
	if short := WaitingReport([]byte(dump), 1); !strings.Contains(short, "(the 1 longest of 2 lines)") || strings.Contains(short, "goroutine 13") {
		t.Fatalf("max 1 must keep the longest wait and say so:\n%s", short)
	}

	// Three coordinators' idle loops: the same state at the same frames
	// is one line, whatever each waited; another state is a line of its own.
	twin := func(id, wait, state string) string {
		g := dump[strings.Index(dump, "goroutine 13"):strings.Index(dump, "goroutine 14")]
		return strings.Replace(strings.Replace(g, "goroutine 13 [IO wait, 2 minutes,", "goroutine "+id+" ["+state+", "+wait+",", 1), "\n\n", "\n", 1)
	}
	more := dump + "\n" + twin("16", "5 minutes", "IO wait") + "\n" + twin("17", "1 minute", "IO wait") + "\n" + twin("18", "3 minutes", "select")
	r = WaitingReport([]byte(more), 10)
	want = "testutil.Main: 5 goroutines outside test code have waited a minute or more in this module or raft:\n" +
		"goroutine 12 [select, 18 minutes]: index.(*Index).enqueue index.go:385\n" +
		"goroutines 13, 16, 17 [IO wait, 1-5 minutes, locked to thread]: net.(*conn).Read <- github.com/hashicorp/raft.(*NetworkTransport).handleConn net_transport.go:560\n" +
		"goroutine 18 [select, 3 minutes, locked to thread]: net.(*conn).Read <- github.com/hashicorp/raft.(*NetworkTransport).handleConn net_transport.go:560\n"
	if r != want {
		t.Fatalf("report of alike goroutines:\n%s\nwant:\n%s", r, want)
	}
}
