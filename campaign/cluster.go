package campaign

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/coordinator"
	"github.com/kvtier/kvtier/internal/netutil"
	"github.com/kvtier/kvtier/wire"
)

// Instance is the engine instance the campaign's rankds serve.
const Instance = "engine0"

// cluster is the campaign's kvtier: one coordinator with embedded NATS on
// loopback, Ranks rankds of Instance on the host backend (each in its own
// network namespace when it can), a NATS proxy in front of every rankd,
// one L2 directory on a tmpfs of its own.
type cluster struct {
	cfg Config
	log *zap.Logger

	dir, creds, hostD, l2FS, l2D, logD, indexD string
	coordBin, rankdBin                         string

	lab    *lab
	labWhy string    // why there are no namespaces ("" with them)
	l3     *l3Server // nil without L3
	tmpfs  bool
	l2Why  string // why L2 is not a tmpfs ("" when it is)

	coords   []*coordNode
	rankAddr []string
	proxies  []proxySet // per rank: one proxy per coordinator's NATS server
	ranks    []*proc
	subj     wire.Subjects

	admin    *nats.Conn // admin-write
	engine   *nats.Conn // the instance's engine identity (rankd status)
	observer *nats.Conn // the coordinator identity: events and inventories
}

// coordNode is one coordinator: its embedded NATS server on loopback,
// its gossip address, and with Coordinators 3 its NATS route and raft
// ports.
type coordNode struct {
	id                            string // raft server id (c1, c2, c3)
	natsPort, routePort, raftPort int
	gossip                        string
	dataD                         string
	p                             *proc
}

func (n *coordNode) natsURL() string { return "nats://127.0.0.1:" + strconv.Itoa(n.natsPort) }

// natsURL lists every coordinator's NATS server (the clients move to a
// surviving one).
func (c *cluster) natsURL() string {
	urls := make([]string, len(c.coords))
	for i, n := range c.coords {
		urls[i] = n.natsURL()
	}
	return strings.Join(urls, ",")
}

// coordProcs returns the coordinators' processes.
func (c *cluster) coordProcs() []*proc {
	out := make([]*proc, len(c.coords))
	for i, n := range c.coords {
		out[i] = n.p
	}
	return out
}

// raftMode reports whether the coordinators replicate through raft.
func (c *cluster) raftMode() bool { return len(c.coords) > 1 }

// leader returns the index of the coordinator raft names leader, -1 when
// none answers as one (or without raft).
func (c *cluster) leader(ctx context.Context) int {
	if !c.raftMode() {
		return -1
	}
	nodes, _ := coordinator.CollectRaft(ctx, c.admin, c.subj, 300*time.Millisecond)
	for _, n := range nodes {
		if n.State != "Leader" {
			continue
		}
		for i, cn := range c.coords {
			if cn.id == n.ID {
				return i
			}
		}
	}
	return -1
}

func newCluster(cfg Config, dir string) (*cluster, error) {
	c := &cluster{cfg: cfg, log: cfg.Log.Named("cluster"), dir: dir, creds: filepath.Join(dir, "creds"),
		hostD: filepath.Join(dir, "shm"), l2FS: filepath.Join(dir, "l2fs"), logD: filepath.Join(dir, "logs"),
		indexD: filepath.Join(dir, "index"), subj: wire.Subjects{Prefix: wire.DefaultPrefix}}
	c.l2D = filepath.Join(c.l2FS, "l2")
	for _, d := range []string{c.hostD, c.l2FS, c.logD, c.indexD} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// build compiles the daemons (or takes them from BinDir).
func (c *cluster) build() error {
	bd := c.cfg.BinDir
	if bd == "" {
		bd = filepath.Join(c.dir, "bin")
		cmd := exec.Command("go", "build", "-o", bd+string(os.PathSeparator), "./cmd/coordinator", "./cmd/rankd")
		cmd.Dir = c.cfg.SourceDir
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("building the daemons in %s: %w\n%s", c.cfg.SourceDir, err, out)
		}
	}
	c.coordBin, c.rankdBin = filepath.Join(bd, "coordinator"), filepath.Join(bd, "rankd")
	return nil
}

