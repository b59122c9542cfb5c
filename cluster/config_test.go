package cluster

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
)

func TestConfigValidate(t *testing.T) {
	base := func() Config {
		c := DefaultConfig()
		c.NodeName = "rankd-0"
		c.Meta = rankdMeta(0)
		c.SecretKey = make([]byte, 32)
		return c
	}
	if err := (func() *Config { c := base(); return &c })().Validate(); err != nil {
		t.Fatalf("default config with meta: %v", err)
	}
	// Plaintext gossip is fine on loopback, or off it when insecure.
	for _, mod := range []func(*Config){
		func(c *Config) { c.SecretKey, c.BindAddr = nil, "127.0.0.1" },
		func(c *Config) { c.SecretKey, c.Insecure = nil, true },
	} {
		c := base()
		mod(&c)
		if err := c.Validate(); err != nil {
			t.Fatalf("plaintext gossip on %s (insecure %v): %v", c.BindAddr, c.Insecure, err)
		}
	}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		rule string // substring of the error
	}{
		{"empty name", func(c *Config) { c.NodeName = "" }, "node name must be set"},
		{"name with @", func(c *Config) { c.NodeName = "a@b" }, "must not contain '@'"},
		{"long name", func(c *Config) { c.NodeName = strings.Repeat("x", 129) }, "over 128 B"},
		{"bind addr", func(c *Config) { c.BindAddr = "localhost" }, "bind address"},
		{"bind port", func(c *Config) { c.BindPort = 70000 }, "bind port 70000"},
		{"advertise addr", func(c *Config) { c.AdvertiseAddr = "host" }, "advertise address"},
		{"empty seed", func(c *Config) { c.Seeds = []string{"a:1", ""} }, "seed 1 is empty"},
		{"key size", func(c *Config) { c.SecretKey = make([]byte, 20) }, "secret key is 20 B"},
		{"plaintext off loopback", func(c *Config) { c.SecretKey = nil }, "gossip on 0.0.0.0 (off loopback) needs a secret key"},
		{"secondary without primary", func(c *Config) {
			c.SecretKey, c.BindAddr, c.SecondaryKeys = nil, "127.0.0.1", [][]byte{make([]byte, 16)}
		}, "1 secondary gossip keys without a primary"},
		{"secondary key size", func(c *Config) { c.SecondaryKeys = [][]byte{make([]byte, 16), make([]byte, 7)} }, "secondary gossip key 1 is 7 B"},
		{"label", func(c *Config) { c.Label = strings.Repeat("l", 256) }, "label is 256 B"},
		{"probe timeout vs interval", func(c *Config) { c.Detector.ProbeTimeout = 50 * time.Millisecond }, "2 x probe timeout 50ms must be below probe interval 100ms"},
		{"probe interval", func(c *Config) { c.Detector.ProbeInterval = 0 }, "probe interval 0s"},
		{"suspicion mult", func(c *Config) { c.Detector.SuspicionMult = 0 }, "suspicion mult 0"},
		{"gossip nodes", func(c *Config) { c.Detector.GossipNodes = 0 }, "gossip nodes 0"},
		{"broadcast timeout", func(c *Config) { c.BroadcastTimeout = 0 }, "broadcast timeout"},
		{"event buffer", func(c *Config) { c.EventBuffer = 0 }, "event buffer 0"},
		{"join retry", func(c *Config) { c.JoinRetry = 0 }, "join retry"},
		{"no role", func(c *Config) { c.Meta.Role = "" }, "role \"\" must be"},
		{"leaving", func(c *Config) { c.Meta.Leaving = true }, "leaving is set only by Cluster.Leave"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base()
			tc.mod(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.rule) {
				t.Fatalf("err = %v, want rule %q", err, tc.rule)
			}
			if !errors.Is(err, ErrConfig) && !errors.Is(err, ErrMeta) {
				t.Fatalf("err = %v wraps neither ErrConfig nor ErrMeta", err)
			}
		})
	}
}

func TestMetaValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*Meta)
		rule string // "" = valid
	}{
		{"rankd ok", func(*Meta) {}, ""},
		{"coordinator ok", func(m *Meta) { *m = coordMeta(); m.Incarnation = 1 }, ""},
		{"leaving ok", func(m *Meta) { m.Leaving = true }, ""}, // a leaving peer's meta
		{"coordinator with ranks", func(m *Meta) { m.Role = RoleCoordinator; m.Engine = "" }, "coordinator has no rank identity"},
		{"no engine", func(m *Meta) { m.Engine = "" }, "needs an engine instance"},
		{"tp size", func(m *Meta) { m.TPSize = 0 }, "tp size 0"},
		{"tp rank", func(m *Meta) { m.TPRank = 8 }, "tp rank 8 must be in [0, tp size 8)"},
		{"dcp divides", func(m *Meta) { m.DCPSize = 3 }, "dcp size 3 must be >= 1 and divide tp size 8"},
		{"dcp rank rule", func(m *Meta) { m.TPRank, m.DCPRank = 6, 1 }, "dcp rank 1 must equal tp rank 6 % dcp size 4 = 2"},
		{"incarnation", func(m *Meta) { m.Incarnation = 0 }, "incarnation must be non-zero"},
		{"nats list in one", func(m *Meta) { m.NATS = []string{"nats://a:1,nats://b:1"} }, "nats url 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := rankdMeta(0)
			m.Incarnation = 42
			tc.mod(&m)
			err := m.Validate()
			if tc.rule == "" {
				if err != nil {
					t.Fatalf("valid meta: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.rule) || !errors.Is(err, ErrMeta) {
				t.Fatalf("err = %v, want ErrMeta naming %q", err, tc.rule)
			}
		})
	}
}

func TestMetaEncodeRoundTrip(t *testing.T) {
	m := rankdMeta(6)
	m.Incarnation = NewIncarnation()
	m.L1UsedBytes, m.L1CapBytes, m.L2UsedBytes = 1<<40, 1<<41, 1<<50
	b, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeMeta(b)
	if err != nil {
		t.Fatal(err)
	}
	b2, _ := got.Encode()
	if string(b) != string(b2) {
		t.Fatalf("round trip changed the encoding:\n%s\n%s", b, b2)
	}
	if !strings.HasPrefix(string(b), `{"v":1,"role":"rankd",`) {
		t.Fatalf("encoding %s: want the version first, then the role", b)
	}
	if strings.Contains(string(b), "leaving") {
		t.Fatalf("encoding %s: leaving must be omitted while false", b)
	}
	lm := m
	lm.Leaving = true
	lb, err := lm.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := DecodeMeta(lb); err != nil || !got.Leaving || !strings.HasSuffix(string(lb), `,"leaving":true}`) {
		t.Fatalf("leaving meta %s decodes to %+v, %v", lb, got, err)
	}
	t.Logf("typical meta: %d B of %d: %s", len(b), MaxMetaBytes, b)

	// Unknown fields from a newer minor version are accepted; another
	// version is not.
	// json.Number keeps the incarnation exact (a float64 would round it).
	var raw map[string]any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil {
		t.Fatal(err)
	}
	raw["future"] = true
	fb, _ := json.Marshal(raw)
	if _, err := DecodeMeta(fb); err != nil {
		t.Fatalf("unknown field refused: %v", err)
	}
	// A member from before issue 28.2 still gossips its admin address:
	// decoded, and not kept (nothing re-gossips it).
	delete(raw, "future")
	raw["admin"] = "10.0.0.7:9100"
	ab, _ := json.Marshal(raw)
	if got, err := DecodeMeta(ab); err != nil {
		t.Fatalf("an older member's meta with an admin address refused: %v", err)
	} else if again, _ := got.Encode(); strings.Contains(string(again), `"admin"`) || strings.Contains(string(again), "10.0.0.7") {
		t.Fatalf("the admin address survives decoding: %s", again)
	}
	if strings.Contains(string(b), "admin") {
		t.Fatalf("encoding %s carries an admin address", b)
	}
	raw["v"] = 2
	vb, _ := json.Marshal(raw)
	if _, err := DecodeMeta(vb); !errors.Is(err, ErrMeta) {
		t.Fatalf("version 2: err = %v", err)
	}
	if _, err := DecodeMeta(append(b, []byte(`{}`)...)); !errors.Is(err, ErrMeta) {
		t.Fatalf("trailing data: err = %v", err)
	}

	big := m
	big.Engine = strings.Repeat("e", 500)
	if _, err := big.Encode(); !errors.Is(err, ErrMetaTooLarge) || !strings.Contains(err.Error(), "limit of 512 B") {
		t.Fatalf("oversized meta: err = %v", err)
	}
}

