package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/coordinator"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) {
	// A raft future that raft dropped at its shutdown is never answered.
	testutil.Main(m, testutil.IgnoreRaftAwait)
}

func testSpec() dcp.Spec {
	return dcp.Spec{
		Model: "cli-model", Layout: dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}, ChunkTokens: 4,
		Groups: []dcp.Group{{Name: "attn", Kind: dcp.Attention, BlockSize: 4, Layers: 1, KVFormat: "bf16",
			SemanticBytes: 4 * 64, PageBytes: 4 * 64, StrideBytes: 4 * 64}},
	}
}

// fixture is a coordinator with a namespace, a rank member, placements for
// both ranks of instance "eng" and one decided restore.
type fixture struct {
	c      *coordinator.Coordinator
	nc     *nats.Conn
	spec   dcp.Spec
	ns     dcp.Namespace
	tokens []uint32
	chunks []dcp.ChunkHash
}

func newFixture(t *testing.T) *fixture {
	cfg := coordinator.DefaultConfig()
	cfg.DataDir = t.TempDir()
	cfg.Insecure = true // the CLI output tests; TestServe runs with auth on
	cfg.Embedded.Port = 0
	cfg.HTTPAddr = ""
	cfg.Cluster.NodeName = "coord"
	cfg.Cluster.BindAddr, cfg.Cluster.BindPort = "127.0.0.1", 0
	cfg.LeaveTimeout = 200 * time.Millisecond
	cfg.RequireMemberIncarnation = false // eng/0 reports over NATS without a member
	cfg.Logger = zaptest.NewLogger(t)
	c, err := coordinator.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Shutdown)
	nc, err := bus.Connect(c.NATSURL(), "test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	f := &fixture{c: c, nc: nc, spec: testSpec()}
	ctx := context.Background()
	subj := wire.Subjects{}

	// A rankd member for eng/1.
	cc := cluster.DefaultConfig()
	cc.NodeName = "rankd-eng-1"
	cc.BindAddr, cc.BindPort = "127.0.0.1", 0
	cc.Logger = zaptest.NewLogger(t)
	cc.Meta = cluster.Meta{Role: cluster.RoleRankd, Engine: "eng", TPRank: 1, TPSize: 2, DCPSize: 1, DCPRank: 0}
	m, err := cluster.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Leave(200 * time.Millisecond); _ = m.Shutdown() })
	if err := m.Start(); err != nil {
		t.Fatal(err)
	}
	jctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := m.Join(jctx, c.GossipAddr()); err != nil {
		t.Fatal(err)
	}

	reg, err := bus.Call[wire.RegisterReply](jctx, nc, subj.Coord(wire.CoordRegister), f.spec)
	if err != nil {
		t.Fatal(err)
	}
	f.ns = reg.Namespace
	for i := range 12 {
		f.tokens = append(f.tokens, uint32(100+i))
	}
	f.chunks = dcp.ChunkHashes(f.ns, f.tokens, 4)
	for tp := range 2 {
		r := wire.Rank{Instance: "eng", TPRank: tp}
		inc := uint64(1)
		if tp == 1 {
			inc = m.LocalMember().Meta.Incarnation
		}
		b := wire.Batch{Rank: r, Incarnation: inc}
		for i, ch := range f.chunks[:2] {
			b.Events = append(b.Events, wire.Event{Seq: uint64(i + 1), Kind: wire.Stored, Tier: wire.L1,
				Key: dcp.Key{NS: f.ns, Chunk: ch, Shard: uint16(tp)}, Size: 256, Sum: uint64(0xabc0 + i)})
		}
		if tp == 1 {
			// Rank 1 also wrote its first object to L3 (admin ranks counts it).
			b.Events = append(b.Events, wire.Event{Seq: 3, Kind: wire.Stored, Tier: wire.L3,
				Key: dcp.Key{NS: f.ns, Chunk: f.chunks[0], Shard: 1}, Size: 256, Sum: 0xabc0})
		}
		p, _ := b.MarshalBinary()
		if _, err := nc.RequestWithContext(jctx, subj.Events(r), p); err != nil {
			t.Fatal(err)
		}
	}
	plan, err := bus.Call[wire.RestorePlan](jctx, nc, subj.Coord(wire.CoordRestoreBegin),
		wire.RestoreBegin{Namespace: f.ns, Chunks: f.chunks})
	if err != nil || plan.Prefix != 2 {
		t.Fatalf("plan %+v %v", plan, err)
	}
	for rank, items := range plan.Ranks {
		r, _ := wire.ParseRank(rank)
		var res []wire.ItemResult
		for _, it := range items {
			res = append(res, wire.ItemResult{Chunk: it.Chunk, Group: it.Group, OK: true, Sum: it.Sum})
		}
		if _, err := bus.Call[wire.ReportAck](jctx, nc, subj.Coord(wire.CoordRestoreReport),
			wire.RestoreReport{RestoreID: plan.RestoreID, Rank: r, Results: res}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := bus.Call[wire.RestoreVerdict](jctx, nc, subj.Coord(wire.CoordRestoreWait),
		wire.RestoreWait{RestoreID: plan.RestoreID}); err != nil {
		t.Fatal(err)
	}
	// Wait until the coordinator sees the rank member.
	deadline := time.Now().Add(5 * time.Second)
	for {
		var out, errb bytes.Buffer
		if run(ctx, []string{"members", "--insecure", "--nats", c.NATSURL()}, &out, &errb) == 0 && strings.Contains(out.String(), "rankd-eng-1") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("coordinator never saw the rank member")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return f
}

// cli runs a command and returns its exit code, stdout and stderr.
func (f *fixture) cli(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), append(args, "--insecure", "--nats", f.c.NATSURL()), &out, &errb)
	t.Logf("coordinator %s -> %d\n%s%s", strings.Join(args, " "), code, out.String(), errb.String())
	return code, out.String(), errb.String()
}

