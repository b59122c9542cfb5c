package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// bin holds the paths of the daemons and the simulator, built once by
// TestMain without -race (the tests themselves run under -race).
var bin struct{ coordinator, rankd, enginesim, natsnode, s3node string }

func TestMain(m *testing.M) {
	testutil.Watchdog()
	dir, err := os.MkdirTemp("", "kvtier-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	build := exec.Command("go", "build", "-o", dir+string(os.PathSeparator),
		"./cmd/coordinator", "./cmd/rankd", "./cmd/enginesim", "./e2e/natsnode", "./e2e/s3node")
	build.Dir = ".."
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: building the binaries:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	bin.coordinator = filepath.Join(dir, "coordinator")
	bin.rankd = filepath.Join(dir, "rankd")
	bin.enginesim = filepath.Join(dir, "enginesim")
	bin.natsnode = filepath.Join(dir, "natsnode")
	bin.s3node = filepath.Join(dir, "s3node")
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// proc is one child process; its stdout and stderr go to a log file (and,
// for the simulator, to a buffer the test reads).
type proc struct {
	t    *testing.T
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error // exit status, valid after done

	mu  sync.Mutex
	out bytes.Buffer
}

func startProc(t *testing.T, name, logPath string, argv ...string) *proc {
	t.Helper()
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{t: t, name: name, log: logPath, done: make(chan struct{})}
	p.cmd = exec.Command(argv[0], argv[1:]...)
	w := &teeWriter{p: p, f: f}
	p.cmd.Stdout, p.cmd.Stderr = w, w
	if err := p.cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() { p.kill() })
	return p
}

type teeWriter struct {
	p *proc
	f *os.File
}

func (w *teeWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	w.p.out.Write(b)
	w.p.mu.Unlock()
	return w.f.Write(b)
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) alive() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// kill sends SIGKILL and waits.
func (p *proc) kill() {
	if p.alive() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
	}
	<-p.done
}

// stop sends SIGTERM and waits up to 30 s, then kills; it fails the test
// if the process did not exit cleanly in time.
func (p *proc) stop() {
	p.t.Helper()
	if !p.alive() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		if p.err != nil {
			p.t.Errorf("%s exited with %v after SIGTERM; log tail:\n%s", p.name, p.err, tail(p.output(), 20))
		}
	case <-time.After(30 * time.Second):
		p.kill()
		p.t.Errorf("%s did not exit within 30 s of SIGTERM", p.name)
	}
}

