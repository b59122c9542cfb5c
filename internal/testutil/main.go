package testutil

import (
	"bytes"
	"flag"
	"fmt"
	"iter"
	"os"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Main runs a package's tests as goleak.VerifyTestMain does, with a
// watchdog. A test binary that hangs is killed by its -test.timeout with a
// dump of every goroutine, and a CI log that keeps only its last lines
// then shows raft's and NATS's goroutines, not which test waits where. So
// shortly before that timeout the watchdog prints the goroutines that run
// test code (the test functions last, so that they end the output), each
// cut to its waiting frame and the frames of this module, and exits 2.
func Main(m *testing.M, opts ...goleak.Option) {
	Watchdog()
	goleak.VerifyTestMain(m, opts...)
}

// Watchdog starts Main's watchdog, for a TestMain that does not call Main
// (it parses the flags).
func Watchdog() {
	flag.Parse()
	d := watchdogAfter(timeoutFlag())
	if d <= 0 {
		return
	}
	time.AfterFunc(d, func() {
		dump := allStacks()
		fmt.Fprint(os.Stderr, StuckReport(dump, 8<<10))
		fmt.Fprint(os.Stderr, WaitingReport(dump, 12))
		fmt.Fprintf(os.Stderr, "testutil.Watchdog: the tests ran %v, close to -test.timeout: stuck (stacks above, test functions last; then what waits longest outside test code)\n", d)
		os.Exit(2)
	})
}

// WaitingReport lists, a line each, the goroutines of dump that run no
// test code and have waited a minute or more in a frame of this module or
// of hashicorp/raft (a test that hangs in a shutdown waits on one of
// them: raft's Shutdown waits for its own goroutines, which may wait on
// ours): its header, the frame it waits in and the first such frame.
// Goroutines waiting in the same state at the same frames share a line
// (three coordinators' idle loops are one line each, not three, so they
// do not crowd out the one that is stuck). The longest waits come first,
// at most limit lines, then how many were left out. Nothing when none has.
func WaitingReport(dump []byte, limit int) string {
	type g struct {
		ids        []string
		state, at  string // the header's state without the wait; top <- ours file:line
		mins, most int    // the shortest and the longest wait
	}
	var gs []*g
	same := map[string]*g{}
	waiting := 0
	for lines, test := range goroutines(dump) {
		if test {
			continue
		}
		mins := waitedMinutes(lines[0])
		if mins < 1 {
			continue
		}
		var top, ours, at string
		for i := 1; i+1 < len(lines); i += 2 {
			fn := strings.TrimPrefix(funcName(lines[i]), modulePath)
			if top == "" && !strings.HasPrefix(fn, "runtime.") && !strings.HasPrefix(fn, "internal/") {
				top = fn
			}
			if ours == "" && (strings.HasPrefix(lines[i], modulePath) || strings.HasPrefix(fn, "github.com/hashicorp/raft.")) {
				ours, at = fn, strings.Fields(lines[i+1] + " ?")[0] // file:line, without offsets
				if k := strings.LastIndex(at, "/"); k >= 0 {
					at = at[k+1:]
				}
			}
		}
		if ours == "" {
			continue
		}
		waiting++
		where := top
		if top != ours {
			where += " <- " + ours
		}
		where += " " + at
		id, state := splitHeader(lines[0])
		key := state + "\x00" + where
		if o := same[key]; o != nil {
			o.ids = append(o.ids, id)
			o.mins, o.most = min(o.mins, mins), max(o.most, mins)
			continue
		}
		same[key] = &g{ids: []string{id}, state: state, at: where, mins: mins, most: mins}
		gs = append(gs, same[key])
	}
	if len(gs) == 0 {
		return ""
	}
	sort.SliceStable(gs, func(i, j int) bool { return gs[i].most > gs[j].most })
	var b strings.Builder
	fmt.Fprintf(&b, "testutil.Main: %d goroutines outside test code have waited a minute or more in this module or raft", waiting)
	if len(gs) > limit {
		fmt.Fprintf(&b, " (the %d longest of %d lines)", limit, len(gs))
		gs = gs[:limit]
	}
	b.WriteString(":\n")
	for _, g := range gs {
		wait := fmt.Sprintf("%d minute", g.most)
		if g.mins != g.most {
			wait = fmt.Sprintf("%d-%d minute", g.mins, g.most)
		}
		if g.most != 1 {
			wait += "s"
		}
		who := "goroutine " + g.ids[0]
		if len(g.ids) > 1 {
			who = "goroutines " + strings.Join(g.ids, ", ")
		}
		state, rest, _ := strings.Cut(g.state, ",")
		if rest != "" {
			rest = "," + rest
		}
		fmt.Fprintf(&b, "%s [%s, %s%s]: %s\n", who, state, wait, rest, g.at)
	}
	return b.String()
}

// splitHeader cuts a goroutine header ("goroutine 7 [IO wait, 2 minutes,
// locked to thread]:") into its id ("7") and its state without the wait
// ("IO wait, locked to thread").
func splitHeader(header string) (id, state string) {
	rest, _ := strings.CutPrefix(header, "goroutine ")
	id, rest, _ = strings.Cut(rest, " ")
	rest = strings.TrimSuffix(strings.TrimPrefix(rest, "["), "]:")
	var parts []string
	for _, p := range strings.Split(rest, ", ") {
		if !waitRE.MatchString(p) {
			parts = append(parts, p)
		}
	}
	return id, strings.Join(parts, ", ")
}

var waitRE = regexp.MustCompile(`^\d+ minutes?$`)

// waitedMinutes reads the wait from a goroutine header ("goroutine 7
// [select, 17 minutes]:", "[IO wait, 1 minute, locked to thread]"), 0
// when it has none.
func waitedMinutes(header string) int {
	m := waitedRE.FindStringSubmatch(header)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

var waitedRE = regexp.MustCompile(`\[[^]]*, (\d+) minutes?[],]`)

// funcName is a stack line's function without its arguments.
func funcName(line string) string {
	if i := strings.LastIndex(line, "("); i > 0 && strings.HasSuffix(line, ")") {
		return line[:i]
	}
	return line
}

// IgnoreRaftAwait is the goleak option for a package whose tests run a
// replicated coordinator: the goroutine replica.Node.await leaves waiting
// on a future raft dropped at its shutdown stays parked, by design.
var IgnoreRaftAwait = goleak.IgnoreAnyFunction("github.com/kvtier/kvtier/coordinator/replica.(*Node).await.func1")

// timeoutFlag returns the binary's -test.timeout, 0 when none.
func timeoutFlag() time.Duration {
	f := flag.Lookup("test.timeout")
	if f == nil {
		return 0
	}
	d, err := time.ParseDuration(f.Value.String())
	if err != nil {
		return 0
	}
	return d
}

// watchdogAfter is when the watchdog fires for a -test.timeout of d: a
// tenth of it, at most a minute, before; never without a timeout.
func watchdogAfter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d - min(d/10, time.Minute)
}

func allStacks() []byte {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) || len(buf) >= 256<<20 {
			return buf[:n]
		}
		buf = make([]byte, 2*len(buf))
	}
}

