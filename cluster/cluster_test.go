package cluster

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
)

func TestJoinMembersMeta(t *testing.T) {
	reg := prometheus.NewRegistry()
	nodes := startCluster(t, 3, func(c *Config) {
		if c.NodeName == "coord" {
			c.Registerer = reg
		}
	})
	want := map[string]Meta{}
	for _, n := range nodes {
		lm := n.LocalMember()
		if lm.Meta.Incarnation == 0 || lm.ID != memberID(lm.Name, lm.Meta.Incarnation) {
			t.Fatalf("local member %+v: want ID name@incarnation with a fresh incarnation", lm)
		}
		if !strings.HasPrefix(lm.Addr, "127.0.0.1:") || strings.HasSuffix(lm.Addr, ":0") {
			t.Fatalf("local addr %q: want the bound loopback port", lm.Addr)
		}
		want[lm.ID] = lm.Meta
	}
	for i, n := range nodes {
		ms := n.Members()
		if len(ms) != 3 {
			t.Fatalf("node %d sees %d members, want 3", i, len(ms))
		}
		for _, m := range ms {
			w, ok := want[m.ID]
			if !ok {
				t.Fatalf("node %d sees unknown member %s", i, m.ID)
			}
			if m.State != StateAlive || m.Name != nameOf(m.ID) || m.Local != (m.ID == n.LocalMember().ID) {
				t.Fatalf("node %d: member %+v", i, m)
			}
			if fmt.Sprint(m.Meta) != fmt.Sprint(w) {
				t.Fatalf("node %d: meta of %s = %+v, want %+v", i, m.ID, m.Meta, w)
			}
		}
	}
	if got := testutil.Metric(t, reg, "kvtier_cluster_members", "state", "alive"); got != 3 {
		t.Fatalf("members{alive} = %v, want 3", got)
	}
	if got := testutil.Metric(t, reg, "kvtier_cluster_joins_total"); got != 2 {
		t.Fatalf("joins = %v, want 2", got)
	}
}

func TestMetaUpdatePropagates(t *testing.T) {
	nodes := startCluster(t, 3, nil)
	subs := []*Subscription{nodes[0].Subscribe(0), nodes[2].Subscribe(0)}
	r := nodes[1]
	id := r.LocalMember().ID
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := r.UpdateMeta(ctx, func(m *Meta) {
		m.L1UsedBytes, m.L1CapBytes, m.L2UsedBytes = 1<<30, 4<<30, 7<<30
		m.NATS = []string{"nats://10.0.0.7:4222", "nats://10.0.0.8:4222"}
	})
	if err != nil {
		t.Fatalf("UpdateMeta: %v", err)
	}
	for i, s := range subs {
		ev := nextEvent(t, s, 5*time.Second, func(ev Event) bool { return ev.Type == EventUpdate && ev.Member.ID == id })
		if ev.Member.Meta.L1UsedBytes != 1<<30 || ev.Member.Meta.L2UsedBytes != 7<<30 || len(ev.Member.Meta.NATS) != 2 {
			t.Fatalf("subscriber %d: update carries %+v", i, ev.Member.Meta)
		}
	}
	testutil.Eventually(t, 5*time.Second, "Members to show the new meta", func() bool {
		m, _ := member(nodes[0], id)
		return m.Meta.L1CapBytes == 4<<30
	})

	// Identity is fixed for an incarnation; an oversized meta is refused;
	// neither changes the meta in effect.
	before := r.LocalMember().Meta
	if err := r.UpdateMeta(ctx, func(m *Meta) { m.TPRank = 5 }); !errors.Is(err, ErrMeta) {
		t.Fatalf("changing the TP rank: err = %v, want ErrMeta", err)
	}
	if err := r.UpdateMeta(ctx, func(m *Meta) { m.Incarnation++ }); !errors.Is(err, ErrMeta) {
		t.Fatalf("changing the incarnation: err = %v, want ErrMeta", err)
	}
	err = r.UpdateMeta(ctx, func(m *Meta) {
		for i := range 20 {
			m.NATS = append(m.NATS, fmt.Sprintf("nats://host-%02d.example.internal:4222", i))
		}
	})
	if !errors.Is(err, ErrMetaTooLarge) {
		t.Fatalf("20 more NATS URLs: err = %v, want ErrMetaTooLarge", err)
	}
	if fmt.Sprint(r.LocalMember().Meta) != fmt.Sprint(before) {
		t.Fatalf("a refused update changed the meta: %+v, was %+v", r.LocalMember().Meta, before)
	}
}

