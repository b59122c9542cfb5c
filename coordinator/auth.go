package coordinator

import (
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"path/filepath"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// authState is what Start loads from CredsDir. Set by Start, read-only
// afterwards (ReloadAuth swaps the server's users, not these fields).
type authState struct {
	users []*server.NkeyUser
	tls   *tls.Config
	seed  *auth.Seed // signs the NATS URLs in the member metadata
	// route holds the route credentials and TLS of the embedded NATS
	// cluster (Embedded.Cluster), loaded only when it is enabled.
	routeUser, routePass string
	routeTLS             *tls.Config
	// refused counts messages refused because their body names another
	// identity than their subject (C9), by subject kind.
	refused *prometheus.CounterVec
}

func newRefused() *prometheus.CounterVec {
	v := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvtier_coord_unauthorized_total",
		Help: "Messages refused because the body names another rank or instance than the subject the sender is authorized for, by subject kind (events, heartbeat, report, lookup, restore_begin, restore_wait, restore_cancel).",
	}, []string{"subject"})
	initLabels(v, unauthorizedKinds...)
	return v
}

// loadAuth loads the users file (for the embedded server), the server
// certificate (if any) and the coordinator's own seed, and returns the
// coordinator's connect options.
func (c *Coordinator) loadAuth() ([]nats.Option, error) {
	dir := c.cfg.CredsDir
	u, err := auth.LoadUsers(filepath.Join(dir, auth.UsersFile))
	if err != nil {
		return nil, fmt.Errorf("NATS users: %w", err)
	}
	if err := shareGroupsFitUsers(c.cfg.ShareGroups, u); err != nil {
		return nil, err
	}
	c.auth.users = u.ServerUsers(c.subj.Prefix)
	if c.auth.tls, err = auth.ServerTLS(dir); err != nil {
		return nil, fmt.Errorf("NATS TLS: %w", err)
	}
	id := auth.Identity{Role: auth.RoleCoordinator}
	opts, err := auth.Client{Identity: id, Dir: dir}.Options()
	if err != nil {
		return nil, fmt.Errorf("coordinator NATS credentials: %w", err)
	}
	if c.auth.seed, err = auth.LoadSeed(filepath.Join(dir, id.Name()+auth.SeedSuffix)); err != nil {
		return nil, fmt.Errorf("coordinator seed: %w", err)
	}
	if c.cfg.NATSURL == "" && c.cfg.Embedded.Cluster.Enabled() {
		if c.auth.routeUser, c.auth.routePass, err = auth.RouteCredentials(dir); err != nil {
			return nil, fmt.Errorf("NATS cluster routes: %w (make one with 'coordinator creds route-secret' and copy the directory to every coordinator)", err)
		}
		if c.auth.routeTLS, err = auth.RouteTLS(dir); err != nil {
			return nil, fmt.Errorf("NATS cluster routes: %w", err)
		}
	}
	c.log.Info("NATS authentication on", zap.String("creds_dir", dir), zap.Int("users", len(u.Users)),
		zap.Bool("tls", c.auth.tls != nil), zap.Bool("route_tls", c.auth.routeTLS != nil))
	return opts, nil
}

// ReloadAuth re-reads the users file and hands it to the embedded server:
// identities added with 'coordinator creds add' can connect, rotated keys
// replace the old ones (connections of removed keys are closed). With an
// external NATS server it does nothing: reload that server's config.
func (c *Coordinator) ReloadAuth() error {
	// lifeMu orders this after Start (which sets nsrv) and before Shutdown.
	c.lifeMu.Lock()
	defer c.lifeMu.Unlock()
	if c.cfg.Insecure || c.nsrv == nil || !c.started || c.closed {
		return nil
	}
	u, err := auth.LoadUsers(filepath.Join(c.cfg.CredsDir, auth.UsersFile))
	if err != nil {
		return fmt.Errorf("reload NATS users: %w", err)
	}
	if err := shareGroupsFitUsers(c.cfg.ShareGroups, u); err != nil {
		return fmt.Errorf("reload NATS users: %w (the users file was not applied)", err)
	}
	if err := c.nsrv.SetUsers(u.ServerUsers(c.subj.Prefix)); err != nil {
		return err
	}
	c.log.Info("NATS users reloaded", zap.Int("users", len(u.Users)))
	return nil
}

// refuse answers (when the message wants a reply) and counts and logs a
// message whose body names another identity than its subject.
func (c *Coordinator) refuse(m *nats.Msg, kind string, err error) {
	c.auth.refused.WithLabelValues(kind).Inc()
	c.log.Warn("message refused: its body names another identity than its subject", zap.String("subject", m.Subject),
		zap.String("kind", kind), zap.Error(err))
	if m.Reply != "" {
		c.replyError(kind, m, wire.CodeUnauthorized, err.Error())
	}
}

// scope applies the instance scope of an engine subject
// (wire.Subjects.EngineCoord) to the instance a request body names: an
// empty body instance becomes the subject's, another one is refused. The
// unscoped subject keeps the body's, and only in insecure mode (the only
// mode that subscribes it): anywhere else it is treated as a scoped one. It reports
// whether the request may go on.
func (c *Coordinator) scope(m *nats.Msg, op, kind string, bodyInstance *string) bool {
	if c.cfg.Insecure && m.Subject == c.subj.Coord(op) {
		return true
	}
	inst := wire.InstanceOf(m.Subject)
	if *bodyInstance != "" && *bodyInstance != inst {
		if g, outside := c.share.outside(inst, *bodyInstance); outside {
			// An attempt at another share group's copies (share.go).
			c.share.met.refused.WithLabelValues(kind).Inc()
			c.refuse(m, kind, fmt.Errorf("request on %s names instance %q of share group %q, which instance %q is not in: an engine may act only for its own instance: %w",
				m.Subject, *bodyInstance, g, inst, wire.ErrMalformed))
			return false
		}
		c.refuse(m, kind, fmt.Errorf("request on %s names instance %q: an engine may act only for its own instance %q: %w",
			m.Subject, *bodyInstance, inst, wire.ErrMalformed))
		return false
	}
	*bodyInstance = inst
	return true
}

// newRestoreID returns 128 random bits in hex.
func newRestoreID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// signNATS signs the NATS URLs of incarnation inc for the member metadata
// (cluster.Meta.NATSSig); "" when insecure.
func (c *Coordinator) signNATS(inc uint64, urls []string) string {
	if c.auth.seed == nil {
		return ""
	}
	sig, err := c.auth.seed.Sign(cluster.NATSStatement(inc, urls))
	if err != nil {
		c.log.Error("cannot sign the NATS URLs; rankds will not follow them", zap.Error(err))
		return ""
	}
	return base64.StdEncoding.EncodeToString(sig)
}
