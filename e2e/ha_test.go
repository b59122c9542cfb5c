package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/wire"
)

// The acceptance tests of issue 16: three coordinators replicating the
// index through raft, each in its own network namespace with its embedded
// NATS server routed to the others', and four rankds each in theirs.

// coordNode is one coordinator of a replicated cluster.
type coordNode struct {
	id   string
	ns   int
	ip   string
	data string
	p    *proc
}

func (n *coordNode) gossip() string   { return n.ip + ":7946" }
func (n *coordNode) natsURL() string  { return "nats://" + n.ip + ":4222" }
func (n *coordNode) routeURL() string { return "nats-route://" + n.ip + ":6222" }
func (n *coordNode) raftAddr() string { return n.ip + ":7000" }

// raftNode is the part of an admin.raft reply the tests read
// (wire.AdminRaftNode).
type raftNode struct {
	ID           string `json:"id"`
	State        string `json:"state"`
	Term         uint64 `json:"term"`
	LeaderID     string `json:"leader_id"`
	CommitIndex  uint64 `json:"commit_index"`
	AppliedIndex uint64 `json:"applied_index"`
}

type haCluster struct {
	*kv
	lab   *netlab
	nodes []*coordNode
	// leaders records, per raft term, the node every reply saw leading
	// it: two for one term would be a split brain.
	leaders map[uint64]string
	peers   string // --raft-peers
	// cutOff names the nodes behind a partition: running, unreachable.
	cutOff map[string]bool
}

