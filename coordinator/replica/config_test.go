package replica

import (
	"errors"
	"testing"
)

// TestConfigRules: the peer list parses or names the bad entry, and
// Validate names the rule; replicated mode off validates nothing.
func TestConfigRules(t *testing.T) {
	peers, err := ParsePeers("n1=10.0.0.1:9480, n2=10.0.0.2:9480,")
	if err != nil || len(peers) != 2 || peers[1] != (Peer{ID: "n2", Addr: "10.0.0.2:9480"}) {
		t.Fatalf("parse: %+v %v", peers, err)
	}
	for _, bad := range []string{"n1", "=10.0.0.1:1", "n1=10.0.0.1"} {
		if _, err := ParsePeers(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("ParsePeers(%q) = %v, want ErrConfig", bad, err)
		}
	}
	ok := DefaultConfig()
	ok.ID, ok.Dir, ok.Peers, ok.Bootstrap = "n1", "/tmp/x", peers[:1], true
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	off := Config{}
	if err := off.Validate(); err != nil {
		t.Fatalf("raft off: %v", err)
	}
	for name, mod := range map[string]func(*Config){
		"no dir":              func(c *Config) { c.Dir = "" },
		"bootstrap w/o self":  func(c *Config) { c.Peers = peers[1:] },
		"duplicate peer":      func(c *Config) { c.Peers = []Peer{peers[0], peers[0]} },
		"lease > heartbeat":   func(c *Config) { c.LeaderLeaseTimeout = 2 * c.HeartbeatTimeout },
		"election < heartbt":  func(c *Config) { c.ElectionTimeout = c.HeartbeatTimeout / 2 },
		"bad bind":            func(c *Config) { c.Bind = "nowhere" },
		"append entries 2000": func(c *Config) { c.MaxAppendEntries = 2000 },
		"id with comma":       func(c *Config) { c.ID = "a,b" },
	} {
		c := ok
		mod(&c)
		if err := c.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", name, err)
		}
	}
}