func TestGracefulLeaveIsLeft(t *testing.T) {
	reg := prometheus.NewRegistry()
	nodes := startCluster(t, 3, func(c *Config) {
		if c.NodeName == "coord" {
			c.Registerer = reg
		}
	})
	s := nodes[0].Subscribe(0)
	leaver := nodes[2]
	id := leaver.LocalMember().ID
	if err := leaver.Leave(2 * time.Second); err != nil {
		t.Fatalf("Leave: %v", err)
	}
	if err := leaver.Leave(time.Second); err != nil {
		t.Fatalf("second Leave: %v", err)
	}
	if err := leaver.Shutdown(); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	ev := nextEvent(t, s, 5*time.Second, func(ev Event) bool {
		return ev.Member.ID == id && (ev.Type == EventLeave || ev.Type == EventDead)
	})
	if ev.Type != EventLeave || ev.Member.State != StateLeft {
		t.Fatalf("graceful leave reported as %s/%s", ev.Type, ev.Member.State)
	}
	for _, n := range nodes[:2] {
		testutil.Eventually(t, 5*time.Second, "left state at every survivor", func() bool { return memberState(n, id) == StateLeft })
	}
	// Stay left: no death follows, even after a few suspicion timeouts.
	time.Sleep(3 * nodes[0].cfg.Detector.SuspicionFor(3).Max)
	if st := memberState(nodes[0], id); st != StateLeft {
		t.Fatalf("left member is now %s", st)
	}
	if d, l := testutil.Metric(t, reg, "kvtier_cluster_deaths_total"), testutil.Metric(t, reg, "kvtier_cluster_leaves_total"); d != 0 || l != 1 {
		t.Fatalf("deaths %v leaves %v, want 0 and 1", d, l)
	}
}

// TestKilledMemberDeclaredDead kills (Shutdown without Leave) a rankd ten
// times and checks every survivor declares it dead, within a generous bound:
// timing is measured, not asserted (BenchmarkDeadDetection, TestSoakDetection).
func TestKilledMemberDeclaredDead(t *testing.T) {
	runs := 10
	if testing.Short() {
		runs = 3
	}
	coord, all, lag := detectionRuns(t, 4, runs, 5*time.Second)
	t.Logf("detection at coordinator: %s", summary(coord))
	t.Logf("detection at all survivors: %s (worst scheduling lag %v)", summary(all), lag.Round(time.Millisecond))
}

func TestRestartWithNewIncarnation(t *testing.T) {
	for _, tc := range []struct {
		name      string
		waitDeath bool
	}{
		{"after death", true},
		{"before death is detected", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nodes := startCluster(t, 3, nil)
			s := nodes[0].Subscribe(0)
			old := nodes[2].LocalMember()
			_, port, _ := strings.Cut(old.Addr, ":")
			_ = nodes[2].Shutdown()
			if tc.waitDeath {
				nextEvent(t, s, 5*time.Second, func(ev Event) bool { return ev.Type == EventDead && ev.Member.ID == old.ID })
			}
			// Same name, same address and port, new process.
			cfg := testConfig(t, old.Name, rankdMeta(1))
			cfg.BindPort, _ = strconv.Atoi(port)
			restarted := startMember(t, cfg, nodes[0].LocalMember().Addr)
			ev := nextEvent(t, s, 5*time.Second, func(ev Event) bool { return ev.Type == EventJoin && ev.Member.Name == old.Name })
			if ev.Member.ID == old.ID || ev.Member.Meta.Incarnation <= old.Meta.Incarnation || ev.Member.Addr != old.Addr {
				t.Fatalf("rejoin seen as %+v; old was %+v", ev.Member, old)
			}
			if ev.Member.ID != restarted.LocalMember().ID {
				t.Fatalf("rejoin ID %s, want %s", ev.Member.ID, restarted.LocalMember().ID)
			}
			if !tc.waitDeath {
				nextEvent(t, s, 5*time.Second, func(ev Event) bool { return ev.Type == EventDead && ev.Member.ID == old.ID })
			}
			waitConverged(t, []*Cluster{nodes[0], nodes[1], restarted}, 5*time.Second)
			if st := memberState(nodes[0], old.ID); st != StateDead {
				t.Fatalf("old incarnation is %s, want dead", st)
			}
		})
	}
}

