// Command natsnode is an e2e test helper: one server of a kvtier NATS
// cluster without a coordinator around it, the same embedded server and
// credentials (users and permissions, TLS, route secret) that
// 'coordinator serve --nats-cluster' runs. The e2e tests use it for the
// cluster members that must not serve kvtier subjects (until the
// coordinators replicate their index, only one of them may) and kill it
// with SIGKILL. Not a production command.
package main

import (
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
)

func main() {
	cfg := bus.DefaultEmbeddedConfig()
	creds := flag.String("creds-dir", "", "credentials directory from 'coordinator init' (required unless --insecure)")
	flag.BoolVar(&cfg.Insecure, "insecure", false, "no authentication")
	flag.StringVar(&cfg.Host, "nats-host", cfg.Host, "client listen IP")
	flag.IntVar(&cfg.Port, "nats-port", cfg.Port, "client port")
	cluster := flag.String("nats-cluster", "", "route listen IP:PORT (required)")
	routes := flag.String("nats-routes", "", "other servers' route URLs, comma-separated")
	prefix := flag.String("prefix", "kvtier", "NATS subject prefix of the permissions")
	flag.Parse()
	if err := run(cfg, *creds, *cluster, *routes, *prefix); err != nil {
		fmt.Fprintln(os.Stderr, "natsnode:", err)
		os.Exit(1)
	}
}

func run(cfg bus.EmbeddedConfig, creds, cluster, routes, prefix string) error {
	host, ps, err := net.SplitHostPort(cluster)
	if err != nil {
		return fmt.Errorf("--nats-cluster %q: %w", cluster, err)
	}
	if cfg.Cluster.Port, err = strconv.Atoi(ps); err != nil {
		return fmt.Errorf("--nats-cluster port %q: %w", ps, err)
	}
	cfg.Cluster.Host = host
	for _, r := range strings.Split(routes, ",") {
		if r = strings.TrimSpace(r); r != "" {
			cfg.Cluster.Routes = append(cfg.Cluster.Routes, r)
		}
	}
	if !cfg.Insecure {
		u, err := auth.LoadUsers(filepath.Join(creds, auth.UsersFile))
		if err != nil {
			return err
		}
		cfg.Users = u.ServerUsers(prefix)
		if cfg.TLS, err = auth.ServerTLS(creds); err != nil {
			return err
		}
		if cfg.Cluster.Username, cfg.Cluster.Password, err = auth.RouteCredentials(creds); err != nil {
			return err
		}
		if cfg.Cluster.TLS, err = auth.RouteTLS(creds); err != nil {
			return err
		}
	}
	srv, err := bus.StartEmbedded(cfg)
	if err != nil {
		return err
	}
	fmt.Printf("natsnode: serving clients on %s, routes on %s\n", srv.ClientURL(), srv.ClusterAddr())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	srv.Shutdown()
	return nil
}
