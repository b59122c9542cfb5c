package rankd

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestConfigZeroMeansZero (STYLE 23): DefaultConfig(rank) derives the node
// name and gossip port from the rank; New validates what it is given and
// fills nothing in, so an empty node name or a nil logger is refused and
// port 0 stays 0 (a free port).
func TestConfigZeroMeansZero(t *testing.T) {
	r := wire.Rank{Instance: "eng", TPRank: 3}
	c := DefaultConfig(r)
	if c.Rank != r || c.NodeName != "rankd-eng-3" || c.BindPort != 7950 || c.Logger == nil {
		t.Fatalf("DefaultConfig(%s): rank %s, node %q, port %d, logger %v", r, c.Rank, c.NodeName, c.BindPort, c.Logger)
	}
	c.TPSize, c.Join, c.Insecure = 4, []string{"127.0.0.1:7946"}, true
	if err := c.Validate(); err != nil {
		t.Fatalf("DefaultConfig(%s) with TP size, join and insecure: %v", r, err)
	}
	for name, f := range map[string]func(*Config){
		"no node name": func(c *Config) { c.NodeName = "" },
		"no logger":    func(c *Config) { c.Logger = nil },
		"port -1":      func(c *Config) { c.BindPort = -1 },
		"copy path":    func(c *Config) { c.CopyPath = "pcie" },
	} {
		bad := c
		f(&bad)
		if _, err := New(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: New: %v, want ErrConfig", name, err)
		}
	}
	free := c
	free.BindPort = 0
	if err := free.Validate(); err != nil || free.BindPort != 0 {
		t.Fatalf("port 0 (a free one): %v, port %d", err, free.BindPort)
	}
}

// TestConfigL3EncryptNeedsL3: --l3-encrypt without an L3 endpoint is
// refused, naming both flags (transfer refuses it without a storage key).
func TestConfigL3EncryptNeedsL3(t *testing.T) {
	c := DefaultConfig(wire.Rank{Instance: "eng", TPRank: 0})
	c.TPSize, c.Join, c.Insecure, c.L3Encrypt = 1, []string{"127.0.0.1:7946"}, true, true
	if err := c.Validate(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "--l3-encrypt") || !strings.Contains(err.Error(), "--l3-endpoint") {
		t.Fatalf("L3Encrypt without L3: %v, want ErrConfig naming --l3-endpoint and --l3-encrypt", err)
	}
	c.L3.Endpoint, c.L3.Bucket, c.L3.CredentialsFile, c.L3.Insecure = "127.0.0.1:9000", "kv", "/etc/kvtier/s3.json", true
	if err := c.Validate(); err != nil {
		t.Fatalf("L3Encrypt with L3: %v", err)
	}
}
