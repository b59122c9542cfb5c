package cluster

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
)

// Role is what a member does in kvtier.
type Role string

const (
	// RoleCoordinator is the process that keeps the index and fences ranks.
	RoleCoordinator Role = "coordinator"
	// RoleRankd is the per-GPU agent that owns L1/L2 for one rank.
	RoleRankd Role = "rankd"
)

// MetaVersion is the version of the Meta wire encoding. Decoders accept
// unknown fields (newer minor additions, such as Leaving) but reject another
// version.
const MetaVersion = 1

// MaxMetaBytes is the largest encoded Meta memberlist will gossip
// (memberlist.MetaMaxSize).
const MaxMetaBytes = memberlist.MetaMaxSize

// Meta is what a member tells the cluster about itself. It travels in every
// memberlist alive message, so it is small: one JSON object of at most
// MaxMetaBytes bytes. The identity fields (Role, Engine, the rank numbers and
// Incarnation) are fixed for the life of a process; NATS and the usage
// counters may change through Cluster.UpdateMeta; Leaving only through
// Cluster.Leave.
//
// Every holder of the gossip key reads every member's Meta, so it carries
// only what discovery needs (issue 28.2): no admin or metrics address. The
// coordinator's NATS URLs stay: they are how a rankd without --nats finds
// NATS, and they are signed (NATSSig); NATS itself authenticates every
// connection. Older members that still send "admin" are decoded as before
// (the field is ignored).
type Meta struct {
	// Role is coordinator or rankd.
	Role Role `json:"role"`
	// Engine names the inference engine instance a rankd serves (for example
	// the engine's data-parallel replica id). Empty for a coordinator.
	Engine string `json:"eng,omitempty"`
	// TPRank and TPSize are the rankd's tensor-parallel rank and world size.
	TPRank int `json:"tp"`
	TPSize int `json:"tps"`
	// DCPRank and DCPSize are its decode-context-parallel rank and size;
	// DCPRank = TPRank % DCPSize (vLLM), and DCPSize divides TPSize.
	DCPRank int `json:"dcp"`
	DCPSize int `json:"dcps"`
	// Incarnation is new at every process start (see NewIncarnation) and
	// orders the starts of one node name: a larger value is a later start.
	Incarnation uint64 `json:"inc"`
	// NATS lists the NATS URLs this member publishes on or serves (the
	// coordinator's embedded server, or the external cluster it uses).
	NATS []string `json:"nats,omitempty"`
	// NATSSig is the coordinator's signature (base64 of an nkey Ed25519
	// signature) over NATSStatement(Incarnation, NATS): a rankd follows a
	// gossiped NATS URL only when it verifies against the coordinator's
	// public key from its credentials (C9), never because a member claims
	// the coordinator role. Empty when the coordinator runs insecure.
	NATSSig string `json:"natssig,omitempty"`
	// Index is a coordinator's index identity (index.ID: 32 hex digits,
	// random, new with every new index file). A coordinator restarted on
	// an empty data directory gossips a new one; it asks every live rankd
	// for its inventory. Empty for a rankd and from older coordinators.
	Index string `json:"idx,omitempty"`
	// IndexSig is the coordinator's signature (base64, as NATSSig) over
	// IndexStatement(Incarnation, Index). A rankd acts on an index id
	// (offers its inventory when it changes) only when it verifies: a
	// gossip key holder cannot make every rank resync by gossiping ids.
	// A field of its own, not part of NATSSig's statement, so older
	// rankds keep verifying the NATS URLs. Empty when insecure.
	IndexSig string `json:"idxsig,omitempty"`
	// L1UsedBytes, L1CapBytes and L2UsedBytes are the rankd's tier usage as of
	// its last UpdateMeta; informational, gossip-delayed.
	L1UsedBytes uint64 `json:"l1,omitempty"`
	L1CapBytes  uint64 `json:"l1cap,omitempty"`
	L2UsedBytes uint64 `json:"l2,omitempty"`
	// Leaving is set by Cluster.Leave, and only by it (Config.Validate and
	// UpdateMeta refuse it): the member has begun a graceful leave. A member
	// whose last Meta says Leaving is reported left, not dead, when it goes
	// (see leave.go). Older members ignore the field.
	Leaving bool `json:"leaving,omitempty"`
}

// NATSStatement is what a coordinator signs to vouch for the NATS URLs
// of its incarnation inc (Meta.NATSSig).
func NATSStatement(inc uint64, urls []string) []byte {
	return []byte("kvtier coordinator nats v1\n" + strconv.FormatUint(inc, 10) + "\n" + strings.Join(urls, ","))
}

// IndexStatement is what a coordinator signs to vouch for the index id
// of its incarnation inc (Meta.IndexSig).
func IndexStatement(inc uint64, id string) []byte {
	return []byte("kvtier coordinator index v1\n" + strconv.FormatUint(inc, 10) + "\n" + id)
}

// wireMeta is Meta with its version, the encoding on the wire.
type wireMeta struct {
	V int `json:"v"`
	Meta
}