// TestNoFalseDeathUnderLoad keeps five healthy members on a CPU saturated by
// busy goroutines (one per core), with meta updates churning, for five
// seconds, and requires that nobody is declared dead or left.
//
// All five share one Go runtime, so when the machine itself is oversubscribed
// (other tenants, a descheduled VM) every member starves at once, and a
// detector built to declare a member silent for about 0.5 s dead will
// eventually do so. The test therefore measures its environment: the share of
// GOMAXPROCS CPUs the process actually got and the worst wake-up lag of a
// sleeping goroutine. Deaths in an attempt where the process got at least
// minShare of its CPUs and never stalled beyond maxLag fail the test; deaths
// in a starved attempt make it inconclusive: it is retried, and skipped
// (with the numbers) if every attempt is starved. An attempt without deaths
// passes whatever the environment. minShare is 0.85: CI once saw two deaths
// at a share of 0.64 with other race-detector test binaries running beside
// this one, a starved process, not a detector fault; `make test` now runs
// this package alone.
func TestNoFalseDeathUnderLoad(t *testing.T) {
	dur := 5 * time.Second
	if testing.Short() {
		dur = 2 * time.Second
	}
	const (
		minShare = 0.85
		maxLag   = 200 * time.Millisecond
		attempts = 3
	)
	for attempt := 1; ; attempt++ {
		deaths, lag, share := loadAttempt(t, dur)
		env := fmt.Sprintf("CPU share %.2f of %d, worst lag %v", share, runtime.GOMAXPROCS(0), lag.Round(time.Millisecond))
		switch {
		case len(deaths) == 0:
			t.Logf("attempt %d: no deaths (%s)", attempt, env)
			return
		case share >= minShare && lag <= maxLag:
			t.Fatalf("attempt %d: false deaths on an unstarved process (%s): %v", attempt, env, deaths)
		case attempt < attempts:
			t.Logf("attempt %d inconclusive, the machine starved this process (%s): %v", attempt, env, deaths)
		default:
			t.Skipf("machine too loaded to judge: starved in all %d attempts (last: %s): %v", attempts, env, deaths)
		}
	}
}

// loadAttempt runs one load period on a fresh 5-member cluster and returns
// the deaths and leaves seen, the worst scheduling lag of the process and
// the share of its GOMAXPROCS CPUs it got (1 when it cannot tell).
func loadAttempt(t *testing.T, dur time.Duration) (deaths []string, lag time.Duration, share float64) {
	nodes := startCluster(t, 5, nil)
	defer func() {
		for _, n := range nodes {
			_ = n.Shutdown()
		}
	}()
	subs := make([]*Subscription, len(nodes))
	for i, n := range nodes {
		subs[i] = n.Subscribe(0)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	var sink atomic.Uint64
	for range runtime.GOMAXPROCS(0) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var h [32]byte
			for !stop.Load() {
				for range 1000 {
					h = sha256.Sum256(h[:])
				}
			}
			sink.Add(uint64(h[0]))
		}()
	}
	stopLag := lagMonitor()
	cpu0, _ := processCPU()
	wall0 := time.Now()
	share = 1
	// Churn meta updates, as rankds report tier usage.
	deadline := time.Now().Add(dur)
	for i := 0; time.Now().Before(deadline); i++ {
		n := nodes[1+i%(len(nodes)-1)]
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := n.UpdateMeta(ctx, func(m *Meta) { m.L1UsedBytes = uint64(i) })
		cancel()
		if err != nil && !errors.Is(err, ErrTimeout) {
			t.Errorf("UpdateMeta: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	lag = stopLag()
	if cpu1, ok := processCPU(); ok {
		share = float64(cpu1-cpu0) / float64(time.Since(wall0)) / float64(runtime.GOMAXPROCS(0))
	}
	for i, s := range subs {
		s.Close()
		for ev := range s.C() {
			if ev.Type == EventDead || ev.Type == EventLeave {
				deaths = append(deaths, fmt.Sprintf("node %d saw %s of %s", i, ev.Type, ev.Member.ID))
			}
		}
	}
	return deaths, lag, share
}

func TestEncryption(t *testing.T) {
	keyA := []byte("0123456789abcdef0123456789abcdef")
	keyB := []byte("fedcba9876543210")
	nodes := startCluster(t, 2, func(c *Config) { c.SecretKey = keyA })
	seed := nodes[0].LocalMember().Addr
	for _, tc := range []struct {
		name string
		key  []byte
	}{{"other key", keyB}, {"no key", nil}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t, "intruder", rankdMeta(3))
			cfg.SecretKey = tc.key
			c := startMember(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			defer cancel()
			n, err := c.Join(ctx, seed)
			if !errors.Is(err, ErrJoin) || n != 0 {
				t.Fatalf("join with %s: n=%d err=%v, want ErrJoin", tc.name, n, err)
			}
			for i, node := range nodes {
				if len(node.Members()) != 2 {
					t.Fatalf("node %d sees %v", i, node.Members())
				}
			}
			if len(c.Members()) != 1 {
				t.Fatalf("intruder sees %v", c.Members())
			}
		})
	}
}