func FuzzDecodeMeta(f *testing.F) {
	m := rankdMeta(1)
	m.Incarnation = 7
	b, _ := m.Encode()
	f.Add(b)
	f.Add([]byte(`{"v":1,"role":"coordinator","inc":1}`))
	f.Add([]byte(`{"v":1,"role":"rankd","eng":"e","tp":-1,"tps":-8,"dcps":0,"inc":1}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeMeta(b)
		if err != nil {
			if !errors.Is(err, ErrMeta) && !errors.Is(err, ErrMetaTooLarge) {
				t.Fatalf("error %v wraps no sentinel", err)
			}
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("decoded meta does not validate: %v", err)
		}
		if _, err := m.Encode(); err != nil && !errors.Is(err, ErrMetaTooLarge) {
			t.Fatalf("decoded meta does not encode: %v", err)
		}
	})
}

func TestNewIncarnationIncreases(t *testing.T) {
	prev := NewIncarnation()
	for range 1000 {
		v := NewIncarnation()
		if v <= prev {
			t.Fatalf("incarnation %d after %d", v, prev)
		}
		prev = v
	}
}

// TestSuspicionFor pins the detector math to memberlist's (suspectNode and
// suspicionTimeout in v0.7.0) and the default's detection budget.
func TestSuspicionFor(t *testing.T) {
	d := DefaultDetector()
	ms := time.Millisecond
	for _, tc := range []struct {
		n        int
		min, max time.Duration
		k        int
	}{
		{1, 400 * ms, 400 * ms, 0},
		{3, 400 * ms, 400 * ms, 0}, // n-2 < k: no confirmations possible
		{4, 400 * ms, 2000 * ms, 2},
		{9, 400 * ms, 2000 * ms, 2},
		{10, 400 * ms, 2000 * ms, 2},
		{100, 800 * ms, 4000 * ms, 2},
	} {
		got := d.SuspicionFor(tc.n)
		if got.Min != tc.min || got.Max != tc.max || got.Confirmations != tc.k {
			t.Errorf("n=%d: %+v, want min %v max %v k %d", tc.n, got, tc.min, tc.max, tc.k)
		}
	}
	lan := DetectorConfig{ProbeInterval: time.Second, SuspicionMult: 4, SuspicionMaxTimeoutMult: 6}
	if got := lan.SuspicionFor(5); got.Min != 4*time.Second || got.Max != 24*time.Second || got.Confirmations != 2 {
		t.Errorf("memberlist LAN defaults, n=5: %+v", got)
	}
	// Probe round + minimum suspicion + a p99 wait for the first probe (4.6
	// probe intervals) fits the 1.5 s budget up to 100 members.
	for _, n := range []int{2, 10, 32, 100} {
		if got := d.TypicalDetection(n) + 46*d.ProbeInterval/10; got > 1500*ms {
			t.Errorf("n=%d: detection budget %v exceeds 1.5 s", n, got)
		}
	}
	if err := d.Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestParseMemberlistLine(t *testing.T) {
	for _, tc := range []struct {
		in  string
		lvl zapcore.Level
		msg string
	}{
		{"[DEBUG] memberlist: Failed UDP ping: x (timeout reached)\n", zapcore.DebugLevel, "Failed UDP ping: x (timeout reached)"},
		{"[INFO] memberlist: Suspect x has failed, no acks received\n", zapcore.InfoLevel, "Suspect x has failed, no acks received"},
		{"[WARN] memberlist: Refuting a suspect message (from: y)\n", zapcore.WarnLevel, "Refuting a suspect message (from: y)"},
		{"[ERR] memberlist: Failed fallback TCP ping: dial\n", zapcore.WarnLevel, "Failed fallback TCP ping: dial"},
		{"Err: Could not set the deadline: x\n", zapcore.InfoLevel, "Err: Could not set the deadline: x"},
		{"", zapcore.InfoLevel, ""},
		{"[", zapcore.InfoLevel, "["},
	} {
		lvl, msg := parseMemberlistLine([]byte(tc.in))
		if lvl != tc.lvl || msg != tc.msg {
			t.Errorf("%q: %v %q, want %v %q", tc.in, lvl, msg, tc.lvl, tc.msg)
		}
	}
}