// Validate checks the rules of Meta; the error names the rule and numbers.
// It does not check the encoded size (Encode does).
func (m *Meta) Validate() error {
	switch m.Role {
	case RoleCoordinator:
		if m.TPSize != 0 || m.TPRank != 0 || m.DCPSize != 0 || m.DCPRank != 0 {
			return fmt.Errorf("coordinator has no rank identity, got tp %d/%d dcp %d/%d: %w",
				m.TPRank, m.TPSize, m.DCPRank, m.DCPSize, ErrMeta)
		}
	case RoleRankd:
		if m.Engine == "" {
			return fmt.Errorf("rankd needs an engine instance: %w", ErrMeta)
		}
		if m.TPSize < 1 {
			return fmt.Errorf("tp size %d must be >= 1: %w", m.TPSize, ErrMeta)
		}
		if m.TPRank < 0 || m.TPRank >= m.TPSize {
			return fmt.Errorf("tp rank %d must be in [0, tp size %d): %w", m.TPRank, m.TPSize, ErrMeta)
		}
		if m.DCPSize < 1 || m.TPSize%m.DCPSize != 0 {
			return fmt.Errorf("dcp size %d must be >= 1 and divide tp size %d: %w", m.DCPSize, m.TPSize, ErrMeta)
		}
		if m.DCPRank != m.TPRank%m.DCPSize {
			return fmt.Errorf("dcp rank %d must equal tp rank %d %% dcp size %d = %d: %w",
				m.DCPRank, m.TPRank, m.DCPSize, m.TPRank%m.DCPSize, ErrMeta)
		}
	default:
		return fmt.Errorf("role %q must be %q or %q: %w", m.Role, RoleCoordinator, RoleRankd, ErrMeta)
	}
	if m.Incarnation == 0 {
		return fmt.Errorf("incarnation must be non-zero: %w", ErrMeta)
	}
	for i, u := range m.NATS {
		if u == "" || strings.ContainsAny(u, ", \t\r\n") {
			return fmt.Errorf("nats url %d %q must be one non-empty URL without spaces or commas: %w", i, u, ErrMeta)
		}
	}
	if len(m.Index) > 64 || strings.ContainsAny(m.Index, ", \t\r\n") {
		return fmt.Errorf("index id %q must be at most 64 bytes without spaces or commas: %w", m.Index, ErrMeta)
	}
	if len(m.IndexSig) > 128 || strings.ContainsAny(m.IndexSig, ", \t\r\n") {
		return fmt.Errorf("index signature of %d B must be at most 128 bytes without spaces or commas: %w", len(m.IndexSig), ErrMeta)
	}
	return nil
}

// Encode validates m and returns its wire form, at most MaxMetaBytes bytes.
func (m *Meta) Encode() ([]byte, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	b, err := json.Marshal(wireMeta{V: MetaVersion, Meta: *m})
	if err != nil {
		return nil, fmt.Errorf("encode meta: %w: %w", ErrMeta, err)
	}
	if len(b) > MaxMetaBytes {
		return nil, fmt.Errorf("meta encodes to %d B, over memberlist's limit of %d B (engine %d B, %d NATS URLs): %w",
			len(b), MaxMetaBytes, len(m.Engine), len(m.NATS), ErrMetaTooLarge)
	}
	return b, nil
}

// DecodeMeta parses and validates a wire Meta. Bad input gives an error,
// never a panic.
func DecodeMeta(b []byte) (Meta, error) {
	if len(b) > MaxMetaBytes {
		return Meta{}, fmt.Errorf("meta is %d B, over the limit of %d B: %w", len(b), MaxMetaBytes, ErrMetaTooLarge)
	}
	var w wireMeta
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&w); err != nil {
		return Meta{}, fmt.Errorf("decode meta: %w: %w", ErrMeta, err)
	}
	if dec.More() {
		return Meta{}, fmt.Errorf("decode meta: trailing data after the object: %w", ErrMeta)
	}
	if w.V != MetaVersion {
		return Meta{}, fmt.Errorf("meta version %d, want %d: %w", w.V, MetaVersion, ErrMeta)
	}
	if err := w.Meta.Validate(); err != nil {
		return Meta{}, err
	}
	return w.Meta, nil
}

// sameIdentity reports the first identity field that differs between a and b,
// or "" when none does.
func sameIdentity(a, b *Meta) string {
	switch {
	case a.Role != b.Role:
		return "role"
	case a.Engine != b.Engine:
		return "engine"
	case a.TPRank != b.TPRank || a.TPSize != b.TPSize:
		return "tp rank/size"
	case a.DCPRank != b.DCPRank || a.DCPSize != b.DCPSize:
		return "dcp rank/size"
	case a.Incarnation != b.Incarnation:
		return "incarnation"
	}
	return ""
}

// clone returns a deep copy of m.
func (m Meta) clone() Meta {
	if m.NATS != nil {
		m.NATS = append([]string(nil), m.NATS...)
	}
	return m
}

var incarnation struct {
	sync.Mutex
	last uint64
}

// NewIncarnation returns a fresh incarnation: the wall clock in nanoseconds,
// bumped so that two calls in one process never return the same value.
// Because it follows the wall clock, a restarted process gets a larger value
// than its previous life unless the clock stepped back by more than the
// restart took. Call it once per process start and use the value both in
// Meta and in every event the process sends (contract C7).
func NewIncarnation() uint64 {
	incarnation.Lock()
	defer incarnation.Unlock()
	v := uint64(time.Now().UnixNano())
	if v <= incarnation.last {
		v = incarnation.last + 1
	}
	incarnation.last = v
	return v
}
