package replica

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvtier/kvtier/auth"
)

// Peer is one voter of the initial configuration.
type Peer struct {
	ID   string
	Addr string // host:port of its raft port
}

// Config configures replicated mode. With ID empty (the default) the
// coordinator runs alone, exactly as without any of this.
type Config struct {
	// ID is this server's raft id, unique in the cluster. Default "" (off).
	ID string
	// Bind is the raft TCP listen address. Default "127.0.0.1:9480".
	Bind string
	// Advertise is the address peers reach this node at. Default "": the
	// bind address (which must then not be 0.0.0.0).
	Advertise string
	// Dir holds the raft log and stable store (raft.db) and the snapshots.
	// Created 0700; a symlink or a directory open to others is refused.
	// Required with ID; no default. Use a local disk with working fsync.
	Dir string
	// Peers is the initial voter set, this node included, used only with
	// Bootstrap on a node with no raft state. Give every node the same
	// list.
	Peers []Peer
	// Bootstrap bootstraps the cluster from Peers when this node has no
	// raft state yet (ignored once it has). Default false. Safe to set on
	// every node of a new cluster with the same Peers.
	Bootstrap bool
	// CertFile and CertKeyFile are this server's raft peer certificate,
	// signed by the cluster CA and naming ID (kvtier://raft/<ID>), and its
	// key (0600): the raft port is mutual TLS 1.3 (transport.go). Default
	// "": <CredsDir>/raft-<ID>.pem and raft-<ID>-key.pem, written by
	// 'coordinator creds raft-cert' (or 'init --raft-ids').
	CertFile    string
	CertKeyFile string
	// CAFile is the cluster CA every peer's certificate must chain to.
	// Default "": <CredsDir>/ca.pem.
	CAFile string

	// HeartbeatTimeout and ElectionTimeout: a follower that hears nothing
	// from the leader this long starts an election. Defaults 500 ms each.
	// Shorter fails over sooner (the target is 2 s p99); too short on a
	// loaded machine causes needless elections.
	HeartbeatTimeout time.Duration
	ElectionTimeout  time.Duration
	// LeaderLeaseTimeout: a leader that cannot reach a quorum this long
	// steps down, and the acknowledgements it was waiting for fail.
	// Default 250 ms; must be <= HeartbeatTimeout.
	LeaderLeaseTimeout time.Duration
	// CommitTimeout is how long the leader waits before it sends a
	// heartbeat carrying the commit index. Default 5 ms: lower commit
	// latency for followers' state, more packets.
	CommitTimeout time.Duration
	// MaxAppendEntries bounds the entries per append and per batch handed
	// to the index. Default 256 (raft's maximum is 1024).
	MaxAppendEntries int
	// SnapshotThreshold is the number of log entries since the last
	// snapshot that triggers one; SnapshotInterval how often it is
	// checked; TrailingLogs how many entries are kept after a snapshot
	// (a follower behind by fewer catches up from the log, not the
	// snapshot). Defaults 8192, 30 s, 10240.
	SnapshotThreshold uint64
	SnapshotInterval  time.Duration
	TrailingLogs      uint64
	// SnapshotRetain is how many snapshots are kept on disk. Default 2.
	SnapshotRetain int
	// ApplyTimeout bounds the wait for raft to take an entry (not its
	// commit). Default 5 s.
	ApplyTimeout time.Duration
}

// DefaultConfig returns replicated mode's defaults (ID "": off).
func DefaultConfig() Config {
	return Config{
		Bind:               "127.0.0.1:9480",
		HeartbeatTimeout:   500 * time.Millisecond,
		ElectionTimeout:    500 * time.Millisecond,
		LeaderLeaseTimeout: 250 * time.Millisecond,
		CommitTimeout:      5 * time.Millisecond,
		MaxAppendEntries:   256,
		SnapshotThreshold:  8192,
		SnapshotInterval:   30 * time.Second,
		TrailingLogs:       10240,
		SnapshotRetain:     2,
		ApplyTimeout:       5 * time.Second,
	}
}

// Enabled reports whether replicated mode is on.
func (rc *Config) Enabled() bool { return rc.ID != "" }