// TestKeyRotation follows the documented rotation: a member that already
// sends with the new key (old one secondary) and a member that still sends
// with the old key (new one secondary) gossip with each other; a member
// with neither key cannot join.
func TestKeyRotation(t *testing.T) {
	oldKey := []byte("0123456789abcdef0123456789abcdef")
	newKey := []byte("abcdefghijklmnopqrstuvwxyz012345")
	a := testConfig(t, "coord", coordMeta())
	a.SecretKey, a.SecondaryKeys = oldKey, [][]byte{newKey}
	ca := startMember(t, a)
	b := testConfig(t, "rankd-1", rankdMeta(1))
	b.SecretKey, b.SecondaryKeys = newKey, [][]byte{oldKey}
	cb := startMember(t, b, ca.LocalMember().Addr)
	testutil.Eventually(t, 5*time.Second, "both members alive on both sides", func() bool {
		return len(ca.Members()) == 2 && len(cb.Members()) == 2
	})
	x := testConfig(t, "intruder", rankdMeta(2))
	x.SecretKey = []byte("fedcba9876543210")
	cx := startMember(t, x)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if n, err := cx.Join(ctx, ca.LocalMember().Addr); !errors.Is(err, ErrJoin) || n != 0 {
		t.Fatalf("join with a third key: n=%d err=%v, want ErrJoin", n, err)
	}
}

func TestRejectsInvalidMeta(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := testConfig(t, "coord", coordMeta())
	cfg.Registerer = reg
	c := startMember(t, cfg)
	for _, tc := range []struct{ name, meta string }{
		{"bogus@1", `{"v":1,"role":"bogus","inc":1}`},
		{"rankd-9@1", `not json`},
		{"rankd-9@2", `{"v":1,"role":"coordinator","inc":3}`}, // name/incarnation mismatch
	} {
		mc := memberlist.DefaultLocalConfig()
		mc.Name, mc.BindAddr, mc.BindPort = tc.name, "127.0.0.1", 0
		mc.Delegate = rawMeta(tc.meta)
		mc.Logger = log.New(io.Discard, "", 0)
		ml, err := memberlist.Create(mc)
		if err != nil {
			t.Fatalf("raw memberlist: %v", err)
		}
		_, _ = ml.Join([]string{c.LocalMember().Addr})
		_ = ml.Shutdown()
	}
	testutil.Eventually(t, 5*time.Second, "three rejections", func() bool {
		return testutil.Metric(t, reg, "kvtier_cluster_alive_rejected_total") >= 3
	})
	if ms := c.Members(); len(ms) != 1 {
		t.Fatalf("invalid members admitted: %+v", ms)
	}
}

type rawMeta string

func (r rawMeta) NodeMeta(int) []byte                  { return []byte(r) }
func (rawMeta) NotifyMsg([]byte)                       {}
func (rawMeta) GetBroadcasts(int, int) [][]byte        { return nil }
func (rawMeta) LocalState(bool) []byte                 { return nil }
func (rawMeta) MergeRemoteState(buf []byte, join bool) {}

