package cluster

import (
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Config configures one member. Build it from DefaultConfig, set NodeName,
// addresses and Meta, then pass it to New, which validates it.
type Config struct {
	// NodeName names this member, stable across restarts (for example
	// "rankd-gpu3" or the host name plus GPU index). The memberlist node name
	// is NodeName@Incarnation, unique per process start. Default: the host
	// name. Must be non-empty, at most 128 bytes, without '@' or whitespace.
	NodeName string

	// BindAddr is the IP address gossip listens on, UDP and TCP. Default
	// "0.0.0.0" (all interfaces; then AdvertiseAddr or a private IP of the
	// host is advertised).
	BindAddr string
	// BindPort is the UDP and TCP gossip port. Default 7946. 0 picks a free
	// port (tests); read the result from LocalMember().Addr.
	BindPort int
	// AdvertiseAddr is the IP address peers use to reach this member, for
	// NAT or multi-homed hosts. Default "" (derived from BindAddr).
	AdvertiseAddr string
	// AdvertisePort is the port advertised with AdvertiseAddr. Default 0,
	// meaning BindPort. Ignored when AdvertiseAddr is empty.
	AdvertisePort int

	// Seeds are the host:port gossip addresses Join contacts when called
	// without arguments (any live member will do; list several). A seed
	// without a port uses BindPort. Default none: this member starts a
	// cluster of its own until someone joins it.
	Seeds []string
	// JoinRetry is the pause between two rounds of join attempts while
	// Join's context allows. Default 500 ms.
	JoinRetry time.Duration

	// SecretKey enables gossip encryption (AES-GCM) when set: 16, 24 or 32
	// bytes for AES-128/192/256. Every member must share it; a member with
	// another key (or none) cannot join. Default nil: plaintext, which is
	// only acceptable on a trusted network. The slice is copied by New.
	SecretKey []byte
	// SecondaryKeys are further keys accepted for decrypting gossip while
	// a key rotation is rolled out (every member sends with SecretKey).
	// Default none. Rotation: add the new key as a secondary everywhere,
	// then make it the primary everywhere, then drop the old one. Each is
	// 16, 24 or 32 bytes; they need SecretKey.
	SecondaryKeys [][]byte
	// Insecure allows plaintext gossip (no SecretKey) on a bind address
	// other than loopback. Default false: without a key such a member
	// refuses to start, because anyone on the network could then join,
	// forge death notices and claim the coordinator role (C9).
	Insecure bool
	// Label, when set, is sent with every packet and must match at the
	// receiver, so two kvtier clusters on one network never merge. Default
	// "" (none). At most 255 bytes.
	Label string

	// Detector tunes failure detection and gossip. Default DefaultDetector().
	Detector DetectorConfig

	// BroadcastTimeout bounds how long Leave and UpdateMeta wait for their
	// message to reach at least one peer when the caller gives no tighter
	// deadline (Leave spends at most half of it announcing the leave; see
	// Cluster.Leave). Default 2 s.
	BroadcastTimeout time.Duration
	// EventBuffer is the channel capacity of a subscription made with
	// Subscribe(0). Default 1024. Events that do not fit are dropped and
	// counted (see Subscription).
	EventBuffer int

	// Logger receives lifecycle and fault logs, and memberlist's own logs
	// under the name "memberlist". Default zap.NewNop().
	Logger *zap.Logger
	// Registerer, when non-nil, gets this member's metrics:
	// kvtier_cluster_members{state}, kvtier_cluster_joins_total, _deaths_total,
	// _leaves_total, _meta_updates_total, _events_dropped_total and
	// _alive_rejected_total. Shutdown unregisters them. Default nil (not
	// exported). Two members cannot share one Registerer.
	Registerer prometheus.Registerer

	// Meta is what this member tells the others. Meta.Incarnation 0 means
	// "assign one": New sets it with NewIncarnation.
	Meta Meta
}

// DefaultConfig returns a Config with every default filled in. NodeName is
// the host name; Meta is empty and must be set.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		NodeName:         host,
		BindAddr:         "0.0.0.0",
		BindPort:         7946,
		JoinRetry:        500 * time.Millisecond,
		Detector:         DefaultDetector(),
		BroadcastTimeout: 2 * time.Second,
		EventBuffer:      1024,
		Logger:           zap.NewNop(),
	}
}