// Validate checks the raft rules; nothing when replicated mode is off.
func (rc *Config) Validate() error {
	if !rc.Enabled() {
		return nil
	}
	if strings.ContainsAny(rc.ID, " \t\r\n,=") {
		return fmt.Errorf("raft id %q must not contain spaces, ',' or '=': %w", rc.ID, ErrConfig)
	}
	if rc.Dir == "" {
		return fmt.Errorf("raft dir must be set with a raft id: %w", ErrConfig)
	}
	for _, a := range []struct{ name, v string }{{"raft bind", rc.Bind}, {"raft advertise", rc.Advertise}} {
		if a.v == "" && a.name == "raft advertise" {
			continue
		}
		if _, _, err := net.SplitHostPort(a.v); err != nil {
			return fmt.Errorf("%s address %q must be host:port: %w", a.name, a.v, ErrConfig)
		}
	}
	seen := map[string]bool{}
	self := false
	for _, p := range rc.Peers {
		if p.ID == "" || seen[p.ID] {
			return fmt.Errorf("raft peer id %q is empty or listed twice: %w", p.ID, ErrConfig)
		}
		seen[p.ID] = true
		if _, _, err := net.SplitHostPort(p.Addr); err != nil {
			return fmt.Errorf("raft peer %s address %q must be host:port: %w", p.ID, p.Addr, ErrConfig)
		}
		self = self || p.ID == rc.ID
	}
	if rc.Bootstrap && !self {
		return fmt.Errorf("raft bootstrap: the peers %v must include this node %q: %w", rc.Peers, rc.ID, ErrConfig)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"raft heartbeat timeout", rc.HeartbeatTimeout}, {"raft election timeout", rc.ElectionTimeout},
		{"raft leader lease timeout", rc.LeaderLeaseTimeout}, {"raft commit timeout", rc.CommitTimeout},
		{"raft snapshot interval", rc.SnapshotInterval}, {"raft apply timeout", rc.ApplyTimeout},
	} {
		if d.v < 5*time.Millisecond {
			return fmt.Errorf("%s %v must be >= 5ms: %w", d.name, d.v, ErrConfig)
		}
	}
	if rc.LeaderLeaseTimeout > rc.HeartbeatTimeout {
		return fmt.Errorf("raft leader lease timeout %v exceeds heartbeat timeout %v: %w", rc.LeaderLeaseTimeout, rc.HeartbeatTimeout, ErrConfig)
	}
	if rc.ElectionTimeout < rc.HeartbeatTimeout {
		return fmt.Errorf("raft election timeout %v is below heartbeat timeout %v: %w", rc.ElectionTimeout, rc.HeartbeatTimeout, ErrConfig)
	}
	if rc.MaxAppendEntries < 1 || rc.MaxAppendEntries > 1024 {
		return fmt.Errorf("raft max append entries %d must be in [1, 1024]: %w", rc.MaxAppendEntries, ErrConfig)
	}
	if rc.SnapshotThreshold < 1 || rc.SnapshotRetain < 1 {
		return fmt.Errorf("raft snapshot threshold %d and retain %d must be >= 1: %w", rc.SnapshotThreshold, rc.SnapshotRetain, ErrConfig)
	}
	return nil
}

// ParsePeers parses "id=host:port,id=host:port".
func ParsePeers(s string) ([]Peer, error) {
	var out []Peer
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		id, addr, ok := strings.Cut(f, "=")
		if !ok || id == "" {
			return nil, fmt.Errorf("raft peer %q must be id=host:port: %w", f, ErrConfig)
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return nil, fmt.Errorf("raft peer %q must be id=host:port: %w", f, ErrConfig)
		}
		out = append(out, Peer{ID: id, Addr: addr})
	}
	return out, nil
}

// LoadTLS reads this server's raft TLS material: CertFile, CertKeyFile
// and CAFile, each defaulting to its file in credsDir (above). The
// certificate must chain to the CA and name this server's ID. Errors name
// the file, the flag that sets it and how to make it, and wrap ErrConfig.
func (rc *Config) LoadTLS(credsDir string) (*auth.RaftTLS, error) {
	cert, key, ca := rc.CertFile, rc.CertKeyFile, rc.CAFile
	if cert == "" || key == "" || ca == "" {
		if credsDir == "" {
			return nil, fmt.Errorf("raft TLS: give --raft-cert, --raft-cert-key and --raft-ca, or --creds-dir holding them: %w", ErrConfig)
		}
		if (cert == "" || key == "") && auth.ValidRaftFileID(rc.ID) != nil {
			return nil, fmt.Errorf("raft TLS: raft id %q cannot name a file in %s ([A-Za-z0-9._-]); give --raft-cert and --raft-cert-key: %w", rc.ID, credsDir, ErrConfig)
		}
	}
	if cert == "" {
		cert = filepath.Join(credsDir, auth.RaftCertFile(rc.ID))
	}
	if key == "" {
		key = filepath.Join(credsDir, auth.RaftCertKeyFile(rc.ID))
	}
	if ca == "" {
		ca = filepath.Join(credsDir, auth.CAFile)
	}
	t, err := auth.LoadRaftTLS(cert, key, ca)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %w (the raft port is mutual TLS: issue this server's certificate with "+
			"'coordinator creds raft-cert --dir <creds> --id %s' where the cluster CA's key is, and copy "+
			"raft-%s.pem, raft-%s-key.pem and ca.pem to it)", err, ErrConfig, rc.ID, rc.ID, rc.ID)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrConfig)
	}
	if t.ID != rc.ID {
		return nil, fmt.Errorf("raft certificate %s names server %q, but this server's raft id is %q: %w", cert, t.ID, rc.ID, ErrConfig)
	}
	return t, nil
}