// header checks a table's first line names the columns, aligned, and
// returns the data rows.
func header(t *testing.T, out string, cols ...string) []string {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) == 0 || !strings.EqualFold(strings.Join(strings.Fields(lines[0]), " "), strings.Join(cols, " ")) {
		t.Fatalf("header %q, want columns %v", lines[0], cols)
	}
	// Aligned: every column starts at the same offset on every line.
	for i, c := range cols[1:] {
		off := strings.Index(lines[0], " "+c) + 1
		for _, l := range lines[1:] {
			if off < len(l) && off > 0 && l[off-1] != ' ' {
				t.Fatalf("column %d (%s) not aligned in %q", i+1, c, l)
			}
		}
	}
	return lines[1:]
}

func TestAdminCommands(t *testing.T) {
	f := newFixture(t)

	code, out, _ := f.cli(t, "members")
	rows := header(t, out, "NAME", "ROLE", "STATE", "ADDRESS", "INCARNATION", "RANK", "SINCE")
	if code != 0 || len(rows) != 2 || !strings.Contains(out, "coord (self)") || !strings.Contains(out, "eng/1") {
		t.Fatalf("members: code %d rows %d", code, len(rows))
	}
	code, out, _ = f.cli(t, "members", "--json")
	var mr wire.AdminMembersReply
	if code != 0 || json.Unmarshal([]byte(out), &mr) != nil || len(mr.Members) != 2 {
		t.Fatalf("members --json: %d %q", code, out)
	}

	code, out, _ = f.cli(t, "ranks")
	rows = header(t, out, "RANK", "INCARNATION", "LIVENESS", "L1_OBJECTS", "L1_BYTES", "L2_OBJECTS", "L2_BYTES",
		"L3_OBJECTS", "L3_BYTES", "LAST_SEQ", "FENCED", "RESYNC")
	if code != 0 || len(rows) != 2 || !strings.Contains(rows[1], "alive") || !strings.Contains(rows[0], "unknown") {
		t.Fatalf("ranks: code %d rows %v", code, rows)
	}
	// eng/1: 2 L1 objects of 512 B, none in L2, 1 L3 object of 256 B, last seq 3.
	if f := strings.Fields(rows[1]); len(f) < 10 || f[0] != "eng/1" || f[3] != "2" || f[4] != "512" || f[5] != "0" ||
		f[6] != "0" || f[7] != "1" || f[8] != "256" || f[9] != "3" {
		t.Fatalf("ranks: row of eng/1 %q", rows[1])
	}
	code, out, _ = f.cli(t, "ranks", "--json")
	var rr wire.AdminRanksReply
	if code != 0 || json.Unmarshal([]byte(out), &rr) != nil || len(rr.Ranks) != 2 || rr.Ranks[1].L1Objects != 2 || rr.Ranks[1].L1Bytes != 512 ||
		rr.Ranks[1].L3Objects != 1 || rr.Ranks[1].L3Bytes != 256 || rr.Ranks[0].L3Objects != 0 || rr.Ranks[0].L3Bytes != 0 {
		t.Fatalf("ranks --json: %d %+v", code, rr)
	}

	code, out, _ = f.cli(t, "namespaces")
	rows = header(t, out, "NAMESPACE", "MODEL", "SALT", "TP", "DCP", "GROUPS", "CHUNK_TOKENS", "CHUNKS", "OBJECTS",
		"L1_PLACEMENTS", "L1_BYTES", "L2_PLACEMENTS", "L2_BYTES")
	if code != 0 || len(rows) != 1 || !strings.Contains(rows[0], f.ns.String()) || !strings.Contains(rows[0], "cli-model") {
		t.Fatalf("namespaces: %d %v", code, rows)
	}

	code, out, _ = f.cli(t, "restores")
	rows = header(t, out, "RESTORE", "STATE", "PREFIX", "RANKS", "FAILED", "REASONS", "VERDICT_LATENCY", "DECIDED")
	if code != 0 || len(rows) != 1 || !strings.Contains(rows[0], "complete") {
		t.Fatalf("restores: %d %v", code, rows)
	}
	code, out, _ = f.cli(t, "restores", "--json")
	var hr wire.AdminRestoresReply
	if code != 0 || json.Unmarshal([]byte(out), &hr) != nil || len(hr.Restores) != 1 || hr.Restores[0].Prefix != 2 {
		t.Fatalf("restores --json: %d %+v", code, hr)
	}

	code, out, _ = f.cli(t, "verify")
	rows = header(t, out, "STATUS", "NAMESPACES", "RANKS", "CHUNKS", "PLACEMENTS", "LOG_RECORDS", "MISMATCHES")
	if code != 0 || len(rows) != 1 || !strings.HasPrefix(rows[0], "OK") {
		t.Fatalf("verify: %d %v", code, rows)
	}
	code, out, _ = f.cli(t, "verify", "--json")
	var vr wire.AdminVerifyReply
	if code != 0 || json.Unmarshal([]byte(out), &vr) != nil || !vr.OK || vr.Placements != 5 {
		t.Fatalf("verify --json: %d %+v", code, vr)
	}
}

