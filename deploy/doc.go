// Package deploy holds the operator's kit, as files rather than code:
// grafana/kvtier.json (a Grafana dashboard), prometheus/kvtier-alerts.yml
// (alert and recording rules), systemd/ (units for the coordinator and for
// one rankd per rank), examples/ (config files for --config, see
// internal/flagfile), docker/Dockerfile (the image) and helm/kvtier (the
// Kubernetes chart, validated by helm/check.sh: make deploy-check).
//
// Its tests hold the kit to the daemons: every metric a dashboard query or
// an alert rule names must be registered by a real coordinator or rankd,
// every metric vector must show its series on a fresh daemon, the units
// must start the daemons the way the examples are written for, and the
// image and chart must start them with their real flags. It exports
// nothing and never runs in a daemon.
package deploy