// modulePath marks the frames StuckReport keeps.
const modulePath = "github.com/kvtier/kvtier/"

// goroutines yields each goroutine of a dump (runtime.Stack's format) as
// its lines, the header and then pairs of a function and its file:line,
// and whether one of its frames lies in a _test.go file.
func goroutines(dump []byte) iter.Seq2[[]string, bool] {
	return func(yield func([]string, bool) bool) {
		for _, block := range bytes.Split(dump, []byte("\n\n")) {
			lines := strings.Split(strings.TrimSpace(string(block)), "\n")
			if len(lines) < 3 || !strings.HasPrefix(lines[0], "goroutine ") {
				continue
			}
			if !yield(lines, bytes.Contains(block, []byte("_test.go:"))) {
				return
			}
		}
	}
}

// StuckReport condenses a dump of every goroutine (runtime.Stack's format)
// to the goroutines with a frame in a _test.go file: each its header, its
// top frame (what it waits in) and its frames of this module. The
// goroutines of test functions (a frame named Test...) come last. When
// the report would pass limit bytes, the goroutines printed first are
// dropped, and a line says how many.
func StuckReport(dump []byte, limit int) string {
	type g struct {
		text string
		test bool
	}
	var gs []g
	for lines, test := range goroutines(dump) {
		if !test {
			continue
		}
		var b strings.Builder
		b.WriteString(lines[0] + "\n")
		test := false
		// lines[1:] are pairs: a function, then its file and line.
		for i := 1; i+1 < len(lines); i += 2 {
			fn, at := lines[i], lines[i+1]
			if i == 1 || strings.HasPrefix(fn, modulePath) {
				b.WriteString(fn + "\n" + at + "\n")
			}
			if strings.HasPrefix(fn, modulePath) && strings.Contains(fn, ".Test") && strings.Contains(at, "_test.go:") {
				test = true
			}
		}
		gs = append(gs, g{b.String(), test})
	}
	sort.SliceStable(gs, func(i, j int) bool { return !gs[i].test && gs[j].test })
	var out []string
	size, dropped := 0, 0
	for i := len(gs) - 1; i >= 0; i-- {
		if size+len(gs[i].text) > limit && len(out) > 0 {
			dropped = i + 1
			break
		}
		out = append(out, gs[i].text)
		size += len(gs[i].text)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "testutil.Main: %d goroutines run test code", len(gs))
	if dropped > 0 {
		fmt.Fprintf(&b, "; %d of them left out to keep this short", dropped)
	}
	b.WriteString(":\n")
	for i := len(out) - 1; i >= 0; i-- {
		b.WriteString("\n" + out[i])
	}
	return b.String()
}