// up builds the network, the L2 file system, the credentials, starts the
// coordinator, the proxies and every rankd, and waits until all serve.
func (c *cluster) up(ctx context.Context) error {
	if err := c.build(); err != nil {
		return err
	}
	if c.cfg.Netns {
		l, err := newLab(c.cfg.Ranks)
		if err != nil {
			c.labWhy = err.Error()
		} else {
			c.lab = l
		}
	} else {
		c.labWhy = "namespaces switched off (--netns=false)"
	}
	if err := mountTmpfs(c.l2FS, c.cfg.L2Bytes); err != nil {
		c.l2Why = err.Error()
	} else {
		c.tmpfs = true
	}
	if err := os.MkdirAll(c.l2D, 0o700); err != nil {
		return err
	}
	out, err := exec.Command(c.coordBin, "init", "--dir", c.creds, "--instance", Instance,
		"--tp-size", strconv.Itoa(c.cfg.Ranks)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("coordinator init: %w\n%s", err, out)
	}
	host := "127.0.0.1"
	if c.lab != nil {
		host = c.lab.hostIP()
	}
	for i := range c.cfg.Coordinators {
		n := &coordNode{id: fmt.Sprintf("c%d", i+1), dataD: c.indexD}
		if c.cfg.Coordinators > 1 {
			n.dataD = filepath.Join(c.indexD, n.id)
		}
		ports := []*int{&n.natsPort, new(int), &n.routePort, &n.raftPort}
		for _, pp := range ports {
			if *pp, err = netutil.PickPort(); err != nil {
				return err
			}
		}
		n.gossip = net.JoinHostPort(host, strconv.Itoa(*ports[1]))
		c.coords = append(c.coords, n)
	}
	var peers []string
	for _, n := range c.coords {
		peers = append(peers, n.id+"=127.0.0.1:"+strconv.Itoa(n.raftPort))
	}
	// The raft port is mutual TLS: a CA of its own and a certificate per
	// coordinator, given by flag, so that NATS (proxied into the ranks'
	// namespaces) stays as it is.
	raftCA := filepath.Join(c.dir, "raft-ca")
	if c.raftMode() {
		if err := os.MkdirAll(raftCA, 0o700); err != nil {
			return err
		}
		if err := auth.InitTLS(raftCA, []string{"127.0.0.1"}); err != nil {
			return err
		}
		for _, n := range c.coords {
			if err := auth.IssueRaftCert(raftCA, n.id, false); err != nil {
				return err
			}
		}
	}
	for i, n := range c.coords {
		name := "coordinator"
		argv := []string{c.coordBin, "serve", "--data-dir", n.dataD, "--nats-host", "127.0.0.1", "--nats-port", strconv.Itoa(n.natsPort),
			"--bind", n.gossip, "--http", "", "--log-level", "info", "--creds-dir", c.creds}
		if c.raftMode() {
			name = "coordinator-" + n.id
			var gossip, routes []string
			for j, o := range c.coords {
				if j != i {
					gossip, routes = append(gossip, o.gossip), append(routes, "nats-route://127.0.0.1:"+strconv.Itoa(o.routePort))
				}
			}
			// 1 s raft timeouts: on this loaded 2-core machine 500 ms
			// elects on CPU starvation alone (BENCHMARKS, raft).
			argv = append(argv, "--node-name", name, "--join", strings.Join(gossip, ","),
				"--nats-cluster", "127.0.0.1:"+strconv.Itoa(n.routePort), "--nats-routes", strings.Join(routes, ","),
				"--raft-id", n.id, "--raft-bind", "127.0.0.1:"+strconv.Itoa(n.raftPort), "--raft-peers", strings.Join(peers, ","),
				"--raft-bootstrap", "--raft-heartbeat-timeout", "1s", "--raft-election-timeout", "1s",
				"--raft-cert", filepath.Join(raftCA, auth.RaftCertFile(n.id)), "--raft-cert-key", filepath.Join(raftCA, auth.RaftCertKeyFile(n.id)),
				"--raft-ca", filepath.Join(raftCA, auth.CAFile))
		}
		n.p = newProc(name, filepath.Join(c.logD, name+".log"), argv)
		if err := n.p.start(); err != nil {
			return err
		}
	}
	if err := c.connect(ctx); err != nil {
		return err
	}
	var gossips []string
	for _, n := range c.coords {
		gossips = append(gossips, n.gossip)
	}
	if c.cfg.L3 {
		if c.l3, err = startL3(host, c.dir); err != nil {
			return err
		}
	}
	for r := range c.cfg.Ranks {
		listen := "127.0.0.1:0"
		addr := "127.0.0.1:" + strconv.Itoa(7947)
		if c.lab != nil {
			listen = c.lab.hostIP() + ":0"
			addr = c.lab.rankIP(r) + ":7947"
		} else {
			p, err := netutil.PickPort()
			if err != nil {
				return err
			}
			addr = "127.0.0.1:" + strconv.Itoa(p)
		}
		var ps proxySet
		var urls []string
		for _, n := range c.coords {
			px, err := NewProxy(listen, "127.0.0.1:"+strconv.Itoa(n.natsPort), c.log.Named("proxy"+strconv.Itoa(r)))
			if err != nil {
				return err
			}
			ps = append(ps, px)
			urls = append(urls, "nats://"+px.Addr())
		}
		c.proxies = append(c.proxies, ps)
		c.rankAddr = append(c.rankAddr, addr)
		argv := []string{c.rankdBin, "--instance", Instance, "--tp-rank", strconv.Itoa(r), "--tp-size", strconv.Itoa(c.cfg.Ranks),
			"--device", "host", "--host-dir", c.hostD, "--l1-bytes", c.cfg.L1, "--l2-dir", c.l2D, "--l2-free-floor", "0",
			"--join", strings.Join(gossips, ","), "--bind", addr, "--http", "", "--log-level", "info", "--creds-dir", c.creds,
			"--nats", strings.Join(urls, ",")}
		if c.l3 != nil {
			argv = append(argv, "--l3-endpoint", c.l3.endpoint, "--l3-bucket", l3Bucket, "--l3-credentials", c.l3.creds, "--l3-insecure")
			if c.lab != nil {
				// In its namespace the rank reaches the campaign's S3
				// server at the bridge address, not loopback: plain HTTP
				// there must be allowed explicitly.
				argv = append(argv, "--l3-insecure-remote")
			}
		}
		if c.lab != nil {
			argv = append(c.lab.wrap(r), argv...)
		}
		p := newProc(fmt.Sprintf("rankd%d", r), filepath.Join(c.logD, fmt.Sprintf("rankd%d.log", r)), argv)
		c.ranks = append(c.ranks, p)
		if err := p.start(); err != nil {
			return err
		}
	}
	return c.waitServing(ctx, 60*time.Second)
}