// newHA builds the namespaces (0-3 the ranks', 4.. the coordinators'),
// starts n coordinators and the four rankds, and waits until a leader
// serves.
func newHA(t *testing.T, n int) *haCluster {
	t.Helper()
	lab := newNetlab(t, 4+n)
	c := newKV(t, 4)
	h := &haCluster{kv: c, lab: lab, leaders: map[uint64]string{}, cutOff: map[string]bool{}}
	var ips, gossips, urls, peers []string
	for i := range n {
		node := &coordNode{id: fmt.Sprintf("c%d", i+1), ns: 4 + i, ip: lab.rankIP(4 + i), data: filepath.Join(c.dir, fmt.Sprintf("coord%d", i+1))}
		h.nodes = append(h.nodes, node)
		ips, gossips, urls = append(ips, node.ip), append(gossips, node.gossip()), append(urls, node.natsURL())
		peers = append(peers, node.id+"="+node.raftAddr())
	}
	// initCreds: NATS off loopback, so a CA and a certificate for every
	// coordinator's address.
	c.natsHost, c.natsPort, c.tlsHosts = ips[0], 4222, ips
	c.natsURLs = strings.Join(urls, ",")
	c.simNATS = c.natsURLs
	c.rankdNATS = c.natsURLs
	c.gossip = strings.Join(gossips, ",")
	for r := range 4 {
		c.rankAddr[r] = lab.rankIP(r) + ":" + strconv.Itoa(7947+r)
	}
	c.wrap = func(r int) []string { return []string{"ip", "netns", "exec", lab.ns[r]} }
	c.initCreds()
	// Every coordinator's raft peer certificate, from the cluster CA that
	// --tls-host made (as 'coordinator creds raft-cert --id c1,c2,...').
	for _, n := range h.nodes {
		if err := auth.IssueRaftCert(c.creds, n.id, false); err != nil {
			t.Fatal(err)
		}
	}
	h.peers = strings.Join(peers, ",")
	for i := range h.nodes {
		h.startNode(i)
	}
	h.waitStarted(h.nodes...)
	deadline := time.Now().Add(30 * time.Second)
	for {
		nc, err := c.dial(auth.Identity{Role: auth.RoleAdminWrite})
		if err == nil {
			c.nc = nc
			c.conns[auth.Identity{Role: auth.RoleAdminWrite}.Name()] = nc
			t.Cleanup(nc.Close)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no coordinator NATS reachable: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	h.waitLeader(60*time.Second, "")
	for r := range c.tp {
		c.startRank(r)
	}
	return h
}

// startNode starts (or restarts) coordinator i; --raft-bootstrap is a
// no-op on a node that has raft state.
func (h *haCluster) startNode(i int) {
	h.t.Helper()
	n := h.nodes[i]
	var gossip, routes []string
	for j, o := range h.nodes {
		if j != i {
			gossip, routes = append(gossip, o.gossip()), append(routes, o.routeURL())
		}
	}
	args := []string{"ip", "netns", "exec", h.lab.ns[n.ns], bin.coordinator, "serve", "--data-dir", n.data,
		"--nats-host", n.ip, "--nats-port", "4222", "--bind", n.gossip(), "--join", strings.Join(gossip, ","),
		"--http", n.ip + ":9470", "--log-level", "info", "--creds-dir", h.creds, "--node-name", "coordinator-" + n.id,
		"--nats-cluster", n.ip + ":6222", "--nats-routes", strings.Join(routes, ","),
		"--raft-id", n.id, "--raft-bind", n.raftAddr(), "--raft-peers", h.peers, "--raft-bootstrap"}
	n.p = startProc(h.t, "coordinator-"+n.id, filepath.Join(h.logD, "coordinator-"+n.id+".log"), args...)
}

// waitStarted waits until each node logged the end of its start. The
// tests send admin.raft only to started nodes: a coordinator subscribes
// admin.raft before its raft node exists and then panics in raftStatus (a
// nil *raft.Raft), seen in TestHAKillLeader on a restarted node.
func (h *haCluster) waitStarted(nodes ...*coordNode) {
	h.t.Helper()
	for _, n := range nodes {
		h.eventually(60*time.Second, "coordinator "+n.id+" started", func() error {
			if !n.p.alive() {
				h.t.Fatalf("coordinator %s exited: %v\n%s", n.id, n.p.err, tail(n.p.output(), 30))
			}
			// p.output() holds this start's output only.
			if !strings.Contains(n.p.output(), `"coordinator started"`) {
				return fmt.Errorf("%s still starting", n.id)
			}
			return nil
		})
	}
}

// raftStates asks every coordinator for its raft state (one request,
// several replies) and records the leader of each term seen.
func (h *haCluster) raftStates() []raftNode {
	h.t.Helper()
	inbox := h.nc.NewRespInbox()
	sub, err := h.nc.SubscribeSync(inbox)
	if err != nil {
		h.t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := h.nc.PublishRequest(h.subj.Admin("raft"), inbox, []byte("{}")); err != nil {
		return nil
	}
	var out []raftNode
	deadline := time.Now().Add(500 * time.Millisecond)
	for len(out) < len(h.nodes) {
		m, err := sub.NextMsg(time.Until(deadline))
		if err != nil {
			break
		}
		var rep wire.Reply[raftNode]
		if json.Unmarshal(m.Data, &rep) != nil || rep.OK == nil {
			continue
		}
		out = append(out, *rep.OK)
		if rep.OK.State == "Leader" {
			if prev, ok := h.leaders[rep.OK.Term]; ok && prev != rep.OK.ID {
				h.t.Fatalf("split brain: %s and %s both lead term %d", prev, rep.OK.ID, rep.OK.Term)
			}
			h.leaders[rep.OK.Term] = rep.OK.ID
		}
	}
	return out
}

// waitLeader waits until a node other than not leads, every running node
// not cut off answers and follows it, and returns the leader.
func (h *haCluster) waitLeader(d time.Duration, not string) *coordNode {
	h.t.Helper()
	var leader *coordNode
	h.eventually(d, "a raft leader that every running coordinator follows", func() error {
		running := 0
		for _, n := range h.nodes {
			if n.p != nil && n.p.alive() && !h.cutOff[n.id] {
				running++
			}
		}
		st := h.raftStates()
		if len(st) < running {
			return fmt.Errorf("%d of %d running coordinators answered: %+v", len(st), running, st)
		}
		lead := ""
		for _, s := range st {
			if s.State == "Leader" {
				lead = s.ID
			}
		}
		if lead == "" || lead == not {
			return fmt.Errorf("no new leader: %+v", st)
		}
		for _, s := range st {
			if s.LeaderID != lead && s.ID != lead {
				return fmt.Errorf("%s follows %q, not %s", s.ID, s.LeaderID, lead)
			}
		}
		for _, n := range h.nodes {
			if n.id == lead {
				leader = n
			}
		}
		return nil
	})
	return leader
}

// waitCaughtUp waits until node id has applied what the leader had
// committed when the wait began.
func (h *haCluster) waitCaughtUp(id string) {
	h.t.Helper()
	var target uint64
	h.eventually(60*time.Second, id+" caught up with the leader", func() error {
		var mine *raftNode
		st := h.raftStates()
		for i, s := range st {
			if s.State == "Leader" && target == 0 {
				target = s.CommitIndex
			}
			if s.ID == id {
				mine = &st[i]
			}
		}
		switch {
		case target == 0:
			return fmt.Errorf("no leader: %+v", st)
		case mine == nil:
			return fmt.Errorf("%s does not answer", id)
		case mine.AppliedIndex < target:
			return fmt.Errorf("%s applied %d of %d", id, mine.AppliedIndex, target)
		}
		return nil
	})
}

// acked reads what every rankd was acknowledged (events.applied_through).
func (h *haCluster) acked() []uint64 {
	h.t.Helper()
	out := make([]uint64, h.tp)
	for r := range h.tp {
		rank := wire.Rank{Instance: "engine0", TPRank: r}
		h.eventually(20*time.Second, fmt.Sprintf("status of rank %d", r), func() error {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			st, err := bus.Call[struct {
				Events struct {
					AppliedThrough uint64 `json:"applied_through"`
				} `json:"events"`
			}](ctx, h.as(auth.Engine("engine0")), h.subj.Engine(rank, "status"), struct{}{})
			if err != nil {
				return err
			}
			out[r] = st.Events.AppliedThrough
			return nil
		})
	}
	return out
}

// verify runs admin verify on whichever coordinator leads, retrying while
// none serves (a leader change), and fails the test unless it is clean.
func (h *haCluster) verify(when string) *wire.AdminVerifyReply {
	h.t.Helper()
	var v *wire.AdminVerifyReply
	h.eventually(30*time.Second, "verify "+when, func() error {
		var err error
		if v, err = admin[wire.AdminVerifyReply](h.kv, wire.AdminVerify, struct{}{}); err != nil {
			var we *wire.Error
			if errors.As(err, &we) {
				h.t.Fatalf("verify %s: %v", when, err)
			}
			return err
		}
		return nil
	})
	if !v.OK {
		h.t.Fatalf("verify %s: %+v", when, v)
	}
	return v
}

// resyncsDone sums kvtier_coord_resyncs_total (every outcome) on node n's
// /metrics; -1 when it cannot be read.
func (h *haCluster) resyncsDone(n *coordNode) float64 {
	resp, err := http.Get("http://" + n.ip + ":9470/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, l := range strings.Split(string(body), "\n") {
		if f := strings.Fields(l); len(f) == 2 && strings.HasPrefix(f[0], "kvtier_coord_resyncs_total{") {
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				return -1
			}
			sum += v
		}
	}
	return sum
}

// checkAcked fails unless the serving leader's index holds every sequence
// the rankds were acknowledged, read from the index itself (admin ranks):
// nothing acknowledged was lost. A resync pending there is allowed (a
// batch the old leader never acknowledged may have been lost in transit,
// leaving a gap; go-back-N then asks for the inventory): it has not
// changed the index yet.
func (h *haCluster) checkAcked(acked []uint64, when string) {
	h.t.Helper()
	var rep *wire.AdminRanksReply
	h.eventually(30*time.Second, when+": admin ranks from the leader", func() error {
		var err error
		rep, err = admin[wire.AdminRanksReply](h.kv, wire.AdminRanks, struct{}{})
		return err // no responders while a new leader subscribes
	})
	for r, a := range acked {
		var best *wire.AdminRank
		for i, k := range rep.Ranks {
			if k.Rank.Instance == "engine0" && k.Rank.TPRank == r && (best == nil || k.Incarnation > best.Incarnation) {
				best = &rep.Ranks[i]
			}
		}
		if best == nil {
			h.t.Fatalf("%s: rank %d not in the index", when, r)
		}
		if best.LastSeq < a {
			h.t.Fatalf("%s: rank %d was acknowledged through sequence %d; the new leader's index holds through %d (resync pending %v): acknowledged events lost",
				when, r, a, best.LastSeq, best.Resync)
		}
	}
}

// lookupBack polls an engine lookup until a coordinator answers it (only
// the leader serves lookups) and returns how long that took from t0.
func (h *haCluster) lookupBack(t0 time.Time, plan *enginesim.Plan) time.Duration {
	h.t.Helper()
	eng := h.as(auth.Engine("engine0"))
	req := wire.LookupRequest{Namespace: plan.R.Namespace, Chunks: plan.Hashes, Instance: "engine0"}
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		_, err := bus.Call[wire.LookupReply](ctx, eng, h.subj.EngineCoord("engine0", wire.CoordLookup), req)
		cancel()
		if err == nil {
			return time.Since(t0)
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("no lookup answered within 60 s of the failover: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// engineLoop is one engine process after another (one at a time: a new
// registration of the instance supersedes the last one's session), each
// storing a new prompt and restoring it (enginesim --phase all) until
// stop. A COMPLETE verdict whose bytes do not compare equal is counted in
// wrong.
type engineLoop struct {
	stop                           func()
	stored, complete, other, wrong atomic.Int64
}

func (h *haCluster) startEngineLoop() *engineLoop {
	l := &engineLoop{}
	var (
		stopped atomic.Bool
		wg      sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 1; !stopped.Load(); i++ {
			result := filepath.Join(h.dir, fmt.Sprintf("engine%03d.json", i))
			logf, err := os.Create(filepath.Join(h.logD, fmt.Sprintf("engine%03d.log", i)))
			if err != nil {
				return
			}
			sc := []string{"tp4dcp4", "tp4dcp1"}[i%2]
			cmd := exec.Command(bin.enginesim, append([]string{"--nats", h.natsURLs, "--device", "host", "--host-dir", h.hostD,
				"--instance", "engine0", "--scenario", sc, "--phase", "all", "--seed", strconv.Itoa(9000 + i), "--chunks", "6",
				"--compute", "1ms", "--result", result, "--wait-prefix", "2s", "--timeout", "10s", "--restore-deadline", "5s"},
				h.credsArgs()...)...)
			cmd.Stdout, cmd.Stderr = logf, logf
			_ = cmd.Run()
			logf.Close()
			b, err := os.ReadFile(result)
			var res enginesim.Result
			if err != nil || json.Unmarshal(b, &res) != nil {
				l.other.Add(1)
				time.Sleep(100 * time.Millisecond)
				continue
			}
			if res.Stored > 0 {
				l.stored.Add(1)
			}
			if res.Verdict != wire.VerdictComplete {
				l.other.Add(1)
				continue
			}
			l.complete.Add(1)
			for _, rr := range res.Ranks {
				if rr.Mismatch != 0 || rr.Outside != 0 {
					l.wrong.Add(1)
					break
				}
			}
		}
	}()
	l.stop = func() {
		stopped.Store(true)
		wg.Wait()
	}
	return l
}

func percentiles(ds []time.Duration) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	at := func(p float64) time.Duration { return s[min(len(s)-1, int(p*float64(len(s))))].Round(time.Millisecond) }
	return fmt.Sprintf("n=%d min %v p50 %v p90 %v p99 %v max %v", len(s), s[0].Round(time.Millisecond), at(0.5), at(0.9), at(0.99),
		s[len(s)-1].Round(time.Millisecond))
}

// TestHAKillLeader: kill -9 the raft leader 5 times while engines store
// and restore (issue 16 acceptance, short).
func TestHAKillLeader(t *testing.T) { haKillCampaign(t, 5) }

// TestSoakHAKillLeader is the 50-kill version (make soak).
func TestSoakHAKillLeader(t *testing.T) {
	if os.Getenv("KVTIER_SOAK") != "1" {
		t.Skip("soak: set KVTIER_SOAK=1 (make soak)")
	}
	haKillCampaign(t, 50)
}

// haKillCampaign: every kill is followed by a check that the new leader's
// index holds every sequence the rankds were acknowledged (read from the
// ranks right after the kill, when nothing can acknowledge), a verify on
// the new leader, and the restart of the killed node until it caught up.
// At the end: no COMPLETE verdict with wrong bytes, the failover time
// (kill -> a lookup answered by the new leader) as a distribution, the
// index equal to every inventory, verify clean.
func haKillCampaign(t *testing.T, kills int) {
	h := newHA(t, 3)
	c := h.kv
	c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", "79")
	c.waitL2([]int64{16, 16, 16, 16})
	sc, _ := enginesim.LookupScenario("tp4dcp4")
	plan, err := enginesim.NewPlan(sc, 79)
	if err != nil {
		t.Fatal(err)
	}

	rl := h.startEngineLoop()
	stopped := false
	stopLoad := func() {
		if !stopped {
			stopped = true
			rl.stop()
		}
	}
	defer stopLoad()

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 16))
	var failovers []time.Duration
	verified := map[string]int{}
	conclusive := 0
	for k := range kills {
		// Kill k comes after the engine finished k runs: kills land in
		// stores and restores, and every failover has load before it.
		c.eventually(120*time.Second, "engine runs before the next kill", func() error {
			if done := rl.stored.Load() + rl.other.Load(); done < int64(k) {
				return fmt.Errorf("%d engine runs finished", done)
			}
			// On a loaded machine (make test runs packages side by side,
			// under -race) every run may overlap a kill: the last kill
			// waits until a restore has completed between kills.
			if k == kills-1 && rl.complete.Load() == 0 {
				return fmt.Errorf("%d engine runs finished, no restore COMPLETE yet", rl.stored.Load()+rl.other.Load())
			}
			return nil
		})
		leader := h.waitLeader(60*time.Second, "")
		time.Sleep(300*time.Millisecond + time.Duration(rng.Int64N(int64(1200*time.Millisecond))))
		// Followers do not resync: what a follower shows now is what it
		// shows when it takes over.
		before := map[string]float64{}
		for _, n := range h.nodes {
			if n != leader {
				before[n.id] = h.resyncsDone(n)
			}
		}
		if err := leader.p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		<-leader.p.done
		t0 := time.Now()
		acked := h.acked()
		back := h.lookupBack(t0, plan)
		failovers = append(failovers, back)
		next := h.waitLeader(60*time.Second, leader.id)
		h.checkAcked(acked, fmt.Sprintf("kill %d of leader %s", k+1, leader.id))
		// The check read the index before any resync of the new leader
		// finished (else an inventory, not the replicated log, may have
		// brought the sequences back).
		if b, a := before[next.id], h.resyncsDone(next); b >= 0 && a == b {
			conclusive++
		} else {
			t.Logf("kill %d: the new leader %s finished a resync (%v -> %v) before the check; this kill's check does not count", k+1, next.id, b, a)
		}
		v := h.verify(fmt.Sprintf("after kill %d", k+1))
		verified[next.id]++
		t.Logf("kill -9 #%d of leader %s: a lookup answered %v later, %s leads, acknowledged sequences %v all held, verify ok (%d placements)",
			k+1, leader.id, back.Round(time.Millisecond), next.id, acked, v.Placements)
		for i, n := range h.nodes {
			if n == leader {
				h.startNode(i)
				h.waitStarted(n)
			}
		}
		h.waitCaughtUp(leader.id)
	}
	stopLoad()
	t.Logf("failover (kill -9 of the leader -> a lookup answered by the new leader): %s (target p99 2 s)", percentiles(failovers))
	t.Logf("engine runs (store a prompt, restore it): %d stored, %d restores COMPLETE (%d with wrong bytes), %d not complete (cut short or recomputed)",
		rl.stored.Load(), rl.complete.Load(), rl.wrong.Load(), rl.other.Load())
	t.Logf("verify ran clean on the new leader after each kill: %v; %d of %d acknowledged-sequence checks read the index before any resync",
		verified, conclusive, kills)
	if conclusive == 0 {
		t.Fatal("every acknowledged-sequence check came after a resync of the new leader: none shows the replicated log kept the acknowledged events")
	}
	if rl.wrong.Load() != 0 {
		t.Fatalf("%d COMPLETE verdicts with wrong bytes", rl.wrong.Load())
	}
	if rl.complete.Load() == 0 {
		t.Fatal("no restore completed during the campaign")
	}
	if p := slices.Max(failovers); p > 2*time.Second && os.Getenv("KVTIER_STRICT_TIMING") == "1" {
		t.Fatalf("slowest failover %v, over 2 s", p)
	}
	for r := range c.tp {
		c.waitRank(r)
	}
	var last error
	c.eventually(60*time.Second, "index agrees with the inventories", func() error {
		last = c.agree()
		return last
	})
	h.verify("at the end")
}

// TestHAPartitionLeader: the leader's link is cut during a store stream:
// it steps down (stops acknowledging) by itself, the majority elects a new
// leader that holds everything acknowledged, no two leaders ever lead one
// term; after the heal the old leader follows, every node applies the
// same log, the index equals every inventory and verify is clean.
func TestHAPartitionLeader(t *testing.T) {
	h := newHA(t, 3)
	c := h.kv
	c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", "80")
	c.waitL2([]int64{16, 16, 16, 16})
	sc, _ := enginesim.LookupScenario("tp4dcp4")
	plan, err := enginesim.NewPlan(sc, 80)
	if err != nil {
		t.Fatal(err)
	}
	s := c.startStoreStream(1, c.natsURLs)
	stopped := false
	defer func() {
		if !stopped {
			s.stop()
		}
	}()
	c.eventually(120*time.Second, "stores under way", func() error {
		if s.ok.Load() < 1 {
			return fmt.Errorf("%d stores so far", s.ok.Load())
		}
		return nil
	})
	old := h.waitLeader(60*time.Second, "")
	lostBefore := strings.Count(old.p.output(), "raft leadership lost")
	s.markNanos.Store(time.Now().UnixNano())
	if err := h.lab.cut(old.ns); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	h.cutOff[old.id] = true
	var stepDown time.Duration
	c.eventually(30*time.Second, "the cut-off leader steps down", func() error {
		if strings.Count(old.p.output(), "raft leadership lost") > lostBefore {
			stepDown = time.Since(t0)
			return nil
		}
		return fmt.Errorf("%s still leads", old.id)
	})
	acked := h.acked() // the old leader acknowledges nothing any more
	back := h.lookupBack(t0, plan)
	next := h.waitLeader(60*time.Second, old.id)
	h.checkAcked(acked, "partition of leader "+old.id)
	t.Logf("partition of leader %s: it stepped down after %v (seen in its log, polled every 50 ms); %s leads, a lookup answered %v after the cut; acknowledged sequences %v all held",
		old.id, stepDown.Round(time.Millisecond), next.id, back.Round(time.Millisecond), acked)

	if err := h.lab.heal(old.ns); err != nil {
		t.Fatal(err)
	}
	delete(h.cutOff, old.id)
	c.eventually(60*time.Second, "stores after the partition", func() error {
		if s.okAfter.Load() < 1 {
			return fmt.Errorf("no store begun after the cut finished yet")
		}
		return nil
	})
	s.stop()
	stopped = true
	c.eventually(60*time.Second, "every node applied the same log after the heal", func() error {
		st := h.raftStates()
		if len(st) != len(h.nodes) {
			return fmt.Errorf("%d of %d nodes answer", len(st), len(h.nodes))
		}
		for _, x := range st {
			if x.AppliedIndex != st[0].AppliedIndex || x.CommitIndex != st[0].CommitIndex {
				return fmt.Errorf("applied/commit indexes differ: %+v", st)
			}
		}
		return nil
	})
	h.waitLeader(30*time.Second, "")
	for r := range c.tp {
		c.waitRank(r)
	}
	var last error
	c.eventually(60*time.Second, "index agrees with the inventories", func() error {
		last = c.agree()
		return last
	})
	v := h.verify("after the heal")
	terms := make([]uint64, 0, len(h.leaders))
	for term := range h.leaders {
		terms = append(terms, term)
	}
	slices.Sort(terms)
	var seen []string
	for _, term := range terms {
		seen = append(seen, fmt.Sprintf("%d:%s", term, h.leaders[term]))
	}
	t.Logf("healed: one leader per term seen (%s), indexes equal on every node, index == inventories, verify ok (%d placements); %d stores ok",
		strings.Join(seen, " "), v.Placements, s.ok.Load())
}
