package e2e

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	coordadmin "github.com/kvtier/kvtier/coordinator/admin"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/internal/testutil"
)

// Rolling upgrade under load (issue 31.2). An engine serves without a
// pause (enginesim.Run in this process, fail-open, one run after another:
// restore a prompt stored earlier, store a new one) while every rankd and
// then every coordinator is stopped with SIGTERM and started again, one at
// a time, each back before the next. The binary started again is the same
// one: it stands in for the upgraded build (the test exercises the
// stop/start protocol and the engine's fail-open path, not a change of
// version on the wire).
//
// Asserted: every engine run is OK (fail-open: what kvtier did not
// confirm is recomputed, and every byte of every rank is then the
// prompt's, the engine's own check), the loop never stops (no engine
// restart), every run ends within the bound its configuration promises,
// and after each restart a restore hits every chunk again within
// rollRecoverWithin. Measured and printed: the hit rate (chunks restored
// / chunks asked, by the restores of earlier prompts) per second, the dip
// during each restart and the time until a restore hit every chunk again.

// rollEngineConfig is the loop's engine. Its waits bound every run: see
// runBound.
func rollEngineConfig(t *testing.T, c *kv, natsURL string) enginesim.Config {
	cfg := enginesim.DefaultConfig()
	cfg.Scenario, cfg.Chunks, cfg.NATSURL = "tp4dcp4", 1, natsURL
	cfg.Creds = auth.Client{Dir: c.creds}
	cfg.Host = cuda.DefaultHostConfig()
	cfg.Host.Dir = c.hostD
	cfg.FailOpen, cfg.AttachWait = true, 250*time.Millisecond
	cfg.Compute, cfg.WaitPrefix = time.Millisecond, 0
	cfg.Timeout, cfg.RestoreDeadline = 3*time.Second, 3*time.Second
	f, err := os.Create(filepath.Join(c.logD, "engine-loop.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	cfg.Out = &stampWriter{w: f}
	if os.Getenv("KVTIER_ROLL_LOG") != "" {
		cfg.Out = &stampWriter{w: os.Stderr}
	}
	return cfg
}

// stampWriter prefixes each line of the engine's log with the wall clock,
// so that it lines up with the daemons' logs.
type stampWriter struct {
	w    io.Writer
	mid  bool // the last write ended inside a line
	line []byte
}

func (s *stampWriter) Write(b []byte) (int, error) {
	s.line = s.line[:0]
	for _, ch := range b {
		if !s.mid {
			s.line = append(s.line, time.Now().Format("15:04:05.000 ")...)
		}
		s.line = append(s.line, ch)
		s.mid = ch != '\n'
	}
	if _, err := s.w.Write(s.line); err != nil {
		return 0, err
	}
	return len(b), nil
}

// runBound is the longest one fail-open run may take under cfg: the
// attach retries for AttachWait and its last attempt may take two
// requests (the spec, then the pools), a restore takes up to three more
// (begin, retrieve, wait), the pools' release at most 2 s. Anything
// longer is an engine that hung on a daemon, which fail-open forbids.
func runBound(cfg enginesim.Config) time.Duration {
	return cfg.AttachWait + 5*cfg.Timeout + 2*time.Second
}

// engineRun is one enginesim.Run of the loop.
type engineRun struct {
	phase      string
	seed       uint64
	start, end time.Time
	// asked and restored count chunks, for a restore of an earlier
	// prompt: restored are those kvtier confirmed (not recomputed).
	asked, restored int
	ok              bool
	problem         string
	attached        bool
}

// rollLoop runs the engine: round after round it restores two prompts it
// stored earlier (a miss stores the prompt again, as an engine stores what
// it recomputed) and stores a new one, until stop. One run at a time: a
// new registration of the instance supersedes the last one's session.
type rollLoop struct {
	cfg  enginesim.Config
	stop func()
	// exited is closed when the loop's goroutine returns.
	exited chan struct{}

	// mu guards the following.
	mu   sync.Mutex
	runs []engineRun
	held []uint64 // seeds whose store kvtier confirmed
}

func startRollLoop(t *testing.T, cfg enginesim.Config) *rollLoop {
	l := &rollLoop{cfg: cfg, exited: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		defer close(l.exited)
		next := uint64(1000)
		for i := 0; ctx.Err() == nil; i++ {
			for j := range 2 {
				l.mu.Lock()
				var old uint64
				if len(l.held) > 0 {
					old = l.held[(2*i+j)%len(l.held)]
				}
				l.mu.Unlock()
				if old == 0 || ctx.Err() != nil {
					break
				}
				r := l.run(ctx, enginesim.PhaseRestore, old)
				if r.restored < r.asked && ctx.Err() == nil {
					l.run(ctx, enginesim.PhaseStore, old)
				}
			}
			if ctx.Err() == nil {
				next++
				l.run(ctx, enginesim.PhaseStore, next)
			}
		}
	}()
	var once sync.Once
	l.stop = func() {
		once.Do(func() {
			cancel()
			<-l.exited
		})
	}
	t.Cleanup(l.stop)
	return l
}

// run runs the engine once and records it. A run cut short by stop is
// not recorded.
func (l *rollLoop) run(ctx context.Context, phase string, seed uint64) engineRun {
	cfg := l.cfg
	cfg.Phase, cfg.Seed = phase, seed
	r := engineRun{phase: phase, seed: seed, start: time.Now()}
	res, err := enginesim.Run(ctx, cfg)
	r.end = time.Now()
	if ctx.Err() != nil {
		return r
	}
	r.ok = err == nil && res != nil && res.OK
	if err != nil {
		r.problem = err.Error()
	}
	if res != nil {
		r.attached = res.Attached
		if phase == enginesim.PhaseRestore {
			r.asked, r.restored = res.Chunks, res.Chunks-len(res.Recomputed)
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.runs = append(l.runs, r)
	if phase == enginesim.PhaseStore && r.ok && res.Attached && len(res.CacheProblems) == 0 && !slices.Contains(l.held, seed) {
		l.held = append(l.held, seed)
	}
	return r
}

func (l *rollLoop) snapshot() []engineRun {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.runs)
}

// fullHitAfter returns the start of the first restore begun after t that
// restored every chunk it asked for, and whether there is one yet.
func (l *rollLoop) fullHitAfter(t time.Time) (time.Time, bool) {
	for _, r := range l.snapshot() {
		if r.phase == enginesim.PhaseRestore && r.start.After(t) && r.asked > 0 && r.restored == r.asked {
			return r.start, true
		}
	}
	return time.Time{}, false
}

// restart is one daemon's stop and start: SIGTERM at term, serving again
// (and seen alive by the coordinator) at back, and recovered: the start
// of the first restore begun after back that hit every chunk (its
// resolution is the loop's spacing of restores).
type restart struct {
	what                  string
	term, back, recovered time.Time
}

// rollRecoverWithin bounds the time from a daemon back to a restore that
// hits every chunk again. Not a performance target: a cluster that never
// serves a prompt it holds again after a restart is broken. A CI run at a
// load of ~17 saw the engine's byte compare after a full hit take 62 s
// before the run reported it, so the bound is loose.
const rollRecoverWithin = 3 * time.Minute

// roll stops and restarts each target in turn (SIGTERM, start, wait until
// it serves) under the loop's load, and waits after each until a restore
// hits every chunk again.
func roll(t *testing.T, c *kv, l *rollLoop, targets []string, restartOne func(what string)) []restart {
	t.Helper()
	var out []restart
	for _, what := range targets {
		r := restart{what: what}
		r.term = time.Now()
		restartOne(what)
		r.back = time.Now()
		c.eventually(rollRecoverWithin, "a restore hitting every chunk after the restart of "+what, func() error {
			if at, ok := l.fullHitAfter(r.back); ok {
				r.recovered = at
				return nil
			}
			return fmt.Errorf("no restore with every chunk hit since %s was back", what)
		})
		t.Logf("%s: SIGTERM, back after %v, every chunk hit again %v after that",
			what, r.back.Sub(r.term).Round(time.Millisecond), r.recovered.Sub(r.back).Round(time.Millisecond))
		out = append(out, r)
	}
	return out
}

// waitBaseline waits until the loop has restored earlier prompts with
// every chunk hit n times: the cluster serves before anything restarts.
func waitBaseline(c *kv, l *rollLoop, n int) {
	c.t.Helper()
	c.eventually(60*time.Second, fmt.Sprintf("%d restores of earlier prompts hitting every chunk", n), func() error {
		full := 0
		for _, r := range l.snapshot() {
			if !r.ok {
				c.t.Fatalf("engine run %s seed %d failed before any restart: %s", r.phase, r.seed, r.problem)
			}
			if r.phase == enginesim.PhaseRestore && r.asked > 0 && r.restored == r.asked {
				full++
			}
		}
		if full < n {
			return fmt.Errorf("%d so far", full)
		}
		return nil
	})
}

// checkRuns fails the test for a run that was not OK (a wrong byte, or an
// engine that could not serve) or took longer than its bound, and for a
// loop that stopped by itself.
func checkRuns(t *testing.T, l *rollLoop, runs []engineRun) {
	t.Helper()
	select {
	case <-l.exited:
		t.Fatal("the engine loop stopped before the test stopped it")
	default:
	}
	bound := runBound(l.cfg)
	var bad []string
	for _, r := range runs {
		if !r.ok {
			bad = append(bad, fmt.Sprintf("%s seed %d at %s: not OK: %s", r.phase, r.seed, r.start.Format("15:04:05.000"), r.problem))
		}
		if d := r.end.Sub(r.start); d > bound {
			bad = append(bad, fmt.Sprintf("%s seed %d at %s took %v, over the bound %v", r.phase, r.seed, r.start.Format("15:04:05.000"), d, bound))
		}
	}
	if len(bad) > 0 {
		t.Fatalf("%d of %d engine runs wrong or unbounded:\n%s", len(bad), len(runs), strings.Join(bad, "\n"))
	}
}

// hitBin is the restores of earlier prompts that ended in one second.
type hitBin struct {
	from            time.Duration // since the loop's first run
	restores        int
	asked, restored int
}

func (b hitBin) rate() float64 {
	if b.asked == 0 {
		return -1
	}
	return float64(b.restored) / float64(b.asked)
}

// hitTimeline bins the restores of earlier prompts by the second they
// ended in, from t0.
func hitTimeline(runs []engineRun, t0 time.Time, bin time.Duration) []hitBin {
	var out []hitBin
	for _, r := range runs {
		if r.phase != enginesim.PhaseRestore || r.asked == 0 {
			continue
		}
		i := int(r.end.Sub(t0) / bin)
		if i < 0 {
			continue
		}
		for len(out) <= i {
			out = append(out, hitBin{from: time.Duration(len(out)) * bin})
		}
		out[i].restores++
		out[i].asked += r.asked
		out[i].restored += r.restored
	}
	return out
}

// hitRate is the hit rate of the restores that ended in [from, to) and
// how many there were; -1 without any.
func hitRate(runs []engineRun, from, to time.Time) (float64, int) {
	asked, restored, n := 0, 0, 0
	for _, r := range runs {
		if r.phase == enginesim.PhaseRestore && r.asked > 0 && !r.end.Before(from) && r.end.Before(to) {
			asked, restored, n = asked+r.asked, restored+r.restored, n+1
		}
	}
	if asked == 0 {
		return -1, 0
	}
	return float64(restored) / float64(asked), n
}

// overlapRate is the hit rate of the restores in flight at some moment
// of [from, to] and how many there were; -1 without any.
func overlapRate(runs []engineRun, from, to time.Time) (float64, int) {
	asked, restored, n := 0, 0, 0
	for _, r := range runs {
		if r.phase == enginesim.PhaseRestore && r.asked > 0 && !r.end.Before(from) && !r.start.After(to) {
			asked, restored, n = asked+r.asked, restored+r.restored, n+1
		}
	}
	if asked == 0 {
		return -1, 0
	}
	return float64(restored) / float64(asked), n
}

func pct(f float64) string {
	if f < 0 {
		return "  -"
	}
	return fmt.Sprintf("%3.0f%%", 100*f)
}

// report prints the hit rate per second with the restarts marked, one row
// per restart (downtime, dip, recovery) and the runs' latencies; it
// returns the restart table for BENCHMARKS.md.
func report(t *testing.T, title string, runs []engineRun, rs []restart, until time.Time) string {
	t.Helper()
	if len(runs) == 0 {
		t.Fatal("no engine runs")
	}
	t0 := runs[0].start
	bins := hitTimeline(runs, t0, time.Second)
	marks := map[int][]string{}
	for _, r := range rs {
		ti, bi, ri := int(r.term.Sub(t0)/time.Second), int(r.back.Sub(t0)/time.Second), int(r.recovered.Sub(t0)/time.Second)
		marks[ti] = append(marks[ti], r.what+" SIGTERM")
		marks[bi] = append(marks[bi], r.what+" back")
		marks[ri] = append(marks[ri], r.what+" recovered")
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s: hit rate per second (chunks restored / chunks asked by restores of earlier prompts ending in that second)\n", title)
	for i := 0; i < len(bins) || i < int(until.Sub(t0)/time.Second)+1; i++ {
		var h hitBin
		if i < len(bins) {
			h = bins[i]
		}
		bar := ""
		if h.asked > 0 {
			bar = strings.Repeat("#", h.restored*20/h.asked)
		}
		fmt.Fprintf(&b, "  %4ds %s %2d/%-2d %-20s %s\n", i, pct(h.rate()), h.restored, h.asked, bar, strings.Join(marks[i], ", "))
	}
	var tab strings.Builder
	base, nb := hitRate(runs, t0, rs[0].term)
	fmt.Fprintf(&tab, "| restarted | down: SIGTERM -> serving | restores in flight while down: hit rate (n) | SIGTERM -> recovered: hit rate (n) | recovered: serving -> a restore that hits every chunk begins |\n|---|---|---|---|---|\n")
	fmt.Fprintf(&tab, "| (baseline, before) | | | %s (%d) | |\n", strings.TrimSpace(pct(base)), nb)
	for _, r := range rs {
		down, nd := overlapRate(runs, r.term, r.back)
		dip, n := hitRate(runs, r.term, r.recovered)
		fmt.Fprintf(&tab, "| %s | %.2f s | %s (%d) | %s (%d) | %.2f s |\n", r.what, r.back.Sub(r.term).Seconds(),
			strings.TrimSpace(pct(down)), nd, strings.TrimSpace(pct(dip)), n, r.recovered.Sub(r.back).Seconds())
	}
	after, na := hitRate(runs, rs[len(rs)-1].recovered, until)
	fmt.Fprintf(&tab, "| (after, all restarted) | | | %s (%d) | |\n", strings.TrimSpace(pct(after)), na)
	var gaps []time.Duration
	var last time.Time
	for _, r := range runs {
		if r.phase == enginesim.PhaseRestore {
			if !last.IsZero() {
				gaps = append(gaps, r.start.Sub(last))
			}
			last = r.start
		}
	}
	if len(gaps) > 0 {
		fmt.Fprintf(&tab, "\nspacing of restores (the resolution of 'recovered'): %s\n", percentiles(gaps))
	}
	lat := map[string][]time.Duration{}
	var restores, stores int
	for _, r := range runs {
		lat[r.phase] = append(lat[r.phase], r.end.Sub(r.start))
		if r.phase == enginesim.PhaseRestore {
			restores++
		} else {
			stores++
		}
	}
	fmt.Fprintf(&tab, "engine runs: %d restores of earlier prompts, %d stores, all OK (every byte of every rank checked)\n", restores, stores)
	for _, ph := range []string{enginesim.PhaseRestore, enginesim.PhaseStore} {
		if len(lat[ph]) > 0 {
			fmt.Fprintf(&tab, "%s run latency: %s\n", ph, percentiles(lat[ph]))
		}
	}
	t.Logf("\n%s\n%s", b.String(), tab.String())
	return tab.String()
}

// TestRollingUpgrade: one coordinator, TP4 rankds on the host backend
// with L2; each rankd, then the coordinator, restarted once under load.
func TestRollingUpgrade(t *testing.T) { rollingSingle(t, 1) }

// TestSoakRollingUpgrade is the longer version (make soak): three rounds.
func TestSoakRollingUpgrade(t *testing.T) {
	if os.Getenv("KVTIER_SOAK") != "1" {
		t.Skip("soak: set KVTIER_SOAK=1 (make soak)")
	}
	rollingSingle(t, 3)
}

func rollingSingle(t *testing.T, rounds int) {
	c := newKV(t, 4)
	c.startAll()
	l := startRollLoop(t, rollEngineConfig(t, c, c.natsURL()))
	waitBaseline(c, l, 2)
	var targets []string
	for range rounds {
		for r := range c.tp {
			targets = append(targets, "rankd"+strconv.Itoa(r))
		}
		targets = append(targets, "coordinator")
	}
	rs := roll(t, c, l, targets, func(what string) {
		if what == "coordinator" {
			c.coord.stop()
			c.startCoordinator()
			for r := range c.tp {
				c.waitRank(r)
			}
			return
		}
		r, _ := strconv.Atoi(strings.TrimPrefix(what, "rankd"))
		c.ranks[r].stop()
		c.startRank(r)
	})
	time.Sleep(time.Second) // a tail after the last recovery, for the timeline
	until := time.Now()
	runs := l.snapshot()
	checkRuns(t, l, runs)
	l.stop()
	report(t, fmt.Sprintf("rolling upgrade, 1 coordinator, TP4, %d round(s)", rounds), runs, rs, until)
}

// raftTrio is three coordinators on loopback replicating the index
// through raft, each with its embedded NATS server routed to the others'
// (the kv's rankds and engine hold all three URLs).
type raftTrio struct {
	*kv
	ids                                 []string
	nats, route, gossip, raftAddr, data []string
	procs                               []*proc
	peers                               string
}

func newRaftTrio(t *testing.T) *raftTrio {
	t.Helper()
	c := newKV(t, 4)
	h := &raftTrio{kv: c}
	addr := func() string { return "127.0.0.1:" + strconv.Itoa(testutil.FreePort(t)) }
	var urls, peers []string
	for i := range 3 {
		id := "c" + strconv.Itoa(i+1)
		h.ids = append(h.ids, id)
		h.nats, h.route, h.gossip, h.raftAddr = append(h.nats, addr()), append(h.route, addr()), append(h.gossip, addr()), append(h.raftAddr, addr())
		h.data = append(h.data, filepath.Join(c.dir, "coord-"+id))
		urls = append(urls, "nats://"+h.nats[i])
		peers = append(peers, id+"="+h.raftAddr[i])
	}
	h.procs = make([]*proc, 3)
	h.peers = strings.Join(peers, ",")
	c.natsURLs = strings.Join(urls, ",")
	c.simNATS, c.rankdNATS = c.natsURLs, c.natsURLs
	c.gossip = strings.Join(h.gossip, ",")
	c.initCreds()
	// The raft port is mutual TLS: the cluster CA (with a NATS server
	// certificate for loopback, so NATS speaks TLS too, as 'coordinator
	// creds tls --host 127.0.0.1' makes it) and each coordinator's raft
	// peer certificate.
	if err := auth.InitTLS(c.creds, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	for _, id := range h.ids {
		if err := auth.IssueRaftCert(c.creds, id, false); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		h.startNode(i)
	}
	for i := range 3 {
		h.waitStarted(i)
	}
	c.eventually(30*time.Second, "a coordinator's NATS", func() error {
		nc, err := c.dial(auth.Identity{Role: auth.RoleAdminWrite})
		if err != nil {
			return err
		}
		c.nc = nc
		c.conns[auth.Identity{Role: auth.RoleAdminWrite}.Name()] = nc
		t.Cleanup(nc.Close)
		return nil
	})
	h.waitLeader()
	for r := range c.tp {
		c.startRank(r)
	}
	return h
}

// startNode starts (or restarts) coordinator i. 1 s raft timeouts, as the
// campaign's: on a loaded 2-core machine 500 ms elects on CPU starvation
// alone.
func (h *raftTrio) startNode(i int) {
	h.t.Helper()
	var gossip, routes []string
	for j := range 3 {
		if j != i {
			gossip, routes = append(gossip, h.gossip[j]), append(routes, "nats-route://"+h.route[j])
		}
	}
	host, port, _ := strings.Cut(h.nats[i], ":")
	args := []string{bin.coordinator, "serve", "--data-dir", h.data[i], "--nats-host", host, "--nats-port", port,
		"--bind", h.gossip[i], "--join", strings.Join(gossip, ","), "--http", "127.0.0.1:0", "--log-level", "info",
		"--creds-dir", h.creds, "--node-name", "coordinator-" + h.ids[i],
		"--nats-cluster", h.route[i], "--nats-routes", strings.Join(routes, ","),
		"--raft-id", h.ids[i], "--raft-bind", h.raftAddr[i], "--raft-peers", h.peers, "--raft-bootstrap",
		"--raft-heartbeat-timeout", "1s", "--raft-election-timeout", "1s"}
	h.procs[i] = startProc(h.t, "coordinator-"+h.ids[i], filepath.Join(h.logD, "coordinator-"+h.ids[i]+".log"), args...)
}

func (h *raftTrio) waitStarted(i int) {
	h.t.Helper()
	h.eventually(60*time.Second, "coordinator "+h.ids[i]+" started", func() error {
		if p := h.procs[i]; !p.alive() {
			h.t.Fatalf("coordinator %s exited: %v\n%s", h.ids[i], p.err, tail(p.output(), 30))
		}
		if !strings.Contains(h.procs[i].output(), `"coordinator started"`) {
			return fmt.Errorf("%s still starting", h.ids[i])
		}
		return nil
	})
}

// waitLeader waits until all three answer admin.raft, one leads and the
// others follow it, each within 64 entries of what the leader had
// committed (the load keeps committing between the replies); it returns
// the leader's index.
func (h *raftTrio) waitLeader() int {
	h.t.Helper()
	lead := -1
	h.eventually(60*time.Second, "a raft leader every coordinator follows, caught up", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		st, err := coordadmin.CollectRaft(ctx, h.nc, h.subj, 500*time.Millisecond)
		if err != nil {
			return err
		}
		if len(st) != 3 {
			return fmt.Errorf("%d of 3 coordinators answered: %+v", len(st), st)
		}
		lead = -1
		var commit uint64
		for _, s := range st {
			if s.State == "Leader" {
				lead, commit = slices.Index(h.ids, s.ID), s.CommitIndex
			}
		}
		if lead < 0 {
			return fmt.Errorf("no leader: %+v", st)
		}
		for _, s := range st {
			if s.LeaderID != h.ids[lead] && s.ID != h.ids[lead] || s.AppliedIndex+64 < commit {
				return fmt.Errorf("%s follows %q, applied %d of %d", s.ID, s.LeaderID, s.AppliedIndex, commit)
			}
		}
		return nil
	})
	return lead
}

// TestRollingUpgradeRaft: three raft coordinators, TP4 rankds; each
// follower, then the leader restarted under load. The rankds' restarts
// under raft are left to the soak: under -race on 2 busy cores they
// double this test's ~35 s, and TestRollingUpgrade restarts them.
func TestRollingUpgradeRaft(t *testing.T) { rollingRaft(t, 1, false) }

// TestSoakRollingUpgradeRaft is the longer version (make soak): three
// rounds of every rankd, then the followers, then the leader.
func TestSoakRollingUpgradeRaft(t *testing.T) {
	if os.Getenv("KVTIER_SOAK") != "1" {
		t.Skip("soak: set KVTIER_SOAK=1 (make soak)")
	}
	rollingRaft(t, 3, true)
}

func rollingRaft(t *testing.T, rounds int, ranks bool) {
	h := newRaftTrio(t)
	c := h.kv
	l := startRollLoop(t, rollEngineConfig(t, c, c.natsURLs))
	waitBaseline(c, l, 2)
	var rs []restart
	for range rounds {
		var targets []string
		for r := range c.tp {
			if ranks {
				targets = append(targets, "rankd"+strconv.Itoa(r))
			}
		}
		rs = append(rs, roll(t, c, l, targets, func(what string) {
			r, _ := strconv.Atoi(strings.TrimPrefix(what, "rankd"))
			c.ranks[r].stop()
			c.startRank(r)
		})...)
		// Followers first, the leader last, whoever leads by then.
		lead := h.waitLeader()
		var order []string
		for i, id := range h.ids {
			if i != lead {
				order = append(order, id+" (follower)")
			}
		}
		order = append(order, h.ids[lead]+" (leader)")
		rs = append(rs, roll(t, c, l, order, func(what string) {
			id, role, _ := strings.Cut(what, " ")
			i := slices.Index(h.ids, id)
			if role == "(leader)" && h.waitLeader() != i {
				t.Logf("%s no longer leads; restarting it anyway", id)
			}
			h.procs[i].stop()
			h.startNode(i)
			h.waitStarted(i)
			h.waitLeader()
			for r := range c.tp {
				c.waitRank(r)
			}
		})...)
	}
	time.Sleep(time.Second)
	until := time.Now()
	runs := l.snapshot()
	checkRuns(t, l, runs)
	l.stop()
	what := "the coordinators"
	if ranks {
		what = "every rankd, then the coordinators"
	}
	report(t, fmt.Sprintf("rolling upgrade, 3 raft coordinators, TP4, %d round(s) of %s", rounds, what), runs, rs, until)
}