// connect opens the campaign's own NATS connections.
func (c *cluster) connect(ctx context.Context) error {
	dial := func(id auth.Identity) (*nats.Conn, error) {
		o, err := auth.Client{Identity: id, Dir: c.creds}.Options()
		if err != nil {
			return nil, err
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			nc, err := bus.Connect(c.natsURL(), "campaign-"+id.Name(), o...)
			if err == nil {
				return nc, nil
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return nil, fmt.Errorf("connect as %s: %w", id, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	var err error
	if c.admin, err = dial(auth.Identity{Role: auth.RoleAdminWrite}); err != nil {
		return err
	}
	if c.engine, err = dial(auth.Engine(Instance)); err != nil {
		return err
	}
	c.observer, err = dial(auth.Identity{Role: auth.RoleCoordinator})
	return err
}

// statusReply is the part of rankd's status reply the campaign reads.
type statusReply struct {
	Incarnation uint64 `json:"incarnation"`
	Accepting   bool   `json:"accepting"`
}

func (c *cluster) rank(r int) wire.Rank { return wire.Rank{Instance: Instance, TPRank: r} }

func adminCall[T any](ctx context.Context, c *cluster, op string, req any) (*T, error) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return bus.Call[T](cctx, c.admin, c.subj.Admin(op), req)
}

// serving reports nil when every rankd accepts engine requests and the
// coordinator sees its incarnation alive.
func (c *cluster) serving(ctx context.Context) error {
	m, err := adminCall[wire.AdminMembersReply](ctx, c, wire.AdminMembers, struct{}{})
	if err != nil {
		return fmt.Errorf("coordinator members: %w", err)
	}
	if c.raftMode() {
		// admin.ranks is served by the raft leader alone.
		if _, err := adminCall[wire.AdminRanksReply](ctx, c, wire.AdminRanks, struct{}{}); err != nil {
			return fmt.Errorf("no raft leader serves: %w", err)
		}
	}
	for r := range c.cfg.Ranks {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		st, err := bus.Call[statusReply](cctx, c.engine, c.subj.Engine(c.rank(r), "status"), struct{}{})
		cancel()
		if err != nil {
			return fmt.Errorf("rank %d status: %w", r, err)
		}
		if !st.Accepting {
			return fmt.Errorf("rank %d not accepting", r)
		}
		found := false
		for _, mm := range m.Members {
			if mm.Rank == c.rank(r).String() && mm.Incarnation == st.Incarnation && mm.State == "alive" {
				found = true
			}
		}
		if !found {
			return fmt.Errorf("coordinator does not see incarnation %d of rank %d alive", st.Incarnation, r)
		}
	}
	return nil
}

func (c *cluster) waitServing(ctx context.Context, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		err := c.serving(ctx)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("cluster not serving within %v: %w", d, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// inventory reads rank r's whole inventory (every page of one snapshot).
func (c *cluster) inventory(ctx context.Context, r int) (wire.Inventory, error) {
	var pages []wire.InventoryPage
	req := wire.InventoryRequest{}
	for {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		p, err := bus.Call[wire.InventoryPage](cctx, c.observer, c.subj.Inventory(c.rank(r)), req)
		cancel()
		if err != nil {
			return wire.Inventory{}, fmt.Errorf("rank %d inventory page %d: %w", r, req.Page, err)
		}
		pages = append(pages, *p)
		if len(pages) >= p.Pages {
			break
		}
		req = wire.InventoryRequest{Snapshot: p.Snapshot, Page: len(pages)}
	}
	return wire.AssembleInventory(pages)
}

// l2Files lists the L2 object files, sorted (a pick indexes it).
func (c *cluster) l2Files() []string {
	files, _ := filepath.Glob(filepath.Join(c.l2D, "*", "*.kvo"))
	sort.Strings(files)
	return files
}

// down stops everything, in order: rankds, coordinator, proxies, network,
// file system.
func (c *cluster) down() {
	for _, p := range c.ranks {
		p.mu.Lock()
		p.stopping = true
		p.mu.Unlock()
		p.signal(syscall.SIGCONT)
		p.signal(syscall.SIGKILL)
	}
	for _, n := range c.coords {
		if n.p == nil {
			continue
		}
		n.p.mu.Lock()
		n.p.stopping = true
		n.p.mu.Unlock()
		n.p.signal(syscall.SIGCONT)
		n.p.signal(syscall.SIGKILL)
	}
	if c.l3 != nil {
		c.l3.close()
	}
	for _, nc := range []*nats.Conn{c.admin, c.engine, c.observer} {
		if nc != nil {
			nc.Close()
		}
	}
	for _, p := range c.proxies {
		p.Close()
	}
	if c.lab != nil {
		c.lab.teardown()
	}
	if c.tmpfs {
		unmount(c.l2FS)
	}
}
