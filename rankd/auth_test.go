package rankd

import (
	"encoding/base64"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/objstore"
	"github.com/kvtier/kvtier/wire"
	"go.uber.org/zap/zaptest"
)

// TestConfigNeedsCredentials: a rank refuses to start without NATS
// credentials (or a way to verify the coordinator) unless insecure.
func TestConfigNeedsCredentials(t *testing.T) {
	base := func() Config {
		c := DefaultConfig(wire.Rank{Instance: "eng", TPRank: 0})
		c.TPSize, c.Join = 1, []string{"127.0.0.1:7946"}
		return c
	}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		rule string
	}{
		{"nothing", func(*Config) {}, "no NATS credentials"},
		{"seed but no coordinator key", func(c *Config) { c.SeedFile = "/x.nk" }, "no coordinator key"},
	} {
		c := base()
		tc.mod(&c)
		if err := c.Validate(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.rule) {
			t.Errorf("%s: %v, want rule %q", tc.name, err, tc.rule)
		}
	}
	for _, mod := range []func(*Config){
		func(c *Config) { c.Insecure = true },
		func(c *Config) { c.CredsDir = "/etc/kvtier" },
		func(c *Config) { c.SeedFile, c.NATSURL = "/x.nk", "nats://127.0.0.1:4222" },
	} {
		c := base()
		mod(&c)
		if err := c.Validate(); err != nil {
			t.Errorf("%+v: %v", c, err)
		}
	}
}

// TestTrustedNATS: only URLs the coordinator's key signed for that
// incarnation are followed.
func TestTrustedNATS(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "creds")
	if err := auth.Init(dir, []auth.Instance{{Name: "eng", TPSize: 1}}); err != nil {
		t.Fatal(err)
	}
	seed, err := auth.LoadSeed(filepath.Join(dir, "coordinator.nk"))
	if err != nil {
		t.Fatal(err)
	}
	other, err := auth.LoadSeed(filepath.Join(dir, "admin.nk"))
	if err != nil {
		t.Fatal(err)
	}
	d := &Daemon{cfg: DefaultConfig(wire.Rank{Instance: "eng"}), log: zaptest.NewLogger(t), met: newMetrics("eng/0")}
	d.cfg.Rank, d.cfg.CredsDir = wire.Rank{Instance: "eng"}, dir
	if err := d.loadAuth(); err != nil {
		t.Fatal(err)
	}
	sign := func(s *auth.Seed, inc uint64, urls []string) string {
		sig, err := s.Sign(cluster.NATSStatement(inc, urls))
		if err != nil {
			t.Fatal(err)
		}
		return base64.StdEncoding.EncodeToString(sig)
	}
	urls := []string{"nats://10.0.0.1:4222"}
	member := func(inc uint64, nats []string, sig string) cluster.Member {
		return cluster.Member{Name: "coordinator", Meta: cluster.Meta{Role: cluster.RoleCoordinator, Incarnation: inc, NATS: nats, NATSSig: sig}}
	}
	for _, tc := range []struct {
		name string
		m    cluster.Member
		want bool
	}{
		{"signed", member(7, urls, sign(seed, 7, urls)), true},
		{"unsigned", member(7, urls, ""), false},
		{"garbage", member(7, urls, "!!"), false},
		{"signed by another identity", member(7, urls, sign(other, 7, urls)), false},
		{"signature of other URLs", member(7, []string{"nats://6.6.6.6:4222"}, sign(seed, 7, urls)), false},
		{"signature of another incarnation", member(8, urls, sign(seed, 7, urls)), false},
	} {
		if got := d.trustedNATS(tc.m); got != tc.want {
			t.Errorf("%s: trusted = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestL3PlaintextOnlyOnLoopback (tiers4.3): a rankd's L3 over plain HTTP
// is refused at Validate off loopback unless --l3-insecure-remote, as
// plaintext gossip off loopback is unless --insecure.
func TestL3PlaintextOnlyOnLoopback(t *testing.T) {
	for _, tc := range []struct {
		endpoint string
		remote   bool
		ok       bool
	}{
		{"127.0.0.1:9000", false, true},
		{"s3.internal.example:9000", false, false},
		{"s3.internal.example:9000", true, true},
	} {
		c := DefaultConfig(wire.Rank{Instance: "eng", TPRank: 0})
		c.TPSize, c.Join, c.Insecure = 1, []string{"127.0.0.1:7946"}, true
		c.L3.Endpoint, c.L3.Bucket, c.L3.CredentialsFile, c.L3.Insecure, c.L3.InsecureRemote = tc.endpoint, "kv", "/etc/kvtier/s3.json", true, tc.remote
		err := c.Validate()
		if tc.ok && err != nil || !tc.ok && (!errors.Is(err, objstore.ErrConfig) || !strings.Contains(err.Error(), "off loopback")) {
			t.Errorf("plain HTTP to %s, remote allowed %v: %v, want ok=%v", tc.endpoint, tc.remote, err, tc.ok)
		}
	}
}