// Validate checks every rule of the config; the error names the rule and the
// numbers. A zero Meta.Incarnation is allowed (New assigns one).
func (c *Config) Validate() error {
	switch {
	case c.NodeName == "":
		return fmt.Errorf("node name must be set: %w", ErrConfig)
	case len(c.NodeName) > 128:
		return fmt.Errorf("node name is %d B, over 128 B: %w", len(c.NodeName), ErrConfig)
	case strings.ContainsAny(c.NodeName, "@ \t\r\n"):
		return fmt.Errorf("node name %q must not contain '@' or whitespace: %w", c.NodeName, ErrConfig)
	}
	if net.ParseIP(c.BindAddr) == nil {
		return fmt.Errorf("bind address %q must be an IP address: %w", c.BindAddr, ErrConfig)
	}
	if c.BindPort < 0 || c.BindPort > 65535 {
		return fmt.Errorf("bind port %d must be in [0, 65535]: %w", c.BindPort, ErrConfig)
	}
	if c.AdvertiseAddr != "" && net.ParseIP(c.AdvertiseAddr) == nil {
		return fmt.Errorf("advertise address %q must be an IP address: %w", c.AdvertiseAddr, ErrConfig)
	}
	if c.AdvertisePort < 0 || c.AdvertisePort > 65535 {
		return fmt.Errorf("advertise port %d must be in [0, 65535]: %w", c.AdvertisePort, ErrConfig)
	}
	for i, s := range c.Seeds {
		if s == "" {
			return fmt.Errorf("seed %d is empty: %w", i, ErrConfig)
		}
	}
	if c.JoinRetry <= 0 {
		return fmt.Errorf("join retry %v must be > 0: %w", c.JoinRetry, ErrConfig)
	}
	switch len(c.SecretKey) {
	case 0, 16, 24, 32:
	default:
		return fmt.Errorf("secret key is %d B, must be 16, 24 or 32 B (AES-128/192/256): %w", len(c.SecretKey), ErrConfig)
	}
	if len(c.SecretKey) == 0 && !c.Insecure {
		if ip := net.ParseIP(c.BindAddr); !ip.IsLoopback() {
			return fmt.Errorf("gossip on %s (off loopback) needs a secret key: without one anyone on the network can join, forge death notices and claim the coordinator role; give a gossip key or run insecure: %w", c.BindAddr, ErrConfig)
		}
	}
	if len(c.SecondaryKeys) > 0 && len(c.SecretKey) == 0 {
		return fmt.Errorf("%d secondary gossip keys without a primary secret key: %w", len(c.SecondaryKeys), ErrConfig)
	}
	for i, k := range c.SecondaryKeys {
		switch len(k) {
		case 16, 24, 32:
		default:
			return fmt.Errorf("secondary gossip key %d is %d B, must be 16, 24 or 32 B: %w", i, len(k), ErrConfig)
		}
	}
	if len(c.Label) > memberlist.LabelMaxSize {
		return fmt.Errorf("label is %d B, over %d B: %w", len(c.Label), memberlist.LabelMaxSize, ErrConfig)
	}
	if err := c.Detector.Validate(); err != nil {
		return err
	}
	if c.BroadcastTimeout <= 0 {
		return fmt.Errorf("broadcast timeout %v must be > 0: %w", c.BroadcastTimeout, ErrConfig)
	}
	if c.EventBuffer < 1 {
		return fmt.Errorf("event buffer %d must be >= 1: %w", c.EventBuffer, ErrConfig)
	}
	if c.Logger == nil {
		return fmt.Errorf("logger must be set (zap.NewNop() for none): %w", ErrConfig)
	}
	if c.Meta.Leaving {
		return fmt.Errorf("meta: leaving is set only by Cluster.Leave, never in a config: %w", ErrMeta)
	}
	m := c.Meta
	if m.Incarnation == 0 {
		m.Incarnation = 1 // placeholder: New assigns the real one
	}
	if _, err := m.Encode(); err != nil {
		return fmt.Errorf("meta: %w", err)
	}
	return nil
}

// memberID is the memberlist node name of one process start.
func memberID(name string, inc uint64) string {
	return fmt.Sprintf("%s@%d", name, inc)
}

// memberlistConfig builds memberlist's config from c; d receives every
// callback, logs go to out.
func (c *Config) memberlistConfig(id string, d *delegate, out *logBridge) *memberlist.Config {
	mc := memberlist.DefaultLANConfig()
	mc.Name = id
	mc.BindAddr = c.BindAddr
	mc.BindPort = c.BindPort
	mc.AdvertiseAddr = c.AdvertiseAddr
	mc.AdvertisePort = c.AdvertisePort
	if c.AdvertiseAddr != "" && c.AdvertisePort == 0 {
		mc.AdvertisePort = c.BindPort
	}
	if len(c.SecretKey) > 0 {
		mc.SecretKey = append([]byte(nil), c.SecretKey...)
		if len(c.SecondaryKeys) > 0 {
			// Validate checked every key's length: NewKeyring cannot fail.
			kr, _ := memberlist.NewKeyring(c.SecondaryKeys, mc.SecretKey)
			mc.Keyring = kr
		}
		mc.GossipVerifyIncoming, mc.GossipVerifyOutgoing = true, true
	}
	mc.Label = c.Label
	c.Detector.apply(mc)
	mc.Delegate = d
	mc.Events = d
	mc.Alive = d
	mc.Conflict = d
	mc.Logger = out.stdLogger()
	mc.LogOutput = nil
	return mc
}