func TestSubscriptionDropsAreCounted(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := testConfig(t, "coord", coordMeta())
	cfg.Registerer = reg
	c := startMember(t, cfg)
	s := c.Subscribe(1) // never read until the end
	others := []*Cluster{
		startMember(t, testConfig(t, "rankd-0", rankdMeta(0)), c.LocalMember().Addr),
		startMember(t, testConfig(t, "rankd-1", rankdMeta(1)), c.LocalMember().Addr),
	}
	waitConverged(t, append(others, c), 5*time.Second)
	testutil.Eventually(t, 5*time.Second, "a drop", func() bool { return s.Dropped() >= 1 })
	if got := testutil.Metric(t, reg, "kvtier_cluster_events_dropped_total"); got < 1 {
		t.Fatalf("dropped metric %v", got)
	}
	first := <-s.C()
	if first.Seq != 1 {
		t.Fatalf("first event Seq %d, want 1", first.Seq)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := others[0].UpdateMeta(ctx, func(m *Meta) { m.L2UsedBytes = 1 }); err != nil {
		t.Fatalf("UpdateMeta: %v", err)
	}
	ev := nextEvent(t, s, 5*time.Second, func(Event) bool { return true })
	if ev.Seq != first.Seq+1+s.Dropped() {
		t.Fatalf("after %d drops, next Seq %d (first %d): the gap must show the drops", s.Dropped(), ev.Seq, first.Seq)
	}
	s.Close()
	s.Close()
}

func TestLifecycle(t *testing.T) {
	cfg := testConfig(t, "coord", coordMeta())
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := c.Join(ctx, "127.0.0.1:1"); !errors.Is(err, ErrNotStarted) {
		t.Fatalf("Join before Start: %v", err)
	}
	if err := c.Leave(time.Second); !errors.Is(err, ErrNotStarted) {
		t.Fatalf("Leave before Start: %v", err)
	}
	if err := c.UpdateMeta(ctx, func(m *Meta) { m.L1UsedBytes = 9999 }); err != nil {
		t.Fatalf("UpdateMeta before Start: %v", err)
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	if got := c.LocalMember(); got.Meta.L1UsedBytes != 9999 || got.State != StateAlive {
		t.Fatalf("meta set before Start not announced: %+v", got)
	}
	if err := c.Start(); !errors.Is(err, ErrStarted) {
		t.Fatalf("second Start: %v", err)
	}
	if n, err := c.Join(ctx); n != 0 || err != nil {
		t.Fatalf("Join without seeds: %d %v", n, err)
	}
	s := c.Subscribe(0)
	if err := c.Leave(0); err != nil {
		t.Fatalf("Leave alone: %v", err)
	}
	if err := c.UpdateMeta(ctx, func(m *Meta) { m.L1UsedBytes = 1 }); !errors.Is(err, ErrClosed) {
		t.Fatalf("UpdateMeta after Leave: %v", err)
	}
	if err := c.Shutdown(); err != nil {
		t.Fatal(err)
	}
	if err := c.Shutdown(); err != nil {
		t.Fatalf("second Shutdown: %v", err)
	}
	for range s.C() { // closed by Shutdown
	}
	if _, ok := <-c.Subscribe(0).C(); ok {
		t.Fatal("Subscribe after Shutdown: channel open")
	}
	if err := c.Leave(time.Second); !errors.Is(err, ErrClosed) {
		t.Fatalf("Leave after Shutdown: %v", err)
	}
	if err := c.Start(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Start after Shutdown: %v", err)
	}

	// A Join retrying against nothing returns when the cluster shuts down.
	c2 := startMember(t, testConfig(t, "lonely", coordMeta()))
	done := make(chan error, 1)
	go func() {
		_, err := c2.Join(context.Background(), "127.0.0.1:1")
		done <- err
	}()
	time.Sleep(100 * time.Millisecond) // let it fail a few attempts; correctness does not depend on it
	_ = c2.Shutdown()
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("Join during Shutdown: %v", err)
	}
}

func TestMetricsRegistration(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := testConfig(t, "coord", coordMeta())
	cfg.Registerer = reg
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(cfg); err == nil {
		t.Fatal("a second member on one registry registered its metrics")
	}
	_ = c.Shutdown()
	if _, err := New(cfg); err != nil {
		t.Fatalf("metrics not unregistered by Shutdown: %v", err)
	}
}

// summary formats p50/p90/max of ds.
func summary(ds []time.Duration) string {
	if len(ds) == 0 {
		return "no samples"
	}
	s := slices.Clone(ds)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	q := func(p float64) time.Duration { return s[int(p*float64(len(s)-1)+0.5)] }
	return fmt.Sprintf("n=%d min=%v p50=%v p90=%v max=%v", len(s),
		s[0].Round(time.Millisecond), q(0.5).Round(time.Millisecond), q(0.9).Round(time.Millisecond), s[len(s)-1].Round(time.Millisecond))
}