func TestObjectCommand(t *testing.T) {
	f := newFixture(t)
	dir := t.TempDir()
	specFile := filepath.Join(dir, "spec.json")
	js, _ := json.Marshal(f.spec)
	if err := os.WriteFile(specFile, js, 0o600); err != nil {
		t.Fatal(err)
	}
	var toks []string
	for _, tk := range f.tokens {
		toks = append(toks, strconv.Itoa(int(tk)))
	}
	tokFile := filepath.Join(dir, "tokens.txt")
	if err := os.WriteFile(tokFile, []byte(strings.Join(toks, " ")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	// By token chain: 3 chunks x 2 shards, the first 2 chunks held, the
	// first chunk's shard 1 in L1 and L3 (7 rows).
	code, out, _ := f.cli(t, "object", "--spec-file", specFile, "--tokens", tokFile)
	if code != 0 || !strings.HasPrefix(out, "restorable prefix: 2 chunks (instance eng)") {
		t.Fatalf("object by tokens: %d %q", code, out)
	}
	rows := header(t, strings.SplitN(out, "\n", 2)[1], "CHUNK", "KEY", "HOLDER", "TIER", "SIZE", "SUM", "INCARNATION", "SEQ")
	if len(rows) != 7 || strings.Count(out, "(missing)") != 2 || !strings.Contains(out, " L3 ") {
		t.Fatalf("object by tokens: %d rows", len(rows))
	}
	// The same chain in JSON.
	code, out, _ = f.cli(t, "object", "--spec-file", specFile, "--tokens", tokFile, "--json")
	var or wire.AdminObjectReply
	if code != 0 || json.Unmarshal([]byte(out), &or) != nil || or.Prefix != 2 || len(or.Objects) != 6 {
		t.Fatalf("object --json: %d %+v", code, or)
	}
	// Another model name is another namespace: unknown.
	code, _, errs := f.cli(t, "object", "--spec-file", specFile, "--model", "other", "--tokens", tokFile)
	if code != 1 || !strings.Contains(errs, wire.CodeUnknownNamespace) {
		t.Fatalf("object, other model: %d %q", code, errs)
	}
	// By key.
	k := dcp.Key{NS: f.ns, Chunk: f.chunks[1], Shard: 1}
	code, out, _ = f.cli(t, "object", "--key", k.String())
	if code != 0 || !strings.Contains(out, "eng/1") || !strings.Contains(out, "L1") {
		t.Fatalf("object by key: %d %q", code, out)
	}
	// By namespace and chunk hashes.
	code, out, _ = f.cli(t, "object", "--namespace", f.ns.String(), "--chunks", f.chunks[0].String(), "--json")
	if code != 0 || json.Unmarshal([]byte(out), &or) != nil || or.Prefix != 1 || len(or.Objects) != 2 {
		t.Fatalf("object by chunks: %d %q", code, out)
	}
	// Usage errors.
	if code, _, _ := f.cli(t, "object"); code != 2 {
		t.Fatalf("object without a selector: exit %d", code)
	}
	if code, _, _ := f.cli(t, "object", "--key", "nope"); code != 2 {
		t.Fatalf("object with a bad key: exit %d", code)
	}
}

func TestUsage(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(context.Background(), nil, &out, &errb); code != 2 || !strings.Contains(errb.String(), "commands:") {
		t.Fatalf("no args: %d %q", code, errb.String())
	}
	if code := run(context.Background(), []string{"bogus"}, &out, &errb); code != 2 {
		t.Fatalf("unknown command: %d", code)
	}
	if code := run(context.Background(), []string{"serve"}, &out, &errb); code != 2 {
		t.Fatalf("serve without --data-dir: %d", code)
	}
	if code := run(context.Background(), []string{"members", "--insecure", "--nats", "nats://127.0.0.1:1", "--timeout", "100ms"}, &out, &errb); code != 1 {
		t.Fatalf("members without a coordinator: %d", code)
	}
}

// TestServe runs the serve command, queries it, and stops it the way a
// signal does (its context ends).
func TestServe(t *testing.T) {
	port := testutil.FreePort(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	var errb bytes.Buffer
	creds := filepath.Join(t.TempDir(), "creds")
	if code := run(ctx, []string{"init", "--dir", creds, "--instance", "engine0", "--tp-size", "2"}, &bytes.Buffer{}, &errb); code != 0 {
		t.Fatalf("init: %d %s", code, errb.String())
	}
	// Without credentials, serve refuses to start (auth is on by default).
	if code := run(ctx, []string{"serve", "--data-dir", t.TempDir(), "--bind", "127.0.0.1:0", "--http", ""}, &bytes.Buffer{}, &errb); code != 2 ||
		!strings.Contains(errb.String(), "no credentials dir") {
		t.Fatalf("serve without --creds-dir: %d %s", code, errb.String())
	}
	go func() {
		done <- run(ctx, []string{"serve", "--data-dir", t.TempDir(), "--nats-port", strconv.Itoa(port), "--creds-dir", creds,
			"--bind", "127.0.0.1:0", "--http", "127.0.0.1:0", "--log-level", "warn"}, &bytes.Buffer{}, &errb)
	}()
	url := "nats://127.0.0.1:" + strconv.Itoa(port)
	deadline := time.Now().Add(10 * time.Second)
	for {
		var out bytes.Buffer
		if run(context.Background(), []string{"members", "--creds-dir", creds, "--nats", url, "--timeout", "200ms"}, &out, &bytes.Buffer{}) == 0 {
			if !strings.Contains(out.String(), "coordinator") {
				t.Fatalf("members: %q", out.String())
			}
			// An anonymous admin client is refused.
			var e2 bytes.Buffer
			if code := run(context.Background(), []string{"members", "--insecure", "--nats", url, "--timeout", "500ms"}, &out, &e2); code != 1 ||
				!strings.Contains(strings.ToLower(e2.String()), "authorization violation") {
				t.Fatalf("anonymous members: %d %s", code, e2.String())
			}
			// An instance added later connects after SIGHUP.
			if code := run(ctx, []string{"creds", "add", "--dir", creds, "--instance", "engine1", "--tp-size", "1"}, &out, &e2); code != 0 {
				t.Fatalf("creds add: %d %s", code, e2.String())
			}
			dialEngine1 := func() error {
				opts, err := auth.Client{Identity: auth.Engine("engine1"), Dir: creds}.Options()
				if err != nil {
					t.Fatal(err)
				}
				nc, err := nats.Connect(url, append(opts, nats.MaxReconnects(0))...)
				if err == nil {
					nc.Close()
				}
				return err
			}
			if dialEngine1() == nil {
				t.Fatal("engine1 connected before the reload")
			}
			if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
				t.Fatal(err)
			}
			// Not dialing while the reload runs: nats-server's reload of
			// the users re-registers its clients without the lock a client
			// still in its CONNECT reads under (a data race inside
			// nats-server v2.15.2 the race detector caught in make test at
			// a load of 2; nats-server#1388 is the same kind). A reload of
			// a few users takes milliseconds.
			time.Sleep(300 * time.Millisecond)
			for dialEngine1() != nil {
				if time.Now().After(deadline.Add(10 * time.Second)) {
					t.Fatal("engine1 still refused after SIGHUP")
				}
				time.Sleep(20 * time.Millisecond)
			}
			break
		}
		select {
		case code := <-done:
			t.Fatalf("serve exited %d: %s", code, errb.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("serve never answered")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("serve exited %d: %s", code, errb.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve did not stop")
	}
}

// verify exits 1 and names the mismatches when the coordinator's index
// disagrees with its durable copy (here a stand-in coordinator says so).
func TestVerifyMismatchExitsOne(t *testing.T) {
	ecfg := bus.DefaultEmbeddedConfig()
	ecfg.Port = 0
	ecfg.Insecure = true
	srv, err := bus.StartEmbedded(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := bus.Connect(srv.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	subj := wire.Subjects{Prefix: wire.DefaultPrefix}
	sub, err := nc.Subscribe(subj.Admin(wire.AdminVerify), func(m *nats.Msg) {
		_ = bus.Respond(m, &wire.AdminVerifyReply{OK: false, Ranks: 1, Chunks: 1, Placements: 2,
			Mismatches: []string{"chunk 00ff: placement of eng/0 in memory, not in bbolt"}})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"verify"}, {"verify", "--json"}} {
		var out, errb bytes.Buffer
		code := run(context.Background(), append(args, "--insecure", "--nats", srv.ClientURL()), &out, &errb)
		if code != 1 {
			t.Fatalf("%v: exit %d, want 1\n%s%s", args, code, out.String(), errb.String())
		}
		if !strings.Contains(out.String()+errb.String(), "placement of eng/0 in memory, not in bbolt") {
			t.Fatalf("%v: the mismatch is not shown:\n%s%s", args, out.String(), errb.String())
		}
	}
}

// TestRankResetCommand: "rank reset <instance>/<tp>" forgets the rank's
// incarnation and placements and says so; a bad rank is a usage error, an
// unknown one a failure.
func TestRankResetCommand(t *testing.T) {
	f := newFixture(t)
	code, out, _ := f.cli(t, "rank", "reset", "eng/0")
	if code != 0 || out != "rank eng/0 reset: incarnation 1 forgotten, 2 placements dropped, 0 active restores failed\n" {
		t.Fatalf("rank reset: %d %q", code, out)
	}
	var out2, errb bytes.Buffer
	if code := run(context.Background(), []string{"rank", "reset", "--insecure", "--nats", f.c.NATSURL(), "eng"}, &out2, &errb); code != exitUsage {
		t.Fatalf("rank reset eng: %d %s", code, errb.String())
	}
	if code, _, errs := f.cli(t, "rank", "reset", "nobody/3"); code != exitFail || !strings.Contains(errs, "not_found") {
		t.Fatalf("rank reset nobody/3: %d %q", code, errs)
	}
	if code, _, _ := f.cli(t, "rank"); code != exitUsage {
		t.Fatalf("rank without reset: %d", code)
	}
}

// TestInitCLI: init writes private credentials, TLS files and a
// nats-server configuration that nats-server parses; creds rotate and
// nats-conf work on the directory; a second init refuses to overwrite.
func TestInitCLI(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "creds")
	conf := filepath.Join(t.TempDir(), "nats-auth.conf")
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"init", "--dir", dir, "--instance", "a", "--tp-size", "2", "--instance", "b",
		"--tls-host", "127.0.0.1,kv.example", "--raft-ids", "c1,c2", "--nats-conf", conf}, &out, &errb); code != 0 {
		t.Fatalf("init: %d %s", code, errb.String())
	}
	for name, mode := range map[string]os.FileMode{"coordinator.nk": 0o600, "rankd-a-1.nk": 0o600, "engine-b.nk": 0o600,
		"rankd-b-0.nk": 0o600, "gossip.key": 0o600, "users.json": 0o644, "ca.pem": 0o644, "ca-key.pem": 0o600,
		"server.pem": 0o644, "server-key.pem": 0o600, "raft-c1.pem": 0o644, "raft-c1-key.pem": 0o600, "raft-c2.pem": 0o644,
		"raft-c2-key.pem": 0o600} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil || st.Mode().Perm() != mode {
			t.Errorf("%s: %v %v, want mode %04o", name, st.Mode(), err, mode)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "rankd-b-1.nk")); err == nil {
		t.Error("instance b has TP size 1 but got a rank 1 identity")
	}
	if _, err := os.Stat(filepath.Join(dir, "raft.key")); err == nil {
		t.Error("init wrote raft.key; the raft port is TLS (issue 28.4)")
	}
	body, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(conf, append([]byte("listen: 127.0.0.1:-1\n"), body...), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := server.ProcessConfigFile(conf); err != nil {
		t.Fatalf("nats-server does not parse the generated config: %v", err)
	}
	if code := run(context.Background(), []string{"init", "--dir", dir}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "credentials exist") {
		t.Fatalf("second init: %d %s", code, errb.String())
	}
	before, _ := os.ReadFile(filepath.Join(dir, "rankd-a-1.nk"))
	if code := run(context.Background(), []string{"creds", "rotate", "--dir", dir, "--name", "rankd-a-1"}, &out, &errb); code != 0 {
		t.Fatalf("rotate: %d %s", code, errb.String())
	}
	after, _ := os.ReadFile(filepath.Join(dir, "rankd-a-1.nk"))
	if bytes.Equal(before, after) || len(after) == 0 {
		t.Fatal("rotate did not replace the seed")
	}
	if code := run(context.Background(), []string{"creds", "rotate", "--dir", dir, "--name", "rankd-z-9"}, &out, &errb); code != 1 {
		t.Fatalf("rotate of an unknown identity: %d", code)
	}
	if code := run(context.Background(), []string{"creds", "nats-conf", "--dir", dir, "--out", conf}, &out, &errb); code != 0 {
		t.Fatalf("nats-conf: %d %s", code, errb.String())
	}
}

// TestServeRaftFlags: a bad --raft-peers entry and a bootstrap whose peers
// leave this node out are usage errors naming the rule, before anything
// starts; so is --rebuild-index with --raft-id (seen failing before the
// rule: serve started).
func TestServeRaftFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--raft-id", "c1", "--raft-peers", "c1"}, "must be id=host:port"},
		{[]string{"--raft-id", "c1", "--raft-peers", "c2=127.0.0.1:9481", "--raft-bootstrap"}, "must include this node"},
		{[]string{"--raft-id", "c1", "--raft-dir", "/nonexistent/raft", "--rebuild-index"}, `serve: --rebuild-index is for a single coordinator: in replicated mode (raft id "c1") a replica rebuilt`},
		{[]string{"--raft-id", "c1", "--raft-key-file", "/etc/kvtier/raft.key"}, "raft.key is no longer read"},
	} {
		var out, errb bytes.Buffer
		args := append([]string{"serve", "--data-dir", t.TempDir(), "--insecure"}, tc.args...)
		if code := run(context.Background(), args, &out, &errb); code != exitUsage || !strings.Contains(errb.String(), tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want usage error with %q", tc.args, code, errb.String(), tc.want)
		}
	}
}

// TestRaftCertCLI (issue 28.4): raft peer certificates come from the
// cluster CA: init issues them with --raft-ids (only together with
// --tls-host, which makes the CA), 'creds tls' adds the CA to a directory
// made without one, 'creds raft-cert' issues more (repeatable or
// comma-separated --id, --replace to renew), and each refusal says what to
// run instead.
func TestRaftCertCLI(t *testing.T) {
	cli := func(args ...string) (int, string) {
		var out, errb bytes.Buffer
		code := run(context.Background(), args, &out, &errb)
		return code, out.String() + errb.String()
	}
	dir := filepath.Join(t.TempDir(), "creds")
	if code, out := cli("init", "--dir", dir, "--raft-ids", "c1"); code != exitUsage || !strings.Contains(out, "--raft-ids needs --tls-host") {
		t.Fatalf("init --raft-ids without --tls-host: %d %s", code, out)
	}
	if code, out := cli("init", "--dir", dir, "--tls-host", "127.0.0.1", "--raft-ids", "c1,../x"); code != exitUsage || !strings.Contains(out, `"../x"`) {
		t.Fatalf("init with a bad raft id: %d %s", code, out)
	}
	if code, out := cli("init", "--dir", dir); code != exitOK {
		t.Fatalf("init: %d %s", code, out)
	}
	if code, out := cli("creds", "raft-cert", "--dir", dir, "--id", "c1"); code != exitFail || !strings.Contains(out, "coordinator creds tls") {
		t.Fatalf("raft-cert without a CA: %d %s", code, out)
	}
	if code, out := cli("creds", "tls", "--dir", dir); code != exitUsage {
		t.Fatalf("creds tls without --host: %d %s", code, out)
	}
	if code, out := cli("creds", "tls", "--dir", dir, "--host", "127.0.0.1"); code != exitOK {
		t.Fatalf("creds tls: %d %s", code, out)
	}
	if code, out := cli("creds", "raft-cert", "--dir", dir); code != exitUsage {
		t.Fatalf("raft-cert without --id: %d %s", code, out)
	}
	if code, out := cli("creds", "raft-cert", "--dir", dir, "--id", "c1", "--id", "c2,c3"); code != exitOK {
		t.Fatalf("raft-cert: %d %s", code, out)
	}
	for _, id := range []string{"c1", "c2", "c3"} {
		if _, err := auth.LoadRaftTLS(filepath.Join(dir, auth.RaftCertFile(id)), filepath.Join(dir, auth.RaftCertKeyFile(id)),
			filepath.Join(dir, auth.CAFile)); err != nil {
			t.Errorf("%s: %v", id, err)
		}
	}
	if code, out := cli("creds", "raft-cert", "--dir", dir, "--id", "c2"); code != exitFail || !strings.Contains(out, "--replace") {
		t.Fatalf("raft-cert over an existing one: %d %s", code, out)
	}
	if code, out := cli("creds", "raft-cert", "--dir", dir, "--id", "c2", "--replace"); code != exitOK {
		t.Fatalf("raft-cert --replace: %d %s", code, out)
	}
}
