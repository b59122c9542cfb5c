// Package deploy holds the operator's kit, as files rather than code:
// grafana/kvtier.json (a Grafana dashboard), systemd/ (units for the
// coordinator and for one rankd per rank) and examples/ (config files for
// --config, see internal/flagfile).
//
// Its tests hold the kit to the daemons: every metric a dashboard query
// names must be registered by a real coordinator or rankd, and the units
// must start the daemons the way the examples are written for. It exports
// nothing and never runs in a daemon.
package deploy