// wait waits for the process to exit on its own.
func (p *proc) wait(timeout time.Duration) error {
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		p.kill()
		return fmt.Errorf("%s still running after %v; killed", p.name, timeout)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// httpAddr matches the "http" field of a daemon's start log line (rankd
// serving, coordinator started).
var httpAddr = regexp.MustCompile(`"http":\s*"([0-9.:]+)"`)

// metricsOf is the /metrics of the daemon name whose log is out, at the
// address its last start logged (a restarted daemon logs a new one),
// scraped at each read.
func metricsOf(t *testing.T, name, out string) prometheus.Gatherer {
	t.Helper()
	m := httpAddr.FindAllStringSubmatch(out, -1)
	if m == nil {
		t.Fatalf("%s HTTP address not in its log", name)
	}
	return testutil.Scrape("http://" + m[len(m)-1][1] + "/metrics")
}

// rankMetrics is rankd r's /metrics, for testutil.Metric.
func (c *kv) rankMetrics(r int) prometheus.Gatherer {
	c.t.Helper()
	return metricsOf(c.t, "rankd "+strconv.Itoa(r), c.ranks[r].output())
}

// coordMetrics is the coordinator's /metrics, for testutil.Metric.
func (c *kv) coordMetrics() prometheus.Gatherer {
	c.t.Helper()
	return metricsOf(c.t, "coordinator", c.coord.output())
}

// kv is one kvtier cluster of real processes: a coordinator with embedded
// NATS and tp rankds of instance "engine0" on the host backend, sharing an
// L2 directory. Authentication is on, as in production (C9): the first
// startCoordinator makes the credentials with 'coordinator init' (with a
// CA and server certificate when NATS listens off loopback), every daemon
// and the simulator get --creds-dir, and the test's own connections use
// the identity that may send to a subject (connFor).
type kv struct {
	t        *testing.T
	dir      string
	tp       int
	natsPort int
	gossip   string // coordinator gossip host:port
	// natsHost is the embedded NATS listen address; rankdNATS the URL the
	// rankds use (both 127.0.0.1 unless a test moves the ranks into
	// network namespaces).
	natsHost  string
	rankdNATS string
	rankAddr  []string // gossip host:port of each rankd
	// natsCluster, when set, is the coordinator's NATS route listen
	// address (--nats-cluster) and natsRoutes the other servers' route
	// URLs: its embedded server joins a NATS cluster.
	natsCluster string
	natsRoutes  []string
	// simNATS, when set, is the simulator's --nats (several URLs of a
	// NATS cluster); default natsURL().
	simNATS string
	// natsDial is the host the test's own connections dial the
	// coordinator's NATS at (default 127.0.0.1; its namespace IP when the
	// coordinator runs in one), coordWrap prefixes its command line, and
	// tlsHosts are more names for the server certificate.
	natsDial string
	// natsURLs, when set, replaces natsURL() (several servers).
	natsURLs  string
	coordWrap []string
	tlsHosts  []string
	coordArgs []string // extra coordinator serve flags
	rankArgs  []string // extra rankd flags
	// rankArgsFor, when set, gives rank r's own extra flags (after
	// rankArgs: a flag given again overrides, e.g. --l2-dir).
	rankArgsFor func(r int) []string
	// wrap, when set, prefixes rank r's command line (ip netns exec ...).
	wrap  func(r int) []string
	l1    string
	coord *proc
	ranks []*proc
	nc    *nats.Conn // as admin-write
	subj  wire.Subjects
	creds string // credentials directory; made by the first startCoordinator
	// insecure runs every process with --insecure instead of credentials
	// (the development mode; TestInsecureModeStillWorks).
	insecure bool
	conns    map[string]*nats.Conn // the test's connections by identity name
	hostD    string
	l2D      string
	logD     string
	simSeq   int
}

func newKV(t *testing.T, tp int) *kv {
	t.Helper()
	dir := t.TempDir()
	c := &kv{t: t, dir: dir, tp: tp, natsPort: testutil.FreePort(t), natsHost: "127.0.0.1",
		gossip: "127.0.0.1:" + strconv.Itoa(testutil.FreePort(t)), l1: "256MiB", subj: wire.Subjects{Prefix: wire.DefaultPrefix},
		hostD: filepath.Join(dir, "shm"), l2D: filepath.Join(dir, "l2"), logD: filepath.Join(dir, "logs"),
		creds: filepath.Join(dir, "creds"), conns: map[string]*nats.Conn{}}
	for range tp {
		c.rankAddr = append(c.rankAddr, "127.0.0.1:"+strconv.Itoa(testutil.FreePort(t)))
	}
	for _, d := range []string{c.hostD, c.l2D, c.logD, filepath.Join(dir, "index")} {
		if err := os.MkdirAll(d, 0o700); err != nil { // private: the host backend and L2 insist
			t.Fatal(err)
		}
	}
	c.ranks = make([]*proc, tp)
	t.Cleanup(func() {
		if t.Failed() {
			c.dumpLogs()
		}
	})
	return c
}

func (c *kv) natsURL() string {
	if c.natsURLs != "" {
		return c.natsURLs
	}
	host := c.natsDial
	if host == "" {
		host = "127.0.0.1"
	}
	return "nats://" + host + ":" + strconv.Itoa(c.natsPort)
}

func (c *kv) dumpLogs() {
	entries, _ := os.ReadDir(c.logD)
	for _, e := range entries {
		b, _ := os.ReadFile(filepath.Join(c.logD, e.Name()))
		c.t.Logf("--- %s (tail)\n%s", e.Name(), tail(string(b), 25))
	}
}

// startCoordinator starts (or restarts) the coordinator and waits until it
// answers admin requests.
func (c *kv) startCoordinator() {
	c.t.Helper()
	c.initCreds()
	args := []string{bin.coordinator, "serve", "--data-dir", filepath.Join(c.dir, "index"),
		"--nats-host", c.natsHost, "--nats-port", strconv.Itoa(c.natsPort), "--bind", c.gossip,
		"--http", "127.0.0.1:0", "--log-level", "info"}
	args = append(args, c.credsArgs()...)
	if c.natsCluster != "" {
		args = append(args, "--nats-cluster", c.natsCluster, "--nats-routes", strings.Join(c.natsRoutes, ","))
	}
	args = append(append(slices.Clone(c.coordWrap), args...), c.coordArgs...)
	c.coord = startProc(c.t, "coordinator", filepath.Join(c.logD, "coordinator.log"), args...)
	if c.nc == nil {
		for name, nc := range c.conns {
			nc.Close()
			delete(c.conns, name)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			nc, err := c.dial(auth.Identity{Role: auth.RoleAdminWrite})
			if err == nil {
				c.nc = nc
				c.conns[auth.Identity{Role: auth.RoleAdminWrite}.Name()] = nc
				c.t.Cleanup(nc.Close)
				break
			}
			if time.Now().After(deadline) || !c.coord.alive() {
				c.t.Fatalf("coordinator NATS not reachable: %v\n%s", err, tail(c.coord.output(), 20))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	c.eventually(20*time.Second, "coordinator answers admin.members", func() error {
		if !c.coord.alive() {
			c.t.Fatalf("coordinator exited: %v\n%s", c.coord.err, tail(c.coord.output(), 30))
		}
		_, err := admin[wire.AdminMembersReply](c, wire.AdminMembers, struct{}{})
		return err
	})
}

// startRank starts (or restarts) rankd r and waits until it serves engine
// requests and the coordinator sees this incarnation alive.
func (c *kv) startRank(r int) {
	c.t.Helper()
	nats := c.rankdNATS
	args := []string{bin.rankd, "--instance", "engine0", "--tp-rank", strconv.Itoa(r), "--tp-size", strconv.Itoa(c.tp),
		"--device", "host", "--host-dir", c.hostD, "--l1-bytes", c.l1, "--l2-dir", c.l2D, "--l2-free-floor", "0",
		"--join", c.gossip, "--bind", c.rankAddr[r], "--http", "127.0.0.1:0", "--log-level", "info"}
	args = append(args, c.credsArgs()...)
	if nats != "" {
		args = append(args, "--nats", nats)
	}
	args = append(args, c.rankArgs...)
	if c.rankArgsFor != nil {
		args = append(args, c.rankArgsFor(r)...)
	}
	if c.wrap != nil {
		args = append(c.wrap(r), args...)
	}
	c.ranks[r] = startProc(c.t, fmt.Sprintf("rankd%d", r), filepath.Join(c.logD, fmt.Sprintf("rankd%d.log", r)), args...)
	c.waitRank(r)
}

// waitRank waits until rankd r answers status and the coordinator has its
// incarnation alive.
func (c *kv) waitRank(r int) {
	c.t.Helper()
	rank := wire.Rank{Instance: "engine0", TPRank: r}
	var inc uint64
	c.eventually(30*time.Second, fmt.Sprintf("rankd %d serves engine requests", r), func() error {
		if p := c.ranks[r]; p != nil && !p.alive() {
			c.t.Fatalf("rankd %d exited: %v\n%s", r, p.err, tail(p.output(), 30))
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		st, err := bus.Call[statusReply](ctx, c.as(auth.Engine("engine0")), c.subj.Engine(rank, "status"), struct{}{})
		if err != nil {
			return err
		}
		if !st.Accepting {
			return fmt.Errorf("not accepting yet")
		}
		inc = st.Incarnation
		return nil
	})
	c.eventually(30*time.Second, fmt.Sprintf("coordinator sees rankd %d alive", r), func() error {
		m, err := admin[wire.AdminMembersReply](c, wire.AdminMembers, struct{}{})
		if err != nil {
			return err
		}
		for _, mm := range m.Members {
			if mm.Rank == rank.String() && mm.Incarnation == inc && mm.State == "alive" {
				return nil
			}
		}
		return fmt.Errorf("incarnation %d of %s not alive in %+v", inc, rank, m.Members)
	})
	// The index's view of the rank (admin ranks) follows the membership:
	// a restarted rank's entry shows its old, dead incarnation until the
	// new one's inventory or heartbeat reaches it.
	c.eventually(30*time.Second, fmt.Sprintf("the index has rankd %d alive", r), func() error {
		k, err := c.rankInfo(r)
		if err != nil {
			return err
		}
		if k.Incarnation != inc {
			return fmt.Errorf("rank %d alive at incarnation %d, want %d", r, k.Incarnation, inc)
		}
		return nil
	})
}

// statusReply is the part of rankd's status reply the tests read.
type statusReply struct {
	Incarnation uint64 `json:"incarnation"`
	Accepting   bool   `json:"accepting"`
}

func (c *kv) startAll() {
	c.t.Helper()
	c.startCoordinator()
	for r := range c.tp {
		c.startRank(r)
	}
}

func (c *kv) stopRanks() {
	c.t.Helper()
	var wg sync.WaitGroup
	for _, p := range c.ranks {
		if p != nil {
			wg.Add(1)
			go func() { defer wg.Done(); p.stop() }()
		}
	}
	wg.Wait()
}

// sim runs the engine simulator to completion and returns its result.
func (c *kv) sim(args ...string) (*enginesim.Result, string, error) {
	c.t.Helper()
	p, result := c.startSim(args...)
	err := p.wait(3 * time.Minute)
	return readResult(c.t, result), p.output(), err
}

// startSim starts the simulator; the result file is read after it exits.
func (c *kv) startSim(args ...string) (*proc, string) {
	c.t.Helper()
	c.simSeq++
	result := filepath.Join(c.dir, fmt.Sprintf("sim%d.json", c.simSeq))
	simNATS := c.natsURL()
	if c.simNATS != "" {
		simNATS = c.simNATS
	}
	argv := append([]string{bin.enginesim, "--nats", simNATS, "--device", "host", "--host-dir", c.hostD,
		"--instance", "engine0", "--result", result}, c.credsArgs()...)
	argv = append(argv, args...)
	p := startProc(c.t, "enginesim", filepath.Join(c.logD, fmt.Sprintf("enginesim%d.log", c.simSeq)), argv...)
	return p, result
}

func readResult(t *testing.T, path string) *enginesim.Result {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var r enginesim.Result
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("result %s: %v", path, err)
	}
	return &r
}

// mustSim runs the simulator and fails the test unless it succeeded.
func (c *kv) mustSim(args ...string) *enginesim.Result {
	c.t.Helper()
	res, out, err := c.sim(args...)
	if err != nil || res == nil || !res.OK {
		c.t.Fatalf("enginesim %v: %v\n%s", args, err, tail(out, 40))
	}
	c.t.Logf("enginesim %v:\n%s", args, tableOf(out))
	return res
}

// tableOf extracts the final table from the simulator's output.
func tableOf(out string) string {
	var b strings.Builder
	in := false
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		l := sc.Text()
		if strings.Contains(l, "  restore ") && strings.Contains(l, "verdict") {
			in = true
		}
		if in {
			b.WriteString(l + "\n")
		}
		if strings.HasPrefix(l, "enginesim: RESULT") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// admin sends an admin request to the coordinator.
func admin[T any](c *kv, op string, req any) (*T, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return bus.Call[T](ctx, c.nc, c.subj.Admin(op), req)
}

// eventually polls f until it returns nil or the deadline passes.
func (c *kv) eventually(d time.Duration, what string, f func() error) {
	c.t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: not within %v: %v", what, d, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// rankInfo returns the coordinator's view of rank r.
func (c *kv) rankInfo(r int) (wire.AdminRank, error) {
	rep, err := admin[wire.AdminRanksReply](c, wire.AdminRanks, struct{}{})
	if err != nil {
		return wire.AdminRank{}, err
	}
	for _, k := range rep.Ranks {
		if k.Rank.Instance == "engine0" && k.Rank.TPRank == r && k.Liveness == "alive" {
			return k, nil
		}
	}
	return wire.AdminRank{}, fmt.Errorf("rank %d not alive in %+v", r, rep.Ranks)
}

// waitL2 waits until every rank's L2 holds at least want[r] objects in the
// coordinator's index (write-through finished and reported).
func (c *kv) waitL2(want []int64) {
	c.t.Helper()
	c.eventually(60*time.Second, "L2 write-through reported", func() error {
		for r, n := range want {
			k, err := c.rankInfo(r)
			if err != nil {
				return err
			}
			if k.L2Objects < n {
				return fmt.Errorf("rank %d: %d L2 objects, want %d", r, k.L2Objects, n)
			}
		}
		return nil
	})
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// initCreds makes the cluster's credentials once, as an operator does:
// 'coordinator init' for instance engine0 (and a CA plus server
// certificate when NATS listens off loopback: TLS is required there).
func (c *kv) initCreds() {
	c.t.Helper()
	if c.insecure {
		return
	}
	if _, err := os.Stat(filepath.Join(c.creds, auth.UsersFile)); err == nil {
		return
	}
	args := []string{bin.coordinator, "init", "--dir", c.creds, "--instance", "engine0", "--tp-size", strconv.Itoa(c.tp)}
	if !bus.IsLoopback(c.natsHost) {
		hosts := []string{"127.0.0.1"}
		if c.rankdNATS != "" {
			if u, err := url.Parse(c.rankdNATS); err == nil {
				hosts = append(hosts, u.Hostname())
			}
		}
		args = append(args, "--tls-host", strings.Join(append(hosts, c.tlsHosts...), ","))
	}
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		c.t.Fatalf("coordinator init: %v\n%s", err, out)
	}
}

// addInstanceCreds adds the identities of another engine instance (its
// rankds and its engine) to the cluster's credentials, as an operator does
// with 'coordinator creds add' before starting them. Called before the
// coordinator starts, it needs no reload.
func (c *kv) addInstanceCreds(instance string) {
	c.t.Helper()
	if c.insecure {
		return
	}
	c.initCreds()
	out, err := exec.Command(bin.coordinator, "creds", "add", "--dir", c.creds, "--instance", instance,
		"--tp-size", strconv.Itoa(c.tp)).CombinedOutput()
	if err != nil {
		c.t.Fatalf("coordinator creds add --instance %s: %v\n%s", instance, err, out)
	}
}

// dial connects to the coordinator's NATS as id with the cluster's
// credentials.
func (c *kv) dial(id auth.Identity, opts ...nats.Option) (*nats.Conn, error) {
	o, err := auth.Client{Identity: id, Dir: c.creds, Insecure: c.insecure}.Options()
	if err != nil {
		c.t.Fatal(err)
	}
	return bus.Connect(c.natsURL(), "e2e-"+id.Name(), append(o, opts...)...)
}

// as returns the test's connection as identity id (made once, closed at
// the end of the test or when the coordinator's NATS moves).
func (c *kv) as(id auth.Identity) *nats.Conn {
	c.t.Helper()
	if nc := c.conns[id.Name()]; nc != nil {
		return nc
	}
	nc, err := c.dial(id)
	if err != nil {
		c.t.Fatalf("connect as %s: %v", id, err)
	}
	c.conns[id.Name()] = nc
	c.t.Cleanup(nc.Close)
	return nc
}

// connFor returns a connection of the identity that may send to subject:
// a rank for its events, heartbeats and reports, the coordinator for an
// inventory request, the instance's engine for the engine API and the
// engine coordinator subjects, admin-write for admin.
func (c *kv) connFor(subject string) *nats.Conn {
	c.t.Helper()
	p := c.subj.Prefix + "."
	rest := strings.TrimPrefix(subject, p)
	switch {
	case strings.HasPrefix(rest, "events.") || strings.HasPrefix(rest, "heartbeat.") ||
		strings.HasPrefix(rest, "coord."+wire.CoordRestoreReport+"."):
		r, err := wire.RankOf(subject)
		if err != nil {
			c.t.Fatal(err)
		}
		return c.as(auth.Rankd(r))
	case strings.HasPrefix(rest, "rank.") && strings.HasSuffix(rest, ".inventory"):
		return c.as(auth.Identity{Role: auth.RoleCoordinator})
	case strings.HasPrefix(rest, "rank."):
		return c.as(auth.Engine(strings.SplitN(rest, ".", 3)[1]))
	case strings.HasPrefix(rest, "coord."):
		return c.as(auth.Engine(wire.InstanceOf(subject)))
	}
	return c.nc
}

// credsArgs are the credentials flags of every process: --creds-dir, or
// --insecure in insecure mode.
func (c *kv) credsArgs() []string {
	if c.insecure {
		return []string{"--insecure"}
	}
	return []string{"--creds-dir", c.creds}
}
