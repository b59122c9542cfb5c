package rankd

import "github.com/prometheus/client_golang/prometheus"

// Registry returns the registry /metrics serves: the daemon's metrics, the
// transfer engine's, the cluster member's and the Go and process
// collectors. It is complete once New returns; deploy's dashboard test
// checks every panel's metric against it.
func (d *Daemon) Registry() *prometheus.Registry { return d.met.reg }
