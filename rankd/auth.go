package rankd

import (
	"encoding/base64"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/cluster"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// trust is what New loads from the credentials (C9). Set by New, read-only
// afterwards except the log limiter.
type trust struct {
	natsOpts []nats.Option // seed, inbox prefix, TLS CA
	coordKey string        // the coordinator's public nkey; "" when insecure
	// untrusted counts gossiped NATS URLs refused because their
	// signature does not verify.
	untrusted prometheus.Counter

	mu      sync.Mutex // guards lastLog
	lastLog time.Time
}

// loadAuth loads the rank's seed and the coordinator's key.
func (d *Daemon) loadAuth() error {
	d.trust.untrusted = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd",
		Name: "untrusted_nats_urls_total", Help: "Gossiped NATS URLs not followed because the coordinator's signature over them did not verify (C9).",
		ConstLabels: prometheus.Labels{"rank": d.cfg.Rank.String()}})
	if err := d.met.reg.Register(d.trust.untrusted); err != nil {
		return err
	}
	cl := auth.Client{Identity: auth.Rankd(d.cfg.Rank), Dir: d.cfg.CredsDir, SeedFile: d.cfg.SeedFile, CAFile: d.cfg.TLSCA,
		Insecure: d.cfg.Insecure}
	opts, err := cl.Options()
	if err != nil {
		return fmt.Errorf("NATS credentials: %w", err)
	}
	d.trust.natsOpts = opts
	if d.cfg.Insecure {
		d.log.Warn("INSECURE: NATS without credentials, gossiped NATS URLs followed unverified, plaintext gossip allowed; anyone on the network can speak for this rank (C9)")
		return nil
	}
	d.trust.coordKey = d.cfg.CoordinatorKey
	if d.trust.coordKey == "" && d.cfg.CredsDir != "" {
		u, err := auth.LoadUsers(filepath.Join(d.cfg.CredsDir, auth.UsersFile))
		if err != nil {
			if d.cfg.NATSURL != "" {
				return nil // the URL is configured; no need to verify one
			}
			return fmt.Errorf("coordinator key: %w", err)
		}
		for _, x := range u.Users {
			if x.Role == auth.RoleCoordinator {
				d.trust.coordKey = x.NKey
			}
		}
		if d.trust.coordKey == "" && d.cfg.NATSURL == "" {
			return fmt.Errorf("users file in %s has no coordinator identity to verify a gossiped NATS URL: %w", d.cfg.CredsDir, ErrConfig)
		}
	}
	return nil
}

// natsOpts are the connect options of this rank.
func (d *Daemon) natsOpts() []nats.Option { return d.trust.natsOpts }

// trustedNATS reports whether m's gossiped NATS URLs carry a valid
// signature of the coordinator's key (always true when insecure). A
// refusal is counted and logged at most once a second.
func (d *Daemon) trustedNATS(m cluster.Member) bool {
	if d.cfg.Insecure {
		return true
	}
	if d.trust.coordKey == "" && d.cfg.NATSURL != "" {
		// No key to check against, and nothing is taken from gossip:
		// the NATS URL is configured.
		return true
	}
	sig, err := base64.StdEncoding.DecodeString(m.Meta.NATSSig)
	if err == nil && d.trust.coordKey != "" && len(sig) > 0 {
		err = auth.Verify(d.trust.coordKey, cluster.NATSStatement(m.Meta.Incarnation, m.Meta.NATS), sig)
		if err == nil {
			return true
		}
	} else if err == nil {
		err = fmt.Errorf("no signature")
	}
	d.trust.untrusted.Inc()
	d.trust.mu.Lock()
	log := time.Since(d.trust.lastLog) > time.Second
	if log {
		d.trust.lastLog = time.Now()
	}
	d.trust.mu.Unlock()
	if log {
		d.log.Warn("a member claiming the coordinator role gossips NATS URLs the coordinator did not sign; not following them",
			zap.String("member", m.Name), zap.Strings("nats", m.Meta.NATS), zap.Error(err))
	}
	return false
}
