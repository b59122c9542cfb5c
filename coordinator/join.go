package coordinator

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"

	"github.com/kvtier/kvtier/cluster"
	"go.uber.org/zap"
)

// advertisedNATS turns the URL this process uses into one other hosts can
// use: an unspecified listen host (0.0.0.0) is replaced by host.
func advertisedNATS(u, host string) string {
	p, err := url.Parse(u)
	if err != nil || host == "" {
		return u
	}
	if ip := net.ParseIP(p.Hostname()); ip != nil && ip.IsUnspecified() {
		p.Host = net.JoinHostPort(host, p.Port())
		return p.String()
	}
	return u
}

// joinCluster starts the memberlist member with role coordinator and the
// signed NATS URLs in its Meta, so a rankd needs only one seed address, and
// joins the seeds.
func (c *Coordinator) joinCluster(natsURL string) error {
	cc := c.cfg.Cluster
	cc.Insecure = cc.Insecure || c.cfg.Insecure // --insecure also allows plaintext gossip off loopback
	if cc.Logger == nil {
		cc.Logger = c.cfg.Logger
	}
	if cc.Registerer == nil {
		cc.Registerer = c.reg
	}
	var urls []string
	for _, u := range strings.Split(natsURL, ",") {
		host := cc.AdvertiseAddr
		if host == "" {
			if ip := net.ParseIP(cc.BindAddr); ip != nil && !ip.IsUnspecified() {
				host = cc.BindAddr
			}
		}
		urls = append(urls, advertisedNATS(strings.TrimSpace(u), host))
	}
	// No HTTP (metrics, health) address: every gossip key holder reads the
	// Meta (issue 28.2). The NATS URLs stay, signed: they are how rankds
	// without --nats find NATS.
	cc.Meta = cluster.Meta{Role: cluster.RoleCoordinator, NATS: urls, Incarnation: cluster.NewIncarnation(),
		Index: c.idx.ID()}
	cc.Meta.NATSSig = c.signNATS(cc.Meta.Incarnation, urls)
	cc.Meta.IndexSig = c.signIndex(cc.Meta.Incarnation, cc.Meta.Index)
	m, err := cluster.New(cc)
	if err != nil {
		return fmt.Errorf("cluster member: %w", err)
	}
	c.member = m
	c.msub = m.Subscribe(0)
	if err := m.Start(); err != nil {
		return err
	}
	// With a wildcard bind and no advertise address, the gossip address
	// memberlist picked is the best guess of the address others reach us at.
	if changed := c.fixAdvertisedNATS(urls); changed != nil {
		ctx, cancel := context.WithTimeout(c.ctx, c.cfg.JoinTimeout)
		err := m.UpdateMeta(ctx, func(meta *cluster.Meta) {
			meta.NATS, meta.NATSSig = changed, c.signNATS(meta.Incarnation, changed)
		})
		cancel()
		if err != nil && !errors.Is(err, cluster.ErrTimeout) {
			return fmt.Errorf("advertise NATS URL: %w", err)
		}
	}
	if !c.goroutines.Go("membership", c.membershipLoop) {
		return fmt.Errorf("start the membership loop: %w", ErrClosed)
	}
	ctx, cancel := context.WithTimeout(c.ctx, c.cfg.JoinTimeout)
	defer cancel()
	n, err := m.Join(ctx)
	if err != nil {
		if errors.Is(err, cluster.ErrClosed) {
			return fmt.Errorf("join cluster: %w", err)
		}
		// The ranks find us anyway: a rankd rejoins its seeds whenever it
		// sees no live coordinator. Serving beats refusing to start.
		c.log.Error("no seed reachable; serving as a cluster of one until members join", zap.Strings("seeds", cc.Seeds),
			zap.Error(err))
	}
	c.log.Info("cluster joined", zap.Int("seeds_reached", n), zap.Strings("nats_advertised", m.LocalMember().Meta.NATS))
	return nil
}

// fixAdvertisedNATS returns urls with unspecified hosts replaced by the
// member's gossip host, or nil when none needed it.
func (c *Coordinator) fixAdvertisedNATS(urls []string) []string {
	host, _, err := net.SplitHostPort(c.member.LocalMember().Addr)
	if err != nil {
		return nil
	}
	var out []string
	changed := false
	for _, u := range urls {
		v := advertisedNATS(u, host)
		changed = changed || v != u
		out = append(out, v)
	}
	if !changed {
		return nil
	}
	return out
}

// signIndex signs the index id of incarnation inc for the member metadata
// (cluster.Meta.IndexSig): a rankd offers its inventory when the signed id
// changes, and ignores an id nobody signed (a gossip key holder would
// otherwise make every rank resync). "" when insecure or without an id.
func (c *Coordinator) signIndex(inc uint64, id string) string {
	if c.auth.seed == nil || id == "" {
		return ""
	}
	sig, err := c.auth.seed.Sign(cluster.IndexStatement(inc, id))
	if err != nil {
		c.log.Error("cannot sign the index id; rankds will not offer their inventories when it changes", zap.Error(err))
		return ""
	}
	return base64.StdEncoding.EncodeToString(sig)
}
